"""The operator's gRPC service on the coordinator: a thin layer over the coordinator's public queries.

It reads :class:`replicator.coordinator.planner.CoordinatorState` through its public queries under the
coordinator's lock, and acts only by changing the coordinator's decisions (pins, the restore target,
backup requests, copies marked bad), which hosts carry out through their heartbeats. Bucket I/O (commit
times) happens outside the lock. The same view feeds the Prometheus metrics (:func:`cluster_view`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from mtc_rpc import admin_pb2 as pb
from mtc_rpc import admin_pb2_grpc as pb_grpc
from mtc_rpc import coordinator_pb2 as cpb
from replicator.coordinator.backup_status import BackupSchedulerStatus
from replicator.metrics import ClusterView
from replicator.tier_wire import from_wire, holder_to_wire, to_wire
from replicator.tiers import BUCKET_HOLDER, Tier
from sidecar.saves import format_ranks

log = logging.getLogger(__name__)

# A minutes-based backup is overdue once its newest commit is older than this many intervals: one
# interval plus time for the upload itself, so that a healthy schedule never reads as degraded.
OVERDUE_INTERVALS = 1.5


def _backup(coord: Any) -> BackupSchedulerStatus | None:
    """The coordinator's bucket scheduler's state, or None when no bucket is configured."""
    return coord.backup.status()


def cluster_view(coord: Any) -> ClusterView:
    """The job-wide facts the coordinator's replicator exports as metrics."""
    lost = coord.lost_ranks()
    with coord.lock:
        st = coord.state
        newest = st.newest_complete_step()
        view = dict(newest_complete_step=-1 if newest is None else newest,
                    newest_redundant=newest is not None and st.is_redundant(newest),
                    hosts=coord.topology.nodes, hosts_registered=len(st.registered), hosts_lost=len(lost),
                    pinned_steps=tuple(st.pinned_steps()))
        sched = _backup(coord)
        if sched is not None:
            view.update(backup_configured=True, backup_last_success_unix=sched.last_success_unix,
                        backup_skipped=sched.skipped, backup_failures=sched.failures,
                        backup_interval_seconds=sched.interval_seconds,
                        backup_in_progress_step=sched.in_progress_step)
    return ClusterView(**view)


class BadCopies:
    """Copies an operator's verify found corrupt: hidden from the coordinator and deleted by their hosts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bad: dict[int, set[tuple[int, int]]] = {}  # holder rank -> {(owner rank, step)}

    def add(self, holder: int, owner: int, step: int) -> None:
        with self._lock:
            self._bad.setdefault(holder, set()).add((owner, step))

    def filter(self, request: cpb.HeartbeatRequest) -> tuple[cpb.HeartbeatRequest, list[tuple[int, int]]]:
        """The request without the host's bad copies, and those copies (to delete). Forgets deleted ones."""
        with self._lock:
            bad = self._bad.get(request.rank)
            if not bad:
                return request, []
            if request.full_report:
                present = {(h.owner_rank, h.step) for h in request.holdings}
                bad &= present  # a copy the host no longer reports was deleted: forget it
            else:  # a delta heartbeat (docs/coordinator.md): what it removed since its last report is gone
                bad -= {(d.owner_rank, d.step) for d in request.removed}
            if not bad:
                self._bad.pop(request.rank, None)
                return request, []
            hit = sorted(bad)
        out = cpb.HeartbeatRequest()
        out.CopyFrom(request)
        del out.holdings[:]
        out.holdings.extend(h for h in request.holdings if (h.owner_rank, h.step) not in hit)
        return out, hit


class CompletionTimes:
    """When each step was first seen as the newest complete one (wall clock), for ``mtc steps``."""

    MAX_STEPS = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unix: dict[int, float] = {}

    def note(self, step: int) -> None:
        if step < 0:
            return
        with self._lock:
            if step not in self._unix:
                self._unix[step] = time.time()
                for old in sorted(self._unix)[: max(0, len(self._unix) - self.MAX_STEPS)]:
                    del self._unix[old]

    def get(self) -> dict[int, float]:
        with self._lock:
            return dict(self._unix)


class FilteredCoordinator:
    """The Coordinator servicer with bad copies taken out of heartbeats and sent back as deletions.

    It also notes when each step first became the newest complete one (O(1) per heartbeat).
    """

    def __init__(self, inner: Any, bad: BadCopies, completed: CompletionTimes | None = None) -> None:
        self._inner = inner
        self._bad = bad
        self._completed = completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def Heartbeat(self, request: cpb.HeartbeatRequest, context: grpc.ServicerContext) -> cpb.HeartbeatResponse:
        # A report the caller's certificate may not make (mutual TLS) must not touch the filter's state either.
        self._inner.authorize_report(request.rank, context)
        request, doomed = self._bad.filter(request)
        resp = self._inner.Heartbeat(request, context)
        if doomed:
            # Delta heartbeats do not re-send what the coordinator already holds: drop the bad copies from
            # the coordinator's view too, until the host deletes them.
            with self._inner.lock:
                st = self._inner.state
                held = [k for k in doomed if st.holding(request.rank, k) is not None]
                if held:
                    st.report_removed(request.rank, held)
        for owner, step in doomed:
            resp.deletions.append(cpb.Deletion(owner_rank=owner, step=step))
        if self._completed is not None:
            self._completed.note(resp.newest_complete_step)
        return resp


# RPCs that change what the job keeps, restores or deletes: under mutual TLS with rank identities they need
# the admin certificate (replicator.net.security.AdminGate; docs/security.md). The rest only read.
ADMIN_ACTIONS = frozenset({"Pin", "Unpin", "RestoreStep", "BackupNow", "ReportBadCopy"})


class AdminServicer(pb_grpc.AdminServicer):
    """``mtc``'s questions and actions, answered from the coordinator ``coord``."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord
        self.bad = BadCopies()
        self.completed = CompletionTimes()
        self._commit_records: dict[int, tuple[float, int]] = {}

    def wrap(self, coordinator_servicer: Any) -> FilteredCoordinator:
        """The Coordinator servicer to register, so that copies reported bad stop being used."""
        return FilteredCoordinator(coordinator_servicer, self.bad, self.completed)

    # ------------------------------------------------------------------ helpers
    def _backup_records(self, steps: list[int]) -> dict[int, tuple[float, int]]:
        """(commit time, total bytes) of each backed-up step, read from the bucket once (outside the lock)."""
        configured = _backup(self.coord) is not None
        out = {}
        for s in steps:
            if s not in self._commit_records and configured:
                try:
                    self._commit_records[s] = self.coord.backup.commit_record(s)
                except Exception as e:  # deleted by retention meanwhile, or unreadable: unknown
                    log.debug("no commit record for step %d: %s", s, e)
                    continue
            if s in self._commit_records:
                out[s] = self._commit_records[s]
        return out

    # ------------------------------------------------------------------ RPCs
    def GetSummary(self, request: pb.GetSummaryRequest, context: grpc.ServicerContext) -> pb.GetSummaryResponse:
        coord = self.coord
        lost = coord.lost_ranks()
        with coord.lock:
            st = coord.state
            # Each query below walks every rank: ask as few as possible (newest first, stop early).
            newest = st.newest_complete_step()
            newest_redundant = newest is not None and st.is_redundant(newest)
            any_redundant = newest_redundant or any(
                st.is_redundant(s) for s in reversed(st.globally_complete_steps()) if s != newest)
            target = coord.restore_target()
            resp = pb.GetSummaryResponse(
                job=coord.job, nodes=coord.topology.nodes, hosts_registered=len(st.registered), lost_ranks=lost,
                newest_complete_step=-1 if newest is None else newest,
                newest_redundant=newest_redundant,
                pinned_steps=st.pinned_steps(), restore_target=-1 if target is None else target,
                newest_backup_step=-1, backup_in_progress_step=-1, epoch=coord.epoch, redundancy=str(st.redundancy))
            if newest is not None:
                resp.newest_complete_bytes = sum(srcs[0].size for srcs in st.sources(newest).values())
            sched = _backup(coord)
            if sched is not None:
                resp.backup_url = sched.url
                resp.newest_backup_step = sched.newest_committed
                resp.backup_last_success_unix = sched.last_success_unix or 0.0
                resp.backup_interval_seconds = sched.interval_seconds
                resp.backup_interval_steps = sched.interval_steps
                resp.backup_skipped = sched.skipped
                resp.backup_failures = sched.failures
                resp.backup_last_error = sched.last_error
                resp.backup_in_progress_step = sched.in_progress_step
            if coord.last_restores:  # the newest any host reported
                rank, last = max(coord.last_restores.items(), key=lambda kv: kv[1].finished_unix)
                resp.last_restore.CopyFrom(last)
                resp.last_restore_rank = rank
            if coord.last_handshakes:  # Orbax mode: the slowest host's last handshake
                rank, slowest = max(coord.last_handshakes.items(), key=lambda kv: kv[1].seconds)
                resp.slowest_handshake.CopyFrom(slowest)
                resp.slowest_handshake_rank = rank
            up_seconds = coord.seconds_since_start()
        problems = []
        if newest is None:
            problems.append("no globally complete step")
        elif not any_redundant:
            problems.append("no complete step has all its parity (every code group's)" if coord.state.ec.enabled
                            else "no complete step survives the loss of any one host")
        if lost:
            problems.append(f"hosts lost: {len(lost)} (ranks {format_ranks(lost)})")
        if sched is not None:
            interval = resp.backup_interval_seconds
            if interval:
                age = time.time() - resp.backup_last_success_unix if resp.backup_last_success_unix else None
                limit = OVERDUE_INTERVALS * interval
                if (age is not None and age > limit) or (age is None and up_seconds > limit and newest is not None):
                    problems.append(f"backup overdue: newest backup older than {OVERDUE_INTERVALS}x the "
                                    f"{interval:.0f}s interval")
            elif resp.backup_interval_steps and newest is not None:
                behind = newest - max(resp.newest_backup_step, -1)
                if resp.newest_backup_step < 0 or behind >= 2 * resp.backup_interval_steps:
                    problems.append(f"backup overdue: newest backup step {resp.newest_backup_step} is "
                                    f"{behind} steps behind (interval {resp.backup_interval_steps})")
        resp.problems.extend(problems)
        resp.degraded = bool(problems)
        return resp

    def ListSteps(self, request: pb.ListStepsRequest, context: grpc.ServicerContext) -> pb.ListStepsResponse:
        coord = self.coord
        first_seen = coord.steps_first_seen()
        completed = self.completed.get()
        now = time.time()
        infos = []
        with coord.lock:
            st = coord.state
            nodes = coord.topology.nodes
            pinned = set(st.pinned_steps())
            backing = set(st.backups_in_progress())
            target = coord.restore_target()
            newest = st.newest_complete_step()
            for step in st.known_steps():
                found = st.sources(step)
                savers = st.expected_ranks(step)  # elastic: the ranks that saved the step
                info = pb.StepInfo(step=step, complete=st.is_complete(step), redundant=st.is_redundant(step),
                                   pinned=step in pinned, backing_up=step in backing,
                                   backed_up=coord.in_bucket(step),
                                   restore_target=step == target)
                for r in savers:
                    kinds = {s.kind for s in found.get(r, [])}
                    if not kinds:
                        info.missing_ranks.append(r)
                    if Tier.LOCAL in kinds:
                        info.local_ranks.append(r)
                    if Tier.PEER in kinds:
                        info.peer_ranks.append(r)
                    if Tier.BUCKET in kinds:
                        info.bucket_ranks.append(r)
                info.bytes = sum(srcs[0].size for srcs in found.values())
                if step in first_seen:
                    info.first_seen_unix = now - first_seen[step]
                info.complete_unix = completed.get(step, 0.0)
                infos.append(info)
        records = self._backup_records([i.step for i in infos if i.backed_up])
        for i in infos:
            unix, total = records.get(i.step, (0.0, 0))
            i.backup_unix = unix
            if not i.bytes:  # only in the bucket, which hosts do not report sizes for
                i.bytes = total
        return pb.ListStepsResponse(job=coord.job, nodes=nodes, steps=infos,
                                    newest_complete_step=-1 if newest is None else newest, epoch=coord.epoch)

    def ListHosts(self, request: pb.ListHostsRequest, context: grpc.ServicerContext) -> pb.ListHostsResponse:
        coord = self.coord
        nodes = coord.topology.nodes
        first = max(0, request.first_rank)
        last = nodes - 1 if request.last_rank < 0 else min(nodes - 1, request.last_rank)
        lost = set(coord.lost_ranks())
        seen = coord.hosts_seen()
        addresses = coord.host_addresses()
        out = []
        with coord.lock:
            st = coord.state
            registered = st.registered
            for r in range(first, last + 1):
                held = st.holdings_of(r)
                info = pb.HostInfo(rank=r, address=addresses.get(r, ""), incarnation=registered.get(r, 0),
                                   seconds_since_report=seen.get(r, -1.0), lost=r in lost,
                                   steps=sorted({h.step for h in held}), pieces=len(held),
                                   bytes=sum(h.size for h in held if h.tier is not Tier.REPLICA))
                if (last := coord.last_restores.get(r)) is not None:
                    info.last_restore.CopyFrom(last)
                if (hs := coord.last_handshakes.get(r)) is not None:
                    info.last_handshake.CopyFrom(hs)
                out.append(info)
        return pb.ListHostsResponse(hosts=out)

    def LocateStep(self, request: pb.LocateStepRequest, context: grpc.ServicerContext) -> pb.LocateStepResponse:
        coord = self.coord
        addresses = coord.host_addresses()
        resp = pb.LocateStepResponse(job=coord.job, nodes=coord.topology.nodes, step=request.step)
        with coord.lock:
            st = coord.state
            if request.step not in st.known_steps():
                context.abort(grpc.StatusCode.NOT_FOUND, f"step {request.step} is on no tier")
            for holder in sorted(st.registered):
                for h in st.holdings_of(holder):
                    if h.step != request.step or h.tier is Tier.REPLICA:
                        continue
                    resp.pieces.append(pb.Piece(owner_rank=h.owner_rank, holder_rank=holder,
                                                address=addresses.get(holder, ""), tier=to_wire(h.tier),
                                                content_hash=h.content_hash, size=h.size))
                for h in st.ec.parity_of(holder):  # ec: the holder's parity of the step (its group's digest)
                    if h.step == request.step:
                        resp.pieces.append(pb.Piece(owner_rank=holder, holder_rank=holder,
                                                    address=addresses.get(holder, ""), tier=to_wire(Tier.PARITY),
                                                    content_hash=h.content_hash, size=h.size))
            for rank, srcs in sorted(st.sources(request.step).items()):
                resp.ranks.append(pb.RankData(rank=rank, owner_rank=srcs[0].owner_rank))
            for rank, digest in st.backup_ranks(request.step).items():
                resp.pieces.append(pb.Piece(owner_rank=rank, holder_rank=holder_to_wire(BUCKET_HOLDER), tier=to_wire(Tier.BUCKET),
                                            content_hash=digest or ""))
            sched = _backup(coord)
            if sched is not None:
                resp.backup_url = sched.url
        return resp

    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        with self.coord.lock:
            st = self.coord.state
            if request.step < 0 or request.step not in st.known_steps():
                context.abort(grpc.StatusCode.NOT_FOUND, f"step {request.step} is on no tier")
            st.pin(request.step)
            log.info("operator pinned step %d", request.step)
            return pb.PinResponse(pinned_steps=st.pinned_steps())

    def Unpin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        if request.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad step {request.step}")
        self.coord.release_restore_pin(request.step)
        with self.coord.lock:
            st = self.coord.state
            st.unpin(request.step)
            log.info("operator unpinned step %d", request.step)
            return pb.PinResponse(pinned_steps=st.pinned_steps())

    def RestoreStep(self, request: pb.RestoreStepRequest,
                    context: grpc.ServicerContext) -> pb.RestoreStepResponse:
        if request.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad step {request.step}")
        wait = max(0.0, min(request.wait_seconds, 60.0))
        r = self.coord.PrepareRestore(cpb.PrepareRestoreRequest(step=request.step, wait_seconds=wait), context)
        if r.step < 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, r.reason)
        return pb.RestoreStepResponse(step=r.step, nodes=self.coord.topology.nodes, ready_ranks=r.ready_ranks,
                                      ready=r.ready, reason=r.reason)

    def BackupNow(self, request: pb.BackupNowRequest, context: grpc.ServicerContext) -> pb.BackupNowResponse:
        sched = _backup(self.coord)
        if sched is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no backup tier configured (--backup-url)")
        with self.coord.lock:
            newest = self.coord.state.newest_complete_step()
            step = newest if request.step < 0 else request.step
            if step is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no globally complete step to back up")
            if step in sched.committed_steps:
                return pb.BackupNowResponse(step=step, state="already-backed-up")
            if sched.in_progress_step == step:
                return pb.BackupNowResponse(step=step, state="running")
            if step != newest:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"only the newest complete step ({newest}) can be backed up now, not {step}")
            self.coord.backup.request([step])
            log.info("operator requested a backup of step %d", step)
        return pb.BackupNowResponse(step=step, state="requested")

    def GcPlan(self, request: pb.GcPlanRequest, context: grpc.ServicerContext) -> pb.GcPlanResponse:
        coord = self.coord
        items = []
        with coord.lock:
            st = coord.state
            keep = coord.keep_local
            complete = set(st.globally_complete_steps())
            newest = max(complete) if complete else None
            protected = set(st.pinned_steps()) | set(st.backups_in_progress())
            if newest is not None:
                protected.add(newest)
            for holder, keys in sorted(st.gc_plan(keep).items()):
                held = {h.key: h for h in st.holdings_of(holder)}
                newest_held = sorted({s for _, s in held}, reverse=True)[:keep]
                for owner, step in keys:
                    h = held.get((owner, step))
                    if newest is not None and step < newest and step not in complete:
                        why = f"incomplete and older than the newest complete step {newest}"
                    elif step not in newest_held:
                        why = f"older than the host's {keep} newest steps (--keep-local {keep})"
                    else:
                        why = "stale copy: its content hash differs from the owner's"
                    items.append(pb.GcItem(tier=to_wire(h.tier if h else Tier.PEER), holder_rank=holder, owner_rank=owner,
                                           step=step, size=h.size if h else 0, reason=why))
            for holder in sorted(st.registered):  # ec: parity goes with its step, obsolete parity at once
                for p in st.ec.gc_for(holder, keep):
                    why = ("its step goes (the data rules above)" if coord.state.ec.counts(holder, p.step)
                           else "obsolete: not the parity of the step's current data (or corrupt)")
                    items.append(pb.GcItem(tier=to_wire(Tier.PARITY), holder_rank=holder, owner_rank=holder,
                                           step=p.step, size=p.size, reason=why))
            sched = _backup(coord)
            if sched is not None and sched.keep < len(sched.committed_steps):
                for step in sched.committed_steps[:-sched.keep]:
                    items.append(pb.GcItem(tier=to_wire(Tier.BUCKET), holder_rank=holder_to_wire(BUCKET_HOLDER), owner_rank=-1, step=step,
                                           reason=f"bucket retention keeps the newest {sched.keep} backups"))
        return pb.GcPlanResponse(items=items, protected_steps=sorted(protected))

    def ReportBadCopy(self, request: pb.ReportBadCopyRequest,
                      context: grpc.ServicerContext) -> pb.ReportBadCopyResponse:
        nodes = self.coord.topology.nodes
        if not 0 <= request.owner_rank < nodes or request.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad rank {request.owner_rank} or step {request.step}")
        try:
            tier = from_wire(request.tier)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown tier {request.tier!r}")
        if tier is Tier.BUCKET:
            with self.coord.lock:
                self.coord.state.report_backup(request.step, committed=False)
            action = f"the bucket copy of step {request.step} is no longer used for restores"
        elif tier in (Tier.LOCAL, Tier.PEER):
            if not 0 <= request.holder_rank < nodes:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad holder rank {request.holder_rank}")
            self.bad.add(request.holder_rank, request.owner_rank, request.step)
            action = (f"host {request.holder_rank} deletes its copy of rank {request.owner_rank} step "
                      f"{request.step}; other tiers heal it")
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown tier {tier}")
        log.warning("operator reported a bad copy (%s, file %s): %s", tier, request.file or "?", action)
        return pb.ReportBadCopyResponse(action=action)
