"""What a host's heartbeat does in two corners found by the simulation (issue #33): while its own coordinator
candidate waits to take over it still reports to a higher candidate that serves (seed 70347), and a witness
task that comes with a restore is recorded ahead of the restored bytes, as one that comes with a copy (seed
95210). The real :class:`Heartbeat` and RAM-disk store; the transport and the task runner are stand-ins."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.coordinator.model import Tier
from replicator.heartbeat import Heartbeat, NoCoordinator, Reporter, Wakeup
from replicator.local.store import RamDiskStore
from sidecar import layout
from tests.kits.storage import make_step


class _Unreachable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


class _Candidates:
    """Candidate 0 is this host's own (deposed) coordinator; candidate 1 serves, or is unreachable."""

    def __init__(self, serving: bool) -> None:
        self.addresses = ["cand0", "cand1"]
        self.serving = serving
        self.called: list[int] = []

    def call_one(self, i, method, req, timeout, probe_timeout):
        self.called.append(i)
        if i != 1:
            raise AssertionError(f"candidate {i} must not be called while it waits to take over")
        if not self.serving:
            raise _Unreachable()
        return pb.HeartbeatResponse(epoch=7)


class _Deposed:
    active = False

    def lost_after(self) -> float:
        return 60.0


def _heartbeat(rank: int, store=None, candidates=None, coordinator=None, my_candidate=None) -> Heartbeat:
    parts = SimpleNamespace(store=store, coordinator=coordinator, wakeup=Wakeup(), stopping=threading.Event(),
                            metrics=SimpleNamespace(counters=SimpleNamespace(add=lambda *a: None)),
                            tasks=SimpleNamespace(busy=lambda *a: False, submit=lambda *a, **kw: None),
                            bucket=None)
    opts = SimpleNamespace(rpc_timeout_seconds=5.0, heartbeat_seconds=1.0)
    hb = Heartbeat(opts, Reporter(job="t", rank=rank, nodes=4, my_candidate=my_candidate), parts, incarnation=1)
    hb.candidates = candidates
    return hb


@pytest.mark.parametrize("serving", [True, False], ids=["higher-serves", "none-serves"])
def test_a_host_waiting_to_take_over_reports_to_a_higher_candidate_that_serves(serving: bool) -> None:
    """Simulation seed 70347: candidate 1 took over while candidate 0 was cut off and deposed it; host 0
    (candidate 0's) used to fall silent for the whole wait, so candidate 1 never told it to attest rank 2
    (its own data is identical) and the step did not survive the loss of slice 1."""
    cands = _Candidates(serving)
    hb = _heartbeat(0, candidates=cands, coordinator=_Deposed(), my_candidate=0)
    req = pb.HeartbeatRequest(job="t", rank=0)
    if serving:
        assert hb._send(req).epoch == 7
    else:
        with pytest.raises(NoCoordinator, match="waiting to take over"):
            hb._send(req)
    assert cands.called == [1]


def _files() -> dict[str, bytes]:
    rnd = random.Random(4)
    return {"meta.json": rnd.randbytes(64), "state/0.bin": rnd.randbytes(4096)}


def test_a_witness_task_that_comes_with_a_restore_is_recorded_before_the_bytes_land(tmp_path: Path) -> None:
    """Simulation seed 95210: host 2 (replaced) is told to restore its rank's data and to attest rank 0,
    whose data is identical. The coordinator (and host 0) may be gone when the restore lands: the record is
    kept at once and reported with the restored bytes."""
    store = RamDiskStore(tmp_path / "host2", 2)
    h = layout.read_manifest(make_step(tmp_path / "host0", 4, 2, 4, _files())).content_hash  # a copy on host 0
    hb = _heartbeat(2, store=store)
    src = pb.RestoreSource(kind=tier_pb2.TIER_PEER, holder_rank=0, owner_rank=2, content_hash=h)
    resp = pb.HeartbeatResponse(restore=pb.RestoreTask(step=4, sources=[src]),
                                copies=[pb.CopyTask(owner_rank=0, step=4, source_rank=2, content_hash=h)])
    hb._act(resp)
    assert store.inventory() == []  # nothing reported before the bytes are here
    make_step(layout.steps_dir(tmp_path / "host2"), 4, 2, 4, _files())  # the restore lands
    assert {(x.owner_rank, x.tier, x.content_hash) for x in store.inventory()} == {
        (2, Tier.LOCAL, h), (0, Tier.REPLICA, h)}
