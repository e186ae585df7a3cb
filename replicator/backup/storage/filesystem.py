"""file:// backend: objects are files under a root directory, written atomically (temp file + rename/link)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from sidecar.checksums import ChecksumError, stream_crc32c
from sidecar.commit import fsync_dir
from sidecar.layout import resolve_under

from .base import (
    TMP_MARKER,
    Capabilities,
    ObjectInfo,
    Store,
    Throttle,
    check_name,
    check_prefix,
    copy_source,
)

log = logging.getLogger(__name__)


class FileStore(Store):
    """Objects as files under ``root``; ``create_only`` is atomic via ``link(2)``, prefixes rename atomically."""

    def __init__(self, root: Path | str):
        root = Path(root)
        if not root.is_absolute():
            raise ValueError(f"file store root must be an absolute path, got {str(root)!r}")
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.url = f"file://{root}"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(create_only=True, rename_prefix=True)

    def _path(self, name: str) -> Path:
        return resolve_under(self.root, check_name(name))

    def _dir(self, prefix: str) -> Path:
        prefix = check_prefix(prefix)
        return resolve_under(self.root, prefix) if prefix else Path(os.path.realpath(self.root))

    @staticmethod
    def _info(name: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(
            name=name, size=st.st_size, crc32c=None, generation=st.st_mtime_ns, mtime=st.st_mtime
        )

    def write(
        self,
        name: str,
        data: bytes | Path,
        *,
        create_only: bool = False,
        crc32c: int | None = None,
        throttle: Throttle | None = None,
    ) -> ObjectInfo:
        path = self._path(name)
        if create_only and path.exists():
            raise FileExistsError(f"{self.url}/{name} already exists")
        tmp = path.with_name(f"{TMP_MARKER}{path.name}-{uuid.uuid4().hex[:12]}")
        fd = _create_in(path.parent, tmp)
        try:
            try:

                def sink(chunk: memoryview) -> None:
                    while chunk:
                        chunk = chunk[os.write(fd, chunk) :]

                size, crc = copy_source(data, sink, throttle)
                os.fsync(fd)
            finally:
                os.close(fd)
            if crc32c is not None and crc != crc32c:
                raise ChecksumError(f"{self.url}/{name} (upload)", crc32c, crc)
            if create_only:
                # link(2) fails with EEXIST if the name exists: the atomic create-only commit.
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise FileExistsError(f"{self.url}/{name} already exists") from None
            else:
                os.replace(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fsync_dir(path.parent)
        st = path.stat()
        return ObjectInfo(name=name, size=size, crc32c=crc, generation=st.st_mtime_ns, mtime=st.st_mtime)

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be non-negative")
        with open(self._path(name), "rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def read_to_file(self, name: str, dest: Path) -> ObjectInfo:
        src = self._path(name)
        if not src.is_file():
            raise FileNotFoundError(f"{self.url}/{name} does not exist")
        with open(src, "rb") as fin, open(dest, "wb") as fout:

            def sink(chunk: memoryview) -> None:
                fout.write(chunk)

            size, crc = stream_crc32c(fin, sink)
            fout.flush()
            os.fsync(fout.fileno())
        st = src.stat()
        return ObjectInfo(name=name, size=size, crc32c=crc, generation=st.st_mtime_ns, mtime=st.st_mtime)

    def list(self, prefix: str = "", *, shallow: bool = False) -> list[ObjectInfo]:
        base = self._dir(prefix)
        rel_prefix = check_prefix(prefix)
        root = Path(os.path.realpath(self.root))
        out: list[ObjectInfo] = []
        if not base.is_dir():
            return out
        if shallow:
            for child in base.iterdir():
                if child.name.startswith(TMP_MARKER):
                    continue
                name = f"{rel_prefix}/{child.name}" if rel_prefix else child.name
                if child.is_dir():
                    out.append(ObjectInfo(name=name, is_dir=True))
                elif child.is_file():
                    out.append(self._info(name, child.stat()))
        else:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if not d.startswith(TMP_MARKER)]
                for fn in filenames:
                    if fn.startswith(TMP_MARKER):
                        continue
                    full = Path(dirpath) / fn
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue  # deleted while listing
                    out.append(self._info(full.relative_to(root).as_posix(), st))
        return sorted(out, key=lambda o: o.name)

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        if not path.is_file():
            raise FileNotFoundError(f"{self.url}/{name} does not exist")
        return self._info(name, path.stat())

    def delete(self, name: str, *, recursive: bool = False) -> int:
        if recursive:
            base = self._dir(name)
            if not check_prefix(name):
                raise ValueError("refusing to delete the whole store")
            if not base.is_dir():
                return 0
            count = sum(len(files) for _, _, files in os.walk(base))
            shutil.rmtree(base, ignore_errors=True)
            self._prune(base.parent)
            return count
        path = self._path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            return 0
        except IsADirectoryError:
            raise IsADirectoryError(f"{self.url}/{name} is a prefix; use recursive=True") from None
        self._prune(path.parent)
        return 1

    def _prune(self, d: Path) -> None:
        """Remove now-empty parent directories up to (not including) the root."""
        root = Path(os.path.realpath(self.root))
        while d != root and root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    def rename_prefix(self, src: str, dst: str) -> None:
        s, d = self._dir(src), self._dir(dst)
        if not check_prefix(src) or not check_prefix(dst):
            raise ValueError("rename_prefix needs two non-empty prefixes")
        if not s.is_dir():
            raise FileNotFoundError(f"{self.url}/{src} does not exist")
        if d.exists():
            raise FileExistsError(f"{self.url}/{dst} already exists")
        for attempt in range(8):
            try:
                _makedirs(d.parent)
                # rename(2) onto an existing non-empty directory fails with ENOTEMPTY/EEXIST: a concurrent
                # committer that got there first wins, the loser gets FileExistsError.
                os.rename(s, d)
                break
            except FileNotFoundError:
                if attempt == 7 or not s.is_dir():
                    raise
                # d's parent was pruned by a concurrent delete between our mkdir and rename: again.
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise FileExistsError(f"{self.url}/{dst} already exists") from e
                raise
        fsync_dir(d.parent)
        if s.parent != d.parent:
            fsync_dir(s.parent)
        self._prune(s.parent)


def _create_in(parent: Path, tmp: Path, attempts: int = 8) -> int:
    """Create ``parent`` (with its parents) and the new file ``tmp`` in it; returns the open descriptor.

    Another process may prune ``parent`` (``delete`` removes empty directories) between our mkdir and our
    open — several replicators share one bucket folder — so a vanished directory is recreated and retried.
    """
    for attempt in range(attempts):
        try:
            _makedirs(parent)
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _makedirs(d: Path) -> None:
    """``mkdir -p`` that tolerates a concurrent prune (pathlib's raises FileExistsError in that race)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        if not d.is_dir():
            raise FileNotFoundError(f"{d} vanished while being created") from None
