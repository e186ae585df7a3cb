"""One kept gRPC channel per peer (``replicator.peer.channels``): reused across copies, listings and manifests,
replaced when broken (a peer restarted on its port), when a call on it failed UNAVAILABLE or DEADLINE_EXCEEDED, or
when the token or TLS settings change; closed at the daemon's stop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.net import rpc
from replicator.net.security import BearerTokenClientInterceptor, TlsOptions
from replicator.peer import client as peer_client
from replicator.peer import protocol as peer_protocol
from replicator.peer.channels import OWN_CONNECTION_OPTIONS, PeerChannels, connectivity, make_peer_channel
from sidecar import checksums, commit, layout
from tests.replicator.peer.test_transfer import TOKEN, PeerHost, make_step

UNUSED = "127.0.0.1:1"  # never dialled: a channel connects only when a call (or try_to_connect) wants it


class Counting:
    """A channel factory (``make_peer_channel`` unless told), counting the channels it made and their addresses."""

    def __init__(self, make: Callable[..., grpc.Channel] = make_peer_channel) -> None:
        self.made: list[str] = []
        self._make = make
        self._lock = threading.Lock()

    def __call__(self, address: str, **kw: Any) -> grpc.Channel:
        with self._lock:
            self.made.append(address)
        return self._make(address, **kw)


def slow_reconnect_channel(address: str, *, token: str | None = None, tls: TlsOptions | None = None) -> grpc.Channel:
    """A peer channel whose reconnect backoff is 10 s from the first failure (the daemon's grows to 5 s): in
    TRANSIENT_FAILURE for the whole test, deterministically."""
    assert tls is None
    ch = grpc.insecure_channel(address, options=[("grpc.initial_reconnect_backoff_ms", 10_000),
                                                 ("grpc.max_reconnect_backoff_ms", 10_000), *OWN_CONNECTION_OPTIONS])
    return grpc.intercept_channel(ch, BearerTokenClientInterceptor(token)) if token is not None else ch


@pytest.fixture
def pool() -> Iterator[tuple[PeerChannels, Counting]]:
    made = Counting()
    channels = PeerChannels(made)
    yield channels, made
    channels.close()


def _wait_state(channel: grpc.Channel, want: grpc.ChannelConnectivity, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while connectivity(channel) is not want:
        assert time.monotonic() < deadline, f"channel still {connectivity(channel)}, not {want}"
        time.sleep(0.02)


def test_one_channel_serves_every_copy_listing_and_manifest_from_a_peer(
        pool: tuple[PeerChannels, Counting], tmp_path: Path) -> None:
    channels, made = pool
    host = PeerHost(tmp_path / "src")
    try:
        m5 = make_step(layout.steps_dir(host.root), 1, 5, {"a.bin": 3 << 20, "b.bin": 10})
        m6 = make_step(layout.steps_dir(host.root), 1, 6, {"a.bin": 1 << 20})
        dest = tmp_path / "dst"
        assert peer_client.fetch_step(host.address, 1, 5, dest, token=TOKEN, channels=channels) == m5
        assert peer_client.fetch_step(host.address, 1, 6, dest, token=TOKEN, channels=channels) == m6
        assert [h.step for h in peer_client.list_steps(host.address, token=TOKEN, channels=channels)] == [5, 6]
        assert peer_client.get_manifest(host.address, 1, 6, token=TOKEN, channels=channels) == m6
        (tmp_path / "files").mkdir()
        n = peer_client.fetch_files(host.address, 1, 5, list(m5.files), tmp_path / "files", token=TOKEN,
                                    channels=channels)
        assert n == m5.total_bytes and commit.committed_steps(dest) == [5, 6]
        assert made.made == [host.address]  # five calls, one channel
        assert host.ts is not None and host.ts.transfers_completed == 3  # the bytes went over the data port
        assert channels.addresses() == [host.address]
    finally:
        host.stop()


def test_concurrent_copies_from_one_peer_share_its_channel(pool: tuple[PeerChannels, Counting],
                                                           tmp_path: Path) -> None:
    channels, made = pool
    host = PeerHost(tmp_path / "src")
    try:
        for step in range(1, 7):
            make_step(layout.steps_dir(host.root), 1, step, {"a.bin": 1 << 20})
        errors: list[BaseException] = []

        def copy(step: int) -> None:
            try:
                peer_client.fetch_step(host.address, 1, step, tmp_path / "dst", token=TOKEN, channels=channels)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        threads = [threading.Thread(target=copy, args=(s,)) for s in range(1, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and commit.committed_steps(tmp_path / "dst") == [1, 2, 3, 4, 5, 6]
        assert made.made == [host.address]
    finally:
        host.stop()


def test_a_channel_in_transient_failure_is_replaced_once_the_peer_restarted_on_its_port(tmp_path: Path) -> None:
    made = Counting(slow_reconnect_channel)
    channels = PeerChannels(made)
    root = tmp_path / "src"
    host = PeerHost(root)
    port = int(host.address.rsplit(":", 1)[1])
    make_step(layout.steps_dir(root), 1, 5, {"a.bin": 1 << 20})
    make_step(layout.steps_dir(root), 1, 6, {"a.bin": 1 << 20})
    peer_client.fetch_step(host.address, 1, 5, tmp_path / "dst", token=TOKEN, channels=channels)
    with channels.lease(host.address, token=TOKEN) as old:
        pass
    host.stop()
    # A call while the peer is down (not through the cache) fails, and leaves the kept channel in
    # TRANSIENT_FAILURE: gRPC fails every call on it at once until its reconnect backoff ends.
    with pytest.raises(grpc.RpcError) as e:
        peer_pb2_grpc.PeerStub(old).ListSteps(peer_pb2.ListStepsRequest(), timeout=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    _wait_state(old, grpc.ChannelConnectivity.TRANSIENT_FAILURE)
    host = PeerHost(root, listen=f"127.0.0.1:{port}")  # the daemon is back, on the same port
    try:
        t0 = time.monotonic()
        peer_client.fetch_step(host.address, 1, 6, tmp_path / "dst", token=TOKEN, channels=channels)
        assert time.monotonic() - t0 < 3.0
        assert made.made == [host.address, host.address]
        assert connectivity(old) is grpc.ChannelConnectivity.SHUTDOWN  # the replaced one was closed
    finally:
        channels.close()
        host.stop()


def test_a_call_that_failed_unavailable_retires_the_channel(pool: tuple[PeerChannels, Counting],
                                                            tmp_path: Path) -> None:
    channels, made = pool
    host = PeerHost(tmp_path / "src")
    address = host.address
    assert peer_client.list_steps(address, token=TOKEN, channels=channels) == []
    host.stop()
    with pytest.raises(grpc.RpcError) as e:
        peer_client.list_steps(address, token=TOKEN, channels=channels, timeout_seconds=5)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert channels.addresses() == []  # the next call dials afresh
    with pytest.raises(grpc.RpcError):
        peer_client.list_steps(address, token=TOKEN, channels=channels, timeout_seconds=5)
    assert made.made == [address, address]


def test_a_call_that_failed_deadline_exceeded_retires_the_channel(pool: tuple[PeerChannels, Counting]) -> None:
    """A peer whose connection stalls without an RST (here: a listener that never accepts, so TCP connects and
    nothing ever answers) fails the call DEADLINE_EXCEEDED with the channel still CONNECTING, not broken: the
    channel is replaced all the same, so the next call to that peer dials afresh instead of joining the stall."""
    channels, made = pool
    with socket.create_server(("127.0.0.1", 0), backlog=8) as stalled:
        address = f"127.0.0.1:{stalled.getsockname()[1]}"
        with pytest.raises(grpc.RpcError) as e:
            peer_client.list_steps(address, token=TOKEN, channels=channels, timeout_seconds=0.5)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert channels.addresses() == []  # retired: the next call dials afresh
        with pytest.raises(grpc.RpcError):
            peer_client.list_steps(address, token=TOKEN, channels=channels, timeout_seconds=0.5)
        assert made.made == [address, address]


def test_other_credentials_get_a_new_channel_and_the_old_one_closes_after_its_last_call(
        pool: tuple[PeerChannels, Counting]) -> None:
    channels, made = pool
    with channels.lease(UNUSED, token="a") as first:
        with channels.lease(UNUSED, token="a") as same:
            assert same is first
        with channels.lease(UNUSED, token="b") as second:
            assert second is not first
            assert connectivity(first) is grpc.ChannelConnectivity.IDLE  # still leased: not closed under a call
        assert connectivity(second) is grpc.ChannelConnectivity.IDLE  # kept for the next call
    assert connectivity(first) is grpc.ChannelConnectivity.SHUTDOWN
    with channels.lease(UNUSED, token="b") as again:
        assert again is second
    assert len(made.made) == 2


def test_closing_closes_every_channel_and_refuses_new_calls(pool: tuple[PeerChannels, Counting]) -> None:
    channels, _ = pool
    with channels.lease(UNUSED) as ch:
        pass
    channels.close()
    assert connectivity(ch) is grpc.ChannelConnectivity.SHUTDOWN and channels.addresses() == []
    with pytest.raises(ConnectionAbortedError):
        with channels.lease(UNUSED):
            pass
    with pytest.raises(ConnectionAbortedError):  # an OSError: a copy task fails (and is retried) as usual
        peer_client.list_steps(UNUSED, channels=channels)


def test_without_a_cache_each_call_still_has_its_own_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = Counting(rpc.make_channel)
    monkeypatch.setattr(rpc, "make_channel", made)
    host = PeerHost(tmp_path / "src")
    try:
        made.made.clear()  # PeerHost made none, but be exact about what the calls below make
        peer_client.list_steps(host.address, token=TOKEN)
        peer_client.list_steps(host.address, token=TOKEN)
        assert made.made == [host.address, host.address]
    finally:
        host.stop()


class _StallingPeer(peer_pb2_grpc.PeerServicer):
    """``ReadFiles`` sends ``chunks`` chunks of 64 KiB, ``gap`` seconds apart, then holds the stream open and silent
    until released (a peer whose stream stalled without an RST: its sent bytes stuck behind a lossy link)."""

    def __init__(self, chunks: int, gap: float) -> None:
        self.chunks, self.gap = chunks, gap
        self.release = threading.Event()

    def ReadFiles(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        data = b"\x01" * (64 << 10)
        for i in range(self.chunks):
            if i:
                time.sleep(self.gap)
            yield peer_pb2.FileChunk(file_index=0, offset=i * len(data), data=data,
                                     crc32c=checksums.crc32c(data), name="0.bin" if i == 0 else "",
                                     file_size=4 * len(data) if i == 0 else 0)
        self.release.wait(30)


@pytest.fixture
def stalling() -> Iterator[Callable[[int, float], tuple[str, _StallingPeer]]]:
    servers: list[tuple[grpc.Server, _StallingPeer]] = []

    def start(chunks: int, gap: float = 0.0) -> tuple[str, _StallingPeer]:
        servicer = _StallingPeer(chunks, gap)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        peer_pb2_grpc.add_PeerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, servicer))
        return f"127.0.0.1:{port}", servicer

    yield start
    for server, servicer in servers:
        servicer.release.set()
        server.stop(grace=None).wait(5)


@pytest.mark.parametrize("chunks", [0, 2], ids=["silent-from-the-start", "silent-after-two-chunks"])
def test_a_stream_silent_past_its_bound_is_cancelled_and_retires_its_channel(
        pool: tuple[PeerChannels, Counting], stalling: Callable[..., tuple[str, _StallingPeer]],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, chunks: int) -> None:
    """A ReadFiles stream that delivers nothing for the idle bound (the first chunk: its own, longer bound) fails
    DEADLINE_EXCEEDED with nothing half-written, and its channel is retired so the retry dials afresh. gRPC's
    keepalive did not bound such a stream: under 15 % loss one hung 61 s (tests/faults lossy-one-host-15pct)."""
    from replicator.net.stall import StreamStalled
    from replicator.net.throttle import RateLimiter
    from replicator.peer.sinks import FileSink

    monkeypatch.setattr(peer_protocol, "DATA_IDLE_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(peer_protocol, "STREAM_FIRST_CHUNK_SECONDS", 2.0)
    channels, made = pool
    address, _ = stalling(chunks)
    sink = FileSink(tmp_path, [layout.FileEntry("0.bin", 4 * (64 << 10), 0)])
    t0 = time.monotonic()
    with pytest.raises(StreamStalled) as e, channels.lease(address) as ch:
        peer_client._receive_stream(peer_pb2_grpc.PeerStub(ch), 0, 1, sink, time.monotonic() + 60, RateLimiter(None))
    took = time.monotonic() - t0
    sink.abort()
    bound = 2.0 if chunks == 0 else 1.0
    assert bound <= took <= bound + 2.0, took
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert channels.addresses() == []  # retired: the retry dials a new connection
    assert not [p for p in tmp_path.iterdir() if p.name != "0.bin"] and not (tmp_path / "0.bin").exists()
    assert made.made == [address]


def test_a_slow_stream_that_keeps_delivering_is_not_cancelled(
        pool: tuple[PeerChannels, Counting], stalling: Callable[..., tuple[str, _StallingPeer]],
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Chunks 0.6 s apart under a 1 s idle bound: 1.8 s in all, longer than the bound, and the file arrives."""
    from replicator.net.throttle import RateLimiter
    from replicator.peer.sinks import FileSink

    monkeypatch.setattr(peer_protocol, "DATA_IDLE_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(peer_protocol, "STREAM_FIRST_CHUNK_SECONDS", 1.0)
    channels, _ = pool
    address, servicer = stalling(4, 0.6)
    data = b"\x01" * (64 << 10)
    crc = checksums.crc32c(data * 4)
    sink = FileSink(tmp_path, [layout.FileEntry("0.bin", 4 * len(data), crc)])
    servicer.release.set()  # the stream ends after its fourth chunk
    with channels.lease(address) as ch:
        peer_client._receive_stream(peer_pb2_grpc.PeerStub(ch), 0, 1, sink, time.monotonic() + 60, RateLimiter(None))
    assert (tmp_path / "0.bin").read_bytes() == data * 4
    assert channels.addresses() == [address]
