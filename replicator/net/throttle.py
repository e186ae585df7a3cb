"""The one byte-rate limiter, shared by peer transfers and bucket uploads."""

from __future__ import annotations

import threading
import time

DEFAULT_BURST_BYTES = 8 << 20  # two peer chunks


class RateLimiter:
    """Token bucket over bytes, shared by threads; ``acquire(n)`` sleeps until ``n`` bytes may pass.

    ``bytes_per_second`` None (or 0) means unlimited. ``burst_bytes`` may pass at once after an idle
    period, so short pauses between chunks do not lower the average rate.
    """

    def __init__(self, bytes_per_second: float | None, burst_bytes: int = DEFAULT_BURST_BYTES):
        self.rate = float(bytes_per_second) if bytes_per_second else None
        self._burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, stop: threading.Event | None = None) -> None:
        if self.rate is None or nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self.rate) - nbytes
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
