"""memory:// backend: a process-wide dict of named in-memory buckets, for tests and single-process demos."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

from sidecar.checksums import ChecksumError, crc32c

from .base import (
    Capabilities,
    ObjectInfo,
    Store,
    Throttle,
    UnsupportedOperation,
    check_name,
    check_prefix,
    copy_source,
)

_BUCKETS: dict[str, dict[str, tuple[bytes, int, float]]] = {}
_LOCK = threading.Lock()
_GENERATION = itertools.count(1)


class MemoryStore(Store):
    """Objects in a dict shared by every MemoryStore of the same ``name`` in this process.

    ``rename`` enables the atomic ``rename_prefix`` capability (to exercise the hierarchical-namespace
    commit path without a real bucket).
    """

    def __init__(self, name: str, *, rename: bool = False):
        if not name or "/" in name:
            raise ValueError(f"memory store name must be a non-empty word, got {name!r}")
        self.name = name
        self.url = f"memory://{name}"
        self._rename = rename
        with _LOCK:
            self._objects = _BUCKETS.setdefault(name, {})

    @classmethod
    def wipe(cls, name: str) -> None:
        """Forget bucket ``name`` (tests)."""
        with _LOCK:
            _BUCKETS.pop(name, None)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(create_only=True, rename_prefix=self._rename)

    def write(
        self,
        name: str,
        data: bytes | Path,
        *,
        create_only: bool = False,
        crc32c: int | None = None,
        throttle: Throttle | None = None,
    ) -> ObjectInfo:
        check_name(name)
        parts: list[bytes] = []
        size, crc = copy_source(data, lambda c: parts.append(bytes(c)), throttle)
        if crc32c is not None and crc != crc32c:
            raise ChecksumError(f"{self.url}/{name} (upload)", crc32c, crc)
        blob = b"".join(parts)
        with _LOCK:
            if create_only and name in self._objects:
                raise FileExistsError(f"{self.url}/{name} already exists")
            gen, now = next(_GENERATION), time.time()
            self._objects[name] = (blob, gen, now)
        return ObjectInfo(name=name, size=size, crc32c=crc, generation=gen, mtime=now)

    def _get(self, name: str) -> tuple[bytes, int, float]:
        check_name(name)
        with _LOCK:
            try:
                return self._objects[name]
            except KeyError:
                raise FileNotFoundError(f"{self.url}/{name} does not exist") from None

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be non-negative")
        data = self._get(name)[0]
        return data[start:] if length is None else data[start : start + length]

    def read_to_file(self, name: str, dest: Path) -> ObjectInfo:
        data, gen, mtime = self._get(name)
        with open(dest, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return ObjectInfo(name=name, size=len(data), crc32c=crc32c(data), generation=gen, mtime=mtime)

    def list(self, prefix: str = "", *, shallow: bool = False) -> list[ObjectInfo]:
        prefix = check_prefix(prefix)
        head = f"{prefix}/" if prefix else ""
        with _LOCK:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(head)]
        out: dict[str, ObjectInfo] = {}
        for name, (data, gen, mtime) in items:
            rest = name[len(head) :]
            if shallow and "/" in rest:
                d = head + rest.split("/", 1)[0]
                out[d] = ObjectInfo(name=d, is_dir=True)
            else:
                out[name] = ObjectInfo(
                    name=name, size=len(data), crc32c=crc32c(data), generation=gen, mtime=mtime
                )
        return [out[k] for k in sorted(out)]

    def stat(self, name: str) -> ObjectInfo:
        data, gen, mtime = self._get(name)
        return ObjectInfo(name=name, size=len(data), crc32c=crc32c(data), generation=gen, mtime=mtime)

    def delete(self, name: str, *, recursive: bool = False) -> int:
        if recursive:
            prefix = check_prefix(name)
            if not prefix:
                raise ValueError("refusing to delete the whole store")
            with _LOCK:
                doomed = [k for k in self._objects if k.startswith(prefix + "/")]
                for k in doomed:
                    del self._objects[k]
            return len(doomed)
        check_name(name)
        with _LOCK:
            return 1 if self._objects.pop(name, None) is not None else 0

    def rename_prefix(self, src: str, dst: str) -> None:
        if not self._rename:
            raise UnsupportedOperation(f"{self.url} was opened without rename support")
        src, dst = check_prefix(src), check_prefix(dst)
        if not src or not dst:
            raise ValueError("rename_prefix needs two non-empty prefixes")
        with _LOCK:
            moving = [k for k in self._objects if k.startswith(src + "/")]
            if not moving:
                raise FileNotFoundError(f"{self.url}/{src} does not exist")
            if any(k.startswith(dst + "/") for k in self._objects):
                raise FileExistsError(f"{self.url}/{dst} already exists")
            for k in moving:
                self._objects[dst + k[len(src) :]] = self._objects.pop(k)
