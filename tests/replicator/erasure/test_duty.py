"""The heartbeat's erasure-coding work: a ParityTask in a HeartbeatResponse runs on the task pool and its parity
is reported (tier PARITY, with its group); a Deletion of tier PARITY deletes the parity and never the step's
data; a RestoreSource of tier PARITY rebuilds the host's own data. The real Heartbeat, TaskRunner, Fetcher, RAM
disk store and Peer servers of the other members; only the coordinator is a stand-in (answers built here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.erasure.duty import ParityDuty
from replicator.erasure.host import compute_parity
from replicator.fetch import Fetcher
from replicator.heartbeat import Heartbeat, HostParts, Reporter, Wakeup
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics
from replicator.preemption import PreemptionState
from replicator.tasks import TaskRunner
from sidecar import layout
from tests.kits.ec_hosts import EcPeer, group_spec, read_tree

STEP = 3
SIZES = [[200_000, 3], [150_000], [90_000, 90_000], [250_000]]


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Coordinator:
    """Answers each heartbeat with the next queued response (acking its digest) and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[pb.HeartbeatRequest] = []
        self.answers: list[pb.HeartbeatResponse] = []

    def send(self, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self.requests.append(pb.HeartbeatRequest.FromString(req.SerializeToString()))
        resp = self.answers.pop(0) if self.answers else pb.HeartbeatResponse()
        resp.acked_digest = req.inventory_digest
        resp.heartbeat_interval_ms = 1000
        return resp


@pytest.fixture
def rig(tmp_path: Path):  # type: ignore[no-untyped-def]
    hosts = [EcPeer(tmp_path / f"h{r}", r, 4) for r in range(4)]
    manifests = {h.rank: h.save(STEP, SIZES[h.rank]) for h in hosts}
    me = hosts[0]
    opts = SimpleNamespace(rpc_timeout_seconds=10.0, heartbeat_seconds=1.0, transfer_timeout_seconds=60.0)
    metrics = ReplicatorMetrics(me.root)
    store = RamDiskStore(me.root, 0)
    wakeup = Wakeup()
    tasks = TaskRunner(threads=1, bulk_priority="low", backoff_base_seconds=0.1, wait_seconds=60.0,
                       counters=metrics.counters, on_success=wakeup.ring)
    fetcher = Fetcher(opts, store, tasks, None, metrics, token=None, tls=None)  # type: ignore[arg-type]
    fetcher.ec = me.ec()
    parts = HostParts(store=store, tasks=tasks, fetcher=fetcher, metrics=metrics,
                      preemption=PreemptionState(), wakeup=wakeup,  # type: ignore[arg-type]
                      stopping=threading.Event(),
                      parity=ParityDuty(fetcher.ec, tasks, wakeup.ring, metrics.counters))
    hb = Heartbeat(opts, Reporter(job="ec", rank=0, nodes=4), parts, incarnation=1)  # type: ignore[arg-type]
    coord = Coordinator()
    hb._send = coord.send  # type: ignore[method-assign]
    yield SimpleNamespace(hosts=hosts, manifests=manifests, me=me, hb=hb, coord=coord, store=store, tasks=tasks)
    tasks.shutdown(wait=True)
    for h in hosts:
        h.stop()


def parity_holdings(req: pb.HeartbeatRequest) -> list[pb.Holding]:
    return [h for h in req.holdings if h.tier == tier_pb2.TIER_PARITY]


def test_a_parity_task_from_the_heartbeat_is_computed_reported_and_deleted(rig) -> None:  # type: ignore[no-untyped-def]
    spec = group_spec(3, 1, rig.hosts, STEP, rig.manifests)
    task = pb.ParityTask(step=STEP)
    spec.to_proto(task.group)
    rig.coord.answers.append(pb.HeartbeatResponse(parity=[task]))
    rig.hb.beat()
    assert parity_holdings(rig.coord.requests[0]) == []
    wait_for(lambda: rig.me.parity.holdings() != [] and not rig.tasks.in_flight(), "the parity task")
    rig.hb.beat()
    (held,) = parity_holdings(rig.coord.requests[1])
    assert (held.owner_rank, held.step, held.content_hash) == (0, STEP, spec.digest())
    assert held.size == rig.me.parity.holdings()[0].size > 0
    counters = rig.hb.parts.metrics.counters
    assert (counters.get("parity_tasks"), counters.get("parity_bytes")) == (1, held.size)
    assert list(held.group.members) == list(spec.members) and list(held.group.content_hashes) == list(
        spec.content_hashes) and not any(held.group.addresses)
    assert rig.coord.requests[1].inventory_digest != rig.coord.requests[0].inventory_digest
    rig.hb.beat()  # nothing changed: nothing re-sent
    assert not rig.coord.requests[2].holdings and not rig.coord.requests[2].removed
    # the parity task comes again (the coordinator has not seen the holding yet): nothing is recomputed
    rig.coord.answers.append(pb.HeartbeatResponse(parity=[task]))
    rig.hb.beat()
    assert rig.tasks.in_flight() == []
    # a Deletion of tier PARITY deletes the parity, never the step's data of the same (owner, step)
    rig.coord.answers.append(pb.HeartbeatResponse(deletions=[pb.Deletion(
        owner_rank=0, step=STEP, content_hash=spec.digest(), tier=tier_pb2.TIER_PARITY)]))
    rig.hb.beat()
    assert rig.me.parity.holdings() == []
    assert rig.store.own_steps() == [STEP]
    rig.hb.beat()
    (gone,) = rig.coord.requests[-1].removed
    assert (gone.owner_rank, gone.step, gone.content_hash, gone.tier) == (0, STEP, spec.digest(),
                                                                         tier_pb2.TIER_PARITY)
    assert not parity_holdings(rig.coord.requests[-1])


def test_a_restore_source_of_tier_parity_rebuilds_the_hosts_own_data(rig) -> None:  # type: ignore[no-untyped-def]
    original = read_tree(rig.me.step_dir(STEP))
    spec = group_spec(3, 1, rig.hosts, STEP, rig.manifests)
    for h in rig.hosts[1:]:
        compute_parity(h.ec(), STEP, spec)
    assert rig.store.delete(0, STEP)  # this host lost its data of the step
    lost = group_spec(3, 1, rig.hosts, STEP, rig.manifests)
    lost = lost.__class__(lost.k, lost.m, lost.members, lost.content_hashes, ("",) + lost.addresses[1:])
    src = pb.RestoreSource(kind=tier_pb2.TIER_PARITY, holder_rank=-1, owner_rank=0,
                           content_hash=rig.manifests[0].content_hash)
    lost.to_proto(src.group)
    rig.coord.answers.append(pb.HeartbeatResponse(restore=pb.RestoreTask(step=STEP, sources=[src])))
    rig.hb.beat()
    wait_for(lambda: rig.store.own_steps() == [STEP] and not rig.tasks.in_flight(), "the rebuild")
    assert read_tree(rig.me.step_dir(STEP)) == original
    assert rig.tasks.errors == []
    rig.hb.beat()
    assert [(h.owner_rank, h.step, h.tier) for h in rig.coord.requests[-1].holdings] == [(0, STEP, tier_pb2.TIER_LOCAL)]
    assert rig.hb.parts.metrics.last_restore is not None
    assert layout.read_manifest(rig.me.step_dir(STEP)).content_hash == rig.manifests[0].content_hash


def test_the_hosts_inventory_digest_of_parity_is_the_coordinators(tmp_path) -> None:
    """The heartbeat's digest covers parity by the coordinator's own rule: the holdings the duty reports, read
    back as the coordinator reads them, are the ones the host digests (else the coordinator never acks the
    host's inventory and every report is a full one)."""
    from types import SimpleNamespace

    from replicator.erasure.holder import ParityHolding
    from replicator.erasure.wire import CodeGroupSpec
    from replicator.tier_wire import holding_from_wire
    from replicator.tiers import inventory_digest

    spec = CodeGroupSpec(3, 1, (0, 1, 2, 3), ("a", "b", "c", "d"), ("", "", "", ""))
    held = {(7, spec.digest()): ParityHolding(7, spec.digest(), 4096, spec)}
    duty = ParityDuty(SimpleNamespace(rank=2), None, lambda: None)  # type: ignore[arg-type]
    req = pb.HeartbeatRequest()
    duty.report(req, held, None)
    on_the_wire = [holding_from_wire(h) for h in req.holdings]
    assert on_the_wire == duty.holdings(held)
    assert inventory_digest(on_the_wire) == inventory_digest(duty.holdings(held))
