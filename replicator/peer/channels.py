"""One gRPC channel per peer address, shared by every copy, listing and manifest call to that peer.

Why: a channel per call dialled a new TCP (and HTTP/2) connection for every copy. With 8 % packet loss on every
host (tests/faults/test_links.py, ``lossy-all-hosts-8pct``) one lost SYN cost 1-3 s (the kernel's SYN
retransmission), and every concurrent copy from that peer waited on its own dial; a kept connection only pays
TCP's retransmission of the lost segment (0.2 s and up). The channel keeps its connection alive and reconnects
by itself (keepalive and reconnect backoff: ``rpc.make_channel``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from replicator.net import rpc
from replicator.net.security import TlsOptions

log = logging.getLogger(__name__)

# A channel in one of these states is replaced by a fresh one: in TRANSIENT_FAILURE gRPC fails every call at once
# until its reconnect backoff (up to 5 s) ends, although the peer may be back already (a daemon restarted on the
# same port); a SHUTDOWN channel was closed.
BROKEN_STATES = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
_STATE_BY_VALUE = {c.value[0]: c for c in grpc.ChannelConnectivity}

# A call that failed with one of these retires its channel (the next call dials afresh): UNAVAILABLE, its connection
# is gone; DEADLINE_EXCEEDED, its connection may be stalled without an RST (a peer's host frozen, a link dropping
# every packet), which would hold every later call to that peer until keepalive noticed or each call's deadline.
RETIRING_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

ChannelFactory = Callable[..., grpc.Channel]  # (address, *, token, tls) -> channel, like make_peer_channel

# gRPC shares one connection (subchannel) among all channels whose arguments are equal: a replacement made while
# calls still hold the broken channel would get its connection, backoff and all (measured: two channels to one
# address, one TCP connection). Each kept channel has its own.
OWN_CONNECTION_OPTIONS: list[tuple[str, Any]] = [("grpc.use_local_subchannel_pool", 1)]


def make_peer_channel(address: str, *, token: str | None = None, tls: TlsOptions | None = None,
                      max_message_bytes: int = rpc.MAX_MESSAGE_BYTES) -> grpc.Channel:
    """``rpc.make_channel``'s channel (message bounds, reconnect backoff, keepalive, bearer token, TLS), with a
    connection of its own (``OWN_CONNECTION_OPTIONS``)."""
    return rpc.make_channel(address, token=token, tls=tls, max_message_bytes=max_message_bytes,
                            extra_options=OWN_CONNECTION_OPTIONS)


def connectivity(channel: grpc.Channel) -> grpc.ChannelConnectivity | None:
    """``channel``'s connectivity state, without making it connect; None where gRPC does not tell.

    Read from gRPC's core channel (a private attribute, found through interceptor wrappers): the public way,
    ``channel.subscribe``, starts a polling thread per channel that wakes every 0.2 s for as long as it lives.
    """
    core: Any = channel
    for _ in range(4):  # an intercepted channel -> grpc._channel.Channel -> its core channel
        check = getattr(core, "check_connectivity_state", None)
        if check is not None:
            try:
                return _STATE_BY_VALUE.get(check(False))
            except ValueError:  # "Channel closed!"
                return grpc.ChannelConnectivity.SHUTDOWN
        core = getattr(core, "_channel", None)
        if core is None:
            return None
    return None


@dataclasses.dataclass(eq=False)
class _Entry:
    channel: grpc.Channel
    settings: tuple[str | None, TlsOptions | None]  # (token, tls) the channel was made with
    leases: int = 0
    retired: bool = False  # replaced or the cache closed: closed once its last lease ends
    closed: bool = False


class PeerChannels:
    """A thread-safe cache of channels to peers, one per address (the daemon's, closed at its stop).

    :meth:`lease` hands out the address's channel. It is replaced by a new one when it is in TRANSIENT_FAILURE
    or SHUTDOWN, when a call on it failed UNAVAILABLE or DEADLINE_EXCEEDED (``RETIRING_CODES``: the next call dials
    afresh), or
    when it is asked for with another token or TLS setting. A replaced channel is closed once the calls using
    it ended (closing a channel cancels its calls).
    """

    def __init__(self, make_channel: ChannelFactory = make_peer_channel):
        self._make = make_channel
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def lease(self, address: str, *, token: str | None = None,
              tls: TlsOptions | None = None) -> Iterator[grpc.Channel]:
        """The channel to ``address`` for the calls made inside the block."""
        entry = self._acquire(address, (token, tls))
        try:
            yield entry.channel
        except grpc.RpcError as e:
            if getattr(e, "code", None) is not None and e.code() in RETIRING_CODES:
                self._retire(address, entry)
            raise
        finally:
            self._release(entry)

    def _acquire(self, address: str, settings: tuple[str | None, TlsOptions | None]) -> _Entry:
        doomed: list[_Entry] = []
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError(f"peer channels closed (stopping): not dialling {address}")
            entry = self._entries.get(address)
            if entry is not None:
                state = connectivity(entry.channel)
                if entry.settings != settings or state in BROKEN_STATES:
                    log.info("replacing the channel to peer %s (%s)", address,
                             "token or TLS changed" if entry.settings != settings else state)
                    doomed += self._retire_locked(address, entry)
                    entry = None
            if entry is None:
                token, tls = settings
                entry = _Entry(self._make(address, token=token, tls=tls), settings)
                self._entries[address] = entry
            entry.leases += 1
        _close(doomed)
        return entry

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.leases -= 1
            doomed = self._due(entry)
        _close(doomed)

    def _retire(self, address: str, entry: _Entry) -> None:
        with self._lock:
            doomed = self._retire_locked(address, entry)
        _close(doomed)

    def _retire_locked(self, address: str, entry: _Entry) -> list[_Entry]:
        if self._entries.get(address) is entry:
            del self._entries[address]
        entry.retired = True
        return self._due(entry)

    @staticmethod
    def _due(entry: _Entry) -> list[_Entry]:
        """``[entry]`` when it is to be closed now (marked closed), else []."""
        if entry.retired and entry.leases <= 0 and not entry.closed:
            entry.closed = True
            return [entry]
        return []

    def addresses(self) -> list[str]:
        """The addresses a channel is cached for."""
        with self._lock:
            return sorted(self._entries)

    def close(self) -> None:
        """Close every channel, cancelling the calls still on them; later leases raise ConnectionAbortedError."""
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            for e in entries:
                e.retired = True
                e.closed = True
        _close(entries)


def _close(entries: list[_Entry]) -> None:
    for e in entries:
        e.channel.close()
