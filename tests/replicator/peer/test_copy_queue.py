"""Queued peer copies the coordinator no longer asks for are skipped before they take a transfer thread
(``TaskRunner.asked``, told by the heartbeat with each answer): under packet loss, copies of superseded steps
filled both threads and then failed NOT_FOUND while the copy asked for next waited."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from mtc_rpc import coordinator_pb2 as pb
from replicator.heartbeat import HostParts, Reporter
from replicator.metrics import HostCounters
from replicator.tasks import TaskRunner

WAIT_SECONDS = 10.0


def _runner(threads: int = 1) -> TaskRunner:
    return TaskRunner(threads=threads, bulk_priority="normal", backoff_base_seconds=0.1, wait_seconds=WAIT_SECONDS,
                      counters=HostCounters(), on_success=lambda: None)


class Copier:
    """Records the copies that ran; the first one blocks until released (it holds the only thread)."""

    def __init__(self) -> None:
        self.ran: list[tuple[int, int]] = []
        self.started, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def __call__(self, owner: int, step: int) -> None:
        with self._lock:
            first = not self.ran
            self.ran.append((owner, step))
        if first:
            self.started.set()
            assert self.release.wait(WAIT_SECONDS)


def _idle(tasks: TaskRunner) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while tasks.in_flight():
        assert time.monotonic() < deadline, f"still running: {tasks.in_flight()}"
        time.sleep(0.01)


def test_a_queued_copy_of_a_superseded_step_is_skipped_and_the_one_asked_for_runs() -> None:
    tasks, copier = _runner(), Copier()
    tasks.asked("copy", [(0, 1), (0, 2), (1, 2)])
    for owner, step in [(0, 1), (0, 2), (1, 2)]:
        tasks.submit("copy", owner, step, copier, owner, step)
    assert copier.started.wait(WAIT_SECONDS)
    # The next answer: rank 0's step 2 superseded by step 3 (which is queued now); rank 1's step 2 still wanted.
    tasks.asked("copy", [(0, 3), (1, 2)])
    tasks.submit("copy", 0, 3, copier, 0, 3)
    copier.release.set()
    _idle(tasks)
    assert copier.ran == [(0, 1), (1, 2), (0, 3)]  # the running copy finished; (0, 2) never took the thread
    # Skipped is not failed: asked for again, it runs at once (no backoff), and no failure was recorded.
    tasks.asked("copy", [(0, 2)])
    tasks.submit("copy", 0, 2, copier, 0, 2)
    _idle(tasks)
    assert copier.ran[-1] == (0, 2) and tasks.errors == []


def test_kinds_never_told_and_urgent_tasks_are_never_skipped() -> None:
    tasks, copier = _runner(), Copier()
    copier.release.set()
    tasks.asked("copy", [])
    tasks.submit("restore", 0, 1, copier, 0, 1)
    _idle(tasks)
    tasks.submit("copy", 0, 2, copier, 0, 2, urgent=True)
    _idle(tasks)
    tasks.submit("copy", 0, 3, copier, 0, 3)  # not asked for: skipped
    _idle(tasks)
    assert copier.ran == [(0, 1), (0, 2)]


def _heartbeat(tasks: TaskRunner, copier: Copier) -> Any:
    """A :class:`Heartbeat` of rank 2 whose answers are acted on by ``_act``, its copies run by ``copier``."""
    from replicator.heartbeat import Heartbeat

    store = SimpleNamespace(has=lambda *a, **kw: False)
    fetcher = SimpleNamespace(copy=lambda task: copier(task.owner_rank, task.step))
    parts = HostParts(store=store, tasks=tasks, fetcher=fetcher,  # type: ignore[arg-type]
                      metrics=SimpleNamespace(counters=HostCounters()),  # type: ignore[arg-type]
                      preemption=SimpleNamespace(preempting=False),  # type: ignore[arg-type]
                      wakeup=SimpleNamespace(ring=lambda: None),  # type: ignore[arg-type]
                      stopping=threading.Event())
    hb = Heartbeat(SimpleNamespace(heartbeat_seconds=0.5), Reporter(job="j", rank=2, nodes=4),  # type: ignore[arg-type]
                   parts, incarnation=1)
    hb._acked = object()  # the coordinator holds this host's picture: its answers carry its work
    return hb


def _copy(owner: int, step: int) -> pb.CopyTask:
    return pb.CopyTask(owner_rank=owner, step=step, source_rank=owner, source_address=f"h{owner}:1",
                       content_hash=f"c{owner}-{step}")


def test_the_heartbeat_tells_which_copies_its_latest_answer_asks_for() -> None:
    tasks, copier = _runner(), Copier()
    hb = _heartbeat(tasks, copier)
    hb._act(pb.HeartbeatResponse(copies=[_copy(0, 4), _copy(1, 4)]))
    assert copier.started.wait(WAIT_SECONDS)  # (0, 4) holds the thread, (1, 4) is queued
    hb._act(pb.HeartbeatResponse(copies=[_copy(0, 4), _copy(1, 5)]))  # rank 1's step 5 supersedes its step 4
    copier.release.set()
    _idle(tasks)
    assert copier.ran == [(0, 4), (1, 5)]
    # An answer of a coordinator without this host's picture (it asks for a full report) asks nothing: a queued
    # copy is not dropped for it.
    copier.ran.clear()
    copier.started.clear()
    copier.release.clear()
    hb._act(pb.HeartbeatResponse(copies=[_copy(0, 6), _copy(1, 6)]))
    assert copier.started.wait(WAIT_SECONDS)
    hb._acked = None
    hb._act(pb.HeartbeatResponse())
    copier.release.set()
    _idle(tasks)
    assert copier.ran == [(0, 6), (1, 6)]
