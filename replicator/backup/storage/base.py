"""The storage interface every backup backend implements and its value objects (retries: replicator.net.retry)."""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from replicator.net.retry import RetryPolicy, call_with_retry, is_retryable  # noqa: F401 - re-exported
from sidecar.checksums import crc32c_extend, open_leased, stream_crc32c
from sidecar.layout import safe_relpath

log = logging.getLogger(__name__)

T = TypeVar("T")

# Names of a backend's own temporary files (file://, fsspec file): never listed, never accepted as names.
TMP_MARKER = ".mtc-tmp-"

Throttle = Callable[[int], None]
"""Called with a byte count before those bytes are sent; may sleep to enforce a rate limit."""


class StorageError(OSError):
    """A storage operation failed for a reason that is not one of the built-in OSError kinds."""


class UnsupportedOperation(StorageError):
    """The backend cannot do this (e.g. an atomic prefix rename on a flat-namespace bucket)."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object (or, in a shallow listing, one child "directory" with ``is_dir=True``).

    ``name`` is relative to the store root. ``crc32c`` is the checksum the backend knows for the stored
    bytes (None when it would have to read the object to know it, e.g. file://). ``mtime`` is wall-clock
    seconds since the epoch (for staleness decisions only, never for durations).
    """

    name: str
    size: int = 0
    crc32c: int | None = None
    generation: int | None = None
    mtime: float | None = None
    is_dir: bool = False


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do atomically.

    ``create_only``: ``write(..., create_only=True)`` fails with FileExistsError if the object exists,
    atomically with respect to other writers. ``rename_prefix``: ``rename_prefix`` moves a whole prefix
    at once, atomically (hierarchical-namespace buckets, POSIX directories).
    """

    create_only: bool
    rename_prefix: bool


def check_name(name: str) -> str:
    """Validate an object name (relative, no ``..``/``.``/empty components) and return it."""
    safe_relpath(name)
    if any(part.startswith(TMP_MARKER) for part in name.split("/")):
        raise ValueError(f"object name component may not start with {TMP_MARKER!r}: {name!r}")
    return name


def check_prefix(prefix: str) -> str:
    """Validate a directory-like prefix; ``""`` means the whole store. Trailing ``/`` is stripped."""
    prefix = prefix.rstrip("/")
    if prefix:
        check_name(prefix)
    return prefix


class Store(abc.ABC):
    """A flat namespace of immutable-ish objects named by ``/``-separated relative paths.

    Contract shared by every backend (proved by tests/replicator/backup/test_store_conformance.py):

    * names are validated with :func:`check_name`; bad names raise ValueError and change nothing;
    * ``write`` is all-or-nothing: a reader sees the old object or the complete new one, never a part;
    * ``write(create_only=True)`` raises FileExistsError when the object exists (atomically when
      ``capabilities.create_only``; otherwise it raises UnsupportedOperation);
    * ``write(crc32c=...)`` raises ChecksumError if the stored bytes do not have that crc32c;
    * missing objects raise FileNotFoundError on ``read``/``read_to_file``/``stat``;
    * prefixes are directory-like: ``list("a")`` lists names under ``a/``;
    * ``delete`` is idempotent (deleting a missing object is not an error) and returns the count removed;
    * transient failures are retried inside the backend (see :func:`call_with_retry`), never by callers.
    """

    url: str

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def write(
        self,
        name: str,
        data: bytes | Path,
        *,
        create_only: bool = False,
        crc32c: int | None = None,
        throttle: Throttle | None = None,
    ) -> ObjectInfo:
        """Store ``data`` (bytes, or the contents of a local file) as object ``name``."""

    @abc.abstractmethod
    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[start, start+length)`` of object ``name`` (to the end when ``length`` is None)."""

    @abc.abstractmethod
    def read_to_file(self, name: str, dest: Path) -> ObjectInfo:
        """Download object ``name`` into local file ``dest`` (created or truncated, fsynced)."""

    @abc.abstractmethod
    def list(self, prefix: str = "", *, shallow: bool = False) -> list[ObjectInfo]:
        """Objects under ``prefix`` sorted by name; ``shallow`` gives only immediate children (with dirs)."""

    @abc.abstractmethod
    def stat(self, name: str) -> ObjectInfo:
        """Metadata of object ``name``; FileNotFoundError when it does not exist."""

    @abc.abstractmethod
    def delete(self, name: str, *, recursive: bool = False) -> int:
        """Delete object ``name`` (or, with ``recursive``, every object under prefix ``name``)."""

    def rename_prefix(self, src: str, dst: str) -> None:
        """Atomically move every object under ``src`` to ``dst`` (only if ``capabilities.rename_prefix``).

        FileNotFoundError when ``src`` is empty, FileExistsError when ``dst`` holds anything.
        """
        raise UnsupportedOperation(f"{self.url} cannot rename a prefix atomically")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients and connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# --------------------------------------------------------------------------- helpers for backends

COPY_CHUNK_BYTES = 8 << 20


def source_size(data: bytes | Path) -> int:
    if isinstance(data, Path):
        return data.stat().st_size
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    raise TypeError(f"data must be bytes or a pathlib.Path, got {type(data).__name__}")


def copy_source(
    data: bytes | Path, sink: Callable[[memoryview], object], throttle: Throttle | None
) -> tuple[int, int]:
    """Stream ``data`` into ``sink`` chunk by chunk; return (size, crc32c) of what was streamed."""
    if isinstance(data, Path):
        with open(open_leased(data)[0], "rb", buffering=0) as f:  # leased: a step deleted meanwhile is not recycled
            return stream_crc32c(f, sink, throttle, COPY_CHUNK_BYTES)
    crc, size = 0, 0
    view = memoryview(data).cast("B")
    for off in range(0, view.nbytes, COPY_CHUNK_BYTES):
        chunk = view[off : off + COPY_CHUNK_BYTES]
        if throttle is not None:
            throttle(chunk.nbytes)
        sink(chunk)
        crc = crc32c_extend(crc, chunk)
        size += chunk.nbytes
    return size, crc
