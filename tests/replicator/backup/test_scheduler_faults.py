"""BucketScheduler under faults found by the control-plane simulation (issue #19): a share follows the data,
a run that did not commit is redone, reports are fenced by the run's staging id.

Real pieces throughout: the coordinator's CoordinatorState, the scheduler, each host's BackupAgent and
RamDiskStore over real step directories, and a BackupStore on a local-folder bucket. The heartbeat is
driven by hand (report, then ask for a task, as Coordinator.Heartbeat does) on a manual clock.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from mtc_rpc import coordinator_pb2 as pb
from replicator.backup.agent import BackupAgent
from replicator.backup.bucket import BackupStore
from replicator.backup.scheduler import BucketScheduler
from replicator.backup.storage import open_store
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.local.store import RamDiskStore
from replicator.tiers import Tier
from sidecar import layout
from tests.kits.storage import make_step

JOB = "job"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def files_for(rank: int) -> dict[str, bytes]:
    rnd = random.Random(rank)
    return {"meta.json": rnd.randbytes(100), "state/0.bin": rnd.randbytes(20_000)}


class Job:
    """``nodes`` hosts, one coordinator state and scheduler, one bucket folder."""

    def __init__(self, tmp: Path, nodes: int, replicas: int = 1):
        self.tmp = tmp
        self.nodes = nodes
        self.topology = JobTopology(nodes, 1, replicas)
        self.url = str(tmp / "bucket")
        self.clock = Clock()
        self.state = CoordinatorState(self.topology)
        self.sched = self.new_scheduler(self.state)
        self.stores: dict[int, RamDiskStore] = {}
        self.agents = {r: BackupAgent(BackupStore(open_store(self.url), JOB)) for r in range(nodes)}
        self.inc: dict[int, int] = {}
        for r in range(nodes):
            self.start_host(r, 1)

    def new_scheduler(self, state: CoordinatorState) -> BucketScheduler:
        return BucketScheduler(BackupStore(open_store(self.url), JOB), self.topology, interval_steps=1,
                               clock=self.clock)

    def start_host(self, rank: int, incarnation: int, root: str | None = None) -> None:
        self.stores[rank] = RamDiskStore(self.tmp / (root or f"host{rank}"), rank)
        self.inc[rank] = incarnation
        self.state.register(rank, incarnation)
        self.report(rank)

    def report(self, rank: int, state: CoordinatorState | None = None) -> None:
        (state or self.state).report_inventory(rank, self.stores[rank].inventory(), self.inc[rank])

    def save(self, step: int, rank: int) -> Path:
        return make_step(layout.steps_dir(self.stores[rank].root), step, rank, self.nodes, files_for(rank), JOB)

    def save_on_both(self, step: int) -> None:
        """Hosts 0 and 1 save ``step``, and each holds a peer copy of the other's."""
        for r in (0, 1):
            self.save(step, r)
        self.peer_copy(0, 1, step)
        self.peer_copy(1, 0, step)

    def peer_copy(self, dest: int, owner: int, step: int) -> None:
        src = self.stores[owner].step_dir(owner, step)
        dst = self.stores[dest].step_dir(owner, step)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst)

    def beat(self, rank: int, *, run: bool = True, sched: BucketScheduler | None = None,
             state: CoordinatorState | None = None) -> pb.BackupTask | None:
        """One heartbeat of host ``rank``: its inventory and backup reports, then the task it is handed
        (run at once unless ``run`` is False)."""
        sched, state = sched or self.sched, state or self.state
        self.report(rank, state)
        sched.report(state, rank, self.agents[rank].drain_reports())
        self.join(sched)
        task = sched.task_for(state, rank, {})
        if task is not None and run:
            self.agents[rank].run_task(task, self.stores[rank])
        return task

    @staticmethod
    def join(sched: BucketScheduler) -> None:
        t = sched._commit_thread
        if t is not None:
            t.join(timeout=30)

    def committed(self, sched: BucketScheduler | None = None) -> list[int]:
        return BackupStore(open_store(self.url), JOB).committed_steps()

    def rounds(self, n: int, ranks: list[int] | None = None, advance: float = 0.5) -> None:
        for _ in range(n):
            for r in ranks if ranks is not None else range(self.nodes):
                self.beat(r)
            self.clock.now += advance


def test_share_moves_off_a_replaced_host_to_a_current_holder(tmp_path: Path) -> None:
    """backup-share-held (simulation seed 30): host 1 is replaced with an empty RAM disk after the run of
    step 1 started; its share goes to host 0, which holds a peer copy of rank 1's step, not to the new
    incarnation (which failed three times with FileNotFoundError …/MANIFEST.json, and the run was abandoned)."""
    job = Job(tmp_path, 2)
    job.save(1, 0)
    job.save(1, 1)
    job.peer_copy(0, 1, 1)
    job.peer_copy(1, 0, 1)
    job.report(1)
    task = job.beat(0, run=False)  # the run starts: rank 0 on host 0, rank 1 on host 1
    assert task is not None and list(task.ranks) == [0]
    assert job.sched.current is not None and job.sched.current.assign[1] == 1
    job.start_host(1, 2, root="host1-new")  # replaced: a new incarnation with nothing on its RAM disk
    assert job.beat(1, run=False) is None  # the new incarnation holds nothing: no share for it
    task = job.beat(0)
    assert task is not None and list(task.ranks) == [0, 1] and list(task.source_owner_ranks) == [0, 1]
    job.rounds(2)
    assert job.committed() == [1]
    assert job.sched.failures == 0, job.sched.last_error


def test_an_abandoned_run_is_redone_after_a_back_off(tmp_path: Path) -> None:
    """backup-reaches-newest (simulation seed 21): the only holder of rank 1's step fails its upload three
    times, the run is abandoned; once the host can upload again the newest complete step is backed up
    (it used to wait for a newer step, so the bucket stayed without step 1)."""
    job = Job(tmp_path, 2, replicas=0)
    job.save(1, 0)
    d = job.save(1, 1)
    job.report(1)
    good = (d / "state/0.bin").read_bytes()
    (d / "state/0.bin").write_bytes(b"x" * len(good))  # a flipped piece: the upload refuses it
    for _ in range(4):
        job.rounds(1)
    assert job.sched.current is None and job.committed() == []
    assert "abandoned" in job.sched.last_error or "ChecksumError" in job.sched.last_error
    (d / "state/0.bin").write_bytes(good)  # healed
    assert job.beat(0, run=False) is None  # the back-off: not at once
    job.clock.now += 20.0
    job.rounds(4)
    assert job.committed() == [1]
    assert job.sched.retry_at is None


def test_reports_of_another_staging_do_not_count(tmp_path: Path) -> None:
    """backup-run-fenced (simulation seed 41): host 1 uploaded into a deposed coordinator's staging; its
    report reaches the new coordinator, whose run of the same step must not count it (it did, committed,
    and the commit failed with IncompleteBackupError, never retried)."""
    job = Job(tmp_path, 2)
    job.save_on_both(1)
    old_state = CoordinatorState(job.topology)
    for r in (0, 1):
        old_state.register(r, job.inc[r])
        job.report(r)
        job.report(r, old_state)
    old = job.new_scheduler(old_state)
    task = job.beat(1, sched=old, state=old_state)  # host 1 uploads into the deposed coordinator's staging
    assert task is not None and list(task.ranks) == [1]
    old_staging = task.staging
    new_task = job.beat(0)  # the new coordinator's run: host 0 uploads rank 0 into another staging
    assert new_task is not None and new_task.staging != old_staging
    job.beat(0)  # host 0's report
    task = job.beat(1, run=False)  # host 1's report of the old staging reaches the new coordinator
    cur = job.sched.current
    assert cur is not None and 1 not in cur.done and job.sched._commit_thread is None
    assert task is not None and task.staging == new_task.staging and list(task.ranks) == [1]
    job.agents[1].run_task(task, job.stores[1])
    job.rounds(2)
    assert job.committed() == [1]
    assert job.sched.failures == 0, job.sched.last_error


def test_a_share_handed_out_again_before_its_report_is_not_uploaded_again(tmp_path: Path) -> None:
    """Host 0's heartbeat was sent while its upload ran, so the answer repeats its share. The repeat runs
    after the commit renamed the staging away: it is reported done, not uploaded again (which failed, and
    counted as a backup failure: the flaky test_local_folder_backup_retention_and_restore_after_losing_all_ram)."""
    job = Job(tmp_path, 2)
    job.save_on_both(1)
    job.report(1)
    first = job.beat(0)  # uploads rank 0; the report waits for the next heartbeat
    again = job.sched.task_for(job.state, 0, {})  # the heartbeat sent while it ran gets the share again
    assert first is not None and again is not None and list(again.ranks) == [0] == list(first.ranks)
    job.beat(0)
    job.beat(1)
    job.report(1)
    job.sched.report(job.state, 1, job.agents[1].drain_reports())  # every rank in: the commit runs
    job.join(job.sched)
    assert job.committed() == [1]
    job.agents[0].run_task(again, job.stores[0])
    assert job.agents[0].last_error == ""
    job.rounds(2)
    assert job.sched.failures == 0, job.sched.last_error
    assert job.committed() == [1]
    assert not list((tmp_path / "bucket" / JOB / "staging").glob("*")), "a staging was left or recreated"


def test_a_failed_commit_is_retried(tmp_path: Path) -> None:
    """A commit that fails (here: the staging's upload of rank 1 vanished before it) is redone."""
    job = Job(tmp_path, 2)
    job.save_on_both(1)
    job.report(1)
    job.beat(0)
    job.beat(1)
    staging = job.sched.current.staging  # type: ignore[union-attr]
    commit = job.sched.bucket.commit
    calls = []

    def commit_once_failing(s):  # type: ignore[no-untyped-def]
        calls.append(s.staging_id)
        if len(calls) == 1:
            raise OSError("injected: bucket unavailable")
        return commit(s)

    job.sched.bucket.commit = commit_once_failing  # type: ignore[method-assign]
    job.rounds(1, advance=0.0)
    assert calls == [staging.staging_id] and job.committed() == []
    assert "commit of step 1 failed" in job.sched.last_error
    job.clock.now += 20.0
    job.rounds(4)
    assert job.committed() == [1] and len(calls) == 2


def test_a_step_another_coordinator_committed_is_not_redone(tmp_path: Path) -> None:
    """The commit fails because a deposed coordinator committed the same save first (FileExistsError):
    the scheduler learns the step is in the bucket and does not redo it in a loop."""
    job = Job(tmp_path, 2)
    for r in (0, 1):
        job.save(1, r)
        job.report(r)
    job.beat(0)
    job.beat(1)
    staging = job.sched.current.staging  # type: ignore[union-attr]
    other = BackupStore(open_store(job.url), JOB)  # the deposed coordinator's run, committed first
    theirs = other.begin(1, 2)
    for r in (0, 1):
        other.upload_rank(theirs, r, job.stores[r].step_dir(r, 1))
    other.commit(theirs)
    job.rounds(1, advance=0.0)
    assert "commit of step 1 failed" in job.sched.last_error and 1 in job.sched.committed
    job.clock.now += 20.0
    job.rounds(3)
    assert job.sched.current is None and job.sched.retry_at is None
    assert job.committed() == [1] and other.commit_record(1)[0].staging_id == theirs.staging_id != staging.staging_id


def test_a_backup_committed_after_the_listing_is_learned_when_the_newest_step_falls_back(tmp_path: Path) -> None:
    """complete-step-lost (simulation seed 854): a deposed coordinator's run committed step 1 after the new
    coordinator had listed the bucket; once hosts were lost and nothing was complete on the RAM disks, the
    new coordinator never learned of that backup (no complete step for as long as it ran, the job started
    from scratch). The scheduler lists the bucket again when the newest complete step falls back."""
    job = Job(tmp_path, 2, replicas=0)
    for r in (0, 1):
        job.save(1, r)
        job.report(r)
    assert job.beat(0, run=False) is not None  # the new coordinator lists the bucket (empty) and starts a run
    old_state = CoordinatorState(job.topology)
    old = job.new_scheduler(old_state)
    for r in (0, 1):
        old_state.register(r, job.inc[r])
    for _ in range(3):  # the deposed coordinator's run of step 1 starts, uploads and commits
        for r in (0, 1):
            job.beat(r, sched=old, state=old_state)
    job.join(old)
    assert job.committed() == [1]
    for r in (0, 1):
        job.save(2, r)
        job.report(r)
    job.beat(0, run=False)
    assert job.state.newest_complete_step() == 2
    job.start_host(1, 2, root="host1-new")  # replaced: steps 1 and 2 of rank 1 are only in the bucket now
    job.beat(0, run=False)
    assert job.state.newest_complete_step() == 1
    assert [s.kind for s in job.state.rank_sources(1, 1)] == [Tier.BUCKET]


def test_a_failed_run_is_still_redone_after_the_newest_step_fell_back_to_a_backed_up_one(tmp_path: Path) -> None:
    """backup-reaches-newest (simulation seed 1619): the run of step 2 was abandoned (its only holder of
    rank 1 was replaced); while the newest complete step was step 1, already in the bucket, the pending redo
    was forgotten, and once step 2 was complete again it was never backed up (the interval counted from the
    failed run)."""
    job = Job(tmp_path, 2, replicas=0)
    for r in (0, 1):
        job.save(1, r)
        job.report(r)
    job.rounds(4)
    assert job.committed() == [1]
    for r in (0, 1):
        job.save(2, r)
        job.report(r)
    assert job.beat(0, run=False) is not None and job.sched.current.step == 2  # type: ignore[union-attr]
    job.start_host(1, 2, root="host1-new")  # replaced: rank 1's step 2 is gone, the run is abandoned
    job.clock.now += 1.5  # (open shares are re-checked at most once a second)
    job.beat(0, run=False)
    assert job.sched.current is None and job.sched.retry_at is not None
    assert job.state.newest_complete_step() == 1  # rank 1 from the bucket: step 1 is backed up
    job.rounds(2)
    job.start_host(1, 3)  # the host is back with its RAM disk: step 2 is complete again
    job.clock.now += 20.0
    job.rounds(4)
    assert job.committed() == [1, 2], job.sched.last_error


def test_a_run_stays_protected_from_gc_when_the_bucket_shows_its_step_committed_by_another(tmp_path: Path) -> None:
    """gc-protected (simulation seed 89534): after a failover the new coordinator's run of step 1 was
    uploading when the newest complete step fell back and the scheduler listed the bucket again; it learned
    that the deposed coordinator's run had committed step 1, and reporting that commit cleared the step's
    "being backed up" mark while its own run still read the hosts' step 1: GC then deleted it under the
    upload. Learning a committed backup keeps the mark of the step the scheduler's own run uploads."""
    job = Job(tmp_path, 2, replicas=0)
    job.save_on_both(1)
    for r in (0, 1):
        job.report(r)
    assert job.beat(0, run=False) is not None  # the new coordinator's run of step 1 (the bucket was empty)
    old_state = CoordinatorState(job.topology)
    old = job.new_scheduler(old_state)
    for r in (0, 1):
        old_state.register(r, job.inc[r])
    for _ in range(3):  # the deposed coordinator's run of step 1 starts, uploads and commits
        for r in (0, 1):
            job.beat(r, sched=old, state=old_state)
    job.join(old)
    assert job.committed() == [1]
    for r in (0, 1):
        job.save(2, r)
        job.report(r)
    job.beat(0, run=False)
    assert job.state.newest_complete_step() == 2
    shutil.rmtree(job.stores[1].step_dir(1, 2))  # rank 1's step 2 is gone: the newest complete step falls back
    job.beat(1, run=False)
    assert job.state.newest_complete_step() == 1
    assert sorted(job.state.backup_ranks(1)) == [0, 1]  # the scheduler learned the deposed one's commit
    assert job.sched.current is not None and job.sched.current.step == 1  # its own run still uploads
    assert job.state.backups_in_progress() == [1]  # GC keeps step 1 until the run ends


def test_a_backup_committed_after_the_listing_is_learned_while_no_step_was_ever_complete(tmp_path: Path) -> None:
    """Simulation seed 81627 (issue #33): every host was wiped and a new coordinator took over; it listed the
    bucket (empty) before the deposed coordinator's run of step 1, on the old incarnations' disks, committed.
    With no complete step ever seen, the scheduler never listed the bucket again (a re-list needed the newest
    complete step to fall below one seen), so the job started from scratch beside a complete backup. It now
    lists again at most every RELIST_EMPTY_SECONDS while no step has been complete."""
    from replicator.backup.scheduler import RELIST_EMPTY_SECONDS

    job = Job(tmp_path, 2, replicas=0)
    for r in (0, 1):
        job.save(1, r)
    old_state = CoordinatorState(job.topology)
    old = job.new_scheduler(old_state)
    for r in (0, 1):
        old_state.register(r, job.inc[r])
    old_stores, old_inc = dict(job.stores), dict(job.inc)
    for r in (0, 1):  # replaced: the new incarnations report empty RAM disks to the new coordinator
        job.start_host(r, 2, root=f"host{r}-new")
    new_stores, new_inc = dict(job.stores), dict(job.inc)
    assert job.beat(0, run=False) is None  # it lists the bucket: empty
    assert job.state.newest_complete_step() is None
    job.stores, job.inc = old_stores, old_inc
    for _ in range(3):  # the deposed coordinator's run of step 1 starts, uploads and commits
        for r in (0, 1):
            job.beat(r, sched=old, state=old_state)
    job.join(old)
    assert job.committed() == [1]
    job.stores, job.inc = new_stores, new_inc
    job.beat(0, run=False)
    assert job.state.newest_complete_step() is None  # not listed again at once
    job.clock.now += RELIST_EMPTY_SECONDS
    job.beat(0, run=False)
    assert job.state.newest_complete_step() == 1
    assert [s.kind for s in job.state.rank_sources(1, 0)] == [Tier.BUCKET]


def test_a_backup_committed_after_the_listing_is_learned_when_a_host_comes_over(tmp_path: Path) -> None:
    """newest-complete-regressed (simulation seed 8683, issue #33): candidate 1 took over for a host cut from
    candidate 0 and listed the bucket; candidate 0, still serving the other hosts, then committed its backup of
    step 2. Candidate 1's newest complete step never fell (step 1 all along), so it never listed the bucket
    again: once the other hosts came over to it (one replaced), its newest complete step was 1 while step 2
    was durable in the bucket. A host that comes over from another coordinator now makes it list the bucket
    again, unless it listed within CAME_OVER_RELIST_SECONDS (every host comes over at a takeover)."""
    from replicator.backup.scheduler import CAME_OVER_RELIST_SECONDS

    job = Job(tmp_path, 2, replicas=0)
    for r in (0, 1):
        job.save(1, r)
        job.report(r)
    job.beat(0, run=False)  # the new coordinator lists the bucket (empty)
    old_state = CoordinatorState(job.topology)
    old = job.new_scheduler(old_state)
    for r in (0, 1):
        old_state.register(r, job.inc[r])
        job.save(2, r)
    for _ in range(4):  # the other coordinator's run of step 2 starts, uploads and commits
        for r in (0, 1):
            job.beat(r, sched=old, state=old_state)
    job.join(old)
    assert 2 in job.committed()
    shutil.rmtree(job.stores[1].step_dir(1, 2))  # host 1 replaced since: rank 1's step 2 only in the bucket
    for r in (0, 1):
        job.beat(r, run=False)
    assert job.state.newest_complete_step() == 1  # the newest complete step did not fall: no re-list
    job.sched.host_came_over()
    job.beat(0, run=False)
    assert job.state.newest_complete_step() == 1  # listed just now (a takeover): not again
    job.clock.now += CAME_OVER_RELIST_SECONDS
    job.sched.host_came_over()
    job.beat(0, run=False)
    assert job.state.newest_complete_step() == 2
    assert [s.kind for s in job.state.rank_sources(2, 1)] == [Tier.BUCKET]
