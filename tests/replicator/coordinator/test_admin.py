"""The Admin service in-process: degraded rules (backup overdue, lost hosts), bad copies, pins, metrics view."""

from __future__ import annotations

import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_rpc import admin_pb2 as apb
from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.coordinator.admin import AdminServicer, cluster_view
from replicator.coordinator.backup_hook import BackupScheduler
from replicator.coordinator.backup_status import BackupSchedulerStatus
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.tier_wire import to_wire


class Ctx:
    def abort(self, code, details):
        raise grpc.RpcError(f"{code.name}: {details}")

    def is_active(self):
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(svc, rank, holdings):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                              full_report=True, known_epoch=svc.epoch,
                              holdings=[pb.Holding(owner_rank=o, step=s, content_hash=h, size=10, tier=to_wire(t))
                                        for o, s, h, t in holdings])
    return svc.Heartbeat(req, Ctx())


# One slice of 2 hosts, each with its own step 5 and a ring copy of the other's: complete and redundant.
RING = {0: [(0, 5, "A", "local"), (1, 5, "B", "peer")], 1: [(1, 5, "B", "local"), (0, 5, "A", "peer")]}


def make(backup=None):
    clock = Clock()
    coord = Coordinator(JobTopology(2, 1, 1), "t", heartbeat_seconds=1.0, clock=clock, backup=backup,
                        host_lost_seconds=5.0)
    admin = AdminServicer(coord)
    return coord, admin, admin.wrap(coord), clock


class FakeScheduler(BackupScheduler):
    """A bucket scheduler with a fixed typed status (the real one needs a bucket)."""

    def __init__(self, committed=(), last_success_unix=None, interval_minutes=0.0, interval_steps=0, keep=3):
        self.requested: set[int] = set()
        self._status = BackupSchedulerStatus(
            url="file:///b", committed_steps=tuple(committed), in_progress_step=-1, in_progress_done_ranks=(),
            skipped=0, failures=0, last_error="", interval_steps=interval_steps,
            interval_minutes=interval_minutes, keep=keep, last_success_unix=last_success_unix,
            emergency_step=None, emergency_done=False)

    def request(self, steps):
        self.requested.update(steps)

    def status(self):
        return self._status


def fake_scheduler(**kw):
    return FakeScheduler(**kw)


def test_healthy_then_lost_host_is_degraded() -> None:
    coord, admin, svc, clock = make()
    for r in (0, 1):
        beat(svc, r, RING[r])
    s = admin.GetSummary(apb.GetSummaryRequest(), Ctx())
    assert not s.degraded and s.newest_complete_step == 5 and s.newest_redundant, s.problems
    clock.now += 6.0  # > max(5 heartbeats, 5 s) without a word from rank 1
    beat(svc, 0, RING[0])
    s = admin.GetSummary(apb.GetSummaryRequest(), Ctx())
    assert s.degraded and list(s.lost_ranks) == [1] and any("hosts lost" in p for p in s.problems)
    # A lost host's copies stop counting: the newest step is no longer redundant.
    assert not s.newest_redundant
    assert cluster_view(coord).hosts_lost == 1


@pytest.mark.parametrize("age_intervals,overdue", [(1.0, False), (2.0, True)])
def test_backup_overdue_by_minutes(age_intervals, overdue) -> None:
    sched = fake_scheduler(committed=[5], interval_minutes=10.0,
                           last_success_unix=time.time() - age_intervals * 600)
    coord, admin, svc, _ = make(sched)
    for r in (0, 1):
        beat(svc, r, RING[r])
    s = admin.GetSummary(apb.GetSummaryRequest(), Ctx())
    assert s.degraded is overdue and any("backup overdue" in p for p in s.problems) is overdue, s.problems
    assert s.backup_url == "file:///b" and s.newest_backup_step == 5
    view = cluster_view(coord)
    assert view.backup_configured and view.backup_interval_seconds == 600.0


def test_backup_overdue_by_steps() -> None:
    sched = fake_scheduler(committed=[1], interval_steps=2)
    coord, admin, svc, _ = make(sched)
    for r in (0, 1):
        beat(svc, r, RING[r])
    s = admin.GetSummary(apb.GetSummaryRequest(), Ctx())
    assert s.degraded and "4 steps behind" in s.problems[0], s.problems
    r = admin.BackupNow(apb.BackupNowRequest(step=-1), Ctx())
    assert (r.step, r.state) == (5, "requested") and sched.requested == {5}
    with pytest.raises(grpc.RpcError, match="only the newest complete step"):
        admin.BackupNow(apb.BackupNowRequest(step=3), Ctx())


def test_bad_copy_is_hidden_deleted_and_forgotten() -> None:
    coord, admin, svc, _ = make()
    for r in (0, 1):
        beat(svc, r, RING[r])
    assert coord.state.is_redundant(5)
    admin.ReportBadCopy(apb.ReportBadCopyRequest(step=5, owner_rank=1, holder_rank=0, tier=tier_pb2.TIER_PEER, file="x"), Ctx())
    resp = beat(svc, 0, RING[0])
    assert [(d.owner_rank, d.step) for d in resp.deletions] == [(1, 5)]
    assert not coord.state.is_redundant(5)  # the bad copy no longer counts
    # Host 0 deleted it: the next report without it clears the mark; a fresh copy counts again.
    beat(svc, 0, RING[0][:1])
    assert admin.bad.filter(pb.HeartbeatRequest(rank=0, holdings=[pb.Holding(owner_rank=1, step=5)]))[1] == []
    resp = beat(svc, 0, RING[0])
    assert not resp.deletions and coord.state.is_redundant(5)
    with pytest.raises(grpc.RpcError, match="INVALID_ARGUMENT"):
        admin.ReportBadCopy(apb.ReportBadCopyRequest(step=5, owner_rank=9, holder_rank=0, tier=tier_pb2.TIER_PEER), Ctx())


def test_bad_copy_with_delta_heartbeats() -> None:
    from replicator.tiers import Holding, inventory_digest

    coord, admin, svc, _ = make()
    digests = {}
    for r in (0, 1):
        digests[r] = inventory_digest([Holding(o, s, h, 10, t) for o, s, h, t in RING[r]])
        req = pb.HeartbeatRequest(job="t", rank=r, incarnation=1, address=f"127.0.0.1:{7000 + r}",
                                  full_report=True, inventory_digest=digests[r],
                                  known_epoch=coord.epoch,
                                  holdings=[pb.Holding(owner_rank=o, step=s, content_hash=h, size=10, tier=to_wire(t))
                                            for o, s, h, t in RING[r]])
        assert svc.Heartbeat(req, Ctx()).acked_digest == digests[r]

    def quiet(r, removed=()):
        req = pb.HeartbeatRequest(job="t", rank=r, incarnation=1, base_digest=digests[r],
                                  known_epoch=coord.epoch,
                                  inventory_digest=digests[r],
                                  removed=[pb.Deletion(owner_rank=o, step=s) for o, s in removed])
        return svc.Heartbeat(req, Ctx())

    admin.ReportBadCopy(apb.ReportBadCopyRequest(step=5, owner_rank=1, holder_rank=0, tier=tier_pb2.TIER_PEER), Ctx())
    resp = quiet(0)  # nothing new from host 0: the bad copy still goes, and stops counting at once
    assert [(d.owner_rank, d.step) for d in resp.deletions] == [(1, 5)]
    assert coord.state.holding(0, (1, 5)) is None and not coord.state.is_redundant(5)
    assert [(d.owner_rank, d.step) for d in quiet(0).deletions] == [(1, 5)]  # until the host deletes it
    digests[0] = inventory_digest([Holding(o, s, h, 10, t) for o, s, h, t in RING[0][:1]])
    assert not quiet(0, removed=[(1, 5)]).deletions and not admin.bad.filter(
        pb.HeartbeatRequest(rank=0, full_report=True))[1]


def test_pins_gc_plan_and_steps() -> None:
    coord, admin, svc, _ = make()
    for r in (0, 1):
        beat(svc, r, [(r, 4, f"old{r}", "local")] + RING[r])
    with pytest.raises(grpc.RpcError, match="NOT_FOUND"):
        admin.Pin(apb.PinRequest(step=9), Ctx())
    assert list(admin.Pin(apb.PinRequest(step=4), Ctx()).pinned_steps) == [4]
    plan = admin.GcPlan(apb.GcPlanRequest(), Ctx())
    assert 4 in plan.protected_steps and all(i.step != 4 for i in plan.items)
    assert list(admin.Unpin(apb.PinRequest(step=4), Ctx()).pinned_steps) == []
    steps = admin.ListSteps(apb.ListStepsRequest(), Ctx())
    s5 = next(i for i in steps.steps if i.step == 5)
    assert s5.complete and s5.redundant and list(s5.local_ranks) == [0, 1] and list(s5.peer_ranks) == [0, 1]
    assert s5.complete_unix > 0 and s5.bytes == 20




_INTS = st.one_of(st.integers(-3, 12), st.integers(-(2**63), 2**63 - 1))
_REQUESTS = st.one_of(
    st.builds(lambda: ("GetSummary", apb.GetSummaryRequest())),
    st.builds(lambda: ("ListSteps", apb.ListStepsRequest())),
    st.builds(lambda a, b: ("ListHosts", apb.ListHostsRequest(first_rank=a, last_rank=b)), _INTS, _INTS),
    st.builds(lambda a: ("LocateStep", apb.LocateStepRequest(step=a)), _INTS),
    st.builds(lambda a: ("Pin", apb.PinRequest(step=a)), _INTS),
    st.builds(lambda a: ("Unpin", apb.PinRequest(step=a)), _INTS),
    st.builds(lambda a: ("BackupNow", apb.BackupNowRequest(step=a)), _INTS),
    st.builds(lambda: ("GcPlan", apb.GcPlanRequest())),
    st.builds(lambda a, b, c, t: ("ReportBadCopy", apb.ReportBadCopyRequest(step=a, owner_rank=b, holder_rank=c,
                                                                           tier=t)),
              _INTS, _INTS, _INTS, st.sampled_from([0, 1, 2, 3, 4, 5, -1, 2**31 - 1])),
    st.builds(lambda a, w: ("RestoreStep", apb.RestoreStepRequest(step=a, wait_seconds=w)), _INTS,
              st.sampled_from([0.0, -1.0, float("nan"), 0.01])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_REQUESTS, max_size=6))
def test_any_request_gets_an_answer_or_a_clear_status(calls) -> None:
    """Fuzz: every Admin RPC, any field values: a response or an abort with a status, never an exception."""
    sched = fake_scheduler(committed=[5], interval_minutes=10.0, last_success_unix=time.time())
    coord, admin, svc, _ = make(sched)
    for r in (0, 1):
        beat(svc, r, RING[r])
    for name, req in calls:
        try:
            getattr(admin, name)(req, Ctx())
        except grpc.RpcError:
            pass  # Ctx.abort: a clear status
    beat(svc, 0, RING[0])  # the coordinator still works afterwards
    assert admin.GetSummary(apb.GetSummaryRequest(), Ctx()).nodes == 2
