"""Hosts of an erasure-coded job for tests: each a RAM-disk root with a real ``Peer`` gRPC server (and data port)
on loopback, committed steps written by the sidecar's own writer, and its side of the coding
(:class:`replicator.erasure.host.EcHost`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mtc_rpc import peer_pb2_grpc
from replicator.erasure import spread
from replicator.erasure.holder import ParityRecord, ParityStore
from replicator.erasure.host import EcHost, compute_parity
from replicator.erasure.wire import CodeGroupSpec
from replicator.net import rpc
from replicator.peer import server as peer_server
from replicator.peer.protocol import Throttle
from sidecar import checksums, commit, layout, writer
from sidecar.layout import StepManifest

TOKEN = "ec-token"
JOB = "ec"
STEP = 5
# Different sizes per rank (the group pads to its longest stream), several arrays each, and many 64 KiB stripes.
SIZES = {0: [300_000, 1_000, 700_000], 1: [1_200_000], 2: [5, 400_000, 400_000, 17], 3: [90_000],
         4: [1_000_000, 64 << 10], 5: [777_777]}


def step_arrays(rank: int, step: int, sizes: list[int]) -> list[writer.ArrayCopy]:
    """Rank ``rank``'s arrays of ``step``: pure functions of (rank, step, size), so a rebuild is checked bit for bit."""
    out = []
    for i, n in enumerate(sizes):
        data = np.random.default_rng(rank * 1_000_003 + step * 101 + i).integers(0, 256, n, dtype=np.uint8)
        out.append(writer.ArrayCopy(f"a{i}", (n,), "uint8", None, [writer.ShardCopy(((0, n),), data)]))
    return out


class EcPeer:
    """One host: its root, its parity store, its Peer service (gRPC + optional data port)."""

    def __init__(self, root: Path, rank: int, nodes: int, *, data_port: bool = True, max_streams: int = 2,
                 rebuilds: bool = True, max_rebuilds: int = spread.MAX_SERVED):
        self.root, self.rank, self.nodes = Path(root), rank, nodes
        self.root.mkdir(parents=True, exist_ok=True)
        self.parity = ParityStore(self.root, rank)
        self.ts = peer_server.TransferServer(throttle=Throttle(max_streams=max_streams)) if data_port else None
        if self.ts is not None:
            self.ts.start()
        # RebuildFragments served as the daemon serves it (looked up at each call: tests may wrap it).
        serve = (lambda request: spread.serve(self.ec(), request)) if rebuilds else None
        servicer = peer_server.PeerServicer(self.root, rank, nodes, transfer_server=self.ts, parity=self.parity,
                                            rebuild=serve, max_rebuilds=max_rebuilds)
        self.server, port = rpc.create_server("127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)],
                                              token=TOKEN)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.stopped = False

    def save(self, step: int, sizes: list[int]) -> StepManifest:
        return writer.write_step(writer.HostStep(self.root, JOB, step, self.rank, self.nodes,
                                                 step_arrays(self.rank, step, sizes),
                                                 [layout.ValueEntry("step", step)]))

    def ec(self, **kw) -> EcHost:
        kw.setdefault("stripe_bytes", 64 << 10)
        kw.setdefault("timeout_seconds", 120.0)
        return EcHost(self.rank, self.root, self.parity, token=TOKEN, **kw)

    def step_dir(self, step: int) -> Path:
        return layout.steps_dir(self.root) / layout.step_name(step)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.ts is not None:
            self.ts.stop()
        rpc.stop_server(self.server, 0.5)

    def wipe(self) -> None:
        """The host is lost: its service stops and its RAM disk is emptied."""
        self.stop()
        shutil.rmtree(self.root)
        self.root.mkdir()


def group_spec(k: int, m: int, hosts: list[EcPeer], step: int, manifests: dict[int, StepManifest]) -> CodeGroupSpec:
    """The code group of ``step`` over ``hosts`` (position order), a lost (stopped) host's address empty."""
    return CodeGroupSpec(k, m, tuple(h.rank for h in hosts), tuple(manifests[h.rank].content_hash for h in hosts),
                         tuple("" if h.stopped else h.address for h in hosts))


def read_tree(step_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step_dir)): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


class Job:
    """K + M hosts, each with its step :data:`STEP` of :data:`SIZES` saved (and read back, to compare)."""

    def __init__(self, base: Path, k: int, m: int, **kw: Any):
        n = k + m
        self.k, self.m = k, m
        self.hosts = [EcPeer(base / f"h{r}", r, n, **kw) for r in range(n)]
        self.manifests = {h.rank: h.save(STEP, SIZES[h.rank]) for h in self.hosts}
        self.original = {h.rank: read_tree(h.step_dir(STEP)) for h in self.hosts}

    def spec(self) -> CodeGroupSpec:
        return group_spec(self.k, self.m, self.hosts, STEP, self.manifests)

    def encode_all(self) -> list[ParityRecord]:
        spec = self.spec()
        return [compute_parity(h.ec(), STEP, spec) for h in self.hosts]

    def stop(self) -> None:
        for h in self.hosts:
            h.stop()


def assert_rebuilt(job: Job, rank: int) -> None:
    """``rank``'s step is committed again, bit-exact, every file verified, nothing temporary left."""
    h = job.hosts[rank]
    m = checksums.verify_step_dir(h.step_dir(STEP))  # every file's crc32c against the rebuilt manifest
    assert (m.rank, m.step, m.content_hash) == (rank, STEP, job.manifests[rank].content_hash)
    assert read_tree(h.step_dir(STEP)) == job.original[rank]  # bit-exact, manifest included
    assert commit.committed_steps(layout.steps_dir(h.root)) == [STEP]
    assert [p.name for p in layout.steps_dir(h.root).iterdir()] == [str(STEP)]  # no temporary directory left
