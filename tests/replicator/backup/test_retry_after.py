"""A 429/503 answer's Retry-After is honoured by the one retry loop (issue #33, found by
tests/faults/test_bucket.py): no retry comes sooner than the service asked, and the call succeeds once the
storm is over."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

import pytest

from replicator.backup.storage.gcs import GcsStore
from replicator.net.retry import RETRY_AFTER_CAP_SECONDS, RetryPolicy, call_with_retry, retry_after_seconds
from tests.kits.storage import BUCKET
from tests.replicator.backup.test_storage_faults import FAST

STORM_SECONDS = 2.0
RETRY_AFTER = 0.5


class Answered(Exception):
    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__("503")
        self.code = 503
        self.response = SimpleNamespace(headers=headers)


def test_retry_after_is_read_in_seconds_or_as_a_date_and_capped() -> None:
    assert retry_after_seconds(Answered({"Retry-After": "1.5"})) == 1.5
    assert retry_after_seconds(Answered({"Retry-After": "100000"})) == RETRY_AFTER_CAP_SECONDS
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= retry_after_seconds(Answered({"Retry-After": date})) <= 31  # type: ignore[operator]
    assert retry_after_seconds(Answered({})) is None
    assert retry_after_seconds(Answered({"Retry-After": "soon"})) is None
    assert retry_after_seconds(ValueError()) is None


def test_call_with_retry_waits_as_long_as_asked() -> None:
    calls: list[float] = []

    def fn(attempt: int) -> int:
        calls.append(time.monotonic())
        if attempt < 2:
            raise Answered({"Retry-After": "0.3"})
        return attempt

    policy = RetryPolicy(initial_backoff_seconds=0.01, max_backoff_seconds=0.02, deadline_seconds=5)
    assert call_with_retry(fn, what="t", policy=policy) == 2
    assert all(b - a >= 0.3 for a, b in zip(calls, calls[1:], strict=False)), calls


@pytest.mark.parametrize("status", [429, 503])
def test_a_storm_with_retry_after_through_the_client_library(fake_gcs, fault_proxy, status: int) -> None:  # type: ignore[no-untyped-def]
    store = GcsStore(BUCKET, f"t-{uuid.uuid4().hex[:10]}", options=FAST, client=fake_gcs.client(fault_proxy.url))
    window = fault_proxy.storm(status, STORM_SECONDS, retry_after=RETRY_AFTER)
    store.write("small", b"hello")
    assert time.monotonic() >= window.end  # it succeeded only after the storm
    uploads = [t for t, _, r, kind in fault_proxy.requests_in(window, "POST /upload") if kind]
    # Honoured: no retry sooner than asked (FAST's own backoff, 0.05-0.3 s, would make ~12 in the storm).
    gaps = [b - a for a, b in zip(uploads, uploads[1:], strict=False)]
    assert len(uploads) >= 2 and min(gaps) >= 0.9 * RETRY_AFTER, gaps
    assert len(uploads) <= STORM_SECONDS / RETRY_AFTER + 1, gaps
    assert store.read("small") == b"hello"
