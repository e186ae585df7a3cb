"""Tests for the coordinator service's named parts: the epoch fence, waiter admission, the restore target."""

from __future__ import annotations

import grpc
import pytest

from replicator.coordinator.admission import RETRY_AFTER_KEY, WaiterGate
from replicator.coordinator.fence import MAX_CANDIDATES, EpochFence, candidate_epoch
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.step_tracking import FirstSeen, RestoreTarget
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding


def test_fence_raises_epoch_above_seen_and_steps_down_on_newer():
    f = EpochFence()
    assert not f.active
    f.observe(40)  # heard while standing by
    f.activate(10)
    assert f.active and f.epoch == 41  # above every epoch a host accepted
    assert not f.observe(41) and f.active
    assert f.observe(42) and not f.active and f.max_seen == 42


def test_fence_epochs_end_in_the_candidate_index():
    f = EpochFence(candidate=3)
    f.observe(1000)  # 1000 = 3 * 256 + 232
    f.activate(10)
    assert f.epoch == 1027 and f.epoch % MAX_CANDIDATES == 3  # the next one above 1000 that names candidate 3
    assert candidate_epoch(1027, 3) == 1027 and candidate_epoch(1028, 3) == 1027 + MAX_CANDIDATES
    with pytest.raises(ValueError):
        EpochFence(candidate=MAX_CANDIDATES)


class _Aborted(Exception):
    pass


class _Ctx:
    def __init__(self):
        self.trailing = ()

    def set_trailing_metadata(self, md):
        self.trailing = md

    def abort(self, code, msg):
        raise _Aborted(code, msg)


def test_gate_admits_up_to_max_and_releases_on_exit():
    gate = WaiterGate(1)
    ctx = _Ctx()
    with gate.admitted(ctx, 0.5):
        with pytest.raises(_Aborted) as e:
            with gate.admitted(ctx, 0.5):
                pass
        assert e.value.args[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(ctx.trailing)[RETRY_AFTER_KEY] == "0.50"
    with gate.admitted(ctx, 0.5):  # the place was given back
        pass


def _complete(state: CoordinatorState, step: int) -> None:
    for r in range(state.topology.nodes):
        state.register(r, 1)
        state.report_committed(r, Holding(r, step, f"h{r}", 1), 1)


def test_restore_target_pin_is_released_once_a_newer_step_completes_after_being_served():
    state = CoordinatorState(JobTopology(2, 1, 1))
    for r in range(2):
        state.register(r, 1)
        state.report_inventory(r, [], 1)
    _complete(state, 1)
    target = RestoreTarget(state, forced=1)
    _complete(state, 2)
    assert target.current() == 1  # not served yet: kept
    assert target.served() == 1
    assert target.current() == 1  # step 2 was known when served
    _complete(state, 3)
    assert target.current() == 3 and target.pinned is None and target.served() is None
    assert target.held is None and state.pinned_steps() == []  # its GC hold went with it (step 2 was the newest known)
    target.pin(3)
    assert not target.release(2) and target.release(3) and target.pinned is None


def test_first_seen_keeps_the_first_time():
    fs = FirstSeen()
    assert fs.note(5, 1.0) == 1.0 and fs.note(5, 9.0) == 1.0
    assert fs.ages(10.0) == {5: 9.0}
    fs.forget(5)
    assert fs.ages(10.0) == {}
