"""The peer data protocol's shared parts: limits and wire constants, errors, and throttling.

Used by both ends (``replicator.peer.server`` and the client in ``replicator.peer.client``); docs/peer.md
describes the protocol.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator, Sequence
from typing import Any

from replicator.net import rpc, stall
from replicator.net.throttle import RateLimiter  # noqa: F401 - re-exported for both ends of the peer tier
from sidecar import faults

# Client receive buffer: each recv_into takes what has arrived, up to this many bytes; their crc32c is computed
# while they are in cache and they are written at once, on the one receiving thread. Measured (512 MiB over
# loopback into recycled tmpfs pages, 2 cores; bench.peer's floor 0.227 s): recv-what-arrived 1 MiB + crc32c +
# pwrite 0.232 s, the same with 4 MiB 0.252 s; filling a whole 4 MiB chunk before its crc32c and pwrite
# 0.339 s (the sender stalls meanwhile), as did the former two-thread ring of 4 x 4 MiB (bench.peer 0.336 s).
RECV_BYTES = 1 << 20
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
# Both ends: longest silence on a data socket. A transfer whose peer went silent (its host lost without a reset,
# or cut off) fails this long after its last byte and the task goes to the next source or is retried on a new
# connection: at 30 s a restore cut mid-transfer by an 18 s partition held its host's copies and restores for 10 s
# after the heal (TCP's retransmissions had backed off; tests/faults host-cut-mid-restore). Even at 15 % loss a
# healthy connection is silent this long only if one segment is lost six times running.
DATA_IDLE_TIMEOUT_SECONDS = 10.0
# Client: a ReadFiles stream's first chunk may wait for one of the server's transfer slots (the server refuses it
# RESOURCE_EXHAUSTED after rpc.RPC_TIMEOUT_SECONDS), each later one at most DATA_IDLE_TIMEOUT_SECONDS after the
# previous: a stream silent longer is cancelled (replicator.net.stall; gRPC's keepalive let one hang 61 s).
STREAM_FIRST_CHUNK_SECONDS = rpc.RPC_TIMEOUT_SECONDS + DATA_IDLE_TIMEOUT_SECONDS
DATA_CONNECT_TIMEOUT_SECONDS = 3.0
# Client: a data connection with no byte in flight (waiting for the server's status) is probed after this long
# and given up after the probes go unanswered (keep_alive): a server host gone without a reset is found in
# ~11 s instead of at the transfer's deadline.
DATA_KEEPALIVE_IDLE_SECONDS = 5
DATA_KEEPALIVE_INTERVAL_SECONDS = 2
DATA_KEEPALIVE_PROBES = 3
# Client: a transfer of fewer bytes (whole files) takes the gRPC stream over the peer's kept channel instead of a
# ticket and a new data connection, which cost two more round trips and, on a lossy network, a lost SYN's 1 s
# (the 64 KiB copies of lossy-all-hosts-8pct: p90 1.0 s, all of it in the data connection). Measured on our 2-core
# box (loopback, kept channel, medians of 35 fetch_step calls): 64 KiB 2.8 ms streamed vs 3.2 ms over the data
# port, 256 KiB 3.1 vs 3.3, 1 MiB 4.4 vs 3.8, 4 MiB 8.3 vs 6.3.
STREAM_BELOW_BYTES = 512 << 10
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


def stream_chunks(call: Any, what: str) -> Iterator[Any]:
    """The chunks of a ``ReadFiles`` stream, the stream cancelled (``stall.StreamStalled``) when it is silent past
    STREAM_FIRST_CHUNK_SECONDS before its first chunk or DATA_IDLE_TIMEOUT_SECONDS after one."""
    return stall.watched(call, what, DATA_IDLE_TIMEOUT_SECONDS, STREAM_FIRST_CHUNK_SECONDS)


def keep_alive(sock: socket.socket) -> socket.socket:
    """TCP keepalive on a data connection (DATA_KEEPALIVE_*): while a client waits for the server's status (the
    server may queue it up to DATA_SLOT_WAIT_SECONDS for a slot) nothing else would notice the server's host gone
    without a reset (lost, or cut off): the wait lasted until the transfer's deadline, 600 s by default, holding a
    transfer thread. The kernel's probes are answered by a live peer's kernel however busy its server is."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", DATA_KEEPALIVE_IDLE_SECONDS), ("TCP_KEEPINTVL", DATA_KEEPALIVE_INTERVAL_SECONDS),
                       ("TCP_KEEPCNT", DATA_KEEPALIVE_PROBES)):
        if hasattr(socket, opt):  # Linux; elsewhere the system's keepalive times
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def served_chunk() -> None:
    """A chunk of a step went out to a peer, on the data port or the ``ReadFiles`` stream: the crash point
    ``peer.serve.mid_send`` (a server dying mid-send, either path)."""
    faults.point("peer.serve.mid_send")
