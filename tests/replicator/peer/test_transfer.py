"""Peer transfer: real Peer gRPC servers and data ports on 127.0.0.1, real files, real failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.net import rpc
from replicator.peer import client as peer_client
from replicator.peer import protocol as peer_protocol
from replicator.peer import server as peer_server
from sidecar import checksums, commit, layout, spares
from sidecar.checksums import ChecksumError
from sidecar.layout import FileEntry, StepManifest

REPO = Path(__file__).resolve().parents[3]
TOKEN = "s3cret-token"
NODES = 4


def make_step(parent: Path, rank: int, step: int, sizes: dict[str, int], seed: int = 0) -> StepManifest:
    """Commit a step with random files of the given sizes under ``parent/<step>``."""
    tmp = commit.make_tmp_dir(parent, step)
    rng = np.random.default_rng(seed + step)
    entries = []
    for name, size in sizes.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.integers(0, 256, size, dtype=np.uint8)
        data.tofile(path)
        entries.append(FileEntry(name, size, checksums.crc32c(data)))
    m = StepManifest(job="t", step=step, rank=rank, nodes=NODES, files=tuple(entries))
    commit.write_manifest(tmp, m)
    commit.commit_dir(tmp, parent / str(step))
    return m


def tree(root: Path) -> dict[str, int]:
    """Every path under ``root`` with its size (directories as -1): a snapshot to prove nothing changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = -1
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = os.lstat(p).st_size
    return out


class PeerHost:
    """One host's Peer service: gRPC server + data port over ``root``."""

    def __init__(
        self,
        root: Path,
        own_rank: int = 1,
        *,
        data_port: bool = True,
        ticket_ttl_seconds: float = 30.0,
        server_throttle: peer_protocol.Throttle | None = None,
        max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
        advertise_host: str = "",
        listen: str = "127.0.0.1:0",
    ):
        self.root = root
        self.ts = None
        if data_port:
            self.ts = peer_server.TransferServer(throttle=server_throttle, ticket_ttl_seconds=ticket_ttl_seconds)
            self.ts.start()
        self.servicer = peer_server.PeerServicer(
            root,
            own_rank,
            NODES,
            transfer_server=self.ts,
            throttle=server_throttle,
            advertise_host=advertise_host,
        )
        self.server, port = rpc.create_server(
            listen,
            [(peer_pb2_grpc.add_PeerServicer_to_server, self.servicer)],
            token=TOKEN,
            max_message_bytes=max_message_bytes,
        )
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def stub(self, token: str | None = TOKEN) -> tuple[grpc.Channel, peer_pb2_grpc.PeerStub]:
        ch = rpc.make_channel(self.address, token=token)
        return ch, peer_pb2_grpc.PeerStub(ch)

    def stop(self) -> None:
        if self.ts is not None:
            self.ts.stop()
        rpc.stop_server(self.server, 0.5)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[PeerHost]:
    h = PeerHost(tmp_path / "src")
    yield h
    h.stop()


SIZES = {"MANIFEST.extra": 0, "a/0.0.bin": 12345, "a/1.0.bin": 3 << 20, "b/big.bin": (64 << 20) + 4097}


def assert_same_files(src_dir: Path, dst_dir: Path, manifest: StepManifest) -> None:
    for f in manifest.files:
        a, b = src_dir / f.name, dst_dir / f.name
        assert a.stat().st_size == b.stat().st_size == f.size
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(8 << 20), fb.read(8 << 20)
                assert x == y, f"{f.name} differs"
                if not x:
                    break


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("use_data_port", [True, False], ids=["tcp", "grpc-stream"])
def test_fetch_round_trip_bit_exact(host: PeerHost, tmp_path: Path, use_data_port: bool) -> None:
    m = make_step(layout.steps_dir(host.root), 1, 7, SIZES)
    dest = tmp_path / "dst" / "peer" / "1"
    got = peer_client.fetch_step(
        host.address, 1, 7, dest, token=TOKEN, timeout_seconds=60, use_data_port=use_data_port
    )
    assert got == m
    assert commit.committed_steps(dest) == [7]
    assert layout.read_manifest(dest / "7") == m
    checksums.verify_step_dir(dest / "7")
    assert_same_files(layout.steps_dir(host.root) / "7", dest / "7", m)
    assert sorted(p.name for p in dest.iterdir()) == ["7"]  # no tmp dir, no part files left
    assert not list((dest / "7").rglob("*" + peer_protocol.PART_SUFFIX))
    assert host.ts is not None
    assert host.ts.transfers_completed == (1 if use_data_port else 0)
    assert host.ts.bytes_sent == (m.total_bytes if use_data_port else 0)


def test_a_small_copy_takes_the_stream_and_a_larger_one_the_data_port(host: PeerHost, tmp_path: Path) -> None:
    # Below STREAM_BELOW_BYTES a new data connection (and its ticket) costs more than it saves; on a lossy
    # network a lost SYN cost a copy 1 s.
    below = peer_protocol.STREAM_BELOW_BYTES
    small = make_step(layout.steps_dir(host.root), 1, 5, {"a.bin": below // 2, "b.bin": below // 2 - 1})
    large = make_step(layout.steps_dir(host.root), 1, 6, {"a.bin": below // 2, "b.bin": below // 2})
    assert peer_client.fetch_step(host.address, 1, 5, tmp_path / "d", token=TOKEN) == small
    assert host.ts is not None and host.ts.transfers_completed == 0
    assert peer_client.fetch_step(host.address, 1, 6, tmp_path / "d", token=TOKEN) == large
    assert host.ts.transfers_completed == 1 and host.ts.bytes_sent == below
    checksums.verify_step_dir(tmp_path / "d" / "5")
    checksums.verify_step_dir(tmp_path / "d" / "6")


def test_list_steps_and_peer_copies(host: PeerHost, tmp_path: Path) -> None:
    own = make_step(layout.steps_dir(host.root), 1, 3, {"x.bin": 100})
    copy = make_step(layout.peer_dir(host.root, 2), 2, 3, {"y.bin": 200, "z.bin": 1})
    (layout.steps_dir(host.root) / ".tmp-9-abc").mkdir()  # never listed
    held = peer_client.list_steps(host.address, token=TOKEN)
    assert held == [
        peer_client.HeldStep(1, 3, own.content_hash, 100, "native", 1),
        peer_client.HeldStep(2, 3, copy.content_hash, 201, "native", 2),
    ]
    # A peer copy is served like an own step.
    got = peer_client.fetch_step(host.address, 2, 3, tmp_path / "d", token=TOKEN)
    assert got == copy
    assert peer_client.get_manifest(host.address, 1, 3, token=TOKEN) == own


def test_fetch_subset_of_files(host: PeerHost, tmp_path: Path) -> None:
    m = make_step(layout.steps_dir(host.root), 1, 5, {"a.bin": 1000, "s/b.bin": 5 << 20, "c.bin": 10})
    dest = tmp_path / "partial"
    dest.mkdir()
    wanted = [f for f in m.files if f.name != "a.bin"]
    n = peer_client.fetch_files(host.address, 1, 5, wanted, dest, token=TOKEN)
    assert n == sum(f.size for f in wanted)
    assert sorted(tree(dest)) == ["c.bin", "s", "s/b.bin"]
    assert_same_files(layout.steps_dir(host.root) / "5", dest, StepManifest("t", 5, 1, NODES, tuple(wanted)))
    with pytest.raises(FileExistsError):  # never overwrites, checked before any transfer
        peer_client.fetch_files(host.address, 1, 5, wanted, dest, token=TOKEN)


def _piece(src: Path, name: str, offset: int, length: int) -> layout.FilePiece:
    with open(src / name, "rb") as f:
        f.seek(offset)
        return layout.FilePiece(name, offset, length, checksums.crc32c(f.read(length)))


@pytest.mark.parametrize("use_data_port", [True, False], ids=["tcp", "grpc-stream"])
def test_fetch_pieces_of_files(host: PeerHost, tmp_path: Path, use_data_port: bool) -> None:
    # Only the asked-for byte ranges cross the wire (the data port), each at its offset of a full-size file;
    # the gRPC stream sends whole files instead, which hold the same bytes there.
    m = make_step(layout.steps_dir(host.root), 1, 5, {"a.bin": 5 << 20, "b.bin": 3 << 20, "c.bin": 10})
    src = layout.steps_dir(host.root) / "5"
    wanted = [f for f in m.files if f.name != "c.bin"]
    pieces = [_piece(src, "a.bin", 1 << 20, 1 << 20), _piece(src, "a.bin", 3 << 20, (2 << 20) - 5),
              _piece(src, "b.bin", 0, 4096)]
    dest = tmp_path / "pieces"
    dest.mkdir()
    n = peer_client.fetch_files(host.address, 1, 5, wanted, dest, token=TOKEN, pieces=pieces,
                                use_data_port=use_data_port)
    assert sorted(tree(dest)) == ["a.bin", "b.bin"]  # final names, no part files
    for pc in pieces:
        with open(dest / pc.name, "rb") as f, open(src / pc.name, "rb") as g:
            f.seek(pc.offset)
            g.seek(pc.offset)
            assert f.read(pc.length) == g.read(pc.length)
    assert (dest / "a.bin").stat().st_size == 5 << 20
    if use_data_port:
        assert n == sum(pc.length for pc in pieces) == host.ts.bytes_sent
        with open(dest / "a.bin", "rb") as f:
            assert f.read(1 << 20) == bytes(1 << 20)  # not asked for: never sent
    else:
        assert n == sum(f.size for f in wanted)
        assert_same_files(src, dest, StepManifest("t", 5, 1, NODES, tuple(wanted)))


def test_a_bad_piece_lands_nowhere_and_bad_requests_change_nothing(host: PeerHost, tmp_path: Path) -> None:
    m = make_step(layout.steps_dir(host.root), 1, 5, {"a.bin": 3 << 20})
    src = layout.steps_dir(host.root) / "5"
    dest = tmp_path / "d"
    dest.mkdir()
    good = _piece(src, "a.bin", 4096, 1 << 20)
    with pytest.raises(ChecksumError):  # the crc32c the caller derived from the manifest is not what came
        peer_client.fetch_files(host.address, 1, 5, list(m.files), dest, token=TOKEN,
                                pieces=[layout.FilePiece("a.bin", good.offset, good.length, good.crc32c ^ 1)])
    assert tree(dest) == {}
    for bad in ([layout.FilePiece("other.bin", 0, 10, 0)], [layout.FilePiece("a.bin", (3 << 20) - 4, 8, 0)],
                [layout.FilePiece("a.bin", 0, 0, 0)], [good, layout.FilePiece("a.bin", 0, 10, 0)]):
        with pytest.raises(ValueError):  # checked before anything is asked for
            peer_client.fetch_files(host.address, 1, 5, list(m.files), dest, token=TOKEN, pieces=bad)
        # The server refuses the same requests itself.
        ch, stub = host.stub(TOKEN)
        try:
            req = peer_pb2.OpenTransferRequest(rank=1, step=5, files=["a.bin"], pieces=[
                peer_pb2.TransferPiece(name=pc.name, offset=pc.offset, length=pc.length) for pc in bad])
            assert _code(stub.OpenTransfer, req, timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            ch.close()
    assert tree(dest) == {}


def test_fetch_refuses_existing_step(host: PeerHost, tmp_path: Path) -> None:
    make_step(layout.steps_dir(host.root), 1, 7, {"a": 10})
    dest = tmp_path / "d"
    peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN)
    before = tree(dest)
    with pytest.raises(FileExistsError):
        peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN)
    assert tree(dest) == before


# --------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("use_data_port", [True, False], ids=["tcp", "grpc-stream"])
def test_corrupted_file_on_server_commits_nothing(
    host: PeerHost, tmp_path: Path, use_data_port: bool
) -> None:
    make_step(layout.steps_dir(host.root), 1, 4, {"a.bin": 1 << 20, "b.bin": 9 << 20})
    victim = layout.steps_dir(host.root) / "4" / "b.bin"
    with open(victim, "r+b") as f:  # same size, one flipped byte in the middle
        f.seek(5 << 20)
        byte = f.read(1)
        f.seek(5 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    dest = tmp_path / "d"
    with pytest.raises(ChecksumError, match="b.bin"):
        peer_client.fetch_step(host.address, 1, 4, dest, token=TOKEN, use_data_port=use_data_port)
    assert commit.committed_steps(dest) == []
    assert list(dest.iterdir()) == []  # the temporary directory was removed too


def test_corrupt_manifest_on_server_is_data_loss(host: PeerHost, tmp_path: Path) -> None:
    make_step(layout.steps_dir(host.root), 1, 4, {"a.bin": 10})
    mpath = layout.steps_dir(host.root) / "4" / layout.MANIFEST_NAME
    d = json.loads(mpath.read_bytes())
    d["files"][0]["name"] = "../../escape"
    mpath.write_text(json.dumps(d))
    dest = tmp_path / "d"
    with pytest.raises(grpc.RpcError) as ei:
        peer_client.fetch_step(host.address, 1, 4, dest, token=TOKEN)
    assert ei.value.code() == grpc.StatusCode.DATA_LOSS
    assert not dest.exists() or list(dest.iterdir()) == []


# --------------------------------------------------------------------------- bad requests


def _code(fn: object, *args: object, **kw: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        r = fn(*args, **kw)  # type: ignore[operator]
        if not hasattr(r, "SerializeToString"):
            list(r)  # drain a stream
    return ei.value.code()


def test_bad_requests_rejected_and_nothing_changes(host: PeerHost, tmp_path: Path) -> None:
    make_step(layout.steps_dir(host.root), 1, 7, {"a/x.bin": 100, "y.bin": 5})
    step_dir = layout.steps_dir(host.root) / "7"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    # A symlink inside the step pointing outside the root, listed in a (hand-made) manifest.
    (step_dir / "evil.bin").symlink_to(outside)
    m = layout.read_manifest(step_dir)
    m2 = StepManifest(
        m.job, m.step, m.rank, m.nodes, (*m.files, FileEntry("evil.bin", 6, checksums.crc32c(b"secret")))
    )
    (step_dir / layout.MANIFEST_NAME).write_bytes(m2.to_json())
    before = tree(host.root)
    ch, stub = host.stub()
    inv, nf = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    t = rpc.RPC_TIMEOUT_SECONDS
    cases = [
        (peer_pb2.GetManifestRequest(rank=-1, step=7), "GetManifest", inv),
        (peer_pb2.GetManifestRequest(rank=NODES, step=7), "GetManifest", inv),
        (peer_pb2.GetManifestRequest(rank=1, step=-3), "GetManifest", inv),
        (peer_pb2.GetManifestRequest(rank=1, step=8), "GetManifest", nf),
        (peer_pb2.GetManifestRequest(rank=2, step=7), "GetManifest", nf),
    ]
    for names, code in [
        (["../x"], inv),
        (["/etc/passwd"], inv),
        (["a/../../x"], inv),
        ([""], inv),
        (["a\\x.bin"], inv),
        (["y.bin", "y.bin"], inv),
        (["evil.bin"], inv),
        (["nope.bin"], nf),
        (["a"], nf),
    ]:
        cases.append((peer_pb2.OpenTransferRequest(rank=1, step=7, files=names), "OpenTransfer", code))
        cases.append((peer_pb2.ReadFilesRequest(rank=1, step=7, files=names), "ReadFiles", code))
    cases.append((peer_pb2.OpenTransferRequest(rank=3, step=7), "OpenTransfer", nf))
    cases.append((peer_pb2.ReadFilesRequest(rank=9, step=7), "ReadFiles", inv))
    with ch:
        for req, method, expected in cases:
            got = _code(getattr(stub, method), req, timeout=t)
            assert got == expected, f"{method}({req}) -> {got}, expected {expected}"
        # The whole step at once also refuses because of the escaping symlink.
        assert _code(stub.ReadFiles, peer_pb2.ReadFilesRequest(rank=1, step=7), timeout=t) == inv
    assert tree(host.root) == before
    assert host.ts is not None and host.ts.transfers_completed == 0
    dest = tmp_path / "d"
    with pytest.raises(grpc.RpcError) as ei:
        peer_client.fetch_step(host.address, 1, 99, dest, token=TOKEN)
    assert ei.value.code() == nf
    assert not dest.exists() or list(dest.iterdir()) == []


def test_oversized_message_rejected(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src", max_message_bytes=64 << 10)
    try:
        make_step(layout.steps_dir(h.root), 1, 7, {"y.bin": 5})
        before = tree(h.root)
        ch, stub = h.stub()
        with ch:
            req = peer_pb2.OpenTransferRequest(rank=1, step=7, files=[f"f{i:07d}" for i in range(20000)])
            assert req.ByteSize() > 64 << 10
            assert _code(stub.OpenTransfer, req, timeout=10) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert tree(h.root) == before
    finally:
        h.stop()


# --------------------------------------------------------------------------- tickets and the data port


def _redeem(port: int, ticket: bytes, header: bytes = peer_protocol.DATA_MAGIC) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(header + ticket)
        chunks = []
        while True:
            b = s.recv(1 << 20)
            if not b:
                break
            chunks.append(b)
    data = b"".join(chunks)
    return data[0], data[1:]


def test_ticket_single_use_bound_and_expiring(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src", ticket_ttl_seconds=0.3)
    try:
        make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 1000, "b.bin": 3000})
        ch, stub = h.stub()
        assert h.ts is not None
        with ch:
            resp = stub.OpenTransfer(
                peer_pb2.OpenTransferRequest(rank=1, step=7, files=["b.bin"]), timeout=10
            )
            assert resp.data_port == h.ts.port and len(resp.ticket) == peer_protocol.TICKET_BYTES
            assert [(f.name, f.size) for f in resp.files] == [("b.bin", 3000)]
            status, body = _redeem(resp.data_port, resp.ticket)
            # Bound to the files asked for: exactly b.bin's bytes.
            assert status == 0 and body == (layout.steps_dir(h.root) / "7" / "b.bin").read_bytes()
            status, body = _redeem(resp.data_port, resp.ticket)  # reused
            assert status == 1 and b"ticket" in body
            status, body = _redeem(resp.data_port, os.urandom(peer_protocol.TICKET_BYTES))  # forged
            assert status == 1 and b"ticket" in body
            resp = stub.OpenTransfer(peer_pb2.OpenTransferRequest(rank=1, step=7), timeout=10)
            status, body = _redeem(resp.data_port, resp.ticket, header=b"GET / HT")  # wrong protocol
            assert status == 1 and b"header" in body
            resp = stub.OpenTransfer(peer_pb2.OpenTransferRequest(rank=1, step=7), timeout=10)
            time.sleep(0.5)
            status, body = _redeem(resp.data_port, resp.ticket)  # expired
            assert status == 1 and b"expired" in body
        assert h.ts.transfers_completed == 1
    finally:
        h.stop()


def test_data_port_unreachable_falls_back_to_stream(tmp_path: Path) -> None:
    # The server advertises an address nobody listens on (127.0.0.2 is loopback on Linux).
    h = PeerHost(tmp_path / "src", advertise_host="127.0.0.2")
    try:
        m = make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 2 << 20})
        assert peer_client.fetch_step(h.address, 1, 7, tmp_path / "d", token=TOKEN) == m
        checksums.verify_step_dir(tmp_path / "d" / "7")
        assert h.ts is not None and h.ts.transfers_completed == 0
    finally:
        h.stop()


def test_a_data_connection_not_made_in_time_falls_back_to_stream(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Its SYNs lost (8 % loss on every host: about 2 % of connections lose two): no data connection within
    # DATA_CONNECT_TIMEOUT_SECONDS. The gRPC stream, over the channel's established connection, takes over.
    h = PeerHost(tmp_path / "src")
    try:
        m = make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 2 << 20})

        def lost(address: tuple[str, int], timeout: float | None = None, *args: object) -> socket.socket:
            raise TimeoutError("timed out")

        monkeypatch.setattr(peer_client.socket, "create_connection", lost)
        assert peer_client.fetch_step(h.address, 1, 7, tmp_path / "d", token=TOKEN) == m
        checksums.verify_step_dir(tmp_path / "d" / "7")
        assert h.ts is not None and h.ts.transfers_completed == 0
    finally:
        h.stop()


def test_a_restarting_peer_is_waited_for_within_the_connect_wait(tmp_path: Path) -> None:
    """A peer whose daemon restarts (every Orbax handshake restarts them all) refuses connections for a moment:
    a fetch given a connect wait reaches its new server on the same port; one without fails at once, and a
    peer that never comes back costs the wait and no more."""
    h = PeerHost(tmp_path / "src")
    address = h.address
    make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 1 << 20})
    h.stop()
    with pytest.raises(grpc.RpcError) as e:
        peer_client.fetch_step(address, 1, 7, tmp_path / "d0", token=TOKEN)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE

    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError):
        peer_client.fetch_step(address, 1, 7, tmp_path / "d1", token=TOKEN, connect_wait_seconds=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5

    restarted: list[PeerHost] = []
    starter = threading.Timer(0.4, lambda: restarted.append(PeerHost(tmp_path / "src", listen=address)))
    starter.start()
    try:
        m = peer_client.fetch_step(address, 1, 7, tmp_path / "d2", token=TOKEN, connect_wait_seconds=5)
        assert restarted and m.step == 7
        checksums.verify_step_dir(tmp_path / "d2" / "7")
    finally:
        starter.join()
        for r in restarted:
            r.stop()


@pytest.mark.parametrize("recycled", [False, True])
def test_stop_abandons_in_flight_transfer(tmp_path: Path, recycled: bool) -> None:
    h = PeerHost(tmp_path / "src", server_throttle=peer_protocol.Throttle(bytes_per_second=8 << 20))
    make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 64 << 20})
    dest = tmp_path / "d"
    spare = spares.spare_dir(tmp_path / "root") if recycled else None
    if spare is not None:  # a collected step's file: received into through a mapping
        spare.mkdir(parents=True)
        with open(spare / f"{64 << 20}-abc", "wb") as f:
            f.truncate(64 << 20)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            peer_client.fetch_step(h.address, 1, 7, dest, token=TOKEN, timeout_seconds=60, spare_dir=spare)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not list(dest.glob(".tmp-*/*" + peer_protocol.PART_SUFFIX)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert list(dest.glob(".tmp-*/*" + peer_protocol.PART_SUFFIX)), "transfer never started"
        t0 = time.monotonic()
        assert h.ts is not None
        h.ts.stop(grace_seconds=0.0)
        assert time.monotonic() - t0 < 5.0
        t.join(timeout=30)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], ConnectionError), errors
        assert list(dest.iterdir()) == []
    finally:
        h.stop()
        t.join(timeout=30)


# --------------------------------------------------------------------------- throttle, holders


def test_client_throttle_limits_rate(host: PeerHost, tmp_path: Path) -> None:
    make_step(layout.steps_dir(host.root), 1, 7, {"a.bin": 24 << 20})
    t0 = time.monotonic()
    peer_client.fetch_step(
        host.address, 1, 7, tmp_path / "d", token=TOKEN, throttle=peer_protocol.Throttle(bytes_per_second=32 << 20)
    )
    # 8 MiB of burst, then 16 MiB at 32 MiB/s: at least 0.5 s.
    assert time.monotonic() - t0 >= 0.45


def test_throttle_validation() -> None:
    for bad in (dict(bytes_per_second=0), dict(bytes_per_second=-5), dict(max_streams=0)):
        with pytest.raises(ValueError):
            peer_protocol.Throttle(**bad)  # type: ignore[arg-type]


def test_fetch_step_from_any(tmp_path: Path) -> None:
    bad = PeerHost(tmp_path / "bad")
    good = PeerHost(tmp_path / "good")
    try:
        m = make_step(layout.steps_dir(good.root), 1, 7, {"a.bin": 1 << 20})
        make_step(layout.steps_dir(bad.root), 1, 7, {"a.bin": 1 << 20})
        (layout.steps_dir(bad.root) / "7" / "a.bin").write_bytes(b"\0" * (1 << 20))  # corrupt copy
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        dead_addr = f"127.0.0.1:{dead.getsockname()[1]}"  # bound, not listening: refuses connections
        holders = [dead_addr, bad.address, good.address]
        dest = tmp_path / "d"
        got = peer_client.fetch_step_from_any(holders, 1, 7, dest, token=TOKEN, timeout_seconds=10)
        assert got == m and commit.committed_steps(dest) == [7]
        checksums.verify_step_dir(dest / "7")
        # Rotation: starting at the good holder touches nobody else.
        assert bad.ts is not None and good.ts is not None
        served_bad = bad.ts.transfers_completed
        got = peer_client.fetch_step_from_any(holders, 1, 7, tmp_path / "d2", start_index=2, token=TOKEN)
        assert bad.ts.transfers_completed == served_bad and good.ts.transfers_completed == 2
        with pytest.raises(FileExistsError):
            peer_client.fetch_step_from_any(holders, 1, 7, dest, token=TOKEN)
        with pytest.raises(peer_protocol.PeerUnavailableError) as ei:
            peer_client.fetch_step_from_any(
                [dead_addr, bad.address], 1, 7, tmp_path / "d3", token=TOKEN, timeout_seconds=5
            )
        kinds = [type(e) for _, e in ei.value.errors]
        assert len(kinds) == 2 and issubclass(kinds[1], ChecksumError)
        assert list((tmp_path / "d3").iterdir()) == []
        dead.close()
    finally:
        bad.stop()
        good.stop()


# --------------------------------------------------------------------------- crash of the fetching process

_FETCHER = """
import sys
from pathlib import Path
from replicator.peer import client as peer_client
from replicator.peer import protocol as peer_protocol
peer_client.fetch_step(sys.argv[1], 1, 7, Path(sys.argv[2]), token=sys.argv[3], timeout_seconds=120,
                    throttle=peer_protocol.Throttle(bytes_per_second=16 << 20))
print("COMMITTED", flush=True)
"""


@pytest.mark.slow
def test_sigkilled_fetcher_leaves_no_visible_step(host: PeerHost, tmp_path: Path) -> None:
    m = make_step(layout.steps_dir(host.root), 1, 7, {"a.bin": 2 << 20, "b.bin": 48 << 20})
    dest = tmp_path / "d"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _FETCHER, host.address, str(dest), TOKEN],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        # Wait until the first file is complete and the second is being written.
        while time.monotonic() < deadline and proc.poll() is None:
            parts = list(dest.glob(".tmp-*/b.bin" + peer_protocol.PART_SUFFIX))
            if parts and parts[0].stat().st_size > (4 << 20):
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert commit.committed_steps(dest) == []
    assert not (dest / "7").exists()
    leftovers = [p.name for p in dest.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(layout.TMP_PREFIX)
    assert commit.remove_tmp_dirs(dest) and list(dest.iterdir()) == []
    # The server is unharmed and a retry commits the step.
    assert peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN) == m
    checksums.verify_step_dir(dest / "7")


def test_server_max_streams_queues_transfers(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src", server_throttle=peer_protocol.Throttle(max_streams=1))
    try:
        make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 32 << 20})
        ch, stub = h.stub()
        with ch:
            t1, t2 = (
                stub.OpenTransfer(peer_pb2.OpenTransferRequest(rank=1, step=7), timeout=10) for _ in range(2)
            )
        with (
            socket.create_connection(("127.0.0.1", t1.data_port), timeout=10) as a,
            socket.create_connection(("127.0.0.1", t2.data_port), timeout=10) as b,
        ):
            a.sendall(peer_protocol.DATA_MAGIC + t1.ticket)
            assert a.recv(1) == b"\0"  # A holds the only slot and does not read: the server blocks
            b.sendall(peer_protocol.DATA_MAGIC + t2.ticket)
            b.settimeout(0.5)
            with pytest.raises(TimeoutError):
                b.recv(1)  # B waits for the slot
            got = 0
            while (k := len(a.recv(1 << 20))) > 0:
                got += k
            assert got == 32 << 20
            b.settimeout(10)
            assert b.recv(1) == b"\0"  # A done: B is served
    finally:
        h.stop()


def test_manifest_checks_on_the_client(host: PeerHost, tmp_path: Path) -> None:
    m = make_step(layout.steps_dir(host.root), 1, 7, {"a.bin": 100})
    dest = tmp_path / "d"
    with pytest.raises(layout.ManifestError, match="content hash"):
        peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN, expected_content_hash="0" * 64)
    assert not dest.exists()
    # A (hostile) manifest naming a file MANIFEST.json would shadow the manifest written at commit.
    make_step(layout.steps_dir(host.root), 1, 8, {layout.MANIFEST_NAME + ".x": 1})
    mpath = layout.steps_dir(host.root) / "8" / layout.MANIFEST_NAME
    d = json.loads(mpath.read_text().replace(layout.MANIFEST_NAME + ".x", layout.MANIFEST_NAME))
    mpath.write_text(json.dumps(layout.seal_manifest_dict(d)))  # a hostile peer seals what it sends
    with pytest.raises(layout.ManifestError, match="named"):
        peer_client.fetch_step(host.address, 1, 8, dest, token=TOKEN)
    assert not dest.exists()
    assert (
        peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN, expected_content_hash=m.content_hash) == m
    )


class _TamperingServicer(peer_server.PeerServicer):
    """Fault injector: corrupts the ReadFiles stream in transit (cannot be caused with a real server)."""

    def __init__(self, *args: object, fault: str, **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.fault = fault

    def ReadFiles(self, request, context):  # type: ignore[no-untyped-def]
        for i, chunk in enumerate(super().ReadFiles(request, context)):
            if i == 1 and self.fault == "bad-crc":
                chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
            elif i == 1 and self.fault == "gap":
                chunk.offset += 1
            elif i == 1 and self.fault == "bad-index":
                chunk.file_index = 7
            elif i == 1 and self.fault == "truncate":
                return
            yield chunk


@pytest.mark.parametrize(
    "fault,error",
    [
        ("bad-crc", ChecksumError),
        ("gap", ConnectionError),
        ("bad-index", ConnectionError),
        ("truncate", ConnectionError),
    ],
)
def test_tampered_stream_commits_nothing(tmp_path: Path, fault: str, error: type) -> None:
    root = tmp_path / "src"
    make_step(layout.steps_dir(root), 1, 7, {"a.bin": 3 << 20})
    servicer = _TamperingServicer(root, 1, NODES, fault=fault)
    server, port = rpc.create_server(
        "127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)], token=TOKEN
    )
    server.start()
    try:
        dest = tmp_path / "d"
        with pytest.raises(error):
            peer_client.fetch_step(f"127.0.0.1:{port}", 1, 7, dest, token=TOKEN)
        assert list(dest.iterdir()) == []
    finally:
        rpc.stop_server(server, 0.5)


def test_fetch_deadline(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src", server_throttle=peer_protocol.Throttle(bytes_per_second=8 << 20))
    try:
        make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 32 << 20})
        dest = tmp_path / "d"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            peer_client.fetch_step(h.address, 1, 7, dest, token=TOKEN, timeout_seconds=1.0)
        assert time.monotonic() - t0 < 5.0
        assert list(dest.iterdir()) == []
    finally:
        h.stop()


# --------------------------------------------------------------------------- bounded data port (#12.4)


def _ticket(h: PeerHost, rank: int = 1, step: int = 7) -> peer_pb2.OpenTransferResponse:
    ch, stub = h.stub()
    with ch:
        return stub.OpenTransfer(peer_pb2.OpenTransferRequest(rank=rank, step=step), timeout=10)


def _read_all(s: socket.socket, timeout: float = 30.0) -> bytes:
    s.settimeout(timeout)
    out = bytearray()
    while True:
        try:
            k = s.recv(1 << 20)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not k:
            break
        out += k
    return bytes(out)


def test_header_deadline_counts_from_accept_not_per_byte(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src")
    h.ts.stop()
    h.ts = peer_server.TransferServer(header_timeout_seconds=1.0)
    h.ts.start()
    h.servicer.transfer_server = h.ts
    try:
        make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 1000})
        t = _ticket(h)
        header = peer_protocol.DATA_MAGIC + t.ticket
        with socket.create_connection(("127.0.0.1", t.data_port), timeout=10) as s:
            # One byte every 0.2 s: each recv on the server sees data well within any per-call timeout.
            sent = 0
            t0 = time.monotonic()
            with pytest.raises(OSError):
                for b in header:
                    s.sendall(bytes([b]))
                    sent += 1
                    time.sleep(0.2)
                    if time.monotonic() - t0 > 20:
                        break
                s.settimeout(5)
                if s.recv(1) in (b"", b"\1"):
                    raise ConnectionResetError("cut")  # cut after the last byte: also fine
            assert sent < len(header), "the trickling client completed its header: no deadline"
        assert h.ts.connections_cut >= 1
        # The port keeps serving well-behaved clients.
        assert peer_client.fetch_step(h.address, 1, 7, tmp_path / "d", token=TOKEN).step == 7
    finally:
        h.stop()


def test_idle_connections_cost_no_thread_and_are_bounded(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src")
    h.ts.stop()
    h.ts = peer_server.TransferServer(header_timeout_seconds=30.0, max_header_connections=50)
    h.ts.start()
    h.servicer.transfer_server = h.ts
    idle: list[socket.socket] = []
    try:
        m = make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": 4 << 20})
        threads_before = threading.active_count()
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", h.ts.port), timeout=10))
        # Every idle connection beyond the limit gets cut (oldest first), without a thread per connection.
        deadline = time.monotonic() + 30
        while h.ts.connections_cut < 250 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.ts.connections_cut >= 250
        assert threading.active_count() <= threads_before + 2
        # A real transfer still goes through the data port while idle connections are held.
        d = tmp_path / "d"
        assert peer_client.fetch_step(h.address, 1, 7, d, token=TOKEN) == m
        assert h.ts.transfers_completed == 1
        closed = 0
        for s in idle:
            s.settimeout(0.01)
            try:
                closed += s.recv(1) in (b"", b"\1")
            except TimeoutError:
                pass
            except OSError:
                closed += 1
        assert closed >= 250
    finally:
        for s in idle:
            s.close()
        h.stop()


def test_slow_readers_with_valid_tickets_do_not_block_others(tmp_path: Path) -> None:
    h = PeerHost(tmp_path / "src")
    h.ts.stop()
    h.ts = peer_server.TransferServer(min_bytes_per_second=4 << 20, min_rate_grace_seconds=1.0)
    h.ts.start()
    h.servicer.transfer_server = h.ts
    slow: list[socket.socket] = []
    try:
        size = 64 << 20
        m = make_step(layout.steps_dir(h.root), 1, 7, {"a.bin": size})
        # Two clients take both transfer slots (default max_streams=2) and then read nothing.
        for _ in range(2):
            t = _ticket(h)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(10)
            s.connect(("127.0.0.1", t.data_port))
            s.sendall(peer_protocol.DATA_MAGIC + t.ticket)
            assert s.recv(1) == b"\0"
            slow.append(s)
        d = tmp_path / "d"
        assert peer_client.fetch_step(h.address, 1, 7, d, token=TOKEN, timeout_seconds=60) == m
        checksums.verify_step_dir(d / "7")
        # The slow ones were cut: they can never get the whole step.
        for s in slow:
            assert len(_read_all(s)) < size
        assert h.ts.connections_cut >= 2
    finally:
        for s in slow:
            s.close()
        h.stop()


def test_tampered_manifest_on_server_is_data_loss(host: PeerHost, tmp_path: Path) -> None:
    make_step(layout.steps_dir(host.root), 1, 4, {"a.bin": 10})
    mpath = layout.steps_dir(host.root) / "4" / layout.MANIFEST_NAME
    d = json.loads(mpath.read_bytes())
    d["files"][0]["crc32c"] ^= 1  # well-formed, but not what was written
    mpath.write_text(json.dumps(d))
    dest = tmp_path / "d"
    with pytest.raises(grpc.RpcError) as ei:
        peer_client.fetch_step(host.address, 1, 4, dest, token=TOKEN)
    assert ei.value.code() == grpc.StatusCode.DATA_LOSS
    assert "checksum" in (ei.value.details() or "")
    assert not dest.exists() or list(dest.iterdir()) == []
    assert [s.step for s in peer_client.list_steps(host.address, token=TOKEN)] == []


@pytest.mark.parametrize("use_data_port", [True, False])
def test_copy_overwrites_recycled_pages_bit_exact(host: PeerHost, tmp_path: Path, use_data_port: bool) -> None:
    root = tmp_path / "dst-root"
    dest = root / "peer" / "1"
    spare = spares.spare_dir(root)
    old = make_step(layout.steps_dir(host.root), 1, 4, {"a.bin": 3 << 20, "b.bin": 2 << 20}, seed=1)
    peer_client.fetch_step(host.address, 1, 4, dest, token=TOKEN, spare_dir=spare, use_data_port=use_data_port)
    inodes = {os.stat(dest / "4" / f.name).st_ino for f in old.files}
    commit.delete_step(dest / "4", spare=spare)  # what GC does
    assert spares.spare_bytes(spare) == 5 << 20
    new = make_step(layout.steps_dir(host.root), 1, 5, {"a.bin": (3 << 20) - 7, "c.bin": 4 << 20}, seed=2)
    assert peer_client.fetch_step(
        host.address, 1, 5, dest, token=TOKEN, spare_dir=spare, use_data_port=use_data_port
    ) == new
    assert {os.stat(dest / "5" / f.name).st_ino for f in new.files} == inodes  # the same pages, reused
    checksums.verify_step_dir(dest / "5")
    assert_same_files(layout.steps_dir(host.root) / "5", dest / "5", new)
    assert spares.spare_bytes(spare) == 0


def test_a_transfer_whose_peer_goes_silent_fails_after_the_idle_timeout_not_later(tmp_path):
    """A data port that accepts the ticket, says OK, sends part of a file and then nothing (its host cut off or
    lost without a reset): the receiver gives up DATA_IDLE_TIMEOUT_SECONDS (10 s) after the last byte, with
    the file's part removed, so the task goes to the next source. At 30 s a restore cut mid-transfer held its
    host's copies and restores 10 s past an 18 s partition's heal (tests/faults host-cut-mid-restore)."""
    from replicator.net.throttle import RateLimiter
    from replicator.peer.sinks import FileSink

    assert peer_protocol.DATA_IDLE_TIMEOUT_SECONDS <= 10.0
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    release = threading.Event()

    def silent_port() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)  # the magic and the ticket
            conn.sendall(bytes([peer_protocol.STATUS_OK]) + b"x" * 1000)
            release.wait(30)  # then silence, the connection held open

    t = threading.Thread(target=silent_port, daemon=True)
    t.start()
    entry = FileEntry("0.bin", 1 << 20, 0)
    sink = FileSink(tmp_path, [entry])
    t0 = time.monotonic()
    try:
        with pytest.raises(OSError):  # socket.timeout is a TimeoutError
            peer_client._receive_tcp("127.0.0.1", port, b"ticket", sink, time.monotonic() + 60, RateLimiter(None))
        took = time.monotonic() - t0
    finally:
        release.set()
        sink.abort()
        t.join(5)
        srv.close()
    assert peer_protocol.DATA_IDLE_TIMEOUT_SECONDS - 1 <= took <= peer_protocol.DATA_IDLE_TIMEOUT_SECONDS + 3, took
    assert not list(tmp_path.iterdir())  # nothing half-written left
