"""The one commit helper for step directories on a POSIX filesystem, and their garbage collection.

A step is written under a temporary sibling name, fsynced, then renamed (:func:`commit_dir`).

Who may remove what (writers and the replicator share the RAM disk and run in different processes):
a temporary directory is owned by the process holding an exclusive ``flock`` on it (taken by
:func:`make_tmp_dir`, released at :func:`commit_dir` or when the owner dies), and start-up cleanup
(:func:`remove_tmp_dirs`) removes only unlocked ones. Deletion renames a step to a trash name before
removing its files, so a killed GC leaves trash (removed at start), never a half-deleted step.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar import faults
from sidecar.checksums import check_step_files
from sidecar.layout import (
    MANIFEST_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    ManifestError,
    StepManifest,
    parse_step_name,
    read_manifest,
    step_name,
)
from sidecar.spares import recycle_files

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp-"  # ".<name>.tmp-<nonce>": a small file being written by write_file_atomic


def write_file_atomic(path: Path, data: bytes) -> None:
    """THE atomic small-file write: ``data`` to a unique sibling temporary name, fsynced, renamed over
    ``path``, directory fsynced. A crash leaves the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Open, flock-ed directory fds of the temporary directories this process is writing, by path. The lock
# is what tells another process's start-up cleanup "a live writer owns this": it goes away with the
# owner (commit, removal, or the process dying), never by age.
_OWNED: dict[Path, int] = {}
_OWNED_LOCK = threading.Lock()
_MAKE_TMP_ATTEMPTS = 8


def _release_gone_owned() -> None:
    """Close the lock fds of temporary directories that no longer exist (removed by their writer)."""
    with _OWNED_LOCK:
        for path, fd in list(_OWNED.items()):
            try:
                gone = os.fstat(fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                os.close(fd)
                del _OWNED[path]


def _release_owned(path: Path) -> None:
    with _OWNED_LOCK:
        fd = _OWNED.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def make_tmp_dir(parent: Path, step: int) -> Path:
    """Create a fresh temporary sibling directory in which step ``step`` is written, owned by this process.

    The directory is ``flock``-ed (exclusive) until :func:`commit_dir` publishes it, it is removed, or the
    process dies; :func:`remove_tmp_dirs` in any process leaves it alone meanwhile.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    _release_gone_owned()
    for _ in range(_MAKE_TMP_ATTEMPTS):
        tmp = parent / f"{TMP_PREFIX}{step_name(step)}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # a cleaner removed it between mkdir and open: take another name
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A cleaner that locked it first removes it before unlocking: make sure ours is still there.
            if os.stat(tmp).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(tmp)
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            continue
        with _OWNED_LOCK:
            _OWNED[tmp] = fd
        return tmp
    raise OSError(errno.EAGAIN, f"could not create an owned temporary directory under {parent}")


def remove_owned_dir(path: Path) -> None:
    """Remove a temporary directory this process made with :func:`make_tmp_dir` and release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    _release_owned(Path(path))


def tmp_dir_is_owned(path: Path) -> bool:
    """True when a live process (this one included) holds the lock of temporary directory ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def write_manifest(tmp_dir: Path, manifest: StepManifest) -> None:
    path = Path(tmp_dir) / MANIFEST_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        data = manifest.to_json()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def commit_dir(tmp_dir: Path, final_dir: Path, *, replace: bool = False) -> None:
    """Atomically publish ``tmp_dir`` (already holding its fsynced files and manifest) as ``final_dir``.

    The manifest is read back and every file it lists must be present with its size (the writer and
    fetcher verified each file's crc32c as they wrote it). A directory at ``final_dir`` without a
    manifest is debris of a killed writer or GC and is moved out of the way. A committed step there
    raises FileExistsError unless ``replace``: then the new one takes its place in one atomic exchange
    (renameat2) and the old one is deleted — readers see the old step or the new one, never neither.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if not (tmp_dir / MANIFEST_NAME).is_file():
        raise ManifestError(f"refusing to commit {tmp_dir}: no {MANIFEST_NAME}")
    if tmp_dir.parent != final_dir.parent:
        raise ValueError("temporary and final directories must be siblings (same filesystem)")
    check_step_files(tmp_dir, read_manifest(tmp_dir))
    fsync_dir(tmp_dir)
    if final_dir.exists() and not (final_dir / MANIFEST_NAME).is_file():
        log.warning("removing uncommitted debris at %s before committing over it", final_dir)
        delete_step(final_dir)
    if final_dir.exists():
        if not replace:
            raise FileExistsError(f"step directory {final_dir} already exists")
        if _exchange(tmp_dir, final_dir):
            # tmp_dir now holds the old step: still ours (locked), delete it out of sight.
            fsync_dir(final_dir.parent)
            _release_owned(tmp_dir)
            delete_step(tmp_dir)
            log.info("replaced committed %s", final_dir)
            return
        delete_step(final_dir)  # no renameat2: the step is absent (never half-visible) for a moment
    # rename(2) of a directory onto an empty directory would succeed silently, hence the checks above;
    # each directory has a single writer (its host's sidecar or replicator), so there is no race.
    os.rename(tmp_dir, final_dir)
    _release_owned(tmp_dir)
    fsync_dir(final_dir.parent)


def publish_dir(tmp_dir: Path, final_dir: Path, marker: str) -> None:
    """:func:`commit_dir` for a directory that is not a step (a host's parity of a step,
    ``replicator/erasure/holder.py``): ``tmp_dir`` (from :func:`make_tmp_dir`) holds its fsynced files and
    its commit marker ``marker``, written last; one rename publishes it. FileExistsError when ``final_dir``
    exists (the caller decides whether the one there is current)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if not (tmp_dir / marker).is_file():
        raise FileNotFoundError(f"refusing to publish {tmp_dir}: no {marker}")
    if tmp_dir.parent != final_dir.parent:
        raise ValueError("temporary and final directories must be siblings (same filesystem)")
    fsync_dir(tmp_dir)
    if final_dir.exists():
        raise FileExistsError(f"{final_dir} already exists")
    os.rename(tmp_dir, final_dir)
    _release_owned(tmp_dir)
    fsync_dir(final_dir.parent)


def remove_tmp_dirs(parent: Path) -> list[Path]:
    """Start-up cleanup under ``parent``: temporary directories no live writer owns, and GC trash.

    A temporary directory whose lock is held (a writer in this or another process is filling it) is
    left alone: restarting the replicator while the training process saves must not break the save.
    """
    removed: list[Path] = []
    parent = Path(parent)
    if not parent.is_dir():
        return removed
    for child in parent.iterdir():
        if child.name.startswith(TRASH_PREFIX):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
            continue
        if not child.name.startswith(TMP_PREFIX):
            continue
        try:
            fd = os.open(child, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.debug("leaving %s: a live writer owns it", child)
                continue
            # Removed while we hold the lock, so a writer that raced us sees it gone and picks a new name.
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d leftover temporary or trash directories under %s", len(removed), parent)
    return removed


def committed_steps(parent: Path) -> list[int]:
    """Steps committed under ``parent`` (directories named by an integer holding a manifest), ascending."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    out = []
    for child in parent.iterdir():
        step = parse_step_name(child.name)
        if step is not None and (child / MANIFEST_NAME).is_file():
            out.append(step)
    return sorted(out)


def delete_step(step_dir: Path, *, spare: Path | None = None, only_if: Callable[[Path], bool] | None = None) -> bool:
    """Delete a step directory crash-safely: renamed to a trash name first, then removed.

    A process killed mid-way leaves ``.trash-*`` (removed by :func:`remove_tmp_dirs` at start), never a
    half-deleted directory under the step's name, so the step number can be saved again at once.
    ``spare``: the RAM disk's :func:`spare_dir`; the step's large files move there (their tmpfs pages
    stay allocated) for the next save or copy to overwrite instead of allocating fresh pages.
    ``only_if``: asked with the step under its trash name, where no writer can commit over it; when it
    answers False the step is renamed back and kept (another save was committed under the same name after
    the caller chose to delete). Returns whether a step was deleted.
    """
    step_dir = Path(step_dir)
    trash = step_dir.with_name(f"{TRASH_PREFIX}{step_dir.name}-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(step_dir, trash)
    except FileNotFoundError:
        return False
    if only_if is not None and not only_if(trash):
        try:
            os.rename(trash, step_dir)  # onto nothing, or onto the empty debris of a killed writer
        except OSError as e:
            # Yet another step was committed under the name meanwhile: the one taken away is superseded.
            log.warning("%s was saved again while being kept (%s): deleting the superseded copy", step_dir, e)
        else:
            fsync_dir(step_dir.parent)
            return False
    fsync_dir(step_dir.parent)
    _release_owned(step_dir)
    faults.point("gc.mid_delete")
    if spare is not None:
        try:
            recycle_files(trash, Path(spare))
        except OSError as e:  # recycling is an optimisation: never a reason for a delete to fail
            log.warning("could not keep the pages of %s for reuse: %s", step_dir, e)
    shutil.rmtree(trash, ignore_errors=True)
    return True
