"""The peer tier's TCP data port: single-use transfer tickets and the server that redeems them with ``sendfile``.

``PeerServicer.OpenTransfer`` (``replicator.peer.server``) issues a ticket over the authenticated gRPC channel
for (rank, step, files); the client then opens a plain TCP connection to the :class:`TransferServer` and
presents it; the server sends exactly the granted bytes from the RAM disk (docs/peer.md, "Data port").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicator.net import priority
from replicator.peer.protocol import (
    DATA_HEADER_TIMEOUT_SECONDS,
    DATA_MAGIC,
    DATA_SLOT_WAIT_SECONDS,
    MAX_DATA_HEADER_CONNECTIONS,
    MAX_PENDING_TICKETS,
    MIN_RATE_GRACE_SECONDS,
    MIN_TRANSFER_BYTES_PER_SECOND,
    SENDFILE_SLICE_BYTES,
    STATUS_ERROR,
    STATUS_OK,
    TICKET_BYTES,
    TICKET_TTL_SECONDS,
    RateLimiter,
    Throttle,
    served_chunk,
)
from sidecar import layout
from sidecar.checksums import ChecksumError
from sidecar.layout import FileEntry

log = logging.getLogger(__name__)

HEADER_BYTES = len(DATA_MAGIC) + TICKET_BYTES

# --------------------------------------------------------------------------- tickets


@dataclasses.dataclass(frozen=True)
class _Grant:
    rank: int
    step: int
    step_dir: Path
    files: tuple[FileEntry, ...]
    expires_at: float  # time.monotonic()
    # (file, offset, length) to send, in order: the whole files unless the request named pieces.
    sends: tuple[tuple[FileEntry, int, int], ...] = ()

    def sent(self) -> tuple[tuple[FileEntry, int, int], ...]:
        return self.sends or tuple((e, 0, e.size) for e in self.files)


class TicketBook:
    """Single-use, expiring transfer tickets bound to (rank, step, files)."""

    def __init__(self, ttl_seconds: float = TICKET_TTL_SECONDS, max_pending: int = MAX_PENDING_TICKETS):
        self.ttl_seconds = ttl_seconds
        self._max_pending = max_pending
        self._grants: dict[bytes, _Grant] = {}
        self._lock = threading.Lock()

    def issue(self, rank: int, step: int, step_dir: Path, files: Sequence[FileEntry],
              sends: Sequence[tuple[FileEntry, int, int]] = ()) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for t in [t for t, g in self._grants.items() if g.expires_at <= now]:
                del self._grants[t]
            if len(self._grants) >= self._max_pending:
                raise OSError(errno.EAGAIN, f"too many pending transfer tickets ({self._max_pending})")
            self._grants[ticket] = _Grant(rank, step, Path(step_dir), tuple(files), now + self.ttl_seconds,
                                          tuple(sends))
        return ticket

    def redeem(self, ticket: bytes) -> _Grant | None:
        """The grant for ``ticket``, removing it; None when unknown, already used or expired."""
        with self._lock:
            grant = self._grants.pop(bytes(ticket), None)
        if grant is None or grant.expires_at <= time.monotonic():
            return None
        return grant

    def clear(self) -> None:
        with self._lock:
            self._grants.clear()


# --------------------------------------------------------------------------- the data port



class _Pending:
    """A data connection still owing its header: what arrived so far and its deadline."""

    __slots__ = ("addr", "buf", "deadline")

    def __init__(self, addr: Any, deadline: float):
        self.addr = addr
        self.buf = bytearray()
        self.deadline = deadline


class TransferServer:
    """The TCP data port: serves the files of a redeemed ticket with ``sendfile``, back to back.

    Wire format (docs/peer.md): the client sends ``DATA_MAGIC`` + the 32-byte ticket; the server
    answers one status byte (0 = OK, then exactly the granted files' bytes in order; 1 = error, then a
    2-byte big-endian length and a UTF-8 reason) and closes. ``stop()`` stops accepting, waits up to
    ``grace_seconds`` for in-flight transfers, then cuts the rest (their clients see a short read and
    commit nothing).

    Bounded resources: one selector thread accepts connections and reads every header (no thread per
    connection); a header must be complete ``header_timeout_seconds`` after accept; at most
    ``max_header_connections`` wait for theirs (the oldest is cut to admit a new one); redeemed
    transfers run on at most ``throttle.max_streams`` threads, queue (no thread) up to
    ``max_pending_tickets``, and are cut when the reader falls below ``min_bytes_per_second`` after
    ``min_rate_grace_seconds`` — slow clients holding valid tickets cannot block other transfers.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        throttle: Throttle | None = None,
        ticket_ttl_seconds: float = TICKET_TTL_SECONDS,
        max_pending_tickets: int = MAX_PENDING_TICKETS,
        bulk_priority: str = "normal",
        header_timeout_seconds: float = DATA_HEADER_TIMEOUT_SECONDS,
        max_header_connections: int = MAX_DATA_HEADER_CONNECTIONS,
        min_bytes_per_second: float = MIN_TRANSFER_BYTES_PER_SECOND,
        min_rate_grace_seconds: float = MIN_RATE_GRACE_SECONDS,
        slot_wait_seconds: float = DATA_SLOT_WAIT_SECONDS,
    ):
        if header_timeout_seconds <= 0 or max_header_connections < 1 or min_bytes_per_second <= 0:
            raise ValueError("header timeout, header connection limit and minimum rate must be > 0")
        self.host = host
        self.bulk_priority = bulk_priority
        self._requested_port = port
        self.throttle = throttle or Throttle()
        self.limiter = RateLimiter(self.throttle.bytes_per_second)
        self.slots = threading.BoundedSemaphore(self.throttle.max_streams)
        self.tickets = TicketBook(ticket_ttl_seconds, max_pending_tickets)
        self.header_timeout_seconds = header_timeout_seconds
        self.max_header_connections = max_header_connections
        self.min_bytes_per_second = float(min_bytes_per_second)
        self.min_rate_grace_seconds = min_rate_grace_seconds
        self.slot_wait_seconds = slot_wait_seconds
        self._max_queued = max_pending_tickets
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._active: set[socket.socket] = set()  # redeemed: queued or sending
        self._lock = threading.Lock()
        self.port = 0
        # Counters (read-only for callers).
        self.transfers_completed = 0
        self.bytes_sent = 0
        self.connections_cut = 0  # header deadline, evicted, too slow or refused as busy

    @property
    def running(self) -> bool:
        return self._sock is not None and not self._stop.is_set()

    def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        if self._sock is not None:
            raise RuntimeError("TransferServer already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        # The sending threads run at the bulk priority, so that they yield the CPU to training.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.throttle.max_streams,
            thread_name_prefix="mtc-data-send",
            initializer=priority.lower_current_thread,
            initargs=(self.bulk_priority,),
        )
        self._accept_thread = threading.Thread(target=self._accept_loop, name="mtc-data-accept", daemon=True)
        self._accept_thread.start()
        log.info("transfer data port listening on %s:%d", self.host, self.port)
        return self.port

    def issue_ticket(self, rank: int, step: int, step_dir: Path, files: Sequence[FileEntry],
                     sends: Sequence[tuple[FileEntry, int, int]] = ()) -> bytes:
        """A ticket for ``files`` of the step, or (``sends``) only these (file, offset, length) ranges."""
        if not self.running:
            raise OSError(errno.ESHUTDOWN, "transfer server is not running")
        return self.tickets.issue(rank, step, step_dir, files, sends)

    def stop(self, grace_seconds: float = 0.0) -> None:
        """Stop accepting, let transfers run for ``grace_seconds``, then abandon the rest and join."""
        self._stop.set()
        self.tickets.clear()
        if self._accept_thread is not None:
            self._wake_accept_loop()
            self._accept_thread.join(timeout=5.0)
        if self._sock is not None:
            self._sock.close()
        deadline = time.monotonic() + max(0.0, grace_seconds)
        while time.monotonic() < deadline:
            with self._lock:
                if not self._active:
                    break
            time.sleep(0.02)
        with self._lock:
            active = list(self._active)
        for conn in active:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left = list(self._active)
            self._active.clear()
        for conn in left:  # queued transfers whose task was cancelled
            conn.close()
        if active:
            log.warning("transfer server stopped with %d transfer(s) abandoned", len(active))

    def _wake_accept_loop(self) -> None:
        """A connection to our own port: the accept loop's select returns now and sees the stop, instead of
        after its 0.2 s timeout (which every Orbax-mode handshake's stop phase waited for)."""
        try:
            socket.create_connection(self._sock.getsockname()[:2], timeout=0.5).close()
        except (OSError, AttributeError):
            pass  # not listening: the loop ends by its timeout as before

    # -- accepting and reading headers (one thread, no blocking call)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, None)
        pending: dict[socket.socket, _Pending] = {}  # insertion order = accept order

        def drop(conn: socket.socket, why: str | None) -> None:
            sel.unregister(conn)
            p = pending.pop(conn)
            if why:
                self.connections_cut += 1
                log.warning("data connection from %s cut: %s", p.addr, why)
                _send_error(conn, why)
            conn.close()

        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = 0.2
                if pending:
                    timeout = max(0.0, min(timeout, next(iter(pending.values())).deadline - now))
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._sock:
                        self._accept_some(sel, pending, drop)
                        continue
                    conn = key.fileobj
                    assert isinstance(conn, socket.socket)
                    p = pending[conn]
                    try:
                        chunk = conn.recv(HEADER_BYTES - len(p.buf))
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        drop(conn, None)
                        continue
                    if not chunk:
                        drop(conn, None)
                        continue
                    p.buf += chunk
                    if len(p.buf) == HEADER_BYTES:
                        sel.unregister(conn)
                        del pending[conn]
                        self._admit(conn, p)
                now = time.monotonic()
                # Deadlines are in accept order, so the expired ones are at the front.
                while pending:
                    conn, p = next(iter(pending.items()))
                    if p.deadline > now:
                        break
                    drop(conn, f"no complete header within {self.header_timeout_seconds:g}s of connecting")
        except Exception:  # never expected; the data port is then gone, and clients fall back to streaming
            log.exception("data port accept loop failed")
        finally:
            for conn in list(pending):
                drop(conn, None)
            sel.close()

    def _accept_some(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Pending], drop: Any) -> None:
        assert self._sock is not None
        for _ in range(64):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("data port cannot accept: %s", e)
                    if pending:  # free a descriptor for the newcomer's successors
                        drop(next(iter(pending)), "server overloaded")
                    return
                raise
            conn.setblocking(False)
            if len(pending) >= self.max_header_connections:
                drop(next(iter(pending)), "too many connections waiting to send a header")
            pending[conn] = _Pending(addr, time.monotonic() + self.header_timeout_seconds)
            sel.register(conn, selectors.EVENT_READ, None)

    def _admit(self, conn: socket.socket, p: _Pending) -> None:
        """A complete header: check it, then queue the transfer (no thread until a sender takes it)."""
        header = bytes(p.buf)
        if header[: len(DATA_MAGIC)] != DATA_MAGIC:
            _send_error(conn, "bad protocol header")
            conn.close()
            return
        grant = self.tickets.redeem(header[len(DATA_MAGIC) :])
        if grant is None:
            log.warning("data connection from %s with an unknown, used or expired ticket", p.addr)
            _send_error(conn, "unknown, expired or already used ticket")
            conn.close()
            return
        with self._lock:
            busy = len(self._active) >= self._max_queued
            if not busy:
                self._active.add(conn)
        if busy or self._pool is None:
            self.connections_cut += 1
            _send_error(conn, "too many transfers queued, retry later")
            conn.close()
            return
        try:
            self._pool.submit(self._serve_conn, conn, p.addr, grant)
        except RuntimeError:  # pool shut down: stopping
            with self._lock:
                self._active.discard(conn)
            conn.close()

    # -- sending (on the pool's threads)

    def _serve_conn(self, conn: socket.socket, addr: Any, grant: _Grant) -> None:
        try:
            with conn:
                conn.setblocking(True)
                deadline = time.monotonic() + self.slot_wait_seconds
                while not self.slots.acquire(timeout=0.2):
                    if self._stop.is_set():
                        return
                    if time.monotonic() > deadline:
                        self.connections_cut += 1
                        _send_error(conn, f"no free transfer slot within {self.slot_wait_seconds:g}s")
                        return
                try:
                    self._send_files(conn, grant, addr)
                finally:
                    self.slots.release()
        except TimeoutError as e:
            self.connections_cut += 1
            log.warning("transfer to %s cut: %s", addr, e)
        except OSError as e:
            if self._stop.is_set():
                log.info("abandoned transfer to %s on shutdown", addr)
            else:
                log.warning("transfer to %s failed: %s", addr, e)
        finally:
            with self._lock:
                self._active.discard(conn)

    def _send_files(self, conn: socket.socket, grant: _Grant, addr: Any) -> None:
        # Check everything first so that a step deleted or changed since the ticket was issued is a clean
        # error; files are then opened one at a time (a step may have thousands).
        try:
            paths = [layout.resolve_under(grant.step_dir, e.name) for e in grant.files]
            for entry, path in zip(grant.files, paths, strict=True):
                if os.stat(path).st_size != entry.size:
                    raise ChecksumError(f"{path} (size changed)", entry.crc32c, 0)
        except (OSError, ValueError) as e:
            _send_error(conn, f"rank {grant.rank} step {grant.step} unavailable: {e}")
            return
        start, sent = time.monotonic(), 0
        conn.sendall(bytes([STATUS_OK]))
        conn.setblocking(False)
        # The reader must keep up with the minimum rate after the grace; time spent in our own throttle
        # does not count against it.
        allowance = start + self.min_rate_grace_seconds
        where = {e.name: path for e, path in zip(grant.files, paths, strict=True)}
        for entry, first, length in grant.sent():
            with open(where[entry.name], "rb") as f:
                offset, end = first, first + length
                while offset < end:
                    if self._stop.is_set():
                        raise ConnectionAbortedError("transfer server stopping")
                    n = min(SENDFILE_SLICE_BYTES, end - offset)
                    t0 = time.monotonic()
                    self.limiter.acquire(n, self._stop)
                    allowance += time.monotonic() - t0 + n / self.min_bytes_per_second
                    _sendfile_by(conn, f.fileno(), offset, n, allowance)
                    offset += n
                    sent += n
                    served_chunk()
        conn.setblocking(True)
        conn.shutdown(socket.SHUT_WR)
        with self._lock:
            self.transfers_completed += 1
            self.bytes_sent += sent
        dt = max(time.monotonic() - start, 1e-9)
        log.info(
            "sent rank %d step %d to %s: %d files%s, %d bytes in %.3fs (%.1f MiB/s)",
            grant.rank,
            grant.step,
            addr,
            len(grant.files),
            f" ({len(grant.sends)} pieces)" if grant.sends else "",
            sent,
            dt,
            sent / dt / 2**20,
        )


def _sendfile_by(conn: socket.socket, fd: int, offset: int, n: int, deadline: float) -> None:
    """``sendfile`` ``n`` bytes at ``offset`` to the non-blocking ``conn``, all of them by ``deadline``."""
    out = conn.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_WRITE)
        while n > 0:
            try:
                k = os.sendfile(out, fd, offset, n)
            except (BlockingIOError, InterruptedError):
                k = -1
            if k == 0:
                raise ChecksumError(f"file shorter than its manifest at offset {offset}", 0, 0)
            if k > 0:
                offset += k
                n -= k
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"reader too slow (below the minimum transfer rate), {n} bytes unsent")


def _send_error(conn: socket.socket, reason: str) -> None:
    msg = reason.encode()[:4000]
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(bytes([STATUS_ERROR]) + struct.pack(">H", len(msg)) + msg)
    except OSError:
        pass
