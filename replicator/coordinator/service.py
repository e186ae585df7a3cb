"""The coordinator's gRPC service: a thin servicer over :class:`~replicator.coordinator.serving.CoordinatorCore`.

Each handler validates and authorises its request, makes one locked call into the core and the planner
(:class:`~replicator.coordinator.planner.CoordinatorState`), waits where a call asks to, and translates the
answer. The heartbeat is named by what it decides: its admission (:meth:`Coordinator._admit_report`), the epoch
fence (:meth:`Coordinator._fence_report`), registration and the report itself (:meth:`Coordinator._take_report`),
the host's transport facts and backups (:meth:`Coordinator._note_host`), the preemption notices
(:mod:`~replicator.coordinator.preempting`) and the host's work (:meth:`Coordinator._answer`, built by
:mod:`~replicator.coordinator.host_answer`). Hosts report by heartbeat (an inventory digest plus deltas) and
receive their work in the answer; nothing is pushed, so a restarted or failed-over coordinator rebuilds its
whole state from the next round of heartbeats. Every candidate host runs one; only the active one answers (see
``docs/coordinator.md`` for the failover rule and the epoch fence).
"""

from __future__ import annotations

import dataclasses
import logging

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from mtc_rpc import tier_pb2
from replicator.coordinator import answers, host_answer
from replicator.coordinator.model import NotRegisteredError, StaleIncarnationError
from replicator.coordinator.parity_answer import PARITY_RETRY_INTERVALS, PARITY_RETRY_MIN_SECONDS
from replicator.coordinator.report_order import StaleReportError
from replicator.coordinator.serving import CoordinatorCore
from replicator.tier_wire import holding_from_wire
from replicator.tiers import Holding, Key
from sidecar.saves import format_ranks

log = logging.getLogger(__name__)

# A host silent for longer than this many intervals may be reporting to another candidate: a candidate takes
# over only after max(2 intervals, lost_after / 2) of silence from the serving one (``Heartbeat._send``).
SILENT_INTERVALS = 1.5


def _expired(context: grpc.ServicerContext) -> bool:
    """The caller's deadline has passed: its answer would be thrown away, so do not compute it."""
    try:
        remaining = context.time_remaining()
    except (AttributeError, NotImplementedError):
        return False
    return remaining is not None and remaining <= 0


@dataclasses.dataclass(frozen=True)
class _Report:
    """A heartbeat's holdings and removals, parsed and checked before the lock is taken."""

    holdings: list[Holding]
    removed: list[Key]
    parity_removed: list[int]


class Coordinator(CoordinatorCore, pb_grpc.CoordinatorServicer):
    """Global view of which step is complete where; hands every host its copies, deletions and restores.

    Constructed as :class:`~replicator.coordinator.serving.CoordinatorCore` (its arguments are documented there);
    this class adds the RPCs. Every RPC reads or changes the state under one lock and one epoch fence, and their
    order matters (a deposed or isolated coordinator must not answer).
    """

    # ------------------------------------------------------------------ Heartbeat
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        report = self._admit_report(request, context)
        rank = request.rank
        with self._lock:
            self._fence_report(request, context)
            now = self._clock()
            accepted = self._take_report(request, report, context)
            self._note_host(request, accepted, now)
            self._preempting.report(rank, request.preempting)
            if self._preempting.noticed:
                self.backup.emergency(self.state.newest_complete_step())
            resp = pb.HeartbeatResponse(heartbeat_interval_ms=int(self.heartbeat_interval() * 1000),
                                        epoch=self.epoch, acked_digest=self._digest.get(rank, ""),
                                        preemption_noticed=self.preemption_noticed)
            newest = self.state.newest_complete_step()
            resp.newest_complete_step = -1 if newest is None else newest
            if not accepted:
                return resp  # no trustworthy picture of this host yet: it sends a full report at once
            if self._follow_isolation():
                return resp  # a stale view decides nothing (see isolated())
            self._answer(rank, now, newest, resp)
        return resp

    def _admit_report(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> _Report:
        """Checks before the lock: the caller's deadline, its certificate, job, rank and node count, this
        candidate serving; the holdings parsed and bounded. Aborts the call on the first that fails."""
        if _expired(context):
            self._abort_bad(context, "deadline passed before the heartbeat was handled",
                            grpc.StatusCode.DEADLINE_EXCEEDED)
        self.authorize_report(request.rank, context)
        self._check_nodes(request.nodes, context)
        self._check(request.job, request.rank, context)
        self._check_active(context)
        rank = request.rank
        try:
            holdings = [holding_from_wire(h) for h in request.holdings]
            removed = [(d.owner_rank, d.step) for d in request.removed if d.tier != tier_pb2.TIER_PARITY]
            parity_removed = [d.step for d in request.removed if d.tier == tier_pb2.TIER_PARITY]
        except ValueError as e:
            self._abort_bad(context, f"bad holding from rank {rank}: {e}")
        for h in holdings:
            if not 0 <= h.owner_rank < self.topology.nodes:
                self._abort_bad(context, f"holding of unknown rank {h.owner_rank}", grpc.StatusCode.NOT_FOUND)
        limit = self.max_pieces_per_host()
        if len(holdings) > limit:
            self._abort_bad(context, f"rank {rank} reports {len(holdings)} pieces; a host holds at most {limit} "
                            f"(keep_local {self.keep_local}, replicas {self.topology.replicas}, "
                            f"{self.topology.data_parallelism} slices)")
        return _Report(holdings, removed, parity_removed)

    def _fence_report(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> None:
        """Under the lock: the caller still waits, this candidate still serves, and the host has not accepted a
        newer epoch (then this coordinator was deposed: it steps down, and the call is UNAVAILABLE)."""
        if _expired(context):  # waited too long for the lock: the caller has given up
            self._abort_bad(context, "deadline passed while queued", grpc.StatusCode.DEADLINE_EXCEEDED)
        self._check_active(context)
        if self._fence.observe(request.known_epoch):
            log.warning("coordinator (epoch %d) steps down: rank %d accepted epoch %d", self.epoch, request.rank,
                        request.known_epoch)
            self._abort_bad(context, f"deposed: epoch {request.known_epoch} is newer than {self.epoch}",
                            grpc.StatusCode.UNAVAILABLE)

    def _take_report(self, request: pb.HeartbeatRequest, report: _Report, context: grpc.ServicerContext) -> bool:
        """The report's order, the host's registration and its inventory (in full, or as a delta on the digest
        this coordinator acknowledged). True: the report is accepted and the host's pieces count."""
        st, rank, limit = self.state, request.rank, self.max_pieces_per_host()
        try:
            self._report_order.check(rank, request.incarnation, request.report_seq)
        except StaleReportError as e:
            self._abort_bad(context, str(e), grpc.StatusCode.ABORTED)
        try:
            if st.register(rank, request.incarnation):
                log.info("rank %d registered (incarnation %d) at %s", rank, request.incarnation, request.address)
                self._digest.pop(rank, None)
                self._parity_orders.forget(rank)
            accepted = False
            if request.known_epoch != self.epoch:
                # The host has not accepted our epoch yet: it may still act on another candidate's orders
                # (our answer lost, it went back to that one), so its pieces count for nothing here until
                # it reports again under our epoch, which it learns from this answer (issue #33, seed
                # 46583 of tests/simulation: two candidates counting and deleting one host's pieces).
                if request.known_epoch:
                    self.backup.host_came_over()
            elif request.full_report:
                st.report_inventory(rank, report.holdings, request.incarnation)
                accepted = True
            elif st.is_reported(rank) and request.base_digest == self._digest.get(rank):
                st.check_holdings(rank, report.holdings)
                if st.piece_count(rank) + len(report.holdings) > limit:
                    raise ValueError(f"rank {rank} would hold more than {limit} pieces")
                st.report_removed(rank, report.removed, request.incarnation)
                st.ec.report_removed(rank, report.parity_removed, request.incarnation)
                for h in report.holdings:
                    st.report_committed(rank, h, request.incarnation)
                accepted = True
            if accepted:
                st.deletions_acted(rank)  # it acted on our last answer: what it kept counts again
        except StaleIncarnationError as e:
            self._abort_bad(context, str(e), grpc.StatusCode.FAILED_PRECONDITION)
        except (NotRegisteredError, ValueError) as e:
            self._abort_bad(context, str(e))
        self._report_order.taken(rank, request.incarnation, request.report_seq)
        return accepted

    def _note_host(self, request: pb.HeartbeatRequest, accepted: bool, now: float) -> None:
        """What the host's report says besides its inventory: the digest acknowledged, when it was heard (and
        who else is lost by now), its address, newest saved step and last restore, its backups and requests."""
        st, rank = self.state, request.rank
        if accepted:
            self._digest[rank] = request.inventory_digest
        else:
            self._digest.pop(rank, None)
        st.seen(rank, now)
        self._expire()
        if request.address and self._addresses.get(rank) != request.address:
            self._addresses[rank] = request.address
        if request.newest_saved_step >= 0:
            self._newest_saved[rank] = request.newest_saved_step
        if request.HasField("last_restore"):
            self.last_restores[rank] = request.last_restore  # shown by `mtc status` (admin)
        if request.HasField("last_handshake"):
            self.last_handshakes[rank] = request.last_handshake  # Orbax mode: shown by `mtc status` (admin)
        self.backup.report(st, rank, list(request.backups))
        if request.backup_requests:
            self.backup.request(list(request.backup_requests))

    def _answer(self, rank: int, now: float, newest: int | None, resp: pb.HeartbeatResponse) -> None:
        """This host's work: O(its tasks and holdings), no whole-job scan."""
        st, interval = self.state, self.heartbeat_interval()
        # Byte copies and deletions wait for the whole picture; hash-only checks do not.
        all_reported = self._all_reported()
        whole = all_reported or now - self._started >= 10 * interval + 10.0
        resp.copies.extend(host_answer.copy_tasks(
            st, rank, now=now, floor=newest if newest is not None else -1, first_seen=self._first_seen,
            whole=whole, grace=2 * interval + 1.0, addresses=self._addresses))
        if all_reported and (newest is not None or not st.lost_count()):
            quiet = not st.lost_count() and st.all_heard_since(now - SILENT_INTERVALS * interval)
            resp.deletions.extend(host_answer.order_deletions(st, rank, keep_local=self.keep_local, newest=newest,
                                                              quiet=quiet))
        # Erasure coding: parity of the step being coded, once its code groups' members all hold it (none in
        # copies mode).
        retry = max(PARITY_RETRY_MIN_SECONDS, PARITY_RETRY_INTERVALS * interval)
        resp.parity.extend(self._parity_orders.tasks(st, rank, now, retry, self._addresses))
        task = host_answer.restore_task(st, rank, self.restore_target(), self._addresses,
                                        host_answer.liveness(now, interval))
        if task is not None:
            resp.restore.CopyFrom(task)
            told = {(c.owner_rank, c.step) for c in resp.copies}
            resp.copies.extend(host_answer.witness_copies(st, rank, task, told, self._addresses.get(rank, "")))
        bt = self.backup.task_for(st, rank, self._newest_saved)
        if bt is not None:
            resp.backup.CopyFrom(bt)

    # ------------------------------------------------------------------ clients: steps, restores, status
    def GetSteps(self, request: pb.GetStepsRequest, context: grpc.ServicerContext) -> pb.GetStepsResponse:
        self.note_gone(request.gone_ranks, context)  # also a standby's: its host may take over at once
        if request.wait_seconds <= 0:
            return self._get_steps(request, context)
        with self._admitted(context):
            return self._get_steps(request, context)

    def _reached(self, request: pb.GetStepsRequest) -> bool:
        """A GetSteps long poll's ``min_step`` (when set) or a newer step is globally complete."""
        if not request.HasField("min_step"):
            return True
        newest = self.state.newest_complete_step()
        return newest is not None and newest >= request.min_step

    def _get_steps(self, request: pb.GetStepsRequest, context: grpc.ServicerContext) -> pb.GetStepsResponse:
        with self._lock:
            self._check_serving(context)
            # Bounded in heartbeats: a host silent that long is declared lost and not waited for.
            wait = min(max(0.0, request.wait_seconds), self.lost_after() + 2 * self.heartbeat_interval())
            self._wait(self._clock() + wait, lambda: self._all_reported() and self._reached(request), context)
            self.check_serving(context)  # every other host fell silent meanwhile: not this one's answer
            complete = self.state.globally_complete_steps()
            backed = [s for s in self.state.known_steps() if self.in_bucket(s)]
            if request.HasField("asker_rank") and 0 <= request.asker_rank < self.topology.nodes:
                self._preempting.told(request.asker_rank, backed)
            served = self._restore.served()  # a forced restore: released once a newer step completes
            forced = -1 if served is None else served
            epoch = self.epoch
        return pb.GetStepsResponse(newest_complete_step=complete[-1] if complete else -1,
                                   complete_steps=complete, backed_up_steps=backed, forced_restore_step=forced,
                                   epoch=epoch)

    def PrepareRestore(self, request: pb.PrepareRestoreRequest,
                       context: grpc.ServicerContext) -> pb.PrepareRestoreResponse:
        self._check_nodes(request.nodes, context)
        self.note_gone(request.gone_ranks, context)  # also a standby's: its host may take over at once
        with self._admitted(context):
            return self._prepare_restore(request, context)

    def _prepare_restore(self, request: pb.PrepareRestoreRequest,
                         context: grpc.ServicerContext) -> pb.PrepareRestoreResponse:
        wait = max(0.0, min(request.wait_seconds, 3600.0))
        start = self._clock()
        deadline = start + wait
        poll = self._restore_poll()
        with self._lock:
            self._check_serving(context)
            # A plan is trusted only on fresh reports: a host that restarted (perhaps with a wiped RAM
            # disk) must not be judged on what its previous incarnation held. Wait until every live rank
            # reported after this request; a host silent for lost_after() is declared lost meanwhile, so
            # this is bounded in heartbeats, not by the caller's wait.
            reports_by = start + min(wait, self.lost_after() + 2 * self.heartbeat_interval())
            self._wait(reports_by, lambda: not self._silent_since(start), context, poll)
            self._check_serving(context)  # every other host fell silent meanwhile: not this one's plan
            forced = request.step if request.step >= 0 else self.restore_target()
            if request.step < 0 and forced == self.state.newest_complete_step():
                forced = None  # nothing pinned: plain "newest recoverable"
            try:
                plan = self.state.restore_plan(restoring=True, force_step=forced)
            except ValueError as e:
                return pb.PrepareRestoreResponse(step=-1, reason=str(e), lost_ranks=sorted(self.state.lost),
                                                 epoch=self.epoch)
            if plan.empty:
                return pb.PrepareRestoreResponse(step=-1, reason=plan.reason, lost_ranks=sorted(self.state.lost),
                                                 epoch=self.epoch)
            step = plan.step
            self._restore.pin(step)

            def not_ready() -> list[int]:
                st = self.state
                return [r for r in range(self.topology.nodes) if r not in st.lost
                        and not host_answer.holds_restorable(st, r, step, st.rank_sources(step, r))]

            self._wait(deadline, lambda: not not_ready(), context, poll)
            pending = not_ready()
            lost = sorted(self.state.lost)
            silent = [r for r in self._silent_since(start) if r in pending]
            epoch = self.epoch
        ready = [r for r in range(self.topology.nodes) if r not in pending and r not in lost]
        if pending:
            reason = f"step {step}: ranks {format_ranks(pending)} not ready after {wait}s"
            if silent:
                reason += f" (no report from ranks {format_ranks(silent)})"
        else:
            reason = plan.reason
        if lost:
            reason += f"; lost hosts not waited for: ranks {format_ranks(lost)}"
        return pb.PrepareRestoreResponse(step=step, reason=reason, ready_ranks=ready, ready=not pending,
                                         lost_ranks=lost, unreachable=format_ranks(pending), epoch=epoch)

    def LocateStep(self, request: pb.LocateStepRequest, context: grpc.ServicerContext) -> pb.LocateStepResponse:
        """Elastic restore: the savers of a step and, for the owners asked, every source of their data."""
        if request.step < 0:
            self._abort_bad(context, f"bad step {request.step}")
        for o in request.owners:
            if not 0 <= o < self.topology.nodes:
                self._abort_bad(context, f"unknown rank {o}", grpc.StatusCode.NOT_FOUND)
        with self._lock:
            self._check_serving(context)
            step = request.step
            if step not in self.state.known_steps():
                self._abort_bad(context, f"step {step} is on no tier (known steps: {self.state.known_steps()})",
                                grpc.StatusCode.NOT_FOUND)
            sources = self.state.sources(step)
            resp = pb.LocateStepResponse(savers=self.state.expected_ranks(step),
                                         generation=self.state.step_generation(step),
                                         complete=self.state.is_complete(step))
            for owner in request.owners:
                resp.ranks.add(owner_rank=owner).sources.extend(
                    w for src in sources.get(owner, []) if (w := answers.wire_source(src, self._addresses)))
        return resp

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        self._check_nodes(request.nodes, context)
        with self._lock:
            self.check_serving(context)
            return self._status(request)

    def _status(self, request: pb.GetStatusRequest) -> pb.GetStatusResponse:
        target = self.restore_target()
        t = self.topology
        header = pb.GetStatusResponse(
            job=self.job, topology=pb.Topology(nodes=t.nodes, data_parallelism=t.data_parallelism,
                                               replicas=t.replicas),
            epoch=self.epoch, coordinator_address=self.address,
            restore_target=-1 if target is None else target, heartbeat_interval_seconds=self.heartbeat_interval(),
            host_lost_seconds=self.lost_after(), redundancy=str(self.state.redundancy))
        return answers.status_response(self.state, request, header, now=self._clock(), in_bucket=self.in_bucket,
                                           backup=self.backup.status(), addresses=self._addresses)
