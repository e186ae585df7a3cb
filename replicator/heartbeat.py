"""The replicator's heartbeat: report this host's inventory to the serving coordinator, act on the answer.

It also owns the way to the coordinator: the ordered candidates, failing over to the next one that
answers, and this host's own candidate taking over once every lower one has been silent long enough
(docs/coordinator.md). The answer's work goes to the daemon's :class:`~replicator.tasks.TaskRunner`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc

from mtc_rpc import coordinator_pb2 as cpb
from replicator import host_protocol, logs
from replicator.coordinator.client import FAILOVER_CODES, Candidates
from replicator.coordinator.service import Coordinator
from replicator.coordinator.serving import lost_after_seconds
from replicator.fetch import Fetcher
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics
from replicator.net import retry, rpc
from replicator.net.security import TlsOptions
from replicator.options import ReplicatorOptions
from replicator.preemption import PreemptionState
from replicator.tasks import TaskRunner
from replicator.tiers import Tier, inventory_digest
from sidecar import faults

if TYPE_CHECKING:  # the bucket's backends load only when a --backup-url is configured
    from replicator.backup.agent import BackupAgent
    from replicator.erasure.duty import ParityDuty

log = logging.getLogger(__name__)

BACKUP_REPORTS_KEPT = 64
# Before any coordinator answered: quick retries while it is unreachable (every 0.05 s for ~1 s, then every 0.4 s:
# ~2.6 s in all), then the backoff. Every daemon restarts at once in an Orbax handshake, and the coordinator's own
# host may come up last. A failed connection puts the channel into gRPC's reconnect backoff (~0.1 s: calls fail at
# once until it reconnects): retries at 0.1 s then 0.2 s (before) missed its reconnect about every other time, and
# the host reported 0.3 s late, delaying every host's restore plan (bench.emergency: the handshake's "hosts" phase
# 0.3 s instead of 0.04 s). A retry fails in the channel without reaching the network until it reconnects.
STARTUP_FAST_RETRIES = 20
STARTUP_RETRIES = 24
STARTUP_RETRY_SECONDS = 0.05
STARTUP_RETRY_MAX_SECONDS = 0.4


def new_incarnation() -> int:
    """A random 63-bit nonce naming this process to the coordinator (not a clock reading: a host whose clock
    was stepped back must not look older than its previous run)."""
    return int.from_bytes(os.urandom(8), "big") >> 1 or 1


def _unreachable(e: BaseException) -> bool:
    """No coordinator took the call (not up yet, or no candidate answers): not an overloaded one."""
    return isinstance(e, NoCoordinator) or (isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAVAILABLE)


class NoCoordinator(RuntimeError):
    """No coordinator candidate answered this heartbeat."""


class Wakeup:
    """The heartbeat's doorbell: whoever has news for the coordinator rings it, now or at set times later
    (:meth:`ring_after`: no thread, the waiting loop wakes itself then); the loop waits on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rung = False
        self._due: list[float] = []  # monotonic times of rings set for later, ascending

    def ring(self) -> None:
        with self._cond:
            self._rung = True
            self._cond.notify_all()

    def ring_after(self, delays: Iterable[float]) -> Callable[[], None]:
        """Ring ``delays`` seconds from now, each; returns what cancels those not rung yet."""
        now = time.monotonic()
        times = [now + max(0.0, d) for d in delays]
        with self._cond:
            self._due = sorted(self._due + times)
            self._cond.notify_all()  # the loop's wait may end sooner now

        def cancel() -> None:
            gone = set(times)
            with self._cond:
                self._due = [t for t in self._due if t not in gone]

        return cancel

    def wait(self, seconds: float) -> None:
        """Until rung, a ring set for later is due, or ``seconds`` passed (then ready for the next ring)."""
        until = time.monotonic() + seconds
        with self._cond:
            while not self._rung:
                now = time.monotonic()
                end = min(until, self._due[0]) if self._due else until
                if now >= end:
                    break
                self._cond.wait(end - now)
            now = time.monotonic()
            self._due = [t for t in self._due if t > now]
            self._rung = False


@dataclasses.dataclass(frozen=True)
class Reporter:
    """Who this host is in its reports: fixed for the daemon's life."""

    job: str
    rank: int
    nodes: int
    # Orbax mode: the node count the reports carry (a coordinator of another node count is skipped); 0 native.
    fence_nodes: int = 0
    my_candidate: int | None = None  # this host's place among the coordinator candidates, None: not one


@dataclasses.dataclass(frozen=True)
class HostParts:
    """The parts of this host's daemon (:class:`replicator.daemon.Replicator`) the heartbeat reports and drives."""

    store: RamDiskStore
    tasks: TaskRunner
    fetcher: Fetcher
    metrics: ReplicatorMetrics
    preemption: PreemptionState
    wakeup: Wakeup
    stopping: threading.Event
    coordinator: Coordinator | None = None  # this host's coordinator candidate, if it is one
    bucket: BackupAgent | None = None  # this host's side of the backup tier (None: no --backup-url)
    parity: ParityDuty | None = None  # this host's erasure-coded parity (replicator.erasure.duty)


class Heartbeat:
    """The heartbeat loop and the coordinator link of one :class:`~replicator.daemon.Replicator`.

    It also keeps what the last answer said (:attr:`newest_complete`), this process's :attr:`incarnation`,
    which own steps a restore brought (not saves), and a backup the training loop asked for."""

    def __init__(self, opts: ReplicatorOptions, me: Reporter, parts: HostParts, *, incarnation: int,
                 tls: TlsOptions | None = None, token: str | None = None):
        self.opts = opts
        self.me = me
        self.parts = parts
        self.incarnation = incarnation
        self._tls, self._token = tls, token
        self.address = ""  # this host's, set by :meth:`connect`
        self.newest_complete = -1  # as the last answer said
        self.candidates: Candidates | None = None  # set by :meth:`connect` once the daemon's address is known
        self.epoch = 0  # highest coordinator epoch accepted (fences a deposed coordinator's deletions)
        self._acked: host_protocol.Acked | None = None  # what the coordinator holds of this host
        self._records_taken: host_protocol.LastRecords | None = None  # the last records a coordinator answered
        self.interval = opts.heartbeat_seconds
        self._answered = False  # a coordinator answered one of our heartbeats (since this daemon started)
        self._lower_down_since: float | None = None
        self._backup_reports: list[cpb.BackupReport] = []
        self._seen_own: set[int] | None = None
        self._backup_now = False
        # Numbers this process's reports (HeartbeatRequest.report_seq): the coordinator refuses an older report
        # the network delivers late or twice instead of taking its inventory as current.
        self._report_seq = itertools.count(1)
        # step -> the content hashes this host's restore of that step brings (while the restore runs).
        self._restoring: dict[int, frozenset[str]] = {}

    def connect(self, addresses: list[str], own_address: str) -> None:
        """Reach the coordinator candidates at ``addresses``; this host reports ``own_address``."""
        self.address = own_address
        tls, token, mmb = self._tls, self._token, self.opts.max_message_bytes
        self.candidates = Candidates(addresses, lambda a: rpc.make_channel(a, token=token, tls=tls,
                                                                           max_message_bytes=mmb))

    def close(self) -> None:
        if self.candidates is not None:
            self.candidates.close()

    # ------------------------------------------------------------------ the coordinator link
    def call(self, method: str, request: Any, timeout: float) -> Any:
        """One RPC to the serving coordinator (the first candidate that answers)."""
        if self.candidates is None:
            raise RuntimeError("the replicator is not started")
        return self.candidates.call(method, request, timeout, probe_timeout=self._probe_timeout())

    def call_until(self, method: str, request: Any, within_seconds: float) -> Any:
        """:meth:`call`, retried (with backoff) across a coordinator failover for ``within_seconds``."""
        if self.candidates is None:
            raise RuntimeError("the replicator is not started")
        return self.candidates.call_until(method, request, self.opts.rpc_timeout_seconds,
                                          time.monotonic() + within_seconds)

    def failover_window(self) -> float:
        """How long a restore waits for another coordinator candidate to take over."""
        coord = self.parts.coordinator
        lost = coord.lost_after() if coord is not None else 10 * self.opts.heartbeat_seconds
        return max(3 * self.opts.rpc_timeout_seconds, lost + 4 * self.opts.heartbeat_seconds)

    def _probe_timeout(self) -> float:
        return min(self.opts.rpc_timeout_seconds, max(0.5, self.opts.heartbeat_seconds))

    def _send(self, req: cpb.HeartbeatRequest) -> cpb.HeartbeatResponse:
        """Heartbeat the lowest-ranked candidate that answers; a candidate takes over when all lower ones are down."""
        cands, coord, mine = self.candidates, self.parts.coordinator, self.me.my_candidate
        if cands is None:
            raise RuntimeError("the replicator is not started")
        timeout = self.opts.rpc_timeout_seconds
        last: str | None = None
        waiting: str | None = None
        for i in range(len(cands.addresses)):
            if i == mine and coord is not None and not coord.active:
                turn = host_protocol.takeover(self._lower_down_since, time.monotonic(), coord.takeover_after(),
                                              hinted=coord.lower_candidates_gone())
                self._lower_down_since = turn.lower_down_since
                if not turn.now:
                    waiting = f"lower coordinator candidates unreachable ({last}); waiting to take over"
                    continue
                log.warning("no lower coordinator candidate answers: rank %d takes over", self.me.rank)
                coord.activate(host_protocol.takeover_epoch(time.time_ns(), self.epoch),
                               lower_silent_seconds=turn.silent_seconds(time.monotonic()))
            try:
                resp = cands.call_one(i, "Heartbeat", req, timeout, self._probe_timeout())
            except grpc.RpcError as e:
                if e.code() not in FAILOVER_CODES:
                    raise
                last = e.code().name
                continue
            if host_protocol.lower_serves(i, mine):
                self._lower_down_since = None
                if coord is not None and coord.active:
                    coord.deactivate(f"lower candidate {cands.addresses[i]} serves")
            return resp
        raise NoCoordinator(waiting or f"no coordinator candidate answers ({last})")

    # ------------------------------------------------------------------ what the training loop and restores ask
    def request_backup_now(self) -> None:
        """The training loop asks for an immediate backup of the newest complete step (the next report)."""
        self._backup_now = True
        self.parts.wakeup.ring()

    def _take_backup_now(self) -> bool:
        """Whether the training loop asked for a backup since the last heartbeat (and forget it)."""
        asked, self._backup_now = self._backup_now, False
        return asked

    def _restore(self, task: cpb.RestoreTask, sent_at: float | None = None, round_trip: float = 0.0) -> None:
        """The restore task: this rank's data of the step to restore (not counted as a save when it lands).
        ``sent_at``, ``round_trip``: the heartbeat that brought it (the restore's plan phase)."""
        self.parts.fetcher.restore(self.me.rank, task, plan_seconds=round_trip, planned_at=sent_at)

    # ------------------------------------------------------------------ one heartbeat
    def beat(self) -> float:
        """One report and its answer's work; returns the delay until the next one."""
        me, parts = self.me, self.parts
        store = parts.store
        inv = host_protocol.reportable(store.inventory(), me.nodes)
        own = store.own_steps()
        parity = parts.parity.inventory() if parts.parity is not None else {}
        # The coordinator's digest of this host's whole inventory, its parity included (erasure coding).
        digest = inventory_digest([*inv, *parts.parity.holdings(parity)] if parity and parts.parity else inv)
        self._note_saves(inv)
        backup_requests = list(store.backup_requests())
        if self._take_backup_now() and own:
            backup_requests.append(own[-1])
        current = {h.key: h for h in inv}
        report = host_protocol.Report(
            job=me.job, rank=me.rank, incarnation=self.incarnation, address=self.address,
            report_seq=next(self._report_seq), known_epoch=self.epoch, newest_saved_step=own[-1] if own else -1,
            backup_requests=tuple(backup_requests), preempting=parts.preemption.preempting, fence_nodes=me.fence_nodes)
        req = host_protocol.request(report, current, digest, self._acked)
        if parts.parity is not None:
            parts.parity.report(req, parity, None if self._acked is None else self._acked.parity)
        if parts.bucket is not None:
            # Kept until a coordinator took them: a failed heartbeat (e.g. during a failover) loses none.
            self._backup_reports = (self._backup_reports + parts.bucket.drain_reports())[-BACKUP_REPORTS_KEPT:]
            req.backups.extend(self._backup_reports)
        # Shown by `mtc status`: the last restore, and in Orbax mode the last handshake (each sent once).
        records = host_protocol.LastRecords(parts.metrics.last_restore, parts.metrics.last_handshake)
        host_protocol.attach_last_records(req, records, self._records_taken, self._acked)
        t_send = time.monotonic()
        resp = self._send(req)
        round_trip = time.monotonic() - t_send
        faults.point("heartbeat.after_response")
        self._backup_reports = []
        self._records_taken = records
        self._acked = host_protocol.acknowledged(resp, digest, current, parity)
        if self._acked is None:
            parts.wakeup.ring()  # the coordinator has no picture of this host (restart, failover): report all now
        if not self._accept_epoch(resp.epoch):
            return self.interval
        self.interval = max(0.05, resp.heartbeat_interval_ms / 1000.0 or self.opts.heartbeat_seconds)
        self.newest_complete = resp.newest_complete_step
        parts.metrics.newest_complete_step = resp.newest_complete_step
        if parts.preemption.coordinator_says(resp.preemption_noticed):
            if resp.preemption_noticed:
                log.warning("the coordinator reports a preemption notice")
            else:
                log.info("the coordinator reports the job's preemption notice over (the preempted hosts were "
                         "replaced or lost)")
        self._act(resp, t_send, round_trip)
        # Jittered so that hosts started together do not report in lockstep.
        return self.interval * retry.JITTER.uniform(0.9, 1.1)

    def _accept_epoch(self, epoch: int) -> bool:
        """Follow the answering coordinator's ``epoch`` (:func:`host_protocol.accept_epoch`); False: a deposed
        one's answer, to be ignored. Steps this host's own candidate down when the verdict says so."""
        own = self.parts.coordinator
        verdict = host_protocol.accept_epoch(self.epoch, epoch, own.epoch if own is not None and own.active else None)
        if not verdict.accept:
            log.warning("ignoring the answer of a deposed coordinator (epoch %d < %d)", epoch, self.epoch)
            return False
        self.epoch = verdict.epoch
        if verdict.step_down and own is not None:
            own.deactivate(f"this host accepted epoch {epoch} of another candidate")
        return True

    def _act(self, resp: cpb.HeartbeatResponse, sent_at: float | None = None, round_trip: float = 0.0) -> None:
        """Do the answer's work (:func:`host_protocol.work`): deletions now, copies, a restore and a backup share
        as tasks (``sent_at``, ``round_trip``: the heartbeat's, the plan phase of a restore it carries)."""
        parts = self.parts
        store, tasks, counters = parts.store, parts.tasks, parts.metrics.counters
        todo = host_protocol.work(resp, self.me.rank, self._restoring, tasks.in_flight())
        self._restoring = todo.restoring
        for d in todo.deletions:
            faults.point("gc.before_delete")
            if store.delete(d.owner_rank, d.step, content_hash=d.content_hash):
                counters.add("deletions")
        if self._acked is not None:  # (else the coordinator has no picture of this host and asked for nothing)
            # Before the copies are queued: a queued copy this answer no longer asks for is skipped.
            tasks.asked("copy", [(c.task.owner_rank, c.task.step) for c in todo.copies
                                 if isinstance(c, host_protocol.Copy)])
        for c in todo.copies:
            if isinstance(c, host_protocol.Attest):
                if store.attest_replica(c.owner_rank, c.step, c.content_hash, coming=c.coming) and not c.coming:
                    counters.add("hash_only")
                    parts.wakeup.ring()  # report it now (one recorded ahead is reported when its copy lands)
            elif isinstance(c, host_protocol.Copy) and not store.has(c.task.owner_rank, c.task.step,
                                                                     c.task.content_hash):
                tasks.submit("copy", c.task.owner_rank, c.task.step, parts.fetcher.copy, c.task)
        if todo.restore is not None:
            tasks.submit("restore", self.me.rank, todo.restore.step, self._restore, todo.restore, sent_at, round_trip)
        if parts.parity is not None:
            parts.parity.act(resp)  # parity deletions now, parity tasks queued like copies
        if todo.backup is not None and parts.bucket is not None:
            # Emergency backup (preempting): its own thread at normal priority, not the idle-priority pool.
            tasks.submit("backup", -1, todo.backup.step, parts.bucket.run_task, todo.backup, store,
                         urgent=parts.preemption.preempting)

    def _note_saves(self, inv: list[Any]) -> None:
        """Count and log each own step that appeared on the RAM disk since the last heartbeat."""
        rank, counters = self.me.rank, self.parts.metrics.counters
        own = {h.step: h.size for h in inv if h.owner_rank == rank and Tier(h.tier) is Tier.LOCAL}
        if self._seen_own is None:  # at start: what is already there was saved by an earlier incarnation
            self._seen_own = set(own)
            return
        restored = self.parts.fetcher.restored_among(set(own))
        for step in sorted(set(own) - self._seen_own - restored):
            counters.add("saves")
            counters.add("save_bytes", own[step])
            log.info("save: rank %d committed step %d on the RAM disk: %d bytes", rank, step, own[step])
        self._seen_own = set(own)

    # ------------------------------------------------------------------ the loop
    def retry_delay(self, failures: int, error: BaseException) -> float:
        """Seconds until the next heartbeat after ``failures`` consecutive failed ones, the last ``error``.

        Never sooner than the interval, growing with jitter: no retry storm on a struggling coordinator.
        Never longer than a third of the time after which the coordinator declares a silent host lost: a
        host that backs off for longer is declared lost although it is alive (its data re-planned around,
        its restores waited for), which costs the job more than its retries cost the coordinator.
        """
        if not self._answered and failures <= STARTUP_RETRIES and _unreachable(error):
            # Starting together with the coordinator's host (a job restart, an Orbax handshake): it is
            # likely up in milliseconds; waiting the interval would delay this host's first report (and so
            # a restore plan) by seconds. A few quick tries, then the backoff.
            quick = STARTUP_RETRY_SECONDS if failures <= STARTUP_FAST_RETRIES else STARTUP_RETRY_MAX_SECONDS
            return quick * retry.JITTER.uniform(0.8, 1.2)
        if self.me.my_candidate is not None and isinstance(error, NoCoordinator):
            # A candidate watching for a takeover keeps the plain interval.
            return self.interval * retry.JITTER.uniform(0.8, 1.2)
        cap = lost_after_seconds(self.opts.host_lost_seconds, self.interval) / 3
        return max(self.interval, min(retry.backoff_seconds(failures, self.interval), cap))

    def run(self) -> None:
        """Heartbeat until the daemon stops; failures back off (never sooner than the interval)."""
        me, parts = self.me, self.parts
        failures = 0
        while not parts.stopping.is_set():
            try:
                delay = self.beat()
                failures = 0
                self._answered = True
            except (grpc.RpcError, NoCoordinator) as e:
                failures += 1
                parts.metrics.counters.add("heartbeat_failures")
                if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Our incarnation was superseded (a report under our rank registered after us, e.g.
                    # a forged one or a brief double start): take a new one and report everything again,
                    # so no other process can lock this host out.
                    self.incarnation = new_incarnation()
                    self._acked = None
                    logs.set_context(job=me.job, rank=me.rank, incarnation=self.incarnation)
                if failures % 10 == 1:
                    log.warning("heartbeat to the coordinator failed: %s",
                                e.details() if isinstance(e, grpc.RpcError) else e)
                delay = self.retry_delay(failures, e)
            except Exception:  # keep the daemon alive; the next heartbeat retries
                log.exception("heartbeat handling failed")
                delay = self.interval
            parts.wakeup.wait(delay)
