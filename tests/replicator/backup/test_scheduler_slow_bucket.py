"""A bucket that answers slowly or not at all (a 503 storm, stalled requests) never holds the coordinator's
lock: the scheduler writes a run's begin record and reads the bucket's committed steps after a commit in a
thread of its own, and the heartbeat that starts a run waits at most BEGIN_WAIT_SECONDS for it (issue #33,
found by tests/faults/test_bucket.py: a 503 storm during a backup's start held the lock for 14 s, every host
was declared lost and the coordinator failed over)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from replicator.backup import scheduler as scheduler_mod
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from tests.replicator.backup.test_scheduler_faults import JOB, Job

STALL_SECONDS = 3.0


class SlowBegins(BackupStore):
    """A bucket whose begin records take until ``release`` is set (or fail with ``error``)."""

    def __init__(self, url: str) -> None:
        super().__init__(open_store(url), JOB)
        self.release = threading.Event()
        self.error: Exception | None = None

    def begin(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.release.wait(30)
        if self.error is not None:
            raise self.error
        return super().begin(*args, **kwargs)


def _job(tmp_path: Path) -> tuple[Job, SlowBegins]:
    job = Job(tmp_path, 2)
    slow = SlowBegins(job.url)
    job.sched.bucket = slow
    job.save_on_both(1)
    job.report(0)
    job.report(1)
    return job, slow


def test_a_begin_the_bucket_does_not_answer_leaves_the_heartbeat_free(tmp_path: Path) -> None:
    job, slow = _job(tmp_path)
    timer = threading.Timer(STALL_SECONDS, slow.release.set)
    timer.start()
    try:
        t0 = time.monotonic()
        assert job.beat(0, run=False) is None  # the run is starting; its begin record not written yet
        took = time.monotonic() - t0
        assert took < scheduler_mod.BEGIN_WAIT_SECONDS + 1.0, f"the heartbeat waited {took:.1f}s for the bucket"
        assert job.sched.current is not None and job.sched.status().in_progress_step == 1
        # Still starting: no share is handed out on an unwritten staging (task_for as a heartbeat calls it).
        assert job.sched.task_for(job.state, 1, {}) is None
    finally:
        timer.join()
    job.sched._commit_thread.join(timeout=30)  # type: ignore[union-attr]
    task = job.beat(0, run=False)
    assert task is not None and task.step == 1 and task.staging
    job.rounds(3)
    assert job.committed() == [1]
    assert job.sched.failures == 0, job.sched.last_error


def test_a_begin_that_fails_is_a_failed_run_redone_after_the_back_off(tmp_path: Path) -> None:
    job, slow = _job(tmp_path)
    slow.error = ConnectionResetError("503 storm")
    slow.release.set()
    assert job.beat(0, run=False) is None
    assert job.sched.current is None and job.sched.failures == 1
    assert "cannot start backup of step 1" in job.sched.last_error
    slow.error = None
    job.clock.now += 20.0  # past the back-off
    job.rounds(3)
    assert job.committed() == [1]


def test_a_healthy_bucket_hands_out_the_first_share_at_once(tmp_path: Path) -> None:
    job, slow = _job(tmp_path)
    slow.release.set()
    task = job.beat(0, run=False)
    assert task is not None and task.step == 1
