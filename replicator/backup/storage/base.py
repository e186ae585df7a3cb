"""The storage interface every backup backend implements, its value objects, and the one retry policy."""

from __future__ import annotations

import abc
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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


# --------------------------------------------------------------------------- retries


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, bounded by a total deadline.

    Attempt k (0-based) that fails with a retryable error sleeps ``uniform(0, min(max, initial*2**k))``
    seconds, unless that would pass ``deadline_seconds`` after the first attempt started.
    """

    initial_backoff_seconds: float = 0.1
    max_backoff_seconds: float = 5.0
    deadline_seconds: float = 120.0
    max_attempts: int = 12

    def __post_init__(self) -> None:
        if self.initial_backoff_seconds <= 0 or self.max_backoff_seconds < self.initial_backoff_seconds:
            raise ValueError("need 0 < initial_backoff_seconds <= max_backoff_seconds")
        if self.deadline_seconds <= 0 or self.max_attempts < 1:
            raise ValueError("deadline_seconds must be > 0 and max_attempts >= 1")


_RETRYABLE_HTTP = frozenset({408, 429, 500, 502, 503, 504})


def is_retryable(exc: BaseException) -> bool:
    """THE decision of what is transient, for every backend: timeouts, dropped connections, 408/429/5xx.

    Everything else (404, 412, 403, checksum mismatches, bad names) is final: retrying cannot help.
    """
    from sidecar.layout import ChecksumError

    if isinstance(exc, (ChecksumError, FileNotFoundError, FileExistsError, PermissionError, ValueError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    code = getattr(exc, "code", None)  # google.api_core.exceptions.GoogleAPICallError
    if isinstance(code, int) and code in _RETRYABLE_HTTP:
        return True
    response = getattr(exc, "response", None)  # google.resumable_media InvalidResponse, requests errors
    status = getattr(response, "status_code", None)
    if isinstance(status, int) and status in _RETRYABLE_HTTP:
        return True
    mod = type(exc).__module__
    name = type(exc).__name__
    if mod.startswith(("requests", "urllib3")) and name in (
        "ConnectionError",
        "ConnectTimeout",
        "ReadTimeout",
        "Timeout",
        "ChunkedEncodingError",
        "ProtocolError",
        "ReadTimeoutError",
        "NewConnectionError",
        "IncompleteRead",
    ):
        return True
    if mod.startswith("google.auth") and name == "TransportError":
        return True
    if mod.startswith("http.client") and name in ("RemoteDisconnected", "IncompleteRead"):
        return True
    # A wrapped transport error (google-resumable-media re-raises with __cause__ set).
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc and isinstance(cause, Exception):
        return _is_retryable_cause(cause, depth=1)
    return False


def _is_retryable_cause(exc: BaseException, depth: int) -> bool:
    if depth > 3:
        return False
    mod = type(exc).__module__
    if isinstance(exc, (TimeoutError, ConnectionError)) or mod.startswith(("requests", "urllib3")):
        return is_retryable(exc)
    return False


def call_with_retry(fn: Callable[[int], T], *, what: str, policy: RetryPolicy) -> T:
    """Run ``fn(attempt)`` until it succeeds, fails for good, or the policy's deadline passes.

    ``fn`` receives the 0-based attempt number so it can tell a retry from a first try (needed to
    interpret a 412 on a create-only write whose first attempt may have landed).
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn(attempt)
        except Exception as e:
            if not is_retryable(e) or attempt + 1 >= policy.max_attempts:
                raise
            cap = min(policy.max_backoff_seconds, policy.initial_backoff_seconds * (2**attempt))
            sleep = random.uniform(0, cap)
            elapsed = time.monotonic() - start
            if elapsed + sleep > policy.deadline_seconds:
                log.warning("%s: giving up after %d attempts in %.1fs: %s", what, attempt + 1, elapsed, e)
                raise
            log.info(
                "%s: transient %s (attempt %d), retrying in %.2fs", what, type(e).__name__, attempt + 1, sleep
            )
            time.sleep(sleep)
            attempt += 1


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
    from sidecar.layout import crc32c_extend

    crc, size = 0, 0
    if isinstance(data, Path):
        buf = bytearray(COPY_CHUNK_BYTES)
        view = memoryview(buf)
        with open(data, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                if throttle is not None:
                    throttle(n)
                chunk = view[:n]
                sink(chunk)
                crc = crc32c_extend(crc, chunk)
                size += n
        return size, crc
    view = memoryview(data).cast("B")
    for off in range(0, view.nbytes, COPY_CHUNK_BYTES):
        chunk = view[off : off + COPY_CHUNK_BYTES]
        if throttle is not None:
            throttle(chunk.nbytes)
        sink(chunk)
        crc = crc32c_extend(crc, chunk)
        size += chunk.nbytes
    return size, crc
