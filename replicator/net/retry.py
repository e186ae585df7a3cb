"""The one retry classifier and backoff policy: what is transient, and exponential backoff with full jitter.

Used by the bucket backends (every library call runs through :func:`call_with_retry`) and by gRPC callers.
"""

from __future__ import annotations

import dataclasses
import email.utils
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sidecar.checksums import ChecksumError

log = logging.getLogger(__name__)
# Every jitter of the replicator's waits: a generator of its own, so the global one stays the caller's (a test
# seeding it; Hypothesis, which warns when it moves while it draws).
JITTER = random.Random()

T = TypeVar("T")

_TRANSIENT_GRPC = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED"})


def _is_transient_rpc(exc: BaseException) -> bool:
    """A grpc.RpcError with a transient status (checked by duck typing: no grpc import needed here)."""
    code = getattr(exc, "code", None)
    if not callable(code) or not type(exc).__module__.startswith("grpc"):
        return False
    try:
        name = getattr(code(), "name", "")
    except Exception:  # noqa: BLE001 - a half-built error object is not transient
        return False
    return name in _TRANSIENT_GRPC



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
# A service's Retry-After (429/503) is honoured up to this long; the policy's deadline still bounds the call.
RETRY_AFTER_CAP_SECONDS = 60.0


def retry_after_seconds(exc: BaseException) -> float | None:
    """The ``Retry-After`` of the HTTP answer behind ``exc`` (seconds, or an HTTP date), else None."""
    for e in (exc, exc.__cause__):
        headers = getattr(getattr(e, "response", None), "headers", None)
        value = headers.get("Retry-After") if hasattr(headers, "get") else None
        if not value:
            continue
        try:
            seconds = float(value)
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                continue
        return min(RETRY_AFTER_CAP_SECONDS, max(0.0, seconds))
    return None


def is_retryable(exc: BaseException) -> bool:
    """THE decision of what is transient: timeouts, dropped connections, HTTP 408/429/5xx, and gRPC
    UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED / ABORTED.

    Everything else (404, 412, 403, checksum mismatches, bad names, other gRPC codes) is final: retrying
    the same call cannot help (a corrupt copy is a reason to try another *source*, which the caller decides).
    """
    if isinstance(exc, (ChecksumError, FileNotFoundError, FileExistsError, PermissionError, ValueError)):
        return False
    if _is_transient_rpc(exc):
        return True
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
            sleep = JITTER.uniform(0, cap)
            asked = retry_after_seconds(e)
            if asked is not None:  # the service said when (a 429/503 storm): no sooner
                sleep = max(sleep, asked)
            elapsed = time.monotonic() - start
            if elapsed + sleep > policy.deadline_seconds:
                log.warning("%s: giving up after %d attempts in %.1fs: %s", what, attempt + 1, elapsed, e)
                raise
            log.info(
                "%s: transient %s (attempt %d), retrying in %.2fs", what, type(e).__name__, attempt + 1, sleep
            )
            time.sleep(sleep)
            attempt += 1


def backoff_seconds(failures: int, base: float, cap_factor: float = 8.0, rng: Any = random) -> float:
    """Jittered exponential backoff after ``failures`` consecutive failures:
    ``min(base * 2**(failures-1), base * cap_factor) * U(0.5, 1.5)`` (many callers never retry in lockstep)."""
    return base * min(2.0 ** min(max(0, failures - 1), 62), cap_factor) * rng.uniform(0.5, 1.5)


class KeyedBackoff:
    """Per-key exponential backoff with jitter for tasks retried by a periodic loop (copies, restores).

    :func:`call_with_retry` retries one call in place; this one remembers, per task key, when the
    task may be tried again, for loops (the daemon's heartbeat) that would otherwise resubmit a failing
    task every round.

    After the n-th consecutive failure of a key, the next attempt is allowed no sooner than
    ``min(max_seconds, base_seconds * 2**(n-1))`` scaled by a random factor in [0.5, 1.5) — so that a
    copy into a full RAM disk is retried a handful of times a minute, not hundreds of times a second,
    and many hosts failing together do not retry in lockstep. A success forgets the key.
    """

    def __init__(self, base_seconds: float = 0.5, max_seconds: float = 60.0, rng: Any = None):
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self._rng = rng or random.Random()
        self._state: dict[Any, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def ready(self, key: Any, now: float | None = None) -> bool:
        with self._lock:
            st = self._state.get(key)
        return st is None or (time.monotonic() if now is None else now) >= st[1]

    def failed(self, key: Any, now: float | None = None) -> float:
        """Record a failure; returns the delay before the next attempt."""
        now = time.monotonic() if now is None else now
        with self._lock:
            n = self._state.get(key, (0, 0.0))[0] + 1
            delay = backoff_seconds(n, self.base_seconds, self.max_seconds / self.base_seconds, self._rng)
            self._state[key] = (n, now + delay)
            if len(self._state) > 4096:  # keys of long-gone steps: keep the newest failures only
                for k in sorted(self._state, key=lambda k: self._state[k][1])[:1024]:
                    del self._state[k]
        return delay

    def succeeded(self, key: Any) -> None:
        with self._lock:
            self._state.pop(key, None)

    def failures(self, key: Any) -> int:
        with self._lock:
            return self._state.get(key, (0, 0.0))[0]
