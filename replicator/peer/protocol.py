"""The peer data protocol's shared parts: limits and wire constants, errors, and throttling.

Used by both ends (``replicator.peer.server`` and the client in ``replicator.peer.client``); docs/peer.md
describes the protocol.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

# Receive ring: 4 buffers of 4 MiB. Measured (512 MiB over loopback into tmpfs): 4 MiB x 4 reached
# 1.9 GiB/s vs 1.56 with 8 MiB x 4 and 1.27 with 2 MiB x 8 — chunks that stay in cache between the
# recv copy and the crc/write win. Bounds client memory per transfer to 16 MiB.
CHUNK_BYTES = 4 << 20
RING_BUFFERS = 4
# Server sendfile slice: the unit at which a server checks for stop and applies the rate limit.
SENDFILE_SLICE_BYTES = 16 << 20
# gRPC fallback: data bytes per FileChunk message (well under the 64 MiB message limit).
STREAM_CHUNK_BYTES = 1 << 20
MAX_STREAM_CHUNK_BYTES = 8 << 20
TICKET_BYTES = 32
TICKET_TTL_SECONDS = 30.0
MAX_PENDING_TICKETS = 256
# Largest number of file names one request may name (an Orbax step has a few hundred files).
MAX_FILES_PER_REQUEST = 100_000
MAX_STEP = 10**18
DATA_MAGIC = b"MTCDATA1"
# Server: time allowed from accept until the whole header (magic + ticket) has arrived — a deadline,
# not a per-recv timeout, so a client trickling one byte at a time cannot keep a connection open.
DATA_HEADER_TIMEOUT_SECONDS = 5.0
# Server: connections still owing their header, at most (the oldest is cut to admit a new one; they
# cost no thread: one selector thread reads every header). Legitimate clients send the header at once.
MAX_DATA_HEADER_CONNECTIONS = 128
# Server: slowest acceptable reader. A transfer must keep up with MIN_TRANSFER_BYTES_PER_SECOND after a
# grace of MIN_RATE_GRACE_SECONDS (time spent in the server's own throttle not counted), else it is cut
# and its slot freed: a peer copying into RAM moves hundreds of MB/s, a client holding a slot at
# kilobytes per second is broken or hostile.
MIN_TRANSFER_BYTES_PER_SECOND = 8 << 20
MIN_RATE_GRACE_SECONDS = 10.0
# Server: longest a redeemed transfer waits for a free slot before it is refused as busy.
DATA_SLOT_WAIT_SECONDS = 300.0
# Both ends: longest silence on a data socket.
DATA_IDLE_TIMEOUT_SECONDS = 30.0
DATA_CONNECT_TIMEOUT_SECONDS = 3.0
STATUS_OK = 0
STATUS_ERROR = 1
PART_SUFFIX = ".mtc-part"


class PeerUnavailableError(ConnectionError):
    """No holder could deliver a verified copy of the step; ``errors`` lists (holder, error) pairs."""

    def __init__(self, message: str, errors: Sequence[tuple[str, BaseException]] = ()):
        super().__init__(message)
        self.errors = list(errors)


class TransferRejected(ConnectionError):
    """The data port refused the transfer (unknown, expired or reused ticket; step gone)."""



# --------------------------------------------------------------------------- throttling


@dataclasses.dataclass(frozen=True)
class Throttle:
    """Limits that keep replication from starving training on a small host.

    ``bytes_per_second``: cap on the bytes one side moves (None = unlimited); on a server it is shared
    by all outgoing transfers, on a client it applies to one fetch. ``max_streams``: on a server, the
    number of transfers served at once (each a thread); others wait their turn.
    """

    bytes_per_second: float | None = None
    max_streams: int = 2

    def __post_init__(self) -> None:
        if self.bytes_per_second is not None and not self.bytes_per_second > 0:
            raise ValueError(f"bytes_per_second must be > 0 or None, got {self.bytes_per_second!r}")
        if not isinstance(self.max_streams, int) or self.max_streams < 1:
            raise ValueError(f"max_streams must be an int >= 1, got {self.max_streams!r}")


class RateLimiter:
    """Token bucket over bytes, shared by threads; ``acquire(n)`` sleeps until ``n`` bytes may pass."""

    def __init__(self, bytes_per_second: float | None, burst_bytes: int = 2 * CHUNK_BYTES):
        self.rate = bytes_per_second
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

def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from a blocking socket; with ``deadline`` (``time.monotonic()``) the whole read
    must finish by then (TimeoutError), whatever the socket's per-call timeout."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"read {got} of {n} bytes before the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


# --------------------------------------------------------------------------- retry schedule


class RetryBackoff:
    """Per-key exponential backoff with jitter for failed transfers (copies, restores).

    After the n-th consecutive failure of a key, the next attempt is allowed no sooner than
    ``min(max_seconds, base_seconds * 2**(n-1))`` scaled by a random factor in [0.5, 1.5) — so that a
    copy into a full RAM disk is retried a handful of times a minute, not hundreds of times a second,
    and many hosts failing together do not retry in lockstep. A success forgets the key.
    """

    def __init__(self, base_seconds: float = 0.5, max_seconds: float = 60.0, rng: Any = None):
        import random

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
            delay = min(self.max_seconds, self.base_seconds * 2 ** min(n - 1, 30)) * self._rng.uniform(0.5, 1.5)
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
