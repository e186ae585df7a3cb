"""The coordinator's gRPC service: a thin, locked layer over :class:`replicator.coordinator.planner.CoordinatorState`.

Hosts report by heartbeat and receive their work in the answer; nothing is pushed, so a restarted
coordinator rebuilds its whole state from the next round of heartbeats.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.planner import (
    CoordinatorState,
    Holding,
    NotRegisteredError,
    Source,
    StaleIncarnationError,
    Tier,
)
from replicator.coordinator.topology import JobTopology

log = logging.getLogger(__name__)


class BackupScheduler:
    """Hook for the backup tier: the coordinator asks it for backup work and reports progress to it.

    The default does nothing (no bucket configured).
    """

    def task_for(self, state: CoordinatorState, rank: int, newest_saved: dict[int, int]) -> pb.BackupTask | None:
        return None

    def report(self, state: CoordinatorState, rank: int, reports: list[pb.BackupReport]) -> None:
        return None

    def request(self, steps: list[int]) -> None:
        """Hosts asked for an immediate backup of these steps (Orbax's ``_BACKUP_REQUESTED``)."""
        return None

    def status(self) -> dict[str, Any]:
        return {}


class Coordinator(pb_grpc.CoordinatorServicer):
    """Global view of which step is complete where; hands every host its copies, deletions and restores."""

    def __init__(
        self,
        topology: JobTopology,
        job: str,
        *,
        keep_local: int = 2,
        heartbeat_seconds: float = 2.0,
        backup: BackupScheduler | None = None,
        force_restore_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.topology = topology
        self.job = job
        self.keep_local = keep_local
        self.heartbeat_seconds = heartbeat_seconds
        self.backup = backup or BackupScheduler()
        self.state = CoordinatorState(topology)
        self._lock = threading.Condition()
        self._addresses: dict[int, str] = {}
        self._last_seen: dict[int, float] = {}
        self._newest_saved: dict[int, int] = {}
        # Pinned by PrepareRestore (or the operator's --restore-from-backup) until a newer step completes.
        self._restore_step: int | None = force_restore_step
        # The pin is released once a step newer than every step known when it was served completes
        # (training resumed and saved); None = not served yet, keep it.
        self._restore_floor: int | None = None
        if force_restore_step is not None:
            self.state.pin(force_restore_step)
        self._clock = clock
        self._first_seen: dict[int, float] = {}
        self._copy_grace_seconds = 2 * heartbeat_seconds + 1.0
        self._started = clock()
        self._startup_grace_seconds = 10 * heartbeat_seconds + 10.0

    # ------------------------------------------------------------------ helpers
    def _abort_bad(self, context: grpc.ServicerContext, msg: str, code=grpc.StatusCode.INVALID_ARGUMENT):
        context.abort(code, msg)

    def _check(self, req_job: str, rank: int, context: grpc.ServicerContext) -> None:
        if req_job != self.job:
            self._abort_bad(context, f"job {req_job!r} is not this coordinator's job {self.job!r}",
                            grpc.StatusCode.FAILED_PRECONDITION)
        if not 0 <= rank < self.topology.nodes:
            self._abort_bad(context, f"unknown rank {rank}: the job has ranks 0..{self.topology.nodes - 1}",
                            grpc.StatusCode.NOT_FOUND)

    def _ready(self, rank: int, step: int, sources: dict[int, list[Source]]) -> bool:
        """Does host ``rank`` hold its data of ``step`` (or a byte-identical replica's) on its RAM disk?"""
        good = {(s.owner_rank, s.content_hash) for s in sources.get(rank, []) if s.content_hash}
        return any(h.step == step and (h.owner_rank, h.content_hash) in good and h.tier is not Tier.REPLICA
                   for h in self.state.holdings_of(rank))

    def restore_target(self) -> int | None:
        """The step every host should hold locally: a pinned restore, else the newest complete step."""
        newest = self.state.newest_complete_step()
        if self._restore_step is not None:
            if self._restore_floor is not None and newest is not None and newest > self._restore_floor:
                self.state.unpin(self._restore_step)
                self._restore_step = self._restore_floor = None
            else:
                return self._restore_step
        return newest

    def _restore_task(self, rank: int) -> pb.RestoreTask | None:
        step = self.restore_target()
        if step is None:
            return None
        sources = self.state.sources(step)
        if rank not in sources or self._ready(rank, step, sources):
            return None
        try:
            first = self.state.restore_plan(restoring=False, force_step=step).sources.get(rank)
        except ValueError:
            first = None
        ordered = sorted(sources[rank], key=lambda s: (s != first, _tier_rank(s.kind)))
        out = []
        for s in ordered:
            if s.kind is Tier.LOCAL:
                continue
            if s.kind is Tier.PEER and s.holder_rank not in self._addresses:
                continue
            out.append(pb.RestoreSource(
                kind=str(s.kind), holder_rank=-1 if s.holder_rank is None else s.holder_rank,
                holder_address=self._addresses.get(s.holder_rank, "") if s.holder_rank is not None else "",
                owner_rank=s.owner_rank, content_hash=s.content_hash or ""))
        return pb.RestoreTask(step=step, sources=out) if out else None

    # ------------------------------------------------------------------ RPCs
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self._check(request.job, request.rank, context)
        rank = request.rank
        try:
            holdings = [Holding(h.owner_rank, h.step, h.content_hash, h.size, h.tier) for h in request.holdings]
        except ValueError as e:
            self._abort_bad(context, f"bad holding from rank {rank}: {e}")
        for h in holdings:
            if not 0 <= h.owner_rank < self.topology.nodes:
                self._abort_bad(context, f"holding of unknown rank {h.owner_rank}", grpc.StatusCode.NOT_FOUND)
        with self._lock:
            try:
                if self.state.register(rank, request.incarnation):
                    log.info("rank %d registered (incarnation %d) at %s", rank, request.incarnation, request.address)
                self.state.report_inventory(rank, holdings, request.incarnation)
            except StaleIncarnationError as e:
                self._abort_bad(context, str(e), grpc.StatusCode.FAILED_PRECONDITION)
            except (NotRegisteredError, ValueError) as e:
                self._abort_bad(context, str(e))
            if request.address:
                self._addresses[rank] = request.address
            self._last_seen[rank] = self._clock()
            if request.newest_saved_step >= 0:
                self._newest_saved[rank] = request.newest_saved_step
            self.backup.report(self.state, rank, list(request.backups))
            if request.backup_requests:
                self.backup.request(list(request.backup_requests))
            resp = pb.HeartbeatResponse(heartbeat_interval_ms=int(self.heartbeat_seconds * 1000))
            newest = self.state.newest_complete_step()
            resp.newest_complete_step = -1 if newest is None else newest
            floor = newest if newest is not None else -1
            now = self._clock()
            # Byte copies and deletions wait for the whole picture (see below); hash-only checks do not.
            all_reported = len(self._last_seen) == self.topology.nodes
            for step in self.state.known_steps():
                if step < floor:
                    continue
                first = self._first_seen.setdefault(step, now)
                # Hosts commit a step at about the same time; until all have reported it (or a grace
                # period passed), a data-parallel replica may just be late, and a byte copy to it would
                # be wasted: its own identical data only needs a hash comparison.
                # A host that never comes back must not block re-replication forever: after a while the
                # copies go out on the picture there is.
                whole = all_reported or now - self._started >= self._startup_grace_seconds
                settled = whole and (self.state.is_complete(step) or now - first >= self._copy_grace_seconds)
                for t in self.state.replication_plan(step):
                    if t.dest_rank != rank or not (t.hash_only or settled):
                        continue
                    addr = self._addresses.get(t.source_rank, "")
                    if not t.hash_only and not addr:
                        continue
                    resp.copies.append(pb.CopyTask(owner_rank=t.owner_rank, step=t.step, source_rank=t.source_rank,
                                                   source_address=addr, content_hash=t.content_hash))
            # Deleting needs the whole picture: until every rank has reported to this coordinator (after
            # its own restart, hosts come back one by one), an older step can look incomplete only
            # because its holders have not reported yet.
            if all_reported:
                for owner, step in self.state.gc_plan(self.keep_local).get(rank, []):
                    resp.deletions.append(pb.Deletion(owner_rank=owner, step=step))
            task = self._restore_task(rank)
            if task is not None:
                resp.restore.CopyFrom(task)
            bt = self.backup.task_for(self.state, rank, dict(self._newest_saved))
            if bt is not None:
                resp.backup.CopyFrom(bt)
            self._lock.notify_all()
        return resp

    def _wait_all_registered(self, wait_seconds: float, since: float | None = None) -> None:
        """Wait (bounded) until every rank has reported — with ``since``, reported after that instant."""
        deadline = self._clock() + max(0.0, min(wait_seconds, 3600.0))

        def missing() -> bool:
            if since is None:
                return len(self.state.registered) < self.topology.nodes
            return any(self._last_seen.get(r, -1.0) < since for r in range(self.topology.nodes))

        while missing() and self._clock() < deadline:
            self._lock.wait(min(0.2, max(0.0, deadline - self._clock())))

    def GetSteps(self, request: pb.GetStepsRequest, context: grpc.ServicerContext) -> pb.GetStepsResponse:
        with self._lock:
            self._wait_all_registered(request.wait_seconds)
            complete = self.state.globally_complete_steps()
            backed = sorted(s for s in self.state.known_steps() if len(self.state.backup_ranks(s)) ==
                            self.topology.nodes)
        return pb.GetStepsResponse(newest_complete_step=complete[-1] if complete else -1,
                                   complete_steps=complete, backed_up_steps=backed)

    def PrepareRestore(self, request: pb.PrepareRestoreRequest,
                       context: grpc.ServicerContext) -> pb.PrepareRestoreResponse:
        wait = max(0.0, min(request.wait_seconds, 3600.0))
        start = self._clock()
        deadline = start + wait
        with self._lock:
            # A plan is trusted only on fresh reports: a host that restarted (perhaps with a wiped RAM
            # disk) must not be judged on what its previous incarnation held. Wait (at most one
            # heartbeat interval when all hosts are up) until every rank reported after this request.
            self._wait_all_registered(wait, since=start)
            forced = request.step if request.step >= 0 else self.restore_target()
            if request.step < 0 and forced == self.state.newest_complete_step():
                forced = None  # nothing pinned: plain "newest recoverable"
            try:
                plan = self.state.restore_plan(restoring=True, force_step=forced)
            except ValueError as e:
                return pb.PrepareRestoreResponse(step=-1, reason=str(e))
            if plan.empty:
                return pb.PrepareRestoreResponse(step=-1, reason=plan.reason)
            step = plan.step
            if self._restore_step is not None and self._restore_step != step:
                self.state.unpin(self._restore_step)
            self._restore_step = step
            known = self.state.known_steps()
            self._restore_floor = max(known[-1], step) if known else step
            while True:
                sources = self.state.sources(step)
                ready = [r for r in range(self.topology.nodes) if self._ready(r, step, sources)]
                if len(ready) == self.topology.nodes or self._clock() >= deadline or not context.is_active():
                    break
                self._lock.wait(min(0.2, max(0.0, deadline - self._clock())))
        reason = plan.reason if len(ready) == self.topology.nodes else (
            f"step {step}: ranks {sorted(set(range(self.topology.nodes)) - set(ready))} not ready after {wait}s")
        return pb.PrepareRestoreResponse(step=step, reason=reason, ready_ranks=ready,
                                         ready=len(ready) == self.topology.nodes)

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        with self._lock:
            st = self.state.status()
            now = self._clock()
            st["hosts_seen_seconds_ago"] = {r: round(now - t, 3) for r, t in sorted(self._last_seen.items())}
            st["addresses"] = dict(sorted(self._addresses.items()))
            st["restore_target"] = self.restore_target()
            st["backup"] = self.backup.status()
            st["job"] = self.job
        return pb.GetStatusResponse(status_json=json.dumps(st, default=str))

    # ------------------------------------------------------------------ queries for the admin service and metrics
    LOST_AFTER_HEARTBEATS = 5
    LOST_AFTER_MIN_SECONDS = 5.0

    def lost_ranks(self) -> list[int]:
        """Ranks silent for longer than max(5 heartbeats, 5 s), and (after start-up) ranks never heard from."""
        limit = max(self.LOST_AFTER_HEARTBEATS * self.heartbeat_seconds, self.LOST_AFTER_MIN_SECONDS)
        with self._lock:
            now = self._clock()
            started = now - self._started > max(limit, self._startup_grace_seconds)
            return [r for r in range(self.topology.nodes)
                    if (r in self._last_seen and now - self._last_seen[r] > limit)
                    or (r not in self._last_seen and started)]

    def hosts_seen(self) -> dict[int, float]:
        """rank -> seconds since its last heartbeat (ranks never heard from are absent)."""
        with self._lock:
            now = self._clock()
            return {r: now - t for r, t in sorted(self._last_seen.items())}

    def host_addresses(self) -> dict[int, str]:
        """rank -> Peer service address each host reported."""
        with self._lock:
            return dict(sorted(self._addresses.items()))

    def seconds_since_start(self) -> float:
        return self._clock() - self._started

    @property
    def lock(self) -> threading.Condition:
        """The (reentrant) lock every RPC holds while it reads or changes the state."""
        return self._lock

    def steps_first_seen(self) -> dict[int, float]:
        """step -> seconds since the coordinator first heard of it (steps it tracks for replication)."""
        with self._lock:
            now = self._clock()
            return {s: now - t for s, t in sorted(self._first_seen.items())}

    def release_restore_pin(self, step: int) -> bool:
        """Forget a restore pinned on ``step`` (the next restore takes the newest step again)."""
        with self._lock:
            if self._restore_step != step:
                return False
            self.state.unpin(step)
            self._restore_step = self._restore_floor = None
            return True


def _tier_rank(kind: Tier) -> int:
    return {Tier.LOCAL: 0, Tier.PEER: 1, Tier.REPLICA: 1, Tier.BUCKET: 2}.get(kind, 3)
