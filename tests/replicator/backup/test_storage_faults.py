"""Transient faults (503s, dropped connections, answers after the client's timeout) are retried and succeed."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from replicator.backup.bucket import BackupStore
from replicator.backup.storage import RetryPolicy, call_with_retry, is_retryable
from replicator.backup.storage.gcs import GcsOptions, GcsStore
from sidecar.checksums import ChecksumError, crc32c
from sidecar.layout import read_manifest
from tests.kits.storage import BUCKET, TEST_GCS_OPTIONS, make_step

# 1 s read timeout; the proxy's "late" answers come after 2 s.
FAST = GcsOptions(
    resumable_threshold_bytes=1 << 20,
    chunk_bytes=256 << 10,
    connect_timeout_seconds=2.0,
    timeout_seconds=1.0,
    retry=RetryPolicy(initial_backoff_seconds=0.05, max_backoff_seconds=0.3, deadline_seconds=20.0),
)


def proxied(fake_gcs, proxy, options: GcsOptions = FAST) -> GcsStore:  # type: ignore[no-untyped-def]
    return GcsStore(BUCKET, f"t-{uuid.uuid4().hex[:10]}", options=options, client=fake_gcs.client(proxy.url))


def test_is_retryable_decides_transient_vs_final() -> None:
    import requests
    from google.api_core import exceptions as gex

    for e in (
        gex.ServiceUnavailable("x"),
        gex.TooManyRequests("x"),
        gex.InternalServerError("x"),
        gex.GatewayTimeout("x"),
        requests.exceptions.ReadTimeout("x"),
        requests.exceptions.ConnectionError("x"),
        TimeoutError(),
        ConnectionResetError(),
    ):
        assert is_retryable(e), e
    for e in (
        gex.NotFound("x"),
        gex.PreconditionFailed("x"),
        gex.Forbidden("x"),
        gex.BadRequest("x"),
        FileExistsError(),
        FileNotFoundError(),
        ChecksumError("f", 1, 2),
        ValueError(),
        KeyError("k"),
    ):
        assert not is_retryable(e), e


def test_call_with_retry_backs_off_and_respects_deadline() -> None:
    calls: list[float] = []

    def always_503(attempt: int) -> None:
        calls.append(time.monotonic())
        raise ConnectionResetError("transient")

    policy = RetryPolicy(
        initial_backoff_seconds=0.01, max_backoff_seconds=0.1, deadline_seconds=0.5, max_attempts=1000
    )
    t0 = time.monotonic()
    with pytest.raises(ConnectionResetError):
        call_with_retry(always_503, what="test", policy=policy)
    # The deadline ends the retries (1000 attempts would take ~100 s): at most one more backoff and a
    # loaded box's scheduling past it, not a tight wall-clock bound.
    assert time.monotonic() - t0 < 0.5 + 1.0
    assert len(calls) >= 3
    with pytest.raises(ValueError):
        call_with_retry(lambda a: (_ for _ in ()).throw(ValueError("final")), what="t", policy=policy)
    seen: list[int] = []

    def flaky(attempt: int) -> int:
        seen.append(attempt)
        if attempt < 2:
            raise TimeoutError(f"attempt {attempt}")
        return attempt

    assert call_with_retry(flaky, what="t", policy=policy) == 2
    assert seen == [0, 1, 2]


def test_503s_on_uploads_and_chunks_are_retried(fake_gcs, fault_proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = proxied(fake_gcs, fault_proxy)
    fault_proxy.inject("503", 2, "POST /upload")
    store.write("small", b"hello")
    data = os.urandom((3 << 20) + 11)
    src = tmp_path / "big"
    src.write_bytes(data)
    fault_proxy.inject("503", 1, "PUT /upload")  # a chunk of the resumable upload
    store.write("big", src, crc32c=crc32c(data))
    assert fault_proxy.pending() == 0 and len(fault_proxy.injected) == 3
    assert store.read("small") == b"hello"
    fault_proxy.inject("drop", 1, "GET")
    fault_proxy.inject("late", 1, "GET")
    store.read_to_file("big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
    assert fault_proxy.pending() == 0


def test_bytes_damaged_on_the_way_up_never_stay_stored_as_the_object(fake_gcs, fault_proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The upload sends no client-side checksum pass of its own: the stored object's crc32c, as the service
    # reports it, must equal ours. A damaged chunk is caught there, and the bad object is not left behind.
    store = proxied(fake_gcs, fault_proxy)
    data = os.urandom((3 << 20) + 11)
    src = tmp_path / "big"
    src.write_bytes(data)
    fault_proxy.inject("corrupt", 1, "PUT /upload")
    try:
        store.write("damaged", src, crc32c=crc32c(data))
    except ChecksumError:
        with pytest.raises(FileNotFoundError):
            store.stat("damaged")
    else:  # retried: then the object holds the right bytes
        assert store.read("damaged") == data
    assert fault_proxy.pending() == 0 and any(x.startswith("corrupt PUT") for x in fault_proxy.injected)


def test_create_only_write_whose_answer_was_lost_succeeds_once(fake_gcs, fault_proxy) -> None:  # type: ignore[no-untyped-def]
    store = proxied(fake_gcs, fault_proxy)
    # The first attempt lands but its answer comes after the timeout; the retry then meets 412.
    fault_proxy.inject("late", 1, "POST /upload")
    info = store.write("commit", b"record-1", create_only=True)
    assert fault_proxy.pending() == 0
    assert info.crc32c == crc32c(b"record-1")
    assert store.read("commit") == b"record-1"
    # ... but a genuinely different existing object still is a conflict, retries or not.
    fault_proxy.inject("late", 1, "POST /upload")
    with pytest.raises(FileExistsError):
        store.write("commit", b"record-2", create_only=True)
    assert store.read("commit") == b"record-1"


def test_persistent_failure_gives_up_at_the_deadline(fake_gcs, fault_proxy) -> None:  # type: ignore[no-untyped-def]
    from google.api_core import exceptions as gex

    opts = GcsOptions(
        timeout_seconds=1.0,
        retry=RetryPolicy(initial_backoff_seconds=0.05, max_backoff_seconds=0.2, deadline_seconds=1.0),
    )
    store = proxied(fake_gcs, fault_proxy, opts)
    fault_proxy.inject("503", 10_000, "")
    t0 = time.monotonic()
    with pytest.raises(gex.ServiceUnavailable):
        store.stat("anything")
    assert time.monotonic() - t0 < 3.0
    assert len(fault_proxy.injected) >= 3


def test_backup_round_trip_through_faults(fake_gcs, fault_proxy, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = proxied(fake_gcs, fault_proxy)
    b = BackupStore(store, "job")
    b.check_capabilities()
    d0 = make_step(tmp_path / "h0", 3, 0, 2, {"a.bin": os.urandom(2 << 20), "b/c.bin": os.urandom(1000)})
    d1 = make_step(tmp_path / "h1", 3, 1, 2, {"a.bin": os.urandom(3000)})
    fault_proxy.inject("503", 2, "POST /upload")
    fault_proxy.inject("503", 1, "PUT /upload")
    fault_proxy.inject("drop", 1, "GET /storage/v1/b/mtc-test/o?")  # a listing
    fault_proxy.inject("late", 1, "commits")  # the create-only commit record itself
    s = b.begin(3, 2)
    b.upload_rank(s, 0, d0)
    b.upload_rank(s, 1, d1)
    assert b.commit(s) == 3
    fault_proxy.inject("503", 2, "GET")
    out = b.download_rank(3, 0, tmp_path / "r")
    assert fault_proxy.pending() == 0, fault_proxy.injected
    for f in read_manifest(d0).files:
        assert (out / f.name).read_bytes() == (d0 / f.name).read_bytes()
    assert b.committed_steps() == [3]


def test_every_call_has_a_timeout(fake_gcs, fault_proxy) -> None:  # type: ignore[no-untyped-def]
    """A server that never answers in time cannot hang us: each attempt ends at the read timeout."""
    opts = GcsOptions(
        timeout_seconds=0.5,
        retry=RetryPolicy(
            initial_backoff_seconds=0.05, max_backoff_seconds=0.1, deadline_seconds=0.6, max_attempts=2
        ),
    )
    fault_proxy.late_seconds = 2.0
    store = proxied(fake_gcs, fault_proxy, opts)
    fault_proxy.inject("late", 10, "")
    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:
        store.list("x")
    assert is_retryable(ei.value)
    assert time.monotonic() - t0 < 2.0
    assert TEST_GCS_OPTIONS.timeout_seconds > 0
