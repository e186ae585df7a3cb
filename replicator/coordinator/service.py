"""The coordinator's gRPC service: a locked layer over :class:`replicator.coordinator.planner.CoordinatorState`.

The servicer validates and authorises requests, translates them to and from the planner's value objects
under one lock, and waits where a call asks to. Its own state is in named parts: the epoch fence
(:mod:`replicator.coordinator.fence`), waiter admission (:mod:`replicator.coordinator.admission`), and
the restore target and first-seen times of steps (:mod:`replicator.coordinator.step_tracking`); what it
still keeps itself is per-host transport facts (addresses, acknowledged digests, newest saved steps).
Over 700 lines because it is one servicer of five RPCs plus the queries of the admin service; each
handler is validation, one locked call into the planner, and the translation of its answer. The next split
is by role: the heartbeat's answer (``_answer``: GC, copy, restore and backup tasks) into a module of its
own beside ``answers.py``, the restore RPCs (PrepareRestore and its waits) into another.
Hosts report by heartbeat (an inventory digest plus deltas) and receive their work in the answer;
nothing is pushed, so a restarted or failed-over coordinator rebuilds its whole state from the next
round of heartbeats. Every candidate host runs one; only the active one answers (see
``docs/coordinator.md`` for the failover rule and the epoch fence).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from mtc_rpc import tier_pb2
from replicator.coordinator import answers
from replicator.coordinator.admission import MAX_WAITERS, WaiterGate
from replicator.coordinator.backup_status import BackupSchedulerStatus
from replicator.coordinator.fence import EpochFence
from replicator.coordinator.model import (
    NotRegisteredError,
    Source,
    StaleIncarnationError,
    Tier,
)
from replicator.coordinator.parity_answer import (
    PARITY_RETRY_INTERVALS,
    PARITY_RETRY_MIN_SECONDS,
    ParityOrders,
    parity_deletion,
)
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.report_order import ReportOrder, StaleReportError
from replicator.coordinator.step_tracking import FirstSeen, RestoreTarget
from replicator.coordinator.tier_wire import holding_from_wire
from replicator.coordinator.topology import JobTopology
from replicator.erasure.redundancy import Redundancy
from replicator.net.security import RankAuthorizer
from sidecar.saves import format_ranks

log = logging.getLogger(__name__)

# Default bound on the heartbeats per second the coordinator plans for: the interval it hands out grows
# as nodes / this (10,000 hosts -> 50 s). Measured (bench.scale): an unchanged heartbeat costs ~1.1x a
# no-op gRPC call, ~0.6 ms CPU, so 200/s keep the coordinator near 0.1 of a core.
MAX_HEARTBEATS_PER_SECOND = 200.0
# Waiters (GetSteps, PrepareRestore) poll the state at this period instead of being woken by every
# heartbeat (at 10,000 hosts a wake-up per heartbeat would cost more than the heartbeats).
_POLL_SECONDS = 0.1
# A host silent for longer than this many intervals may be reporting to another candidate: a candidate takes
# over only after max(2 intervals, lost_after / 2) of silence from the serving one (``Heartbeat._send``).
SILENT_INTERVALS = 1.5



def lost_after_seconds(host_lost_seconds: float, interval: float) -> float:
    """Seconds of silence after which a host is declared lost, given ``--host-lost-seconds`` (0 = default)
    and the heartbeat interval in force (never under two intervals)."""
    if host_lost_seconds > 0:
        return max(host_lost_seconds, 2 * interval)
    # Four intervals, but at least 10 s: a busy host (JAX start-up on a loaded machine) is not lost.
    return max(4 * interval, 10.0)

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

    def emergency(self, step: int | None) -> None:
        """A preemption notice: back ``step`` (the newest complete one) up at once, unthrottled."""
        return None

    def host_came_over(self) -> None:
        """A host reported that accepted another coordinator's epoch: that one may have committed backups."""
        return None

    def is_current(self, state: CoordinatorState, step: int) -> bool:
        """The bucket's backup of ``step`` (if any) is of its current save, not of one a rollback abandoned."""
        return True

    def status(self) -> BackupSchedulerStatus | None:
        """The scheduler's state (None: no bucket configured)."""
        return None

    def commit_record(self, step: int) -> tuple[float, int]:
        """(commit time, total bytes) of the bucket's backup of ``step``; ``FileNotFoundError`` if none."""
        raise FileNotFoundError(f"no backup tier: no backup of step {step}")


def _expired(context: grpc.ServicerContext) -> bool:
    """The caller's deadline has passed: its answer would be thrown away, so do not compute it."""
    try:
        remaining = context.time_remaining()
    except (AttributeError, NotImplementedError):
        return False
    return remaining is not None and remaining <= 0


class Coordinator(pb_grpc.CoordinatorServicer):
    """Global view of which step is complete where; hands every host its copies, deletions and restores.

    ``active=False`` makes a standby candidate: every RPC answers UNAVAILABLE until :meth:`activate`.
    ``authorizer`` (mutual TLS): a heartbeat is accepted only from a client certificate that may report
    for its rank (:class:`replicator.net.security.RankAuthorizer`); refused ones change nothing.
    ``candidate``: this coordinator's index among the candidates; its epochs end in it
    (:func:`~replicator.coordinator.fence.candidate_epoch`), so no two candidates serve under one epoch.

    Why ~540 lines in one class: every RPC reads or changes the state under one lock and one epoch fence,
    and their order matters (a deposed or isolated coordinator must not answer); the planning is in
    :class:`~replicator.coordinator.planner.CoordinatorState`, the wire views in ``answers.py``.
    """

    def __init__(
        self,
        topology: JobTopology,
        job: str,
        *,
        keep_local: int = 2,
        heartbeat_seconds: float = 2.0,
        backup: BackupScheduler | None = None,
        backup_factory: Callable[[], BackupScheduler | None] | None = None,
        force_restore_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        host_lost_seconds: float = 0.0,
        max_heartbeats_per_second: float = MAX_HEARTBEATS_PER_SECOND,
        active: bool = True,
        epoch: int = 1,
        address: str = "",
        max_waiters: int = MAX_WAITERS,
        authorizer: RankAuthorizer | None = None,
        other_candidates: bool = False,
        candidate: int | None = None,
        redundancy: Redundancy | None = None,
        elastic: bool = False,
    ):
        self.topology = topology
        # copies:N (None: the topology's replicas) or ec:K+M; checked here (ValueError) by the first state.
        self.redundancy, self.elastic = redundancy, elastic
        # Other candidates may serve when this one is cut off: then an isolated coordinator stops deciding.
        self.other_candidates = other_candidates
        self._isolated_since: float | None = None
        self.authorizer = authorizer
        self.job = job
        self.keep_local = keep_local
        self.heartbeat_seconds = heartbeat_seconds
        self.host_lost_seconds = host_lost_seconds
        self.max_heartbeats_per_second = max_heartbeats_per_second
        self.address = address
        self._backup_factory = backup_factory
        self._backup_instance = backup
        self._force_restore_step = force_restore_step
        self._clock = clock
        self._lock = threading.Condition()
        self._gate = WaiterGate(max_waiters)
        self._fence = EpochFence(candidate)
        # Kept across a reset: it is about the order of one host's messages, not about the view.
        self._report_order = ReportOrder()
        self._reset()
        if active:
            self.activate(epoch)

    def _reset(self) -> None:
        """A fresh view: everything is learnt again from the hosts' reports."""
        if self._backup_factory is not None:
            self.backup = self._backup_factory() or BackupScheduler()
        else:
            self.backup = self._backup_instance or BackupScheduler()
        self.state = CoordinatorState(self.topology, self.redundancy, elastic=self.elastic)
        self._parity_orders = ParityOrders()
        self._addresses: dict[int, str] = {}
        self._digest: dict[int, str] = {}
        self._newest_saved: dict[int, int] = {}
        # rank -> its last restore as it reported it (admin: `mtc status`); what hosts say, never decides.
        self.last_restores: dict[int, tier_pb2.RestoreBreakdown] = {}
        self._first_seen = FirstSeen()
        self._restore = RestoreTarget(self.state, self._force_restore_step)
        self._started = self._clock()
        self.state.watch(range(self.topology.nodes), self._started)
        # Ranks whose current process reports a preemption notice (every heartbeat of a preempting host says
        # so). The job's notice lasts while one of them is registered: a replacement (a new process, not
        # preempting) or a declared loss ends it, so the job restarted after a preemption is not told again.
        self._preempting: set[int] = set()

    @property
    def preemption_noticed(self) -> bool:
        """Some registered host's current process got a preemption notice (the job's notice, told to every
        host; it ends once each such host is replaced or declared lost)."""
        return bool(self._preempting)

    # ------------------------------------------------------------------ failover
    @property
    def active(self) -> bool:
        """This candidate serves (False: a standby, or deposed by a newer epoch)."""
        return self._fence.active

    @property
    def epoch(self) -> int:
        return self._fence.epoch

    @property
    def max_epoch_seen(self) -> int:
        """The highest epoch any host reported accepting."""
        return self._fence.max_seen

    def activate(self, epoch: int) -> None:
        """Start serving with ``epoch`` (higher than any epoch a host may have accepted before)."""
        with self._lock:
            if self.active:
                return
            self._reset()
            self._fence.activate(epoch)
            log.info("coordinator active (epoch %d) for %d hosts", self.epoch, self.topology.nodes)

    def deactivate(self, why: str) -> None:
        with self._lock:
            if self.active:
                log.warning("coordinator (epoch %d) steps down: %s", self.epoch, why)
            self._fence.deactivate()

    # ------------------------------------------------------------------ helpers
    def heartbeat_interval(self) -> float:
        """The interval handed to hosts: the configured one, stretched so that N hosts stay under the rate cap."""
        # max() spelled out: asked several times per heartbeat.
        rate = self.max_heartbeats_per_second
        stretched = self.topology.nodes / (rate if rate > 1e-9 else 1e-9)
        return stretched if stretched > self.heartbeat_seconds else self.heartbeat_seconds

    def lost_after(self) -> float:
        """Seconds of silence after which a host is declared lost (never under two intervals).

        A candidate takes the coordinator over after half of this without an answer from lower ones.
        """
        return lost_after_seconds(self.host_lost_seconds, self.heartbeat_interval())

    def takeover_after(self) -> float:
        """Seconds without an answer from every lower candidate after which a standby takes over (half the
        lost-host time, at least two intervals): a lost heartbeat or a quick restart does not move it."""
        return max(2 * self.heartbeat_seconds, self.lost_after() / 2)

    def _abort_bad(self, context: grpc.ServicerContext, msg: str, code=grpc.StatusCode.INVALID_ARGUMENT):
        context.abort(code, msg)

    def _check(self, req_job: str, rank: int, context: grpc.ServicerContext) -> None:
        if req_job != self.job:
            self._abort_bad(context, f"job {req_job!r} is not this coordinator's job {self.job!r}",
                            grpc.StatusCode.FAILED_PRECONDITION)
        if not 0 <= rank < self.topology.nodes:
            self._abort_bad(context, f"unknown rank {rank}: the job has ranks 0..{self.topology.nodes - 1}",
                            grpc.StatusCode.NOT_FOUND)

    def authorize_report(self, rank: int, context: grpc.ServicerContext) -> None:
        """Abort with PERMISSION_DENIED unless the caller's certificate may report for ``rank`` (mutual TLS).

        Called before anything reads or changes state (also by the admin layer's heartbeat filter).
        """
        if self.authorizer is None:
            return
        why = self.authorizer.refusal(context.auth_context(), rank)
        if why is not None:
            log.warning("%s (peer %s)", why, context.peer())
            self._abort_bad(context, why, grpc.StatusCode.PERMISSION_DENIED)

    def max_pieces_per_host(self) -> int:
        """Bound on what one host may report holding: its ``keep_local`` newest steps plus protected ones
        (pinned, backing up, the newest complete), each with its own data, copies received (as many as it
        sends, more while lost hosts' data is re-made) and replica attestations, with 4x slack."""
        t = self.topology
        parity = 1 if self.state.redundancy.is_ec else 0  # its parity of each step it keeps
        return 4 * (self.keep_local + 3) * (1 + t.replicas + t.data_parallelism + parity)

    def _admitted(self, context: grpc.ServicerContext) -> contextlib.AbstractContextManager[None]:
        """A waiting call's place (RESOURCE_EXHAUSTED, retry in a heartbeat interval, when all are taken)."""
        return self._gate.admitted(context, max(0.5, self.heartbeat_interval()))

    def _check_nodes(self, nodes: int, context: grpc.ServicerContext) -> None:
        """A caller of another node count belongs to another incarnation of an elastic job (Orbax mode).

        UNAVAILABLE, like a standby: the caller tries the next candidate, and this coordinator's state
        (registrations, epoch) is not touched by a host whose ranks mean something else.
        """
        if nodes and nodes != self.topology.nodes:
            self._abort_bad(context, f"this coordinator serves {self.topology.nodes} hosts, the caller's job "
                            f"{nodes} (another incarnation): try the next candidate", grpc.StatusCode.UNAVAILABLE)

    def _check_active(self, context: grpc.ServicerContext) -> None:
        if not self.active:
            self._abort_bad(context, "standby coordinator candidate: try the next candidate",
                            grpc.StatusCode.UNAVAILABLE)

    def isolated(self) -> bool:
        """Serving, with other candidates, a host declared lost and every host but one (its own) silent for at
        least :meth:`takeover_after` (long enough for another candidate to have taken them over): most likely
        this coordinator is the one cut off (a partition), and another candidate serves the rest with a newer
        epoch. It then decides nothing (no deletion, copy, restore or backup task) and answers no client
        (``UNAVAILABLE``: callers try the next candidate), until another host reports again — whose report
        deposes it if that host accepted a newer epoch meanwhile. Its view is stale, not wrong to keep.

        Isolated from the *first* host declared lost, not the last: the others fall silent together but are
        declared lost one by one (a beat apart), and a view without some of them may say an older newest
        complete step than it did a moment before (make test-faults, coordinator-host-cut: hosts 1 and 3, the
        two holders of rank 1's data, declared lost before host 2: newest complete step 1, from the bucket,
        after 3).

        When another host reports again, the hosts it declared lost are expected again (``reinstate``): it was
        the one cut off, so it rebuilds its view from their reports as after a takeover (clients are answered
        once each reported or was declared lost afresh), instead of answering from a view without them."""
        isolated = (self.other_candidates and self.active and self.topology.nodes > 1
                    and self.state.lost_count() > 0
                    and self.state.heard_since(self._clock() - self.takeover_after(), 2) <= 1)
        if isolated and self._isolated_since is None:
            self._isolated_since = self._clock()
            log.warning("coordinator (epoch %d) is isolated: hosts %s declared lost and every other host but one "
                        "silent for %.1fs or more; it decides nothing and answers no client until another host "
                        "reports", self.epoch, format_ranks(sorted(self.state.lost)), self.takeover_after())
        elif not isolated and self._isolated_since is not None:
            back = self.state.reinstate(sorted(self.state.lost), self._clock())
            log.info("coordinator (epoch %d) hears other hosts again after %.1fs isolated; ranks %s expected "
                     "again", self.epoch, self._clock() - self._isolated_since, format_ranks(back) or "none")
            self._isolated_since = None
        return isolated

    def check_serving(self, context: grpc.ServicerContext) -> None:
        """Abort a client's read (the admin service's included) unless this candidate serves, is not
        :meth:`isolated` and has its whole view: a standby's view is empty, an isolated one's stale, and one
        being rebuilt partial."""
        with self._lock:
            self._check_serving(context)
            self._check_whole_view(context)

    def _check_whole_view(self, context: grpc.ServicerContext) -> None:
        """A view rebuilt from some hosts' reports (after a takeover or a restart) may say an older or a newer
        step than the whole picture, and nobody lost: answer once every live host reported or was declared
        lost (bounded by :meth:`lost_after` from activation). Found by the fault tests (docs/testing.md)."""
        if not self._all_reported():
            waiting = self.topology.nodes - self.state.reported_count - len(self.state.lost)
            self._abort_bad(context, f"coordinator (epoch {self.epoch}) is rebuilding its view from the hosts' "
                            f"reports ({waiting} not heard yet; each is waited for at most "
                            f"{self.lost_after():.0f}s); try again", grpc.StatusCode.UNAVAILABLE)

    def _check_serving(self, context: grpc.ServicerContext) -> None:
        """A client's call (steps, restores, status): active and not :meth:`isolated`."""
        self._check_active(context)
        self._expire()
        if self.isolated():
            self._abort_bad(context, f"isolated coordinator (epoch {self.epoch}): no other host reported for "
                            f"{self.lost_after():.1f}s; try the next candidate", grpc.StatusCode.UNAVAILABLE)

    def _ready(self, rank: int, step: int, sources: list[Source]) -> bool:
        """Does host ``rank`` hold its data of ``step`` (or a byte-identical replica's) on its RAM disk?"""
        for s in sources:
            if not s.content_hash:
                continue
            h = self.state.holding(rank, (s.owner_rank, step))
            if h is not None and h.tier is not Tier.REPLICA and h.content_hash == s.content_hash:
                return True
        return False

    def _is_ready(self, rank: int, step: int) -> bool:
        return self._ready(rank, step, self.state.rank_sources(step, rank))

    def _expire(self) -> None:
        if not self.active:
            return  # a standby hears from nobody: it declares nobody lost
        lost = self.state.expire(self._clock(), self.lost_after())
        if lost:
            log.warning("hosts %s declared lost: no report for %.1fs", format_ranks(lost), self.lost_after())
            for r in lost:
                self._digest.pop(r, None)
                self._preempting.discard(r)

    def restore_target(self) -> int | None:
        """The step every host should hold locally: a pinned restore, else the newest complete step."""
        return self._restore.current()

    def _restore_task(self, rank: int) -> pb.RestoreTask | None:
        step = self.restore_target()
        if step is None:
            return None
        sources = self.state.rank_sources(step, rank)
        if not sources or self._ready(rank, step, sources):
            return None
        # Fastest tier first (the daemon tries them in order); not its own copy, nor a host of unknown address.
        out = [w for s in sources if s.kind is not Tier.LOCAL and (w := answers.wire_source(s, self._addresses))]
        return pb.RestoreTask(step=step, sources=out) if out else None

    def _all_reported(self) -> bool:
        """Every host not declared lost has reported its inventory to this coordinator."""
        return self.state.all_reported()

    # ------------------------------------------------------------------ RPCs
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
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
        with self._lock:
            if _expired(context):  # waited too long for the lock: the caller has given up
                self._abort_bad(context, "deadline passed while queued", grpc.StatusCode.DEADLINE_EXCEEDED)
            self._check_active(context)
            if self._fence.observe(request.known_epoch):
                log.warning("coordinator (epoch %d) steps down: rank %d accepted epoch %d", self.epoch, rank,
                            request.known_epoch)
                self._abort_bad(context, f"deposed: epoch {request.known_epoch} is newer than {self.epoch}",
                                grpc.StatusCode.UNAVAILABLE)
            st = self.state
            now = self._clock()
            try:
                self._report_order.check(rank, request.incarnation, request.report_seq)
            except StaleReportError as e:
                self._abort_bad(context, str(e), grpc.StatusCode.ABORTED)
            try:
                if st.register(rank, request.incarnation):
                    log.info("rank %d registered (incarnation %d) at %s", rank, request.incarnation,
                             request.address)
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
                    st.report_inventory(rank, holdings, request.incarnation)
                    accepted = True
                elif st.is_reported(rank) and request.base_digest == self._digest.get(rank):
                    st.check_holdings(rank, holdings)
                    if st.piece_count(rank) + len(holdings) > limit:
                        raise ValueError(f"rank {rank} would hold more than {limit} pieces")
                    st.report_removed(rank, removed, request.incarnation)
                    st.ec.report_removed(rank, parity_removed, request.incarnation)
                    for h in holdings:
                        st.report_committed(rank, h, request.incarnation)
                    accepted = True
                if accepted:
                    st.deletions_acted(rank)  # it acted on our last answer: what it kept counts again
            except StaleIncarnationError as e:
                self._abort_bad(context, str(e), grpc.StatusCode.FAILED_PRECONDITION)
            except (NotRegisteredError, ValueError) as e:
                self._abort_bad(context, str(e))
            self._report_order.taken(rank, request.incarnation, request.report_seq)
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
            self.backup.report(st, rank, list(request.backups))
            if request.backup_requests:
                self.backup.request(list(request.backup_requests))
            if request.preempting and rank not in self._preempting:
                log.warning("rank %d received a preemption notice: emergency backup of the newest complete step",
                            rank)
                self._preempting.add(rank)
            elif not request.preempting and rank in self._preempting:
                self._preempting.discard(rank)  # a new process on that host (replaced): its notice is over
                log.info("rank %d reports no preemption notice any more (a new process)%s", rank,
                         "" if self._preempting else ": the job's notice is over")
            if self._preempting:
                self.backup.emergency(st.newest_complete_step())
            resp = pb.HeartbeatResponse(heartbeat_interval_ms=int(self.heartbeat_interval() * 1000),
                                        epoch=self.epoch, acked_digest=self._digest.get(rank, ""),
                                        preemption_noticed=self.preemption_noticed)
            newest = st.newest_complete_step()
            resp.newest_complete_step = -1 if newest is None else newest
            if not accepted:
                return resp  # no trustworthy picture of this host yet: it sends a full report at once
            if self.isolated():
                return resp  # a stale view decides nothing (see isolated())
            self._answer(rank, now, newest, resp)
        return resp

    def _answer(self, rank: int, now: float, newest: int | None, resp: pb.HeartbeatResponse) -> None:
        """This host's work: O(its tasks and holdings), no whole-job scan."""
        st = self.state
        floor = newest if newest is not None else -1
        # Byte copies and deletions wait for the whole picture (see below); hash-only checks do not.
        all_reported = self._all_reported()
        whole = all_reported or now - self._started >= 10 * self.heartbeat_interval() + 10.0
        grace = 2 * self.heartbeat_interval() + 1.0
        for step in st.known_steps():
            if step < floor:
                self._first_seen.forget(step)
                continue
            first = self._first_seen.note(step, now)
            tasks = st.tasks_for(rank, step)
            if not tasks:
                continue
            # Hosts commit a step at about the same time; until all have reported it (or a grace period
            # passed), a data-parallel replica may just be late, and a byte copy to it would be wasted:
            # its own identical data only needs a hash comparison. A host that never comes back must not
            # block re-replication forever: after a while the copies go out on the picture there is.
            settled = whole and (st.is_complete(step) or now - first >= grace)
            for t in tasks:
                if not (t.hash_only or settled):
                    continue
                addr = self._addresses.get(t.source_rank, "")
                if not t.hash_only and not addr:
                    continue
                resp.copies.append(pb.CopyTask(owner_rank=t.owner_rank, step=t.step, source_rank=t.source_rank,
                                               source_address=addr, content_hash=t.content_hash))
        # Deleting needs the whole picture: until every live rank has reported to this coordinator (after
        # its own restart, hosts come back one by one), an older step can look incomplete only because
        # its holders have not reported yet. Nor while no step is complete and hosts are declared lost:
        # the lost hosts may be alive and hold the rest of an older step (a deposed coordinator, cut off
        # from the hosts that moved to its successor, sees them all as lost), and with nothing complete
        # deleting saves no step (issue #19, found by tests/simulation).
        if all_reported and (newest is not None or not st.lost_count()):
            doomed = st.gc_for(rank, self.keep_local)
            parity_doomed = st.ec.gc_for(rank, self.keep_local)
            if st.lost_count() or not st.all_heard_since(now - SILENT_INTERVALS * self.heartbeat_interval()):
                # Nor a step newer than the newest complete one while hosts are declared lost or silent for
                # longer than a beat's jitter: with their pieces it may be complete (a partition: another
                # candidate serves them and counts it complete; a candidate takes over only after at least
                # two intervals of silence from this one, so a host silent for less cannot have moved yet).
                # It goes once they report again or are replaced (issue #33, tests/simulation seeds 1005
                # and 15775). With no step complete, nothing goes: every step is newer than the newest
                # complete one (seed 42569: a deposed coordinator, the other hosts silent to it, told host
                # 0 to delete step 1 beyond keep_local, complete on its successor).
                doomed = [k for k in doomed if newest is not None and k[1] <= newest]
                parity_doomed = [h for h in parity_doomed if newest is not None and h.step <= newest]
            for owner, step in doomed:
                h = st.holding(rank, (owner, step))
                resp.deletions.append(pb.Deletion(owner_rank=owner, step=step,
                                                  content_hash=h.content_hash if h is not None else ""))
            # Counted for nothing from now until the host's next report: no fallback to a step whose
            # pieces are being deleted (issue #19, found by tests/simulation).
            st.deleting(rank, doomed)
            resp.deletions.extend(parity_deletion(h) for h in parity_doomed)
            st.ec.deleting(rank, [h.step for h in parity_doomed])
        # Erasure coding: parity of each step whose code group's members all hold it (none in copies mode).
        retry = max(PARITY_RETRY_MIN_SECONDS, PARITY_RETRY_INTERVALS * self.heartbeat_interval())
        resp.parity.extend(self._parity_orders.tasks(st, rank, newest, now, retry, self._addresses))
        task = self._restore_task(rank)
        if task is not None:
            resp.restore.CopyFrom(task)
            hashes = {s.content_hash for s in task.sources if s.content_hash}
            told = {(c.owner_rank, c.step) for c in resp.copies}
            for t in st.restore_witnesses(rank, task.step, hashes):
                if (t.owner_rank, t.step) not in told:
                    resp.copies.append(pb.CopyTask(owner_rank=t.owner_rank, step=t.step, source_rank=rank,
                                                   source_address=self._addresses.get(rank, ""),
                                                   content_hash=t.content_hash))
        bt = self.backup.task_for(st, rank, self._newest_saved)
        if bt is not None:
            resp.backup.CopyFrom(bt)

    def _silent_since(self, since: float) -> list[int]:
        """Live ranks that have not reported since ``since``."""
        lost = self.state.lost
        return [r for r in range(self.topology.nodes)
                if r not in lost and (self.state.last_seen(r) or -1.0) < since or
                (r not in lost and not self.state.is_reported(r))]

    def _wait(self, until: float, done: Callable[[], bool], context: grpc.ServicerContext | None) -> None:
        while not done() and self._clock() < until and (context is None or context.is_active()):
            self._lock.wait(min(_POLL_SECONDS, max(0.0, until - self._clock())))
            self._expire()

    def GetSteps(self, request: pb.GetStepsRequest, context: grpc.ServicerContext) -> pb.GetStepsResponse:
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

    def in_bucket(self, step: int) -> bool:
        """Every saver's data of ``step`` is in the bucket, from the step's current save."""
        st = self.state
        return set(st.expected_ranks(step)) <= set(st.backup_ranks(step)) and self.backup.is_current(st, step)

    def _get_steps(self, request: pb.GetStepsRequest, context: grpc.ServicerContext) -> pb.GetStepsResponse:
        with self._lock:
            self._check_serving(context)
            # Bounded in heartbeats: a host silent that long is declared lost and not waited for.
            wait = min(max(0.0, request.wait_seconds), self.lost_after() + 2 * self.heartbeat_interval())
            self._wait(self._clock() + wait, lambda: self._all_reported() and self._reached(request), context)
            self.check_serving(context)  # every other host fell silent meanwhile: not this one's answer
            complete = self.state.globally_complete_steps()
            backed = [s for s in self.state.known_steps() if self.in_bucket(s)]
            served = self._restore.served()  # a forced restore: released once a newer step completes
            forced = -1 if served is None else served
            epoch = self.epoch
        return pb.GetStepsResponse(newest_complete_step=complete[-1] if complete else -1,
                                   complete_steps=complete, backed_up_steps=backed, forced_restore_step=forced,
                                   epoch=epoch)

    def PrepareRestore(self, request: pb.PrepareRestoreRequest,
                       context: grpc.ServicerContext) -> pb.PrepareRestoreResponse:
        self._check_nodes(request.nodes, context)
        with self._admitted(context):
            return self._prepare_restore(request, context)

    def _prepare_restore(self, request: pb.PrepareRestoreRequest,
                         context: grpc.ServicerContext) -> pb.PrepareRestoreResponse:
        wait = max(0.0, min(request.wait_seconds, 3600.0))
        start = self._clock()
        deadline = start + wait
        with self._lock:
            self._check_serving(context)
            # A plan is trusted only on fresh reports: a host that restarted (perhaps with a wiped RAM
            # disk) must not be judged on what its previous incarnation held. Wait until every live rank
            # reported after this request; a host silent for lost_after() is declared lost meanwhile, so
            # this is bounded in heartbeats, not by the caller's wait.
            reports_by = start + min(wait, self.lost_after() + 2 * self.heartbeat_interval())
            self._wait(reports_by, lambda: not self._silent_since(start), context)
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
                lost = self.state.lost
                return [r for r in range(self.topology.nodes) if r not in lost and not self._is_ready(r, step)]

            self._wait(deadline, lambda: not not_ready(), context)
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

    # ------------------------------------------------------------------ queries for the admin service and metrics
    def lost_ranks(self) -> list[int]:
        """Ranks declared lost (silent for :meth:`lost_after`; see docs/coordinator.md), ascending."""
        with self._lock:
            self._expire()
            return sorted(self.state.lost)

    def hosts_seen(self) -> dict[int, float]:
        """rank -> seconds since its last heartbeat, for registered hosts (lost ones are absent)."""
        with self._lock:
            now = self._clock()
            st = self.state
            return {r: now - t for r in st.registered if (t := st.last_seen(r)) is not None}

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
            return self._first_seen.ages(self._clock())

    def release_restore_pin(self, step: int) -> bool:
        """Forget a restore pinned on ``step`` (the next restore takes the newest step again)."""
        with self._lock:
            return self._restore.release(step)


