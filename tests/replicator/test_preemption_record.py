"""The preemption records' one home (replicator/preemption.py): what the flush writes is what `mtc preempt
--wait` reads, a record being written is not taken for one, and a notice is handled once per daemon."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from controller_client.preempt import wait_for_record
from mtc_rpc import control_pb2
from replicator import preemption


def test_the_record_written_is_the_record_read(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        preemption.read_record(tmp_path)
    rec = preemption.PreemptionRecord(step=7, finished=True, reason="step 7 is in the bucket", seconds=1.25)
    preemption.write_record(tmp_path, rec)
    assert json.loads((tmp_path / preemption.PREEMPTION_RECORD).read_text()) == rec.to_dict()
    assert preemption.read_record(tmp_path) == rec
    assert wait_for_record(tmp_path, 1.0) == rec
    preemption.clear_record(tmp_path)
    assert wait_for_record(tmp_path, 0.3) is None


def test_a_partial_or_foreign_record_is_not_a_record(tmp_path: Path) -> None:
    (tmp_path / preemption.PREEMPTION_RECORD).write_text('{"step": 7, "fin')
    with pytest.raises(ValueError):
        preemption.read_record(tmp_path)
    (tmp_path / preemption.PREEMPTION_RECORD).write_text('{"restart": true}')
    with pytest.raises(ValueError):
        preemption.read_record(tmp_path)


def test_a_restart_record_counts_only_since_the_daemon_started(tmp_path: Path) -> None:
    before = time.time() - 1
    assert not preemption.restart_recorded(tmp_path, before)
    preemption.record_restart(tmp_path)
    assert preemption.restart_recorded(tmp_path, before)
    assert not preemption.restart_recorded(tmp_path, time.time() + 5)


class _Link:
    """The heartbeat as a flush sees it: the coordinator says step 3 is complete and in the bucket."""

    interval = 0.05
    newest_complete = 3

    def call(self, method: str, request: Any, timeout: float) -> Any:
        assert method == "GetSteps"
        return type("Steps", (), {"newest_complete_step": 3, "backed_up_steps": [3]})()


class _Bucket:
    def __init__(self) -> None:
        self.unthrottled = 0

    def unthrottle(self) -> None:
        self.unthrottled += 1


def test_a_notice_is_handled_once_and_its_flush_recorded(tmp_path: Path) -> None:
    preemption.write_record(tmp_path, preemption.PreemptionRecord(1, False, "an earlier incarnation's", 0.0))
    state, bucket, wakes = preemption.PreemptionState(), _Bucket(), []
    p = preemption.Preemption(state, _Link(), root=tmp_path, wake=lambda: wakes.append(1), bucket=bucket,
                              rpc_timeout_seconds=1.0, heartbeat_seconds=0.05, tells_others=False)
    assert p.status() == control_pb2.GetPreemptionResponse(noticed=False, notice_step=-1)
    req = control_pb2.PreemptRequest(save_window_seconds=0, flush_seconds=2)
    assert p.on_notice(req) == control_pb2.PreemptResponse(notice_step=3, started=True)
    assert state.preempting and state.noticed and wakes
    assert p.on_notice(req) == control_pb2.PreemptResponse(notice_step=3, started=False)
    assert p.status() == control_pb2.GetPreemptionResponse(noticed=True, notice_step=3, this_host=True)
    rec = wait_for_record(tmp_path, 5.0)
    assert rec is not None, "no flush record"
    assert rec == preemption.PreemptionRecord(3, True, "step 3 is in the bucket", rec.seconds)
    assert bucket.unthrottled == 1
    assert not state.coordinator_says(True), "noticed already: the coordinator's report is not news"
    assert not state.coordinator_says(False) and state.noticed, "this host's own notice lasts its process's life"


def test_the_coordinators_notice_ends_when_it_says_so() -> None:
    """A host that kept running through a preemption of others (a sidecar replicator) follows the coordinator:
    the job's notice ends when the coordinator's answer stops saying it, so the restarted job is not told to
    stop again."""
    state = preemption.PreemptionState()
    assert not state.noticed
    assert state.coordinator_says(True) and state.noticed
    assert not state.coordinator_says(True)
    assert state.coordinator_says(False) and not state.noticed


def test_what_a_sigterm_skips(tmp_path: Path) -> None:
    """One rule for both front doors: a recorded restart never flushes; "after-hook" flushes only after a hook
    or a notice (an in-place restart runs no hook); records older than the daemon are an earlier Pod's."""
    since = time.time() - 1

    def skips(*, noticed: bool = False, mode: str = "after-hook", start: float = since) -> bool:
        return bool(preemption.sigterm_skips_flush(tmp_path, start, noticed=noticed, sigterm_flush=mode))

    assert skips() and not skips(noticed=True) and not skips(mode="always")
    preemption.record_prestop(tmp_path)
    assert not skips() and skips(start=time.time() + 5), "an earlier Pod's hook is not this one's"
    preemption.record_restart(tmp_path)
    assert skips() and skips(noticed=True) and skips(mode="always")


@pytest.mark.parametrize(("told", "least", "most"), [(True, 1.0, 2.5), (False, 4.0, 6.0), (None, 4.0, 6.0)])
def test_the_coordinators_host_lingers_until_the_others_were_told(tmp_path: Path, told, least, most) -> None:
    """Its flush done, the coordinator's host stays until every other preempting host was told (at least
    MIN_LINGER_SECONDS), else a few heartbeats (3 x 1 s + 1 s here); it sends its rank with its GetSteps."""
    asked: list[Any] = []

    class Link(_Link):
        def call(self, method: str, request: Any, timeout: float) -> Any:
            asked.append(request)
            return super().call(method, request, timeout)

    p = preemption.Preemption(preemption.PreemptionState(), Link(), root=tmp_path, wake=lambda: None,
                              bucket=_Bucket(), rpc_timeout_seconds=1.0, heartbeat_seconds=1.0, tells_others=True,
                              rank=2, others_told=None if told is None else (lambda step: told and step == 3))
    t0 = time.monotonic()
    rec = p.flush(grace_seconds=30)
    took = time.monotonic() - t0
    assert rec.finished and rec.step == 3
    assert least <= took < most, took
    assert asked and all(r.asker_rank == 2 for r in asked)
