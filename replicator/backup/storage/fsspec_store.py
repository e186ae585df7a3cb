"""Any fsspec URL as a backup store (s3://, az://, fsspec's memory:// and file:// ...), via fsspec."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from sidecar.checksums import ChecksumError, stream_crc32c

from .base import (
    TMP_MARKER,
    Capabilities,
    ObjectInfo,
    Store,
    Throttle,
    UnsupportedOperation,
    check_name,
    check_prefix,
    copy_source,
)

log = logging.getLogger(__name__)

# fsspec's memory filesystem is one process-wide dict: a process-wide lock makes create-only atomic.
_MEMORY_LOCK = threading.Lock()


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "created", "updated", "LastModified", "last_modified"):
        v = info.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, _dt.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return _dt.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


class FsspecStore(Store):
    """Objects as files of an fsspec filesystem under ``url``.

    Create-only writes are atomic only where this class can make them so: fsspec's ``file`` (temp file +
    ``link(2)``) and ``memory`` (a process lock); elsewhere ``create_only`` raises UnsupportedOperation, so
    a backup to such a URL cannot commit (use gs:// or file:// for backups).
    """

    def __init__(self, url: str, **storage_options: Any):
        # Imported here: fsspec and its implementations load only when an fsspec URL is opened.
        import fsspec
        from fsspec.implementations.local import LocalFileSystem
        from fsspec.implementations.memory import MemoryFileSystem

        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._memory = isinstance(self.fs, MemoryFileSystem)
        if self._local:
            self.fs.makedirs(self.root, exist_ok=True)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(create_only=self._local or self._memory, rename_prefix=False)

    def _path(self, name: str) -> str:
        return f"{self.root}/{check_name(name)}"

    def _rel(self, path: str) -> str:
        path = self.fs._strip_protocol(path).rstrip("/")
        root = self.fs._strip_protocol(self.root).rstrip("/")
        if path == root:
            return ""
        if not path.startswith(root + "/"):
            raise ValueError(f"{path!r} is outside {root!r}")
        return path[len(root) + 1 :]

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
        if create_only and not (self._local or self._memory):
            raise UnsupportedOperation(f"{self.url}: create-only writes are not atomic on {self.fs.protocol}")
        if self._local:
            return self._write_local(name, path, data, create_only, crc32c, throttle)
        # Remote object stores (and fsspec memory) publish a file when it is closed: all-or-nothing.
        parts: list[bytes] = []
        size, crc = copy_source(data, lambda c: parts.append(bytes(c)), throttle)
        if crc32c is not None and crc != crc32c:
            raise ChecksumError(f"{self.url}/{name} (upload)", crc32c, crc)
        blob = b"".join(parts)
        if self._memory:
            with _MEMORY_LOCK:
                if create_only and self.fs.exists(path):
                    raise FileExistsError(f"{self.url}/{name} already exists")
                self.fs.pipe_file(path, blob)
        else:
            self.fs.pipe_file(path, blob)
        return ObjectInfo(name=name, size=size, crc32c=crc, mtime=None)

    def _write_local(
        self,
        name: str,
        path: str,
        data: bytes | Path,
        create_only: bool,
        crc32c: int | None,
        throttle: Throttle | None,
    ) -> ObjectInfo:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f"{TMP_MARKER}{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "xb") as f:
                size, crc = copy_source(data, f.write, throttle)
                f.flush()
                os.fsync(f.fileno())
            if crc32c is not None and crc != crc32c:
                raise ChecksumError(f"{self.url}/{name} (upload)", crc32c, crc)
            if create_only:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise FileExistsError(f"{self.url}/{name} already exists") from None
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return ObjectInfo(name=name, size=size, crc32c=crc, mtime=os.path.getmtime(path))

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be non-negative")
        path = self._path(name)
        if not self.fs.isfile(path):
            raise FileNotFoundError(f"{self.url}/{name} does not exist")
        if length == 0:
            return b""
        return bytes(self.fs.cat_file(path, start=start, end=None if length is None else start + length))

    def read_to_file(self, name: str, dest: Path) -> ObjectInfo:
        path = self._path(name)
        if not self.fs.isfile(path):
            raise FileNotFoundError(f"{self.url}/{name} does not exist")
        with self.fs.open(path, "rb") as fin, open(dest, "wb") as fout:
            if hasattr(fin, "readinto"):
                size, crc = stream_crc32c(fin, fout.write)
            else:  # pragma: no cover - every fsspec file object we know has readinto
                raise UnsupportedOperation("fsspec file object without readinto")
            fout.flush()
            os.fsync(fout.fileno())
        return ObjectInfo(name=name, size=size, crc32c=crc)

    def _info(self, info: dict[str, Any]) -> ObjectInfo:
        is_dir = info.get("type") == "directory"
        return ObjectInfo(
            name=self._rel(info["name"]),
            size=0 if is_dir else int(info.get("size") or 0),
            mtime=_mtime(info),
            is_dir=is_dir,
        )

    def list(self, prefix: str = "", *, shallow: bool = False) -> list[ObjectInfo]:
        prefix = check_prefix(prefix)
        base = f"{self.root}/{prefix}" if prefix else self.root
        if not self.fs.isdir(base):
            return []
        if shallow:
            infos = self.fs.ls(base, detail=True)
        else:
            infos = list(self.fs.find(base, detail=True).values())
        out = [self._info(i) for i in infos]
        out = [o for o in out if o.name and not any(p.startswith(TMP_MARKER) for p in o.name.split("/"))]
        return sorted(out, key=lambda o: o.name)

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}/{name} does not exist") from None
        if info.get("type") != "file":
            raise FileNotFoundError(f"{self.url}/{name} is not an object")
        return self._info(info)

    def delete(self, name: str, *, recursive: bool = False) -> int:
        if recursive:
            prefix = check_prefix(name)
            if not prefix:
                raise ValueError("refusing to delete the whole store")
            found = self.list(prefix)
            if found:
                self.fs.rm(f"{self.root}/{prefix}", recursive=True)
            return len(found)
        path = self._path(name)
        if not self.fs.isfile(path):
            return 0
        self.fs.rm_file(path)
        return 1
