"""The coordinator's serving core: its view, lock and clock, the epoch fence, lost hosts, isolation, and the
checks every RPC makes before it reads or changes anything.

:class:`CoordinatorCore` is what :class:`replicator.coordinator.service.Coordinator` (the gRPC servicer) serves
from: it keeps the planner's state (:class:`~replicator.coordinator.planner.CoordinatorState`) and, in named
parts, the epoch fence (:mod:`~replicator.coordinator.fence`), waiter admission
(:mod:`~replicator.coordinator.admission`), the restore target and first-seen times
(:mod:`~replicator.coordinator.step_tracking`), isolation (:mod:`~replicator.coordinator.isolation`) and the
preemption notices (:mod:`~replicator.coordinator.preempting`); itself only per-host transport facts
(addresses, acknowledged digests, newest saved steps). Questions (``isolated``, ``active``, the admin queries)
observe; the commands that change the serving state are named: ``activate``, ``deactivate``,
``_follow_isolation``, ``_expire``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from mtc_rpc import tier_pb2
from replicator.coordinator import isolation
from replicator.coordinator.admission import MAX_WAITERS, WaiterGate
from replicator.coordinator.backup_hook import BackupScheduler
from replicator.coordinator.fence import EpochFence
from replicator.coordinator.gone import GoneHint
from replicator.coordinator.parity_answer import ParityOrders
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.preempting import PreemptingHosts
from replicator.coordinator.report_order import ReportOrder
from replicator.coordinator.step_tracking import FirstSeen, RestoreTarget
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
# PrepareRestore's waiters (at most one per host: Orbax mode asks from every host) check every rank at each
# poll: nodes^2 rank checks. Polled so that they stay under this many a second, between _MIN_RESTORE_POLL_SECONDS
# and _POLL_SECONDS: a small job's plan is answered within 10 ms of its last report, not 0.1 s (every Orbax
# handshake waited for up to two such polls: the hosts' fresh reports, then their data).
_RESTORE_CHECKS_PER_SECOND = 100_000
_MIN_RESTORE_POLL_SECONDS = 0.01


def lost_after_seconds(host_lost_seconds: float, interval: float) -> float:
    """Seconds of silence after which a host is declared lost, given ``--host-lost-seconds`` (0 = default)
    and the heartbeat interval in force (never under two intervals)."""
    if host_lost_seconds > 0:
        return max(host_lost_seconds, 2 * interval)
    # Four intervals, but at least 10 s: a busy host (JAX start-up on a loaded machine) is not lost.
    return max(4 * interval, 10.0)


class CoordinatorCore:
    """The serving state of one coordinator candidate (see the module docstring).

    ``active=False`` makes a standby candidate: every RPC answers UNAVAILABLE until :meth:`activate`.
    ``authorizer`` (mutual TLS): a heartbeat is accepted only from a client certificate that may report
    for its rank (:class:`replicator.net.security.RankAuthorizer`); refused ones change nothing.
    ``candidate``: this coordinator's index among the candidates; its epochs end in it
    (:func:`~replicator.coordinator.fence.candidate_epoch`), so no two candidates serve under one epoch.
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
        lower_candidates: Sequence[int] = (),
    ):
        self.topology = topology
        # The ranks of the candidates before this one (native mode; replicator.coordinator.gone): when a client
        # names them all gone, this candidate's host takes over at once.
        self._lower_candidates = tuple(lower_candidates)
        self._gone = GoneHint()  # kept across a reset: about the hosts, not about the view
        # Rung when a hint lets this standby's host take over (its heartbeat's doorbell; set by the daemon).
        self.takeover_wake: Callable[[], None] | None = None
        # copies:N (None: the topology's replicas) or ec:K+M; checked here (ValueError) by the first state.
        self.redundancy, self.elastic = redundancy, elastic
        # Other candidates may serve when this one is cut off: then an isolated coordinator stops deciding.
        self.other_candidates = other_candidates
        self._isolation = isolation.Isolation()
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

    def _reset(self, lower_silent_seconds: float = 0.0) -> None:
        """A fresh view: everything is learnt again from the hosts' reports (the lower candidates' hosts expected
        since ``lower_silent_seconds`` ago, the others from now)."""
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
        self.last_handshakes: dict[int, tier_pb2.HandshakeBreakdown] = {}
        self._first_seen = FirstSeen()
        self._restore = RestoreTarget(self.state, self._force_restore_step)
        self._started = self._clock()
        if lower_silent_seconds > 0 and self._lower_candidates:  # the older clocks first: the watch list is ordered
            self.state.watch(self._lower_candidates, self._started - lower_silent_seconds)
        self.state.watch(range(self.topology.nodes), self._started)
        self._preempting = PreemptingHosts()

    @property
    def preemption_noticed(self) -> bool:
        """Some registered host's current process got a preemption notice (the job's notice, told to every
        host; it ends once each such host is replaced or declared lost)."""
        return self._preempting.noticed

    def flush_told(self, step: int, me: int) -> bool:
        """Every other host whose process got a preemption notice has been told by this coordinator that
        ``step`` is in the bucket: the flush of host ``me`` (this coordinator's) need not linger for them."""
        with self._lock:
            return self._preempting.all_told(step, me)

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

    def activate(self, epoch: int, lower_silent_seconds: float = 0.0) -> None:
        """Start serving with ``epoch`` (higher than any epoch a host may have accepted before).
        ``lower_silent_seconds``: how long every lower candidate had been silent to this host (a takeover): their
        hosts' lost-host clocks start that long ago, the others' now. A successor answers clients only once every
        host reported or was declared lost; counted from its activation, the old coordinator's host (cut off, it
        reports nowhere) held every client off for a whole lost-host time after the takeover (restart-while-cut-0:
        10-13 s after the cut)."""
        with self._lock:
            if self.active:
                return
            self._reset(lower_silent_seconds)
            self._fence.activate(epoch)
            log.info("coordinator active (epoch %d) for %d hosts", self.epoch, self.topology.nodes)
            self._declare_gone(self._clock())

    def note_gone(self, ranks: Sequence[int], context: grpc.ServicerContext) -> None:
        """A client's ``gone_ranks`` (replicator.coordinator.gone): serving, declare them lost now; a standby
        keeps them for its host's takeover. Bad ranks abort the call and change nothing."""
        if not ranks:
            return
        try:
            gone = {self.topology.check_rank(r) for r in ranks}
        except ValueError as e:
            self._abort_bad(context, f"gone_ranks: {e}")
        with self._lock:
            now = self._clock()
            self._gone.note(gone, now)
            if self.active:
                self._declare_gone(now)
            wake = not self.active and self._gone.covers(self._lower_candidates, now)
        if wake and self.takeover_wake is not None:
            self.takeover_wake()  # the host's next heartbeat now, not at its interval: it takes over

    def lower_candidates_gone(self) -> bool:
        """A client named every lower candidate's host gone recently: this standby's host takes over at once."""
        with self._lock:
            return self._gone.covers(self._lower_candidates, self._clock())

    def _declare_gone(self, now: float) -> None:
        """Declare lost, now, the hosts a client named gone recently that are not lost yet and are silent: never
        heard by this coordinator, or not for 1.5 heartbeat intervals (a host of a slice that came back reports
        again while the client still counts it out: it is never declared lost for that). Lock held."""
        hint = self._gone.fresh(now)
        if not hint:
            return
        st, quiet = self.state, now - 1.5 * self.heartbeat_interval()
        gone = sorted(r for r in hint if not st.is_lost(r)
                      and (st.incarnation_of(r) is None or ((seen := st.last_seen(r)) is not None and seen <= quiet)))
        for r in gone:
            st.forget_host(r, now)
        self._forget_lost(gone)
        if gone:
            log.warning("hosts %s declared lost: a client says they are gone (their slice is down)",
                        format_ranks(gone))

    def deactivate(self, why: str) -> None:
        with self._lock:
            if self.active:
                log.warning("coordinator (epoch %d) steps down: %s", self.epoch, why)
            self._fence.deactivate()

    # ------------------------------------------------------------------ intervals and checks
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
        """Is this coordinator most likely the one cut off (:mod:`~replicator.coordinator.isolation`)? Then it
        decides nothing and answers no client. A question: entering and leaving isolation (and expecting the
        hosts it declared lost again) is :meth:`_follow_isolation`'s."""
        return isolation.cut_off(self.state, now=self._clock(), takeover_after=self.takeover_after(),
                                 other_candidates=self.other_candidates, active=self.active)

    def _follow_isolation(self) -> bool:
        """The one command that enters and leaves isolation, where a heartbeat's answer or a client's call is
        decided (:meth:`_check_serving`); returns :meth:`isolated`."""
        return self._isolation.follow(self.isolated(), self.state, now=self._clock(), epoch=self.epoch,
                                      takeover_after=self.takeover_after())

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
        if self._follow_isolation():
            self._abort_bad(context, f"isolated coordinator (epoch {self.epoch}): no other host reported for "
                            f"{self.lost_after():.1f}s; try the next candidate", grpc.StatusCode.UNAVAILABLE)

    def _expire(self) -> None:
        if not self.active:
            return  # a standby hears from nobody: it declares nobody lost
        now = self._clock()
        self._declare_gone(now)
        lost = self.state.expire(now, self.lost_after())
        if lost:
            log.warning("hosts %s declared lost: no report for %.1fs", format_ranks(lost), self.lost_after())
            self._forget_lost(lost)

    def _forget_lost(self, ranks: list[int]) -> None:
        """What the service keeps of hosts just declared lost: their acknowledged digest, their notice."""
        for r in ranks:
            self._digest.pop(r, None)
            self._preempting.forget(r)

    def restore_target(self) -> int | None:
        """The step every host should hold locally: a pinned restore, else the newest complete step."""
        return self._restore.current()

    def _all_reported(self) -> bool:
        """Every host not declared lost has reported its inventory to this coordinator."""
        return self.state.all_reported()

    def in_bucket(self, step: int) -> bool:
        """Every saver's data of ``step`` is in the bucket, from the step's current save."""
        st = self.state
        return set(st.expected_ranks(step)) <= set(st.backup_ranks(step)) and self.backup.is_current(st, step)

    def _silent_since(self, since: float) -> list[int]:
        """Live ranks that have not reported since ``since``."""
        lost = self.state.lost
        return [r for r in range(self.topology.nodes)
                if r not in lost and (self.state.last_seen(r) or -1.0) < since or
                (r not in lost and not self.state.is_reported(r))]

    def _restore_poll(self) -> float:
        """How often an open PrepareRestore checks the hosts (see _RESTORE_CHECKS_PER_SECOND)."""
        checks = self.topology.nodes**2 / _RESTORE_CHECKS_PER_SECOND
        return min(_POLL_SECONDS, max(_MIN_RESTORE_POLL_SECONDS, checks))

    def _wait(self, until: float, done: Callable[[], bool], context: grpc.ServicerContext | None,
              poll: float = _POLL_SECONDS) -> None:
        while not done() and self._clock() < until and (context is None or context.is_active()):
            self._lock.wait(min(poll, max(0.0, until - self._clock())))
            self._expire()

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
