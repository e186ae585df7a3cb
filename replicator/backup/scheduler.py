"""The coordinator's side of the backup tier: when and what to back up, who uploads what, the commit.

:class:`BucketScheduler` decides when to back up a globally complete step (every N steps or minutes, or on
request), assigns each rank's upload to a host that holds it (one host per distinct content first, then the
byte-identical replicas, which find the data already there and add only their manifest), commits when every
rank is in, applies retention, records skipped backups, and keeps the planner's view of the bucket's
committed backups in step with the bucket. The hosts' side is :mod:`replicator.backup.agent`.

Bucket calls are caught broadly here, on purpose: a Store raises OSError / ValueError by contract, but the
GCS and fsspec backends let their client libraries' own errors (google.api_core, requests, fsspec) through
once their retries are spent, and the scheduler runs inside the coordinator's heartbeat handler (and its
commit in a thread of its own): one failed bucket call must become a logged failure and a retry, never a
failed heartbeat or a dead commit thread.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mtc_rpc import coordinator_pb2 as pb
from replicator.backup.bucket import BackupCommit, BackupStore, Staging
from replicator.coordinator.backup_hook import BackupScheduler
from replicator.coordinator.backup_status import BackupSchedulerStatus
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Tier

log = logging.getLogger(__name__)

# A backup run that did not commit is redone after RETRY_BASE_SECONDS, doubling up to RETRY_MAX_SECONDS.
RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 16.0
# How often (at most) every open share of the running backup is checked against the holders' reports.
RECHECK_SECONDS = 1.0
# While the newest complete step stays below the newest one seen, the bucket is listed again at most this often.
RELIST_SECONDS = 30.0
# While no step has been complete at all (a new job, or a coordinator that took over after every host was
# wiped), at most this often: the bucket may hold a backup committed after this coordinator listed it.
RELIST_EMPTY_SECONDS = 5.0
# A host that comes over from another coordinator (it accepted another epoch) may have helped that one commit
# a backup after this one listed the bucket: listed again, unless listed this recently (every host comes over
# at a takeover, right after the takeover's own listing).
CAME_OVER_RELIST_SECONDS = 1.0
# A run's begin record is written in a thread of its own, like its commit: a bucket answering 503s or not at
# all must not hold the coordinator's lock (every heartbeat and client waits on it; issue #33). The heartbeat
# that starts a run waits this long for it, so that a healthy bucket hands out the first share at once.
BEGIN_WAIT_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class CommitOutcome:
    """What the background commit of one run leaves for the scheduler (picked up by its next call)."""

    step: int
    # The commit record's content hash of every rank ("": did not save the step); None: the commit failed.
    rank_hashes: tuple[str, ...] | None
    note: str  # why the commit failed; else what retention did ("deleted [..]", or why it failed), or ""
    generation: int  # the committed save's generation (0 when the commit failed)
    committed_steps: tuple[int, ...] | None = None  # the bucket's committed steps read after it (None: unread)

    @property
    def committed(self) -> bool:
        return self.rank_hashes is not None


@dataclasses.dataclass
class BackupRun:
    """The state of the one backup in progress (kept by the coordinator's :class:`BucketScheduler`)."""

    step: int
    staging: Staging | None  # None while its begin record is being written (see BEGIN_WAIT_SECONDS)
    assign: dict[int, int]  # owner rank -> the host rank that uploads it
    primaries: set[int]  # one rank per distinct content: uploaded first, their replicas then add a manifest
    started: float  # scheduler clock
    done: set[int] = dataclasses.field(default_factory=set)  # ranks whose upload was reported
    attempts: dict[int, int] = dataclasses.field(default_factory=dict)  # host rank -> failed reports
    savers: list[int] = dataclasses.field(default_factory=list)  # the ranks that saved the step (all: every rank)
    # owner rank -> whose directory on the assigned host holds its data (itself, or an identical replica)
    source_owner: dict[int, int] = dataclasses.field(default_factory=dict)
    # owner rank -> the content hash planned for it (a re-planned share must upload the same content)
    content: dict[int, str | None] = dataclasses.field(default_factory=dict)
    # Derived at the start and kept up to date by :meth:`move` (O(1) per heartbeat at 10,000 hosts): host ->
    # the ranks it uploads, and how many primaries / savers are not uploaded yet.
    by_holder: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    primaries_left: int = 0
    savers_left: int = 0
    checked_version: int = -1  # CoordinatorState.version when every open share was last checked
    checked_at: float = -1e18  # and when (scheduler clock)

    def __post_init__(self) -> None:
        for r in sorted(self.assign):
            self.by_holder.setdefault(self.assign[r], []).append(r)
        self.primaries_left = len(self.primaries - self.done)
        self.savers_left = len(set(self.savers) - self.done)

    def move(self, rank: int, holder: int, source_owner: int) -> None:
        """Hand ``rank``'s share to ``holder``, whose copy of ``source_owner``'s directory holds its data."""
        old = self.assign.get(rank)
        if old is not None and old in self.by_holder:
            share = self.by_holder[old]
            if rank in share:
                share.remove(rank)
            if not share:
                del self.by_holder[old]
        self.assign[rank] = holder
        self.source_owner[rank] = source_owner
        share = self.by_holder.setdefault(holder, [])
        share.append(rank)
        share.sort()

    def mark_done(self, ranks: list[int]) -> None:
        for r in ranks:
            if r in self.done or r not in self.assign:  # every saver has exactly one assignment
                continue
            self.done.add(r)
            self.savers_left -= 1
            if r in self.primaries:
                self.primaries_left -= 1


def _pick_holder(rank: int, sources: Sequence[Any], avoid: int | None) -> Any | None:
    """The host to upload ``rank``'s data from, among its live LOCAL/PEER ``sources``: the rank's own
    directory first (local to its host, then a peer copy), else an identical replica's (the planner lists
    those only when their content hash equals the rank's); ``avoid`` (a host that just failed) last."""
    holders = [s for s in sources if s.kind in (Tier.LOCAL, Tier.PEER) and s.holder_rank is not None]
    if not holders:
        return None
    return min(holders, key=lambda s: (s.holder_rank == avoid, s.owner_rank != rank, s.kind is not Tier.LOCAL))


def _report_committed(state: CoordinatorState, step: int, rank_hashes: Sequence[str]) -> None:
    """Tell the planner the bucket holds ``step``, with the content hash of every rank that saved it."""
    state.report_backup(step, committed=True, content_hashes={r: h for r, h in enumerate(rank_hashes) if h})


def _withdraw_backups(state: CoordinatorState, steps: Iterable[int]) -> None:
    """Tell the planner the bucket no longer holds ``steps`` (those it knew a backup of)."""
    for gone in steps:
        if state.backup_ranks(gone):
            state.report_backup(gone, committed=False)


class BucketScheduler(BackupScheduler):
    """The coordinator's backup planner (called under the coordinator's lock)."""

    def __init__(
        self,
        bucket: BackupStore,
        topology: JobTopology,
        *,
        interval_steps: int = 0,
        interval_minutes: float = 0.0,
        keep: int = 3,
        stale_staging_seconds: float = 3600.0,
        force_restore_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.bucket = bucket
        self.topology = topology
        self.interval_steps = interval_steps
        self.interval_minutes = interval_minutes
        self.keep = keep
        self.stale_staging_seconds = stale_staging_seconds
        self.force_restore_step = force_restore_step
        self.clock = clock
        self.current: BackupRun | None = None
        self.last_start: float | None = None
        self.last_step: int | None = None
        self.committed: list[int] = []
        # step -> generation of the save committed as that step (a rollback saves a step number again; the
        # newer save is backed up over the abandoned one, see BackupStore.commit).
        self.committed_gen: dict[int, int] = {}
        self.skipped = 0
        self.failures = 0
        self.last_error = ""
        self.last_success_unix: float | None = None  # wall-clock time of the newest committed backup
        self.requested: set[int] = set()
        self._loaded = False
        # The run's bucket work in the background: its begin (the result a Staging or the error), or its commit.
        self._commit_thread: threading.Thread | None = None
        self._commit_result: CommitOutcome | None = None
        self._begin_result: Staging | Exception | None = None
        self._beginning = False
        self._due_while_busy = False
        self.emergency_step: int | None = None
        # A run that did not commit (abandoned, its commit failed, or it could not start) is redone, newest
        # complete step first, whatever the interval, with a growing back-off: not before retry_at.
        self.retry_at: float | None = None
        self.retry_count = 0
        self._newest_seen: int | None = None  # the newest complete step seen so far
        self._relisted: tuple[int | None, float] | None = None  # (newest complete step, when) of the last re-list
        self._loaded_at: float | None = None  # when _load listed the bucket
        self._came_over = False  # a host came over from another coordinator since the last listing

    # ------------------------------------------------------------------ bucket -> state
    def _load(self, state: CoordinatorState) -> None:
        """At (re)start: learn the committed backups from the bucket so restores can use them."""
        if self._loaded:
            return
        self._loaded = True
        self._loaded_at = self.clock()
        try:
            steps = self.bucket.committed_steps()
        except Exception as e:  # any bucket error (see the module docstring): the backups stay unknown
            self.last_error = f"cannot list backups: {e}"
            log.warning("%s", self.last_error)
            return
        newest_unix = None
        for step in steps:
            try:
                newest_unix = self._learn_backup(state, step).committed_unix
            except Exception as e:  # any bucket error, or a malformed record (ManifestError)
                log.warning("ignoring unreadable backup of step %d: %s", step, e)
                self.committed_gen[step] = sys.maxsize  # never "superseded" in a loop of failing commits
        self.committed = steps
        if steps:
            self.last_step = steps[-1]
        if newest_unix is not None:
            self.last_success_unix = newest_unix
            # The minutes interval runs on from the newest backup's commit: a restarted coordinator (every
            # job restart in Orbax mode) must not back up at once.
            self.last_start = self.clock() - max(0.0, time.time() - newest_unix)
        log.info("bucket holds committed backups of steps %s", steps)

    # ------------------------------------------------------------------ scheduling
    def is_current(self, state: CoordinatorState, step: int) -> bool:
        return self.committed_gen.get(step, 0) >= state.step_generation(step)

    def _backed_up(self, state: CoordinatorState, step: int) -> bool:
        """The bucket holds ``step`` as saved now: committed, and not an older save of the step number
        (abandoned by a rollback; then the step is backed up again, superseding it). O(1)."""
        return step in self.committed and self.is_current(state, step)

    def request(self, steps: list[int]) -> None:
        """Back these steps up as soon as they are the newest complete step (unless already committed)."""
        self.requested.update(s for s in steps if s not in self.committed and s != self.last_step)

    def emergency(self, step: int | None) -> None:
        """A preemption notice: ``step`` (the newest complete) goes to the bucket now — no interval; the
        hosts upload it unthrottled at normal priority (they know of the notice from their own signal or
        the heartbeat answer). A backup of an older step still running is not interrupted: the emergency
        one starts when it ends. (An emergency step already in the bucket is left out by :meth:`_due`.)"""
        if step is None:
            return
        if self.emergency_step != step:
            log.warning("emergency backup of step %d requested (preemption)", step)
            self.emergency_step = step
        self.requested.add(step)

    def _failed(self, why: str) -> None:
        """The run did not commit: redo it (the newest complete step then) after a growing back-off."""
        self.failures += 1
        self.last_error = why
        self.retry_count += 1
        delay = min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2 ** (self.retry_count - 1))
        self.retry_at = self.clock() + delay
        log.warning("%s; retrying in %.0fs", why, delay)

    def _due(self, state: CoordinatorState, newest_complete: int | None) -> int | None:
        if newest_complete is None:
            return None
        if self._backed_up(state, newest_complete):
            if self.last_step is None or newest_complete >= self.last_step:
                self.retry_at, self.retry_count = None, 0  # e.g. a deposed coordinator's run committed it
            # else: an older step (hosts were lost) is backed up; the failed run of a newer one is still
            # owed once that step is complete again (found by the simulation, seed 1619).
            return None
        if self.retry_at is not None:
            # The last run failed: the newest complete step is not in the bucket; redo after the back-off.
            return newest_complete if self.clock() >= self.retry_at else None
        if newest_complete in self.requested or newest_complete in self.committed:
            # Requested; or the bucket holds an abandoned save of this step number, which restores must not
            # get: replace it now, whatever the interval.
            return newest_complete
        if self.interval_steps:
            if self.last_step is None or newest_complete >= self.last_step + self.interval_steps:
                return newest_complete
            return None
        if self.interval_minutes:
            if self.last_start is None or self.clock() - self.last_start >= self.interval_minutes * 60:
                return newest_complete
        return None

    def _start(self, state: CoordinatorState, step: int) -> None:
        savers = state.expected_ranks(step)
        sources = state.sources(step)
        assign: dict[int, int] = {}
        primaries: set[int] = set()
        seen_hash: set[str] = set()
        source_owner: dict[int, int] = {}
        content: dict[int, str | None] = {}
        for rank in savers:
            pick = _pick_holder(rank, sources.get(rank, []), None)
            if pick is None:
                raise RuntimeError(f"no live host holds rank {rank}'s data of step {step} (nor an identical "
                                   "replica of it)")
            assert pick.holder_rank is not None
            assign[rank] = pick.holder_rank
            source_owner[rank] = pick.owner_rank
            h = pick.content_hash
            content[rank] = h
            if h not in seen_hash:
                seen_hash.add(h)
                primaries.add(rank)
        state.mark_backup_in_progress(step)
        self.current = BackupRun(step=step, staging=None, assign=assign, primaries=primaries,
                                 started=self.clock(), savers=list(savers), source_owner=source_owner,
                                 content=content)
        self.current.checked_version = state.version
        self.current.checked_at = self.clock()
        self.last_start = self.clock()
        self.last_step = step
        self.requested.discard(step)
        self._beginning = True
        self._commit_thread = self._spawn(self._begin, (step, list(savers)), "mtc-backup-begin")
        self._commit_thread.join(BEGIN_WAIT_SECONDS)
        self._finish_commit(state)

    def _spawn(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> threading.Thread:
        """Run the bucket work ``target(*args)`` in a thread of its own, started (the simulation's scheduler
        runs it in place: its bucket model is instant)."""
        t = threading.Thread(target=target, args=args, daemon=True, name=name)
        t.start()
        return t

    def _begin(self, step: int, savers: list[int]) -> None:
        """The begin thread: write the run's begin record, and leave the staging (or the error)."""
        try:
            self._begin_result = self.bucket.begin(step, self.topology.nodes, savers)
        except Exception as e:  # deliberately broad: this thread must leave an outcome whatever failed
            self._begin_result = e

    def _finish_begin(self, state: CoordinatorState) -> None:
        got, self._begin_result, self._beginning = self._begin_result, None, False
        cur = self.current
        if cur is None:  # abandoned meanwhile: its staging, if any, is left to clean_stale_staging
            return
        if not isinstance(got, Staging):
            self.current = None
            self._due_while_busy = False
            state.clear_backup_in_progress(cur.step)
            self._failed(f"cannot start backup of step {cur.step}: {got}")
            return
        cur.staging = got
        log.info("backup of step %d started (staging %s, %d distinct pieces)", cur.step, got.staging_id,
                 len(cur.primaries))

    def task_for(self, state: CoordinatorState, rank: int, newest_saved: dict[int, int]) -> pb.BackupTask | None:
        self._load(state)
        self._finish_commit(state)
        newest = state.newest_complete_step()
        if self._fell_back(newest) or self._take_came_over():
            self._relist(state)
            newest = state.newest_complete_step()
            self._relisted = (newest, self.clock())
        due = self._due(state, newest)
        if self.current is None and self._commit_thread is None:
            if due is not None:
                try:
                    self._start(state, due)
                except Exception as e:  # any bucket error, or RuntimeError (no live holder): retried later
                    self.last_start = self.clock()
                    self._failed(f"cannot start backup of step {due}: {e}")
        elif due is not None and (self.current is None or due != self.current.step) and not self._due_while_busy:
            self._due_while_busy = True
            self.skipped += 1
            log.warning("backup of step %s due while the backup of step %s still runs: skipped (%d so far); "
                        "the next one starts when it ends", due,
                        self.current.step if self.current else "commit", self.skipped)
        cur = self.current
        if cur is None or cur.staging is None:
            return None
        # A share follows the data: the asker's share is checked against what it holds now (O(its share));
        # every open share when the facts changed, at most once a second (a lost holder never asks).
        now = self.clock()
        if cur.checked_version != state.version and now - cur.checked_at >= RECHECK_SECONDS:
            cur.checked_version, cur.checked_at = state.version, now
            stale = [r for r in cur.savers if r not in cur.done and not self._holds_share(state, cur, r)]
        else:
            stale = [r for r in cur.by_holder.get(rank, ()) if r not in cur.done
                     and not self._holds_share(state, cur, r)]
        if stale and not self._replan(state, cur, stale):
            return None
        # Primaries (one rank per distinct content) first; then the replicas, which find their files there.
        primaries_only = cur.primaries_left > 0
        mine = [r for r in cur.by_holder.get(rank, ())
                if r not in cur.done and (not primaries_only or r in cur.primaries)]
        if not mine:
            return None
        return pb.BackupTask(step=cur.step, staging=cur.staging.staging_id, nodes=self.topology.nodes,
                             ranks=mine, source_owner_ranks=[cur.source_owner.get(r, r) for r in mine])

    @staticmethod
    def _holds_share(state: CoordinatorState, cur: BackupRun, rank: int) -> bool:
        """The host assigned ``rank``'s share still reports the planned content (a replaced host's new
        incarnation, a lost host and a deleted piece hold nothing until they report it again)."""
        h = state.holding(cur.assign[rank], (cur.source_owner.get(rank, rank), cur.step))
        return h is not None and h.tier is not Tier.REPLICA and h.content_hash == cur.content.get(rank)

    def _replan(self, state: CoordinatorState, cur: BackupRun, ranks: list[int],
                avoid: int | None = None) -> bool:
        """Hand ``ranks``' shares to hosts that hold the same content now (their own directory first, then
        a byte-identical replica's). False: some rank has no holder left, and the run was abandoned."""
        for r in ranks:
            srcs = [s for s in state.rank_sources(cur.step, r) if s.content_hash == cur.content.get(r)]
            pick = _pick_holder(r, srcs, avoid)
            if pick is None:
                self._abandon(state)
                self._failed(f"backup of step {cur.step} abandoned: no live host holds rank {r}'s data")
                return False
            assert pick.holder_rank is not None
            if (pick.holder_rank, pick.owner_rank) != (cur.assign[r], cur.source_owner.get(r, r)):
                log.info("backup of step %d: rank %d's share moves from host %d to host %d (rank %d's data)",
                         cur.step, r, cur.assign[r], pick.holder_rank, pick.owner_rank)
                cur.move(r, pick.holder_rank, pick.owner_rank)
        return True

    def report(self, state: CoordinatorState, rank: int, reports: list[pb.BackupReport]) -> None:
        cur = self.current
        for rep in reports:
            # Fenced by the staging id: an upload into another run's staging (a deposed coordinator's, an
            # abandoned run's) does not count toward this one.
            if cur is None or cur.staging is None or rep.step != cur.step or rep.staging != cur.staging.staging_id:
                continue
            cur.mark_done(list(rep.uploaded_ranks))
            if rep.error:
                self.failures += 1
                self.last_error = f"rank {rank}: {rep.error}"
                n = cur.attempts.get(rank, 0) + 1
                cur.attempts[rank] = n
                if n >= 3:
                    self._abandon(state)
                    self._failed(f"backup of step {cur.step} abandoned after repeated failures: {rep.error}")
                    return
                # Another host holding the same content takes the share if there is one.
                left = [r for r in cur.by_holder.get(rank, ()) if r not in cur.done]
                if left and not self._replan(state, cur, left, avoid=rank):
                    return
        if cur is not None and cur.savers_left <= 0 and self._commit_thread is None:
            staging = cur.staging
            self._commit_thread = self._spawn(self._commit, (staging,), "mtc-backup-commit")

    def _abandon(self, state: CoordinatorState) -> None:
        cur, self.current = self.current, None
        if cur is not None:
            state.clear_backup_in_progress(cur.step)
            if cur.staging is None:
                return  # its begin is still being written: clean_stale_staging removes what it leaves
            try:
                self.bucket.abort(cur.staging)
            except Exception as e:  # any bucket error: clean_stale_staging removes it later
                log.warning("could not remove staging %s: %s", cur.staging.staging_id, e)

    def _commit(self, staging: Any) -> None:
        """The commit thread: commit ``staging``, apply retention, and leave the outcome for the scheduler."""
        step = staging.step
        try:
            try:
                self.bucket.commit(staging)
            except Exception:  # re-raised unless the commit landed all the same
                if not self._landed(staging):  # e.g. a rename that timed out but finished: committed
                    raise
            rec, _ = self.bucket.commit_record(step)
        except Exception as e:  # deliberately broad: this thread must leave an outcome whatever failed
            self._commit_result = CommitOutcome(step, None, f"{type(e).__name__}: {e}", 0)
            return
        note = ""
        try:
            deleted = self.bucket.apply_retention(self.keep)
            note = f"deleted {deleted}" if deleted else ""
            self.bucket.clean_stale_staging(self.stale_staging_seconds)
        except Exception as e:  # any bucket error: the backup is committed all the same
            note = f"retention failed: {type(e).__name__}: {e}"
            log.warning("backup of step %d: %s", step, note)
        try:
            committed: tuple[int, ...] | None = tuple(self.bucket.committed_steps())
        except Exception:  # any bucket error: the list is re-read at the next commit or re-list
            committed = None
        self._commit_result = CommitOutcome(step, tuple(rec.rank_hashes), note, rec.generation, committed)

    def _landed(self, staging: Staging) -> bool:
        """The bucket's commit record of the step names ``staging``."""
        try:
            rec, _ = self.bucket.commit_record(staging.step)
        except Exception:  # no record (FileNotFoundError), a malformed one, or any bucket error: not known
            return False
        return rec.staging_id == staging.staging_id

    def _finish_commit(self, state: CoordinatorState) -> None:
        t = self._commit_thread
        if t is None or t.is_alive():
            return
        self._commit_thread = None
        if self._beginning:
            self._finish_begin(state)
            return
        out = self._commit_result or CommitOutcome(-1, None, "no result", 0)
        self._commit_result = None
        cur, self.current = self.current, None
        if cur is not None:
            state.clear_backup_in_progress(cur.step)
        self._due_while_busy = False
        if not out.committed:
            # The staging is left to clean_stale_staging (an abort could race a commit still finishing).
            # Another committer (e.g. a deposed coordinator) may have backed the step up: learn that, so the
            # step is not redone in a loop of FileExistsError.
            self._learn_committed(state, out.step)
            self._failed(f"commit of step {out.step} failed: {out.note}")
            return
        self.retry_at, self.retry_count = None, 0
        _report_committed(state, out.step, out.rank_hashes)
        self.committed_gen[out.step] = out.generation
        self.last_success_unix = time.time()
        if out.committed_steps is not None:  # read in the commit thread: no bucket call under the lock
            self.committed = list(out.committed_steps)
        else:
            self.committed = sorted(set(self.committed) | {out.step})
        self.committed_gen = {s: g for s, g in self.committed_gen.items() if s in self.committed}
        _withdraw_backups(state, set(state.known_steps()) - set(self.committed))
        log.info("backup of step %d committed in %.2fs %s", out.step,
                 self.clock() - (cur.started if cur else self.clock()), out.note)

    def host_came_over(self) -> None:
        """A host reported that accepted another coordinator's epoch: that coordinator, serving meanwhile (a
        partition between candidates), may have committed a backup after this one listed the bucket, and this
        one, its newest complete step never falling, would not list it again (issue #33, simulation seed
        8683: a step durable in the bucket, the newest complete step one older). O(1)."""
        self._came_over = True

    def _take_came_over(self) -> bool:
        """Whether to list the bucket again for a host that came over (see :meth:`host_came_over`)."""
        if not self._came_over:
            return False
        self._came_over = False
        last = self._relisted[1] if self._relisted is not None else self._loaded_at
        return last is not None and self.clock() - last >= CAME_OVER_RELIST_SECONDS

    def _fell_back(self, newest: int | None) -> bool:
        """Whether to list the bucket again: the newest complete step fell below the newest one seen (hosts
        were lost), and a backup this scheduler did not commit may be newer than what it knows (a deposed
        coordinator's run that committed after this one listed the bucket; issue #19, found by
        tests/simulation). Once per fall, then at most every RELIST_SECONDS while it lasts. While no step
        has been complete at all, at most every RELIST_EMPTY_SECONDS: a coordinator that took over after every
        host was wiped listed an empty bucket before a deposed coordinator's run committed, and never learned
        of that backup, so the job started from scratch (issue #33, simulation seed 81627). O(1)."""
        top = self._newest_seen
        if newest is not None and (top is None or newest >= top):
            self._newest_seen, self._relisted = newest, None
            return False
        if top is None:
            last = self._relisted[1] if self._relisted is not None else self._loaded_at
            return last is not None and self.clock() - last >= RELIST_EMPTY_SECONDS
        last = self._relisted
        return last is None or last[0] != newest or self.clock() - last[1] >= RELIST_SECONDS

    def _relist(self, state: CoordinatorState) -> None:
        """Learn every committed backup from the bucket again (new ones reported, vanished ones withdrawn)."""
        try:
            steps = self.bucket.committed_steps()
        except Exception as e:  # any bucket error: tried again after RELIST_SECONDS
            log.warning("cannot list backups: %s", e)
            return
        learned = []
        for step in steps:
            if step in self.committed and state.backup_rank_count(step):
                continue
            try:
                self._learn_backup(state, step)
                learned.append(step)
            except Exception as e:  # any bucket error, or a malformed record (ManifestError)
                log.warning("ignoring unreadable backup of step %d: %s", step, e)
        _withdraw_backups(state, set(self.committed) - set(steps))
        self.committed = steps
        self.committed_gen = {s: g for s, g in self.committed_gen.items() if s in steps}
        if learned:
            log.warning("the newest complete step fell back: the bucket holds backups of steps %s this "
                        "coordinator did not know of", learned)

    def _learn_committed(self, state: CoordinatorState, step: int) -> None:
        """After a failed commit: whether the bucket holds ``step`` all the same (another committer's)."""
        try:
            steps = self.bucket.committed_steps()
            if step in steps:
                self._learn_backup(state, step)
            self.committed = steps
        except Exception as e:  # any bucket error, or a malformed record (ManifestError)
            log.warning("cannot list backups: %s", e)

    def _learn_backup(self, state: CoordinatorState, step: int) -> BackupCommit:
        """The bucket re-sync of one step, for every path that re-reads the bucket (start, a fall back, a
        failed commit): ``step``'s commit record and generation read from the bucket, and the backup reported
        to the planner with each saver's content hash. Raises what the bucket raises."""
        rec, _ = self.bucket.commit_record(step)
        self.committed_gen[step] = self.bucket.committed_generation(step)
        _report_committed(state, step, rec.rank_hashes)
        cur = self.current
        if cur is not None and cur.step == step:
            # Reporting the commit ends the step's "being backed up" mark, but this scheduler's own run of it
            # is still uploading (the commit learned is another's: a deposed coordinator's run, before or
            # after a failover): GC must keep the step until the run ends (simulation seed 89534).
            state.mark_backup_in_progress(step)
        return rec

    def status(self) -> BackupSchedulerStatus:
        cur = self.current
        return BackupSchedulerStatus(
            url=self.bucket.store.url, committed_steps=tuple(self.committed),
            in_progress_step=-1 if cur is None else cur.step,
            in_progress_done_ranks=() if cur is None else tuple(sorted(cur.done)),
            skipped=self.skipped, failures=self.failures, last_error=self.last_error,
            interval_steps=self.interval_steps, interval_minutes=self.interval_minutes, keep=self.keep,
            last_success_unix=self.last_success_unix, emergency_step=self.emergency_step,
            emergency_done=self.emergency_step is not None and self.emergency_step in self.committed)

    def commit_record(self, step: int) -> tuple[float, int]:
        rec, _ = self.bucket.commit_record(step)
        return rec.committed_unix, rec.total_bytes

