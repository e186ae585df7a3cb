"""gs:// backend on google-cloud-storage: crc32c on every hop, generation preconditions, one retry policy.

Every library call gets ``retry=None`` and an explicit timeout: retries happen only in
:func:`replicator.backup.storage.base.call_with_retry`, so one function decides what is transient.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import mmap
import os
import struct
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from sidecar.checksums import ChecksumError, crc32c_extend, file_crc32c, open_leased
from sidecar.checksums import crc32c as crc_of

from .base import (
    Capabilities,
    ObjectInfo,
    RetryPolicy,
    Store,
    Throttle,
    UnsupportedOperation,
    call_with_retry,
    check_name,
    check_prefix,
    source_size,
)

log = logging.getLogger(__name__)

_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # page-cache pages mapped at once, not faulted in one by one


@dataclasses.dataclass(frozen=True)
class GcsOptions:
    """Tuning of the gs:// backend (all durations in seconds, sizes in bytes)."""

    project: str | None = None
    connect_timeout_seconds: float = 10.0
    # Per-request read timeout; a resumable chunk of CHUNK_BYTES must fit in it on a slow link.
    timeout_seconds: float = 120.0
    # Objects above this go through a resumable upload sent in CHUNK_BYTES pieces (multiple of 256 KiB):
    # one lost chunk costs one chunk. A file's chunks are its own page-cache pages, mapped (_MappedFile): an
    # upload allocates no chunk buffers, whatever the file's size (tests/faults/test_memory.py).
    resumable_threshold_bytes: int = 8 << 20
    chunk_bytes: int = 64 << 20
    rename_timeout_seconds: float = 600.0
    max_parallel_deletes: int = 16
    retry: RetryPolicy = RetryPolicy()

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % (256 << 10):
            raise ValueError("chunk_bytes must be a positive multiple of 256 KiB")
        if min(self.connect_timeout_seconds, self.timeout_seconds, self.rename_timeout_seconds) <= 0:
            raise ValueError("timeouts must be positive")


def encode_crc32c(crc: int) -> str:
    return base64.b64encode(struct.pack(">I", crc)).decode()


def decode_crc32c(value: str | None) -> int | None:
    if not value:
        return None
    return int(struct.unpack(">I", base64.b64decode(value))[0])


def _map_error(e: Exception, what: str) -> Exception:
    """Translate library errors into the built-in/typed errors of the Store contract."""
    # Imported here: the google-cloud libraries load on first use (storage/__init__ imports this module).
    from google.api_core import exceptions as gex

    if isinstance(e, gex.NotFound):
        return FileNotFoundError(f"{what}: not found ({e.message})")
    if isinstance(e, gex.PreconditionFailed):
        return FileExistsError(f"{what}: already exists (precondition failed)")
    if isinstance(e, (gex.AlreadyExists, gex.Conflict)):
        return FileExistsError(f"{what}: already exists ({e.message})")
    if isinstance(e, gex.Forbidden):
        return PermissionError(f"{what}: permission denied ({e.message})")
    if type(e).__name__ == "DataCorruption":
        return ChecksumError(f"{what} ({e})", 0, 0)
    return e


class _Reader(io.RawIOBase):
    """A read-only view of in-memory bytes that throttles what the client library pulls from it."""

    def __init__(self, f: BinaryIO, throttle: Throttle | None):
        self._f = f
        self._throttle = throttle

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        if data and self._throttle is not None:
            self._throttle(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()
        super().close()


class _MappedFile(io.RawIOBase):
    """A local file as the upload reads it: each read maps the asked range of the file's pages and hands out a
    view of them, which the HTTP client sends straight from the page cache: no copy into fresh memory, no
    page faults on new buffers, no second read for a checksum pass (measured: the uploader's CPU per MiB
    halved, bench.backup).

    The crc32c of the bytes handed out is checked against ``expect_crc32c`` before the read that would hand
    out the last of them: a file that does not match is never stored (its upload ends with ChecksumError
    before its final chunk is sent). The file is leased (:func:`open_leased`) while a mapping lives.
    ``mapped=False`` hands out bytes read with ``pread`` instead (the library's one-request upload takes
    nothing else).
    """

    def __init__(self, path: Path, throttle: Throttle | None, expect_crc32c: int, mapped: bool = True):
        self._mapped = mapped
        self._fd, _ = open_leased(path)
        self._size = os.fstat(self._fd).st_size
        self._path = path
        self._pos = 0
        self._throttle = throttle
        self._expect = expect_crc32c
        self._crc, self._crc_end = 0, 0  # crc32c of the bytes [0, _crc_end) handed out so far

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes | memoryview:  # type: ignore[override]
        n = self._size - self._pos if size is None or size < 0 else min(size, self._size - self._pos)
        if n <= 0:
            return b""
        # Committed files never shrink; a mapping past the end would fault.
        if os.fstat(self._fd).st_size < self._pos + n:
            raise ChecksumError(f"{self._path} (shrank during its upload)", self._expect, 0)
        view: bytes | memoryview | None = None
        if self._mapped:
            skip = self._pos % mmap.ALLOCATIONGRANULARITY
            flags = mmap.MAP_SHARED | _MAP_POPULATE
            try:
                mm = mmap.mmap(self._fd, skip + n, flags=flags, prot=mmap.PROT_READ, offset=self._pos - skip)
                view = memoryview(mm)[skip:]
            except OSError:  # a file system without mmap
                pass
        if view is None:
            view = os.pread(self._fd, n, self._pos)
            if len(view) != n:
                raise ChecksumError(f"{self._path} (shrank during its upload)", self._expect, 0)
        if self._pos <= self._crc_end < self._pos + n:  # (a chunk sent again is not hashed again)
            self._crc = crc32c_extend(self._crc, view[self._crc_end - self._pos :])
            self._crc_end = self._pos + n
            if self._crc_end == self._size and self._crc != self._expect:
                raise ChecksumError(f"{self._path} (before its last chunk was sent)", self._expect, self._crc)
        self._pos += n
        if self._throttle is not None:
            self._throttle(n)
        return view

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            # A mapping the client still holds keeps the file (and its lease) until it is dropped.
            os.close(self._fd)
        super().close()


class _CrcWriter:
    """Wraps a local file: computes the crc32c of what the download writes into it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.crc = 0
        self.size = 0

    def write(self, data: bytes) -> int:
        self._f.write(data)
        self.crc = crc32c_extend(self.crc, data)
        self.size += len(data)
        return len(data)


class GcsStore(Store):
    """Objects under ``gs://<bucket>/<prefix>/``.

    Uploads send the crc32c we computed (the service rejects a mismatch) and compare the crc32c the
    service reports back; downloads are validated by the client against the stored crc32c.
    ``create_only`` uses ``ifGenerationMatch=0``. ``rename_prefix`` needs a hierarchical-namespace bucket
    and uses ``storage_control_v2.StorageControlClient.rename_folder``.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        options: GcsOptions | None = None,
        client: Any = None,
        control_client: Any = None,
    ):
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        self.bucket_name = bucket
        self.prefix = check_prefix(prefix)
        self.options = options or GcsOptions()
        self.url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self._client = client
        self._control = control_client
        self._hns: bool | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ clients

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                # Imported here: the google-cloud libraries load on first use (storage/__init__ imports this module).
                from google.cloud import storage

                if os.environ.get(_EMULATOR_ENV):
                    # Emulators take no credentials; the library reads the host from the environment.
                    from google.auth.credentials import AnonymousCredentials

                    self._client = storage.Client(
                        project=self.options.project or "mtc-emulator", credentials=AnonymousCredentials()
                    )
                else:
                    self._client = storage.Client(project=self.options.project)
            return self._client

    def control_client(self) -> Any:
        with self._lock:
            if self._control is None:
                # Imported here: the google-cloud libraries load on first use (storage/__init__ imports this module).
                from google.cloud import storage_control_v2

                self._control = storage_control_v2.StorageControlClient()
            return self._control

    @property
    def _timeout(self) -> tuple[float, float]:
        return (self.options.connect_timeout_seconds, self.options.timeout_seconds)

    def _full(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _retry(self, fn: Any, what: str) -> Any:
        def attempt(n: int) -> Any:
            try:
                return fn(n)
            except Exception as e:
                mapped = _map_error(e, what)
                if mapped is e:
                    raise
                raise mapped from e

        return call_with_retry(attempt, what=what, policy=self.options.retry)

    def hierarchical_namespace(self) -> bool:
        """Whether the bucket has hierarchical namespace (read once from the bucket metadata)."""
        if self._hns is None:
            bucket = self.client.bucket(self.bucket_name)
            try:
                self._retry(
                    lambda _: bucket.reload(timeout=self._timeout, retry=None),
                    f"get bucket {self.bucket_name}",
                )
            except PermissionError as e:
                # Object-only credentials cannot read bucket metadata: fall back to create-only commits.
                log.warning(
                    "cannot read metadata of bucket %s (%s); assuming no hierarchical namespace",
                    self.bucket_name,
                    e,
                )
                self._hns = False
                return False
            self._hns = bool(bucket.hierarchical_namespace_enabled)
            log.info("bucket %s hierarchical namespace: %s", self.bucket_name, self._hns)
        return self._hns

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(create_only=True, rename_prefix=self.hierarchical_namespace())

    # ------------------------------------------------------------------ objects

    def _info(self, blob: Any) -> ObjectInfo:
        return ObjectInfo(
            name=self._rel(blob.name),
            size=int(blob.size or 0),
            crc32c=decode_crc32c(blob.crc32c),
            generation=int(blob.generation) if blob.generation is not None else None,
            mtime=blob.updated.timestamp() if blob.updated is not None else None,
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
        full = self._full(check_name(name))
        size = source_size(data)
        if crc32c is None:
            # Imported here: the google-cloud libraries load on first use (storage/__init__ imports this module).

            crc32c = file_crc32c(data)[1] if isinstance(data, Path) else crc_of(data)
        what = f"upload {self.url}/{name}"
        bucket = self.client.bucket(self.bucket_name)

        def attempt(n: int) -> ObjectInfo:
            blob = bucket.blob(full)
            resumable = size > self.options.resumable_threshold_bytes
            blob.chunk_size = self.options.chunk_bytes if resumable else None
            f: io.RawIOBase = (
                _MappedFile(data, throttle, crc32c, mapped=resumable)
                if isinstance(data, Path)
                else _Reader(io.BytesIO(data), throttle)
            )
            try:
                blob.upload_from_file(
                    f,
                    # The library picks multipart for a known size <= 8 MiB whatever chunk_size says;
                    # an unknown size forces the chunked resumable protocol (size is checked below).
                    size=None if resumable else size,
                    # No client-side checksum pass of the library's (google_crc32c, ~1.5 GiB/s on one core
                    # with the GIL held): the bytes are checked where they end up instead. The crc32c we send
                    # is the one the service validates, and the crc32c it reports for the stored object
                    # (computed over what it stored) must equal ours, below. The emulator does not validate
                    # the sent value but reports the stored bytes' own, so the check below holds there too.
                    checksum=None,
                    crc32c_checksum_value=encode_crc32c(crc32c),
                    if_generation_match=0 if create_only else None,
                    timeout=self._timeout,
                    retry=None,
                )
            except Exception as e:
                # Imported here: the google-cloud libraries load on first use (storage/__init__ imports this module).
                from google.api_core import exceptions as gex

                if create_only and n > 0 and isinstance(e, gex.PreconditionFailed):
                    # A previous attempt may have landed before its response was lost: it is ours if
                    # the stored bytes are the bytes we sent.
                    existing = self.stat(name)
                    if existing.crc32c == crc32c and existing.size == size:
                        log.info("%s: earlier attempt had landed", what)
                        return existing
                raise
            finally:
                f.close()
            info = self._info(blob)
            if info.size != size or (info.crc32c is not None and info.crc32c != crc32c):
                # The service stored other bytes than we checksummed (the file changed under us).
                try:
                    blob.delete(if_generation_match=blob.generation, timeout=self._timeout, retry=None)
                except Exception as e:
                    log.warning("could not delete corrupt upload %s: %s", full, e)
                raise ChecksumError(
                    f"{self.url}/{name} (upload, {info.size} of {size} bytes)", crc32c, info.crc32c or 0
                )
            return info

        return self._retry(attempt, what)

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be non-negative")
        if length == 0:
            self.stat(name)
            return b""
        blob = self.client.bucket(self.bucket_name).blob(self._full(check_name(name)))
        whole = start == 0 and length is None
        end = None if length is None else start + length - 1

        def attempt(_: int) -> bytes:
            try:
                return bytes(
                    blob.download_as_bytes(
                        start=start or None,
                        end=end,
                        checksum="crc32c" if whole else None,
                        timeout=self._timeout,
                        retry=None,
                    )
                )
            except Exception as e:
                # A range starting past the end: 416 from the service; the contract says empty bytes.
                if getattr(e, "code", None) == 416:
                    return b""
                raise

        return self._retry(attempt, f"read {self.url}/{name}")

    def read_to_file(self, name: str, dest: Path) -> ObjectInfo:
        blob = self.client.bucket(self.bucket_name).blob(self._full(check_name(name)))

        def attempt(_: int) -> ObjectInfo:
            with open(dest, "wb") as f:
                w = _CrcWriter(f)  # type: ignore[arg-type]
                blob.download_to_file(w, checksum="crc32c", timeout=self._timeout, retry=None)
                f.flush()
                os.fsync(f.fileno())
            return ObjectInfo(
                name=name,
                size=w.size,
                crc32c=w.crc,
                generation=int(blob.generation) if blob.generation is not None else None,
            )

        return self._retry(attempt, f"download {self.url}/{name}")

    def list(self, prefix: str = "", *, shallow: bool = False) -> list[ObjectInfo]:
        prefix = check_prefix(prefix)
        full = self._full(prefix) if prefix else self.prefix
        head = f"{full}/" if full else ""

        def attempt(_: int) -> list[ObjectInfo]:
            it = self.client.list_blobs(
                self.bucket_name,
                prefix=head or None,
                delimiter="/" if shallow else None,
                timeout=self._timeout,
                retry=None,
            )
            out = [self._info(b) for b in it if not b.name.endswith("/")]
            if shallow:
                out += [ObjectInfo(name=self._rel(p.rstrip("/")), is_dir=True) for p in it.prefixes]
            return out

        return sorted(self._retry(attempt, f"list {self.url}/{prefix}"), key=lambda o: o.name)

    def stat(self, name: str) -> ObjectInfo:
        full = self._full(check_name(name))
        bucket = self.client.bucket(self.bucket_name)

        def attempt(_: int) -> ObjectInfo:
            blob = bucket.get_blob(full, timeout=self._timeout, retry=None)
            if blob is None:
                raise FileNotFoundError(f"{self.url}/{name} does not exist")
            return self._info(blob)

        return self._retry(attempt, f"stat {self.url}/{name}")

    def _delete_one(self, full: str) -> int:
        blob = self.client.bucket(self.bucket_name).blob(full)

        def attempt(_: int) -> int:
            try:
                blob.delete(timeout=self._timeout, retry=None)
            except FileNotFoundError:
                return 0
            except Exception as e:
                if getattr(e, "code", None) == 404:
                    return 0  # already gone (maybe by our own earlier attempt)
                raise
            return 1

        return call_with_retry(
            attempt, what=f"delete gs://{self.bucket_name}/{full}", policy=self.options.retry
        )

    def delete(self, name: str, *, recursive: bool = False) -> int:
        if not recursive:
            return self._delete_one(self._full(check_name(name)))
        prefix = check_prefix(name)
        if not prefix:
            raise ValueError("refusing to delete the whole store")
        names = [self._full(o.name) for o in self.list(prefix)]
        if not names:
            return 0
        with ThreadPoolExecutor(max_workers=min(self.options.max_parallel_deletes, len(names))) as pool:
            count = sum(pool.map(self._delete_one, names))
        if self._hns:
            self._delete_folders(self._full(prefix))
        return count

    def _delete_folders(self, full_prefix: str) -> None:
        """HNS buckets keep empty folders after their objects go: remove them deepest first (best effort)."""
        ctl = self.control_client()
        parent = f"projects/_/buckets/{self.bucket_name}"
        try:
            folders = [
                f.name
                for f in ctl.list_folders(
                    parent=parent, prefix=full_prefix + "/", timeout=self.options.timeout_seconds
                )
            ]
            for fname in sorted(folders, key=lambda n: n.count("/"), reverse=True):
                ctl.delete_folder(name=fname, timeout=self.options.timeout_seconds)
        except Exception as e:  # leftover empty folders are untidy, not wrong
            log.warning("could not delete folders under %s: %s", full_prefix, e)

    def rename_prefix(self, src: str, dst: str) -> None:
        src, dst = check_prefix(src), check_prefix(dst)
        if not src or not dst:
            raise ValueError("rename_prefix needs two non-empty prefixes")
        if not self.hierarchical_namespace():
            raise UnsupportedOperation(
                f"{self.url}: bucket has no hierarchical namespace; cannot rename folders"
            )
        ctl = self.control_client()
        parent = f"projects/_/buckets/{self.bucket_name}"
        src_id, dst_id = self._full(src) + "/", self._full(dst) + "/"
        dst_parent = dst_id.rstrip("/").rpartition("/")[0]
        timeout = self.options.timeout_seconds
        if dst_parent:

            def mkdir(_: int) -> None:
                try:
                    ctl.create_folder(
                        parent=parent, folder_id=dst_parent + "/", recursive=True, timeout=timeout
                    )
                except Exception as e:
                    if isinstance(_map_error(e, ""), FileExistsError):
                        return
                    raise

            self._retry(mkdir, f"create folder {dst_parent}")
        request_id = str(uuid.uuid4())  # makes the retried call idempotent on the service side

        def rename(_: int) -> Any:
            return ctl.rename_folder(
                request={
                    "name": f"{parent}/folders/{src_id}",
                    "destination_folder_id": dst_id,
                    "request_id": request_id,
                },
                timeout=timeout,
                retry=None,
            )

        what = f"rename {self.url}/{src} -> {dst}"
        op = self._retry(rename, what)
        try:
            op.result(timeout=self.options.rename_timeout_seconds)
        except Exception as e:
            mapped = _map_error(e, what)
            if mapped is e:
                raise
            raise mapped from e
        log.info("%s done", what)
