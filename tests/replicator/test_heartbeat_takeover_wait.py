"""While its own coordinator candidate waits to take over, a host still reports to a higher candidate that
serves (simulation seed 70347, issue #33), and follows the newest epoch it hears (seed 77568). The host's rules
(:mod:`replicator.host_protocol`) and the real :class:`Heartbeat` carrying them out; the transport is a
stand-in."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from mtc_rpc import coordinator_pb2 as pb
from replicator import host_protocol as hp
from replicator.heartbeat import Heartbeat, NoCoordinator, Reporter, Wakeup


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

    def takeover_after(self) -> float:
        return 30.0

    def lower_candidates_gone(self) -> bool:
        return False  # no client named the lower candidates gone (replicator/coordinator/gone.py)


def _heartbeat(rank: int, candidates=None, coordinator=None, my_candidate=None) -> Heartbeat:
    parts = SimpleNamespace(store=None, coordinator=coordinator, wakeup=Wakeup(), stopping=threading.Event(),
                            metrics=SimpleNamespace(counters=SimpleNamespace(add=lambda *a: None)),
                            tasks=SimpleNamespace(busy=lambda *a: False, submit=lambda *a, **kw: None),
                            bucket=None, parity=None)
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


def _serving_coordinator(epoch: int):
    from replicator.coordinator.service import Coordinator
    from replicator.coordinator.topology import JobTopology

    coord = Coordinator(JobTopology(4, 2, 1), "t", active=False, other_candidates=True, candidate=0)
    coord.activate(epoch)
    assert coord.active
    return coord


def test_a_standby_candidate_waits_takeover_after_since_its_lower_ones_went_silent() -> None:
    """The wait starts when the lower candidates are first found silent; the host takes over once it lasted."""
    first = hp.takeover(None, 100.0, 30.0)
    assert first == hp.Takeover(now=False, lower_down_since=100.0)
    assert not hp.takeover(first.lower_down_since, 129.9, 30.0).now
    assert hp.takeover(first.lower_down_since, 130.0, 30.0).now
    assert hp.takeover_epoch(5, 9) == 10 and hp.takeover_epoch(50, 9) == 50  # above any epoch accepted
    assert hp.lower_serves(0, 1) and not hp.lower_serves(1, 1) and not hp.lower_serves(0, None)


def test_a_host_that_accepts_a_newer_epoch_elsewhere_deposes_its_own_candidate() -> None:
    """Simulation seed 77568: candidate 0 (on host 0) served epoch E while every other host followed
    candidate 1 (epoch F > E); one of host 0's heartbeats reached candidate 1 (a lost answer), which told it to
    delete its old steps. No host would ever report F to candidate 0, so it served on and would have told a
    trainer restarted on host 0 that step 1, just deleted, was the newest complete step. Now the answer's
    newer epoch deposes the host's own candidate; an answer of its own epoch or an older one does not."""
    own = 1_000
    assert hp.accept_epoch(own, own, own) == hp.Epoch(accept=True, epoch=own, step_down=False)  # its own's answer
    assert hp.accept_epoch(own, own - 1, own) == hp.Epoch(accept=False, epoch=own, step_down=False)  # deposed one
    assert hp.accept_epoch(own, own + 5, own) == hp.Epoch(accept=True, epoch=own + 5, step_down=True)
    assert not hp.accept_epoch(own, own + 5, None).step_down  # no own candidate serving: nothing to depose


def test_the_heartbeat_steps_its_own_candidate_down_on_that_verdict() -> None:
    """The daemon carries the verdict out: its own coordinator is deactivated, the epoch followed."""
    coord = _serving_coordinator(1_000)
    hb = _heartbeat(0, coordinator=coord, my_candidate=0)
    own = coord.epoch
    assert hb._accept_epoch(own) and coord.active
    assert not hb._accept_epoch(own - 1) and coord.active
    assert hb._accept_epoch(own + 5)
    assert not coord.active
    assert hb.epoch == own + 5
