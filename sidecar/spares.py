"""The spare-page pool: files of deleted steps kept on the RAM disk for the next write to overwrite."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# Writing into fresh tmpfs pages is the slow part of a save or a peer copy: on our VMs a write into a new
# file runs at ~2.6 GiB/s against ~4.9 GiB/s overwriting an existing one, and pages freed a moment ago
# are sometimes handed back by the hypervisor and must be faulted in again (the bimodal copy times of
# bench.peer: 0.33 s vs 1.2 s for the same 512 MiB). So the files of a deleted step are not unlinked:
# they wait under <root>/.spare/ (named "<size>-<nonce>") and the next writer renames one into place
# and overwrites it. The pool holds at most the files of the most recently deleted step, so the RAM disk
# never holds more than it did before (a new step is complete before GC frees the older one), and its
# bytes count as free space for the writer's capacity check.

# Until GC first deletes a step, the pool is empty and every save writes into fresh pages. So after a save
# commits, an empty pool is filled with files the sizes of that step's, their pages touched (zeros written:
# fallocate alone leaves them untouched, and the writes fault them in later), for the next save to take:
# the second save of a run is as fast as a steady-state one (bench.emergency's safe_after). That adds one
# step's worth, the most GC's recycling keeps there too, and only when the RAM disk has room for twice as
# much. The writer fills in a thread of its own, and stops as soon as another save is
# queued or a restore runs in this process (the restore needs the memory bandwidth: a 1 GiB restore right
# after a save took 0.63-0.77 s instead of 0.31-0.39 s).

SPARE_DIR = ".spare"
# Smaller files are not worth the bookkeeping (and an Orbax step has many tiny ones).
RECYCLE_MIN_BYTES = 1 << 20
# A file of the pool being filled (not takeable until it is renamed "<size>-<nonce>").
WARM_PREFIX = ".warm-"
WARM_CHUNK_BYTES = 8 << 20

_quiet = 0  # restores running in this process (see quiet())
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def quiet():
    """Held by a restore: no pool is filled in this process meanwhile (a fill in progress stops)."""
    global _quiet
    with _quiet_lock:
        _quiet += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet -= 1


def quieted() -> bool:
    """A restore runs in this process (fills stop)."""
    return _quiet > 0


def spare_dir(root: Path) -> Path:
    """The RAM disk's pool of recycled files (see the section comment)."""
    return Path(root) / SPARE_DIR


def _spare_entries(spare: Path) -> list[tuple[int, str]]:
    out = []
    try:
        names = os.listdir(spare)
    except FileNotFoundError:
        return out
    for name in names:
        size, sep, _ = name.partition("-")
        if sep and size.isdigit():
            out.append((int(size), name))
    return out


def spare_bytes(spare: Path) -> int:
    """Bytes held by the pool (they are reused by the next write, so they count as free space)."""
    return sum(size for size, _ in _spare_entries(Path(spare)))


def drop_warm(spare: Path) -> None:
    """Unlink the pool's files still being filled (a fill in progress ends quietly: see :func:`prewarm`), e.g.
    those a process that crashed mid-fill left behind."""
    try:
        names = os.listdir(spare)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(WARM_PREFIX):
            try:
                os.unlink(Path(spare) / name)
            except FileNotFoundError:
                pass


def drop_spares(spare: Path) -> int:
    """Unlink every file of the pool (after ENOSPC: its pages are needed for real data), those being filled
    too; returns bytes freed."""
    freed = 0
    if not Path(spare).is_dir():
        return 0
    drop_warm(spare)
    for size, name in _spare_entries(Path(spare)):
        try:
            os.unlink(Path(spare) / name)
            freed += size
        except FileNotFoundError:
            pass
    return freed


def recycle_files(trash: Path, spare: Path) -> None:
    """Move the large files of ``trash`` (a step being deleted) into the pool, replacing what it held."""
    files = []
    for dirpath, _, filenames in os.walk(trash):
        for fn in filenames:
            path = os.path.join(dirpath, fn)
            st = os.lstat(path)
            if st.st_size >= RECYCLE_MIN_BYTES and (st.st_mode & 0o170000) == 0o100000 and st.st_nlink == 1:
                files.append((path, st.st_size))
    if not files:
        return
    spare.mkdir(exist_ok=True)
    drop_spares(spare)  # the pool keeps one step's worth: the newest
    for path, size in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            try:  # a reader's mapping holds a shared lease: such a file is only unlinked, never reused
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            os.rename(path, spare / f"{size}-{uuid.uuid4().hex[:12]}")  # still locked: see map_verified
        finally:
            os.close(fd)


class SparePool:
    """Takes recycled files out of a RAM disk's pool for one step's writes (thread-safe)."""

    def __init__(self, spare: Path | None):
        self.dir = None if spare is None else Path(spare)
        self._entries: list[tuple[int, str]] | None = None
        self._lock = threading.Lock()
        self.reused_bytes = 0

    def take(self, dest: Path, size: int) -> bool:
        """Move a spare file to ``dest`` (a fresh name in a directory this process owns) and set its size
        to ``size``; False when the pool has nothing suitable (then write a new file as usual)."""
        if self.dir is None or size < RECYCLE_MIN_BYTES:
            return False
        while True:
            with self._lock:
                if self._entries is None:  # one listing per step, not per file
                    self._entries = sorted(_spare_entries(self.dir))
                if not self._entries:
                    return False
                # The smallest file that is large enough, else the largest one.
                i = next((k for k, (n, _) in enumerate(self._entries) if n >= size), len(self._entries) - 1)
                have, name = self._entries.pop(i)
            try:
                os.rename(self.dir / name, dest)
            except FileNotFoundError:  # taken or dropped by another process meanwhile
                continue
            os.truncate(dest, size)
            with self._lock:
                self.reused_bytes += min(have, size)
            return True


def prewarm(spare: Path, sizes: Sequence[int], free_bytes: int, stop: Callable[[], bool] = lambda: False) -> int:
    """Fill an empty pool with files of ``sizes`` (those of a step just committed, ≥ RECYCLE_MIN_BYTES
    counted), their pages written, for the next save of the same state to take (see the section comment).

    Nothing happens when the pool holds anything or ``free_bytes`` (the RAM disk's free space) is under
    twice their total. ``stop()`` is asked between chunks: a file cut short joins the pool at the size
    written. Returns the bytes added; a full RAM disk ends it quietly (that file is removed)."""
    spare = Path(spare)
    sizes = sorted((n for n in sizes if n >= RECYCLE_MIN_BYTES), reverse=True)
    total = sum(sizes)
    if not total or free_bytes < 2 * total or _spare_entries(spare):
        return 0
    spare.mkdir(exist_ok=True)
    zeros = memoryview(bytes(min(WARM_CHUNK_BYTES, sizes[0])))
    added = 0
    for size in sizes:
        if stop():
            break
        nonce = uuid.uuid4().hex[:12]
        warm = spare / f"{WARM_PREFIX}{nonce}"
        written = 0
        try:
            fd = os.open(warm, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                while written < size and not stop():
                    written += os.pwrite(fd, zeros[: min(len(zeros), size - written)], written)
            finally:
                os.close(fd)
            if written < RECYCLE_MIN_BYTES:
                os.unlink(warm)
                break
            os.rename(warm, spare / f"{written}-{nonce}")
        except FileNotFoundError:  # the pool was dropped or refilled by GC meanwhile: it has what it needs
            break
        except OSError as e:
            try:
                os.unlink(warm)
            except FileNotFoundError:
                pass
            if e.errno != errno.ENOSPC:
                raise
            log.info("spare pool of %s: RAM disk full after %d bytes", spare, added)
            break
        added += written
    return added
