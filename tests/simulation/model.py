"""Deterministic simulation of the control plane: the real coordinator and planner, modelled hosts, one seed.

One schedule = one seed. Everything random comes from ``random.Random(seed)``, time is a virtual clock
injected into the real :class:`replicator.coordinator.service.Coordinator` and the real
:class:`replicator.backup.scheduler.BucketScheduler` (whose bucket is :class:`tests.simulation.bucket.BucketModel`),
and events run from one priority queue ordered by (virtual time, sequence number): the same seed gives the
same schedule, the same RPCs and the same answers, so a failing seed replays exactly.

The hosts' rules are the product's: what a host reports, which epoch and coordinator it accepts and what it does
with an answer are decided by :mod:`replicator.host_protocol`, as in the daemon's heartbeat; a host here keeps only
its simulated I/O (RAM disk, task pool, network). Modelled (as the daemon, ``replicator/daemon.py``, does it):

- hosts: RAM disk = a dict of pieces (own ``local`` data, ``peer`` copies) and ``replica`` attestations,
  reported while bytes of their content are here and dropped with the last of them; numbered heartbeats with the inventory digest and deltas against the last
  acknowledged inventory, a full report when the coordinator has no picture; backup reports kept until a
  heartbeat is answered; the answer's copies (byte copies fetched from the source host when they finish,
  hash-only ones recorded at once if bytes of that content are here or a copy of them is in the answer), deletions (skipped while a task of that
  piece runs; a whole answer of a lower epoch than the host accepted is ignored), restores (sources tried in
  order; a replica's data is stored under its owner's name, as a peer copy) and backup shares (the upload
  reads the piece from the RAM disk when it runs; a missing piece fails like ``FileNotFoundError``);
- a trainer saving a step every few seconds on every host (each host commits at its own moment), that
  restarts and restores (``PrepareRestore``) when a host of the job is lost;
- faults: a host or a whole slice replaced with an empty RAM disk (down for a while), the coordinator
  replaced by a new instance of a higher epoch rebuilt from heartbeats (crashed, or deposed while some hosts
  still talk to it), the coordinator's host replaced (both), a replicator restarted with its RAM disk
  (new incarnation, in-flight tasks lost), heartbeats lost before or after the coordinator handled them,
  delayed answers, slow and failing uploads;
- the network (in most schedules; :mod:`tests.simulation.network`): two coordinator candidates picked as the
  heartbeat client picks them, per-message loss, duplicated heartbeats and answers, reordering, partitions.

- erasure coding in about 3 schedules in 10 (:mod:`tests.simulation.parity`): parity holdings, ParityTasks,
  PARITY deletions, rebuilds from the code group, and the ec faults.

Faults come in bursts with lulls between them that let a step become durable, and after the fault window the
schedule runs quiet (no faults, saves stop) until the job has settled, so that liveness can be checked
(:mod:`tests.simulation.phases`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from typing import Any

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator import host_protocol
from replicator.backup.scheduler import BucketScheduler
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding, Tier, inventory_digest
from tests.simulation.bucket import BucketModel
from tests.simulation.network import Network, Partition
from tests.simulation.parity import EC_EXTRA_QUIET_SECONDS, EcConfig, ParityKey, ParityModel, source_spec
from tests.simulation.parity import report as report_parity
from tests.simulation.phases import POLL_SECONDS, Phases

JOB = "sim"
SIZE = 1 << 20
EPOCH_CLOCK_START_NS = 1_700_000_000 * 10**9  # the candidates' time_ns() at virtual time 0
EPOCH_SKEW_SECONDS = 5.0  # how far behind a candidate's clock may be


class Aborted(Exception):
    """What ``context.abort`` raises: a gRPC error status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code


class Ctx:
    """The servicer context of an in-process call (as bench/scale.py does)."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float:
        return 30.0

    def set_trailing_metadata(self, md: Any) -> None:
        return None


class _Ran:
    """A thread whose work already ran (see :class:`SimScheduler`)."""

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        return None


class SimScheduler(BucketScheduler):
    """The real scheduler, its bucket work run in place instead of in a thread: the model's bucket is instant,
    so the work is done when the scheduler next looks, as the simulation waited for it before (a thread's start
    and join cost ~5% of a schedule)."""

    def _spawn(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
        target(*args)
        return _Ran()


class Clock:
    """The virtual clock every party reads."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Config:
    """The shape of one schedule (drawn from the seed)."""

    nodes: int
    slices: int
    identical: bool  # data-parallel replicas hold byte-identical data (the usual case)
    bucket: bool
    fault_seconds: float
    quiet_seconds: float
    save_every: float
    fault_every: float
    p_request_lost: float
    p_answer_lost: float
    p_answer_delayed: float
    p_upload_fails: float
    slow_uploads: bool

    @classmethod
    def draw(cls, rng: random.Random) -> Config:
        nodes = 6 if rng.random() < 0.15 else 4
        return cls(
            nodes=nodes, slices=2, identical=rng.random() < 0.85, bucket=rng.random() < 0.85,
            fault_seconds=rng.uniform(8.0, 16.0), quiet_seconds=16.0, save_every=rng.uniform(1.5, 4.0),
            fault_every=rng.uniform(2.0, 6.0), p_request_lost=rng.choice([0.0, 0.05]),
            p_answer_lost=rng.choice([0.0, 0.05]), p_answer_delayed=rng.choice([0.0, 0.1]),
            p_upload_fails=rng.choice([0.0, 0.0, 0.2]), slow_uploads=rng.random() < 0.3,
        )


class Host:
    """One host's replicator process and RAM disk."""

    def __init__(self, rank: int, incarnation: int):
        self.rank = rank
        self.incarnation = incarnation
        self.up = True
        self.disk: dict[tuple[int, int], Holding] = {}  # the bytes: own (local) data and peer copies
        # (owner, step) -> content hash: replica attestations (``replica-of.json``), reported while bytes of
        # that content are on the disk.
        self.attested: dict[tuple[int, int], str] = {}
        self.acked: host_protocol.Acked | None = None  # the last report the coordinator acknowledged
        self.parity: dict[ParityKey, Holding] = {}  # erasure coding (tests/simulation/parity.py)
        self.epoch = 0
        self.in_flight: set[tuple[str, int, int]] = set()
        self.restoring: dict[int, frozenset[str]] = {}  # step -> content hashes its running restore brings
        self.not_before: dict[tuple[str, int, int], float] = {}
        self.backup_reports: list[pb.BackupReport] = []
        self.waiting = False  # a heartbeat is out (the daemon sends one at a time)
        self.lower_down_since: float | None = None  # a candidate's host: since when no lower candidate answers
        self.coordinator: Coordinator | None = None  # whom it talks to (None: the newest)
        # The coordinator that took this process's newest report (its inventory counts there), and whether that
        # picture is still its newest (a duplicated older report taken by a restarted coordinator is not):
        # ``invariants.check_after_event`` judges a coordinator only on what its hosts last told it.
        self.reported_to: Coordinator | None = None
        self.reported_current = True
        self.reported_inv: dict[tuple[int, int], Holding] = {}  # what that report said it holds
        self.report_seq = 0  # numbers its reports (HeartbeatRequest.report_seq), as Heartbeat.beat does
        # Bumped by every change of ``disk`` or ``attested`` (go through put/delete/attest): the inventory,
        # its digest and the newest own step are computed once per change, not once per heartbeat.
        self.version = 0
        self._inventory: tuple[int, dict, list, str, int] | None = None

    def own(self, step: int) -> Holding | None:
        h = self.disk.get((self.rank, step))
        return h if h is not None and h.tier is Tier.LOCAL else None

    def bytes_of(self, owner: int, step: int) -> Holding | None:
        return self.disk.get((owner, step))

    def put(self, holding: Holding) -> None:
        """Bytes land on the RAM disk (a commit, a copy, a restore)."""
        self.disk[holding.key] = holding
        self.version += 1

    def inventory(self) -> tuple[dict[tuple[int, int], Holding], list[Holding], str, int]:
        """(:meth:`holdings`, its values, their digest, the newest own step or -1), as of the last change."""
        if self._inventory is None or self._inventory[0] != self.version:
            current = self.holdings()
            inv = list(current.values())
            own = max((s for (o, s), x in self.disk.items() if o == self.rank and x.tier is Tier.LOCAL),
                      default=-1)
            digest = inventory_digest([*inv, *self.parity.values()] if self.parity else inv)
            self._inventory = (self.version, current, inv, digest, own)
        return self._inventory[1:]

    def delete(self, owner: int, step: int) -> None:
        """Delete the piece the coordinator named (bytes or an attestation); an attestation also goes with
        the last bytes of its content here (``RamDiskStore.delete``)."""
        self.version += 1
        self.disk.pop((owner, step), None)
        self.attested.pop((owner, step), None)
        left = {x.content_hash for x in self.disk.values() if x.step == step}
        for k in [k for k, ch in self.attested.items() if k[1] == step and ch not in left]:
            del self.attested[k]

    def attest(self, owner: int, step: int, content_hash: str, coming: bool) -> None:
        """A hash-only task: record that ``owner``'s data of ``step`` is bytes held here (the own step, or a
        copy of another replica's identical data: a witness), or coming here (a copy in the same answer),
        as the daemon does (``RamDiskStore.attest_replica``)."""
        if coming or any(x.step == step and x.content_hash == content_hash for x in self.disk.values()):
            self.attested[(owner, step)] = content_hash
            self.version += 1

    def holdings(self) -> dict[tuple[int, int], Holding]:
        """What the daemon's inventory reports: the bytes, and each attestation whose content is here."""
        out = dict(self.disk)
        for (owner, step), ch in self.attested.items():
            if (owner, step) not in out:
                x = next((x for x in self.disk.values() if x.step == step and x.content_hash == ch), None)
                if x is not None:
                    out[(owner, step)] = Holding(owner, step, ch, 0, Tier.REPLICA, x.generation)
        return out

    def attest_restored(self, step: int, content_hash: str, generation: int) -> None:
        """The own rank's data of ``step`` is a replica's bytes held here (a restore from them): record it
        as a self-attestation, as the daemon does (``RamDiskStore.attest_restored``)."""
        if self.own(step) is None:
            self.attested[(self.rank, step)] = content_hash
            self.version += 1

    def busy(self, owner: int, step: int) -> bool:
        return host_protocol.busy(self.in_flight, owner, step)


class Sim:
    """One schedule. :meth:`run` returns the violations found: invariant -> its first violation (empty = held)."""

    def __init__(self, seed: int, *, config: Config | None = None, keep_trace: bool = True,
                 network: bool | None = None, ec: bool | None = None, calm: bool | None = None):
        self.seed = seed
        self.rng = random.Random(seed)
        self.cfg = config or Config.draw(self.rng)
        self.net = Network(seed, network)  # network=False: the schedule as before the network was modelled
        self.clock = Clock()
        self.topo = JobTopology(self.cfg.nodes, self.cfg.slices, 1)
        # Erasure coding in a share of the schedules (drawn apart: ec=False is the schedule as before it was
        # modelled), on hosts whose data differ, with a quiet phase long enough for a ParityTask's retry.
        ec_cfg = EcConfig.draw(seed, ec)
        self.ec: ParityModel | None = None
        if ec_cfg.on:
            # Faults a little rarer and the window longer: a step's parity takes a while (every member commits,
            # reports, then computes), and the faults that matter most hit a step that has it.
            cfg = self.cfg
            self.cfg = dataclasses.replace(cfg, identical=False, fault_every=cfg.fault_every * 1.5,
                                           fault_seconds=cfg.fault_seconds + 4.0,
                                           quiet_seconds=cfg.quiet_seconds + EC_EXTRA_QUIET_SECONDS)
            self.ec = ParityModel(self, ec_cfg)
        # Lulls between bursts of faults, the quiet phase's end once settled (calm=False: as before them).
        self.phases = Phases(seed, calm)
        self.fault_end = self.cfg.fault_seconds  # the fault window's end
        self.settled_at: float | None = None  # the quiet phase ended early, the job settled (phases.py)
        self.durable_ever = False  # some step was durable at some point (the output's durable_fraction)
        self.keep_local = 2
        self.heartbeat_seconds = 1.0
        self.bucket = BucketModel(self.cfg.nodes, self.clock) if self.cfg.bucket else None
        self.epoch = 1
        # With the network on: the coordinator candidates (None: its host is down) and their hosts' ranks.
        self.cand_rank = [0, self.topo.hosts_per_slice]
        self.coord = self._new_coordinator(1, candidate=0 if self.net.cfg.on else None)
        self.deposed: list[Coordinator] = []
        self.cands: list[Coordinator | None] = []
        if self.net.cfg.on:
            self.cands = [self.coord, self._new_coordinator(0, active=False, candidate=1)]
        self.disk_changed = False  # an answer deleted a piece since the last check (invariants.py)
        self.accepted: dict[tuple[int, int], int] = {}  # (rank, incarnation) -> highest epoch it accepted
        self.hosts = [Host(r, self._nonce()) for r in range(self.cfg.nodes)]
        # rank -> the incarnations that ran on its RAM disk since it was last wiped (invariants.wiped_unheard)
        self.disk_incarnations: dict[int, set[int]] = {h.rank: {h.incarnation} for h in self.hosts}
        self.queue: list[tuple[float, int, str, tuple]] = []
        self.seq = itertools.count()
        self.trace: list[str] = []
        self.keep_trace = keep_trace
        self.events = 0
        self.violations: dict[str, str] = {}  # invariant -> the first violation of it
        self.violation_events: dict[str, int] = {}  # invariant -> how many events ran until it
        # Trainer.
        self.next_step = 1
        self.training = True
        self.restoring_since: float | None = None
        self.restore_step: int | None = None  # pinned by the trainer's PrepareRestore
        self.restore_by: tuple[Coordinator, int] | None = None  # ... on this coordinator, of this epoch
        self.restore_asked: tuple[Coordinator, float] | None = None  # to whom and when PrepareRestore was sent
        self.restored: list[int] = []
        # Facts the invariants track (see tests/simulation/invariants.py).
        self.saved_steps: set[int] = set()
        self.max_complete_seen: int | None = None
        self.max_durable_seen: int | None = None
        self.durable_checked: tuple[int, int] | None = None
        self.newest_reported: int | None = None
        self.last_version: tuple[int, int] | None = None
        self.facts_seen: tuple[int, int] | None = None  # the coordinator's facts the invariants last looked at
        self.plan_checks = 0
        self.last_plan_check = self.last_durable_check = -1.0
        self.incomplete_seen = 0
        self._contents: dict[tuple[int, int], str] = {}  # (rank, step) -> content(rank, step)
        from tests.simulation import invariants
        self.inv = invariants
        for h in self.hosts:
            self._at(self.rng.uniform(0.0, 1.0), "beat", (h.rank, h.incarnation))
        self._at(self.cfg.save_every, "save", ())
        self._at(*self.phases.start(self), ())

    # ------------------------------------------------------------------ plumbing
    def _nonce(self) -> int:
        return self.rng.randrange(1, 1 << 62)

    def _new_coordinator(self, epoch: int, *, active: bool = True, candidate: int | None = None) -> Coordinator:
        """``candidate``: its index among the candidates (as the daemon passes it; epochs end in it)."""
        factory: Callable[[], Any] | None = None
        if self.bucket is not None:
            bucket = self.bucket

            def factory() -> BucketScheduler:
                return SimScheduler(bucket, self.topo, interval_steps=1, keep=3, clock=self.clock)  # type: ignore[arg-type]
        return Coordinator(self.topo, JOB, keep_local=2, heartbeat_seconds=self.heartbeat_seconds,
                           backup_factory=factory, clock=self.clock, host_lost_seconds=4.0, epoch=epoch,
                           active=active, other_candidates=self.net.cfg.on, candidate=candidate,
                           redundancy=self.ec.redundancy if self.ec is not None else None,
                           lower_candidates=self.cand_rank[:candidate] if candidate is not None else ())

    def _at(self, t: float, kind: str, args: tuple) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), kind, args))

    def note(self, msg: str) -> None:
        if self.keep_trace:
            self.trace.append(f"{self.clock.now:8.3f} {msg}")

    def host(self, rank: int, incarnation: int) -> Host | None:
        """The host if it still is that incarnation and up (else the event belongs to a dead process)."""
        h = self.hosts[rank]
        return h if h.incarnation == incarnation and h.up else None

    @property
    def faulty(self) -> bool:
        return self.clock.now < self.fault_end

    def content(self, rank: int, step: int) -> str:
        """The true content hash of ``rank``'s data of ``step`` (replicas identical unless configured not)."""
        key = (rank, step)
        found = self._contents.get(key)
        if found is None:  # asked ~400 times per schedule by the invariants: formatted once per piece
            who = rank % self.topo.hosts_per_slice if self.cfg.identical else rank
            found = self._contents[key] = f"{step:04d}.{who:04d}"
        return found

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict[str, str]:
        quiet = self.cfg.quiet_seconds
        queue, clock, check = self.queue, self.clock, self.inv.check_after_event
        handlers: dict[str, Callable[..., None]] = {}  # kind -> its bound _ev_ method (looked up once)
        while queue and self.settled_at is None:
            t, _, kind, args = heapq.heappop(queue)
            if t > self.fault_end + quiet:  # read each time: a lull moves the window's end on
                break
            clock.now = t
            self.events += 1
            handler = handlers.get(kind)
            if handler is None:
                handler = handlers[kind] = getattr(self, "_ev_" + kind)
            handler(*args)
            if self.cands:
                self._refresh_serving()
            check(self, kind)
        if self.settled_at is None:
            self.clock.now = self.fault_end + quiet
        self.inv.check_at_end(self)
        return self.violations

    # ------------------------------------------------------------------ heartbeats
    def _ev_beat(self, rank: int, inc: int) -> None:
        h = self.host(rank, inc)
        if h is None or h.waiting:
            return
        if self.cands:
            self._beat_candidates(h)
            return
        coord = h.coordinator if h.coordinator is not None and h.coordinator.active else self.coord
        if coord is not self.coord and self.rng.random() < 0.5:
            coord = self.coord  # tries the candidates in order; the newest answers
        h.coordinator = coord
        req, digest, current = self._request(h)
        h.waiting = True
        if self.faulty and self.rng.random() < self.cfg.p_request_lost:
            self.note(f"beat {rank} lost on the way")
            self._at(self.clock.now + 2.0, "timeout", (rank, inc))
            return
        try:
            resp = coord.Heartbeat(req, Ctx())
        except Aborted as e:
            self._beat_failed(h, coord, e)
            return
        if resp.acked_digest:  # the report was taken: its inventory counts at this coordinator
            h.reported_to, h.reported_current, h.reported_inv = coord, True, current[0]
        if self.keep_trace:
            self.note(f"beat {rank} -> e{coord.epoch}: {_summary(resp)}")
        if resp.HasField("backup"):
            self.inv.check_backup_task(self, coord, rank, resp.backup)
        if self.faulty and self.rng.random() < self.cfg.p_answer_lost:
            self.note(f"answer to {rank} lost")
            self._at(self.clock.now + 2.0, "timeout", (rank, inc))
            return
        delay = self.rng.uniform(0.5, 2.5) if self.faulty and self.rng.random() < self.cfg.p_answer_delayed else 0.0
        ordered = self.inv.protected_at_order(self, coord, resp)
        self._at(self.clock.now + delay, "answer", (rank, inc, resp, digest, current, coord, ordered))

    def _beat_failed(self, h: Host, coord: Coordinator, e: Aborted) -> None:
        """A heartbeat's error other than a failover one: as ``Heartbeat.run`` handles it."""
        self.note(f"beat {h.rank} -> e{coord.epoch}: {e}")
        h.waiting = False
        if e.code is grpc.StatusCode.FAILED_PRECONDITION:  # a superseded incarnation: take a new one
            self._restart_replicator(h.rank, keep_disk=True, why="stale incarnation")
            return
        if e.code is grpc.StatusCode.UNAVAILABLE:
            h.coordinator = None
        self._at(self.clock.now + self.heartbeat_seconds, "beat", (h.rank, h.incarnation))

    def _request(self, h: Host) -> tuple[pb.HeartbeatRequest, str, tuple[dict, dict]]:
        """The heartbeat as ``Heartbeat.beat`` builds it (:func:`replicator.host_protocol.request`)."""
        rank = h.rank
        h.report_seq += 1
        current, _, digest, newest_own = h.inventory()
        report = host_protocol.Report(job=JOB, rank=rank, incarnation=h.incarnation, address=f"sim:{rank}",
                                      report_seq=h.report_seq, known_epoch=h.epoch, newest_saved_step=newest_own)
        req = host_protocol.request(report, current, digest, h.acked)
        acked_parity = h.acked.parity if h.acked is not None else None
        if h.parity or acked_parity:
            report_parity(req, rank, h.parity, acked_parity)
        req.backups.extend(h.backup_reports)
        return req, digest, (current, h.parity)  # what was reported (h.parity is replaced on change)

    # ------------------------------------------------------------------ the network (tests/simulation/network.py)
    def _beat_candidates(self, h: Host) -> None:
        """One heartbeat as ``Heartbeat._send`` sends it: the lowest-ranked candidate that answers; a host's own
        candidate takes over once every lower one has been silent long enough."""
        req, digest, current = self._request(h)
        now, net, faulty = self.clock.now, self.net, self.faulty
        mine = self.cand_rank.index(h.rank) if h.rank in self.cand_rank else None
        last = "no candidate"
        waiting = None
        for i, c in enumerate(self.cands):
            if i == mine and c is not None and not c.active:
                turn = host_protocol.takeover(h.lower_down_since, now, c.takeover_after())
                h.lower_down_since = turn.lower_down_since
                if not turn.now:
                    waiting = f"{last}; waiting to take over"
                    continue  # meanwhile a higher candidate that serves hears this host (seed 70347)
                c.activate(host_protocol.takeover_epoch(self._epoch_clock(), h.epoch),
                           lower_silent_seconds=turn.silent_seconds(now))
                self.note(f"FAILOVER rank {h.rank}: no lower candidate answers, candidate {i} takes over "
                          f"(epoch {c.epoch})")
            if c is None or not net.reaches(h.rank, i, self.cand_rank[i], now):
                last = f"candidate {i} unreachable"
                continue  # DEADLINE_EXCEEDED: the next candidate
            if faulty and net.chance(net.cfg.p_request_lost):
                last = f"beat lost on the way to candidate {i}"
                continue
            try:
                resp = c.Heartbeat(req, Ctx())
            except Aborted as e:
                if e.code is grpc.StatusCode.UNAVAILABLE:
                    last = f"candidate {i}: {e}"
                    continue
                self._beat_failed(h, c, e)
                return
            if resp.acked_digest:  # the report was taken: its inventory counts at this candidate
                h.reported_to, h.reported_current, h.reported_inv = c, True, current[0]
            if self.keep_trace:
                self.note(f"beat {h.rank} -> c{i} e{c.epoch}: {_summary(resp)}")
            if resp.HasField("backup"):
                self.inv.check_backup_task(self, c, h.rank, resp.backup)
            if faulty and net.chance(net.cfg.p_request_dup):
                self._at(now + net.rng.uniform(0.0, 2.0), "redeliver", (i, c, req))
            if faulty and net.chance(net.cfg.p_answer_lost):
                last = f"answer of candidate {i} lost"
                continue  # the call times out: the next candidate
            if host_protocol.lower_serves(i, mine):
                h.lower_down_since = None
                own = self.cands[mine]
                if own is not None and own.active:
                    own.deactivate(f"lower candidate {i} serves")
                    self.note(f"rank {h.rank}: candidate {i} answers, candidate {mine} steps down")
            h.waiting = True
            delay = self.rng.uniform(0.5, 2.5) if faulty and self.rng.random() < self.cfg.p_answer_delayed else 0.0
            ordered = self.inv.protected_at_order(self, c, resp)
            self._at(now + delay, "answer", (h.rank, h.incarnation, resp, digest, current, c, ordered))
            if faulty and net.chance(net.cfg.p_answer_dup) and self.keep_trace:
                # The network may deliver the answer's packets twice, but a unary gRPC call yields one answer:
                # the duplicate never reaches the daemon (Heartbeat.beat acts once per call).
                self.note(f"duplicate answer to host {h.rank} dropped by its gRPC stack")
            return
        self.note(f"beat {h.rank}: no coordinator answers ({waiting or last})")
        self._at(now + self.heartbeat_seconds * net.rng.uniform(0.8, 1.2), "beat", (h.rank, h.incarnation))

    def _ev_redeliver(self, i: int, c: Coordinator, req: pb.HeartbeatRequest) -> None:
        """The coordinator handles a heartbeat again (a duplicate, or an old one after newer ones); its answer
        goes nowhere (the host's call has ended)."""
        try:
            resp = c.Heartbeat(req, Ctx())
        except Aborted as e:
            self.note(f"duplicate beat {req.rank} -> c{i} e{c.epoch}: {e}")
            return
        h = self.hosts[req.rank]
        if resp.acked_digest and h.incarnation == req.incarnation:
            # Taken (a restarted candidate has no order of this host's reports yet): its picture there is
            # this older report, not the host's newest.
            h.reported_to, h.reported_current = c, False
        self.note(f"duplicate beat {req.rank} -> c{i} e{c.epoch} handled again: {_summary(resp)}")

    def _epoch_clock(self) -> int:
        """A starting or taking-over candidate's ``time_ns()``: the virtual time in nanoseconds (after a wall
        clock's start), in one case of five behind by up to ``EPOCH_SKEW_SECONDS``.

        Nanoseconds, as the daemon's: a coarser clock (a counter, before) gave two candidates equal epochs
        where real clocks cannot (seed 81300: a restarted candidate 0 and a taking-over candidate 1 whose
        clock was behind both at epoch 2), and equal epochs defeat the fence between them.
        """
        r = self.net.rng.random()  # one draw, as before: the schedules' other draws stay the same
        skew = r / 0.2 * EPOCH_SKEW_SECONDS if r < 0.2 else 0.0
        return EPOCH_CLOCK_START_NS + round((self.clock.now - skew) * 1e9)

    def _refresh_serving(self) -> None:
        """``coord``: the active candidate of the newest epoch (the invariants' view); ``deposed``: the others."""
        active = [c for c in self.cands if c is not None and c.active]
        if active:
            newest = active[0]
            for c in active:  # max(active, key=epoch) without a key function: run after every event
                if c.epoch > newest.epoch:
                    newest = c
            if newest is not self.coord:
                self.coord = newest
                self.last_version = None
                self.epoch = max(self.epoch, newest.epoch)
        self.deposed = [c for c in active if c is not self.coord]

    def _client_coordinator(self) -> Coordinator | None:
        """Whom the trainer's client (on rank 0) asks: the first candidate it reaches that serves."""
        if not self.cands:
            return self.coord
        for i, c in enumerate(self.cands):
            if (c is not None and c.active and self.net.reaches(0, i, self.cand_rank[i], self.clock.now)
                    and not c.isolated()):
                return c
        return None

    def _partition(self) -> None:
        """Hosts cut from the serving candidate for a while (healed when the fault window ends at the latest)."""
        rng, n = self.net.rng, self.cfg.nodes
        s = next((i for i, c in enumerate(self.cands) if c is self.coord), 0)
        other = self.cand_rank[1 - s]
        pool = [r for r in range(n) if r not in self.cand_rank]
        kind = rng.random()
        if kind < 0.6:  # the other candidate's host among them: it takes over, two candidates serve
            ranks = {other, *rng.sample(pool, rng.randrange(len(pool)))}
            what = "split"
        elif kind < 0.8:  # only the candidates cannot reach each other
            ranks = {other}
            what = "candidates cut from each other"
        else:  # hosts cut from the serving candidate; the other candidate stays a standby
            ranks = set(rng.sample(pool, rng.randrange(1, len(pool) + 1)))
            what = "hosts cut off"
        until = min(self.clock.now + rng.uniform(2.0, 10.0), self.fault_end)
        self.net.heal(self.clock.now)
        self.net.partitions.append(Partition(frozenset(ranks), s, until))
        self.note(f"FAULT partition ({what}): hosts {sorted(ranks)} cannot reach candidate {s} "
                  f"until {until:.1f}")

    def _candidate_restarts(self, rank: int, down: bool) -> None:
        """The replicator on a candidate's host restarts (or its host goes down): a new coordinator instance
        (candidate 0 activates at start, as ``Replicator.start`` does; candidate 1 starts a standby)."""
        if not self.cands or rank not in self.cand_rank:
            return
        i = self.cand_rank.index(rank)
        old = self.cands[i]
        if old is not None:
            old.deactivate("its replicator stopped")
        if down:
            self.cands[i] = None
            return
        self.cands[i] = self._new_coordinator(self._epoch_clock() if i == 0 else 0, active=i == 0, candidate=i)
        self.note(f"candidate {i} starts on rank {rank}" + (f" and serves (epoch {self.cands[i].epoch})"
                                                             if i == 0 else " as a standby"))

    def _ev_timeout(self, rank: int, inc: int) -> None:
        h = self.host(rank, inc)
        if h is None:
            return
        h.waiting = False  # the daemon keeps its acknowledged inventory and its backup reports
        self._at(self.clock.now + 0.1, "beat", (rank, inc))

    def _ev_answer(self, rank: int, inc: int, resp: pb.HeartbeatResponse, digest: str,
                   current: tuple[dict, dict], coord: Coordinator, ordered: frozenset[int]) -> None:
        """``ordered``: the steps protected from deletion when ``coord`` answered (invariants.check_deletion)."""
        h = self.host(rank, inc)
        if h is None:
            return
        h.waiting = False
        h.backup_reports = []
        h.acked = host_protocol.acknowledged(resp, digest, *current)
        interval = max(0.05, resp.heartbeat_interval_ms / 1000.0)
        self._at(self.clock.now + (0.05 if h.acked is None else interval * self.rng.uniform(0.9, 1.1)), "beat",
                 (rank, inc))
        mine = self.cand_rank.index(rank) if rank in self.cand_rank else None
        own = self.cands[mine] if mine is not None and self.cands else None
        verdict = host_protocol.accept_epoch(h.epoch, resp.epoch, own.epoch if own is not None and own.active else None)
        if not verdict.accept:
            self.note(f"host {rank} ignores the answer of deposed epoch {resp.epoch} < {h.epoch}")
            return
        h.epoch = verdict.epoch
        if verdict.step_down and own is not None:  # as Heartbeat._accept_epoch (seed 77568)
            own.deactivate(f"this host accepted epoch {resp.epoch} of another candidate")
            self.note(f"rank {rank}: accepted epoch {resp.epoch}, candidate {mine} (epoch {own.epoch}) steps down")
        self._act(h, resp, coord, ordered)

    def _act(self, h: Host, resp: pb.HeartbeatResponse, coord: Coordinator, ordered: frozenset[int]) -> None:
        """The answer's work (:func:`replicator.host_protocol.work`, as ``Heartbeat._act`` does it) on the
        simulated RAM disk and task pool."""
        todo = host_protocol.work(resp, h.rank, h.restoring, h.in_flight)
        h.restoring = todo.restoring
        self.inv.check_order(self, h, resp.epoch, coord)
        for d in todo.deletions:
            held = h.holdings().get((d.owner_rank, d.step))
            if d.content_hash and held is not None and held.content_hash != d.content_hash:
                continue  # another save of the step than the one the coordinator chose: kept (RamDiskStore.delete)
            self.inv.check_deletion(self, h.rank, d.owner_rank, d.step, coord, ordered)
            h.delete(d.owner_rank, d.step)
            self.disk_changed = True
        for c in todo.copies:
            if isinstance(c, host_protocol.Attest):
                h.attest(c.owner_rank, c.step, c.content_hash, c.coming)
            elif isinstance(c, host_protocol.Copy):
                have = h.bytes_of(c.task.owner_rank, c.task.step)
                if have is None or have.content_hash != c.task.content_hash:  # RamDiskStore.has
                    self._submit(h, "copy", c.task.owner_rank, c.task.step, self.rng.uniform(0.1, 1.5),
                                 (c.task.source_rank, c.task.content_hash))
        if todo.restore is not None:
            srcs = [(s.kind, s.holder_rank, s.owner_rank, s.content_hash, source_spec(s)) for s in todo.restore.sources]
            self._submit(h, "restore", h.rank, todo.restore.step, self.rng.uniform(0.1, 1.5), (srcs,))
        if self.ec is not None:
            self.ec.act(h, resp, coord, ordered)  # parity deletions now, parity tasks queued like copies
        if todo.backup is not None:
            b = todo.backup
            slow = self.faulty and self.cfg.slow_uploads and self.rng.random() < 0.5
            seconds = self.rng.uniform(3.0, 12.0) if slow else self.rng.uniform(0.1, 1.0)
            if slow:
                # A slow bucket is a fault of the window: once it ends, the rest goes at normal speed (one
                # second at most). Drawn as before, so the seeds' streams stay (seed 87623: an upload drawn
                # slow at the window's end ran on 10 s into the quiet phase, holding up the host's share of
                # the next staging, and the liveness check came before the backup of step 2 could commit).
                seconds = min(seconds, self.fault_end - self.clock.now + 1.0)
            self._submit(h, "backup", -1, b.step, seconds,
                         (b.staging, list(b.ranks), list(b.source_owner_ranks) or list(b.ranks)))

    def _submit(self, h: Host, kind: str, owner: int, step: int, seconds: float, args: tuple) -> None:
        key = (kind, owner, step)
        if key in h.in_flight or self.clock.now < h.not_before.get(key, 0.0):
            return
        h.in_flight.add(key)
        self._at(self.clock.now + seconds, "done", (h.rank, h.incarnation, key, args))

    def _ev_done(self, rank: int, inc: int, key: tuple[str, int, int], args: tuple) -> None:
        h = self.host(rank, inc)
        if h is None:
            return
        h.in_flight.discard(key)
        kind, owner, step = key
        ok = getattr(self, "_do_" + kind)(h, owner, step, *args)
        if not ok:
            h.not_before[key] = self.clock.now + 1.0  # the daemon's retry back-off

    def _peer_piece(self, holder: int, owner: int, step: int, content_hash: str) -> Holding | None:
        src = self.hosts[holder]
        if not src.up:
            return None
        x = src.bytes_of(owner, step)
        return x if x is not None and x.content_hash == content_hash else None

    def _do_copy(self, h: Host, owner: int, step: int, source: int, content_hash: str) -> bool:
        x = self._peer_piece(source, owner, step, content_hash)
        if x is None:
            self.note(f"host {h.rank}: copy of rank {owner} step {step} from {source} failed")
            return False
        h.put(Holding(owner, step, content_hash, x.size, Tier.PEER, x.generation))
        self.note(f"host {h.rank}: copied rank {owner} step {step} from {source}")
        return True

    def _holds_data_for(self, h: Host, step: int, content_hash: str) -> bool:
        return any(x.step == step and x.tier is not Tier.REPLICA and x.content_hash == content_hash
                   and x.owner_rank % self.topo.hosts_per_slice == h.rank % self.topo.hosts_per_slice
                   for x in h.disk.values())

    def _ev_ec(self, what: str, rank: int, step: int) -> None:
        assert self.ec is not None
        self.ec.event(what, rank, step)

    def _do_parity(self, h: Host, _owner: int, step: int, spec: Any, incs: tuple) -> bool:
        assert self.ec is not None
        return self.ec.compute(h, step, spec, incs)

    def _do_restore(self, h: Host, _owner: int, step: int, sources: list) -> bool:
        for kind, holder, owner, content_hash, spec in sources:
            if content_hash and self._holds_data_for(h, step, content_hash):
                x = next((x for x in h.disk.values() if x.step == step and x.tier is Tier.PEER
                          and x.content_hash == content_hash), None)
                if x is not None:  # already here as a replica's bytes (a copy task brought them)
                    h.attest_restored(step, content_hash, x.generation)
                return True
            if spec is not None:  # a rebuild from the code group (tests/simulation/parity.py)
                if self.ec is not None and self.ec.rebuild(h, step, owner, spec):
                    return True
                continue
            if holder < 0:  # the bucket (holder_rank -1; independent of how the proto spells the kind)
                if self.bucket is None or not self.bucket.holds(step, owner, content_hash):
                    continue
                size, gen = SIZE, self.bucket.committed[step].generation
            else:
                x = self._peer_piece(holder, owner, step, content_hash)
                if x is None:
                    continue
                size, gen = x.size, x.generation
            tier = Tier.LOCAL if owner == h.rank else Tier.PEER  # a replica's data keeps its owner's name
            h.put(Holding(owner, step, content_hash, size, tier, gen))
            if owner != h.rank:
                h.attest_restored(step, content_hash, gen)
            self.note(f"host {h.rank}: restored step {step} from {kind} {holder} (rank {owner}'s data)")
            return True
        self.note(f"host {h.rank}: restore of step {step} failed")
        return False

    def _do_backup(self, h: Host, _owner: int, step: int, staging: str, ranks: list[int], owners: list[int]) -> bool:
        assert self.bucket is not None
        done, error = [], ""
        for rank, owner in zip(ranks, owners, strict=True):
            x = h.bytes_of(owner, step)
            if x is None:
                error = f"FileNotFoundError: host{h.rank}/local/steps/{step} of rank {owner}"
                break
            if self.faulty and self.rng.random() < self.cfg.p_upload_fails:
                error = "OSError: injected upload failure"
                break
            try:
                self.bucket.upload(staging, rank, x.content_hash, x.generation)
            except FileNotFoundError as e:
                error = f"FileNotFoundError: {e}"
                break
            done.append(rank)
        h.backup_reports.append(pb.BackupReport(step=step, uploaded_ranks=done, error=error, staging=staging))
        self.note(f"host {h.rank}: backup share of step {step} (staging {staging}) ranks {done}"
                  + (f" failed: {error}" if error else ""))
        return not error

    # ------------------------------------------------------------------ trainer
    def _ev_save(self) -> None:
        if self.clock.now < self.phases.saves_until(self):
            self._at(self.clock.now + self.cfg.save_every, "save", ())
        else:
            if self.phases.on:
                self._at(self.clock.now + 1.0, "settle", ())
            return
        if not self.training or not all(h.up for h in self.hosts):
            return
        step = self.next_step
        self.next_step += 1
        self.saved_steps.add(step)
        self.note(f"trainer saves step {step}")
        for h in self.hosts:
            self._at(self.clock.now + self.rng.uniform(0.0, 0.8), "commit", (h.rank, h.incarnation, step))

    def _ev_commit(self, rank: int, inc: int, step: int) -> None:
        h = self.host(rank, inc)
        if h is None:
            return
        h.put(Holding(rank, step, self.content(rank, step), SIZE, Tier.LOCAL))

    def _job_restarts(self, why: str) -> None:
        """A host of the job is gone: the training processes restart and restore."""
        if self.training:
            self.note(f"trainer restarts ({why})")
        self.training = False
        # The job's processes restart: a PrepareRestore in flight ends with them, and the new processes' call
        # starts afresh (``CoordinatorClient.prepare_restore``: one call, whose wait counts from its own start,
        # ``Coordinator._prepare_restore``). Kept, a host replaced between two polls would be judged on its
        # previous incarnation's report (seed 4000).
        self.restore_asked = None
        if self.restoring_since is None:
            self.restoring_since = self.clock.now
            self._at(self.clock.now + 1.0, "restore_poll", ())

    def _ev_restore_poll(self) -> None:
        if self.training:
            return
        self._at(self.clock.now + 1.0, "restore_poll", ())
        if not all(h.up for h in self.hosts):
            self.restore_asked = None
            return  # the job's processes start when every host is back
        coord = self._client_coordinator()
        if coord is None:
            return  # no candidate serves the client: it retries
        if self.restore_asked is None or self.restore_asked[0] is not coord:
            self.restore_asked = (coord, self.clock.now)
        if coord._silent_since(self.restore_asked[1]):
            return  # PrepareRestore first waits for every live host's report made after the request
        if coord.state.reported_count < self.cfg.nodes:
            # The job's processes restore together: the daemon asks only once every host has reported to
            # the serving coordinator (``OrbaxMode._not_registered``: a lost host is waited for, not skipped).
            # Asked before, a coordinator that declared cut-off hosts lost planned an older step on the others'
            # data (seed 44803: step 1 from the bucket while hosts it could not hear held step 3).
            return
        try:
            resp = coord.PrepareRestore(pb.PrepareRestoreRequest(step=-1, wait_seconds=0.0), Ctx())
        except Aborted as e:
            self.note(f"PrepareRestore: {e}")
            return
        self.restore_step = resp.step if resp.step >= 0 else None
        self.restore_by = (coord, coord.epoch)
        if resp.step < 0:
            if self.clock.now - (self.restoring_since or 0.0) > 12.0:
                self.note(f"trainer starts from scratch: {resp.reason}")
                self.inv.check_scratch_start(self)
                self._resume(None)
            return
        if resp.ready:
            self.inv.check_restore(self, resp.step, set(resp.lost_ranks), coord)
            if all(self._holds_data_for(h, resp.step, self.content(h.rank, resp.step)) for h in self.hosts):
                self._resume(resp.step)
            else:  # a host the coordinator declared lost lacks its data: its read fails, the job retries
                self.note(f"restore of step {resp.step} fails on a host declared lost {list(resp.lost_ranks)}")

    def _resume(self, step: int | None) -> None:
        self.note(f"trainer resumes from step {step}")
        if step is not None:
            self.restored.append(step)
        self.training = True
        self.restoring_since = None
        self.restore_step = None
        self.restore_by = None
        self.restore_asked = None

    def _ev_settle(self) -> None:
        """The quiet phase ends once the job settled (:meth:`Phases.settled`); else look again in a second."""
        if self.phases.settled(self):
            self.settled_at = self.clock.now
            self.note("settled: the quiet phase ends")
        else:
            self._at(self.clock.now + 1.0, "settle", ())

    # ------------------------------------------------------------------ faults
    def _ev_lull(self) -> None:
        """A lull looks whether it is over (:meth:`Phases.lull_over`): then the next burst's first fault."""
        wait = self.phases.lull_over(self)
        if wait is None:
            self._at(self.clock.now + POLL_SECONDS, "lull", ())
        else:
            self._at(self.clock.now + wait, "fault", ())

    def _ev_fault(self) -> None:
        if not self.faulty:
            return
        if self.phases.on:  # bursts of faults and lulls between them (tests/simulation/phases.py)
            if self.phases.after_fault(self):
                self._at(self.clock.now + POLL_SECONDS, "lull", ())
            else:
                self._at(self.clock.now + self.rng.expovariate(1.0 / self.cfg.fault_every), "fault", ())
        else:
            self._at(self.clock.now + self.rng.expovariate(1.0 / self.cfg.fault_every), "fault", ())
        if self.cands and self.net.chance(self.net.cfg.p_partition):
            self._partition()
            return
        if self.ec is not None and self.ec.fault():
            return
        r = self.rng.random()
        n = self.cfg.nodes
        if r < 0.30:
            self._replace([self.rng.randrange(n)], "host replaced")
        elif r < 0.42:
            s = self.rng.randrange(self.cfg.slices)
            h = self.topo.hosts_per_slice
            self._replace(list(range(s * h, (s + 1) * h)), f"slice {s} replaced")
        elif r < 0.62:
            self._failover(crash=self.rng.random() < 0.5)
        elif r < 0.70:
            self._failover(crash=True)
            self._replace([0], "coordinator's host replaced")
        else:
            self._restart_replicator(self.rng.randrange(n), keep_disk=True, why="replicator restarted")

    def _replace(self, ranks: list[int], why: str) -> None:
        down = self.rng.uniform(0.5, 8.0)
        self.note(f"FAULT {why}: hosts {ranks} down for {down:.1f}s, RAM disks empty")
        for r in ranks:
            self.disk_incarnations[r] = set()  # filled below: the replacement's incarnation
        self.inv.hosts_wiped(self, ranks)
        for r in ranks:
            old = self.hosts[r]
            new = Host(r, self._nonce())
            new.up = False
            new.epoch = 0
            del old
            self.hosts[r] = new
            self.disk_incarnations[r] = {new.incarnation}
            self._candidate_restarts(r, down=True)
            self._at(self.clock.now + down, "host_up", (r, new.incarnation))
        self._job_restarts(why)

    def _ev_host_up(self, rank: int, inc: int) -> None:
        h = self.hosts[rank]
        if h.incarnation != inc:
            return
        h.up = True
        self.note(f"host {rank} is back (incarnation {inc % 1000})")
        self._candidate_restarts(rank, down=False)
        self._at(self.clock.now + self.rng.uniform(0.0, 0.3), "beat", (rank, inc))

    def _restart_replicator(self, rank: int, *, keep_disk: bool, why: str) -> None:
        old = self.hosts[rank]
        if not old.up:
            return  # a host that is down runs no replicator to restart
        new = Host(rank, self._nonce())
        if keep_disk:
            new.disk, new.attested, new.parity = dict(old.disk), dict(old.attested), old.parity
            self.disk_incarnations[rank].add(new.incarnation)
        else:
            self.disk_incarnations[rank] = {new.incarnation}
        self.hosts[rank] = new
        if why != "stale incarnation":  # that one only takes a new incarnation; the process runs on
            self._candidate_restarts(rank, down=False)
        self.note(f"FAULT {why}: host {rank} incarnation {new.incarnation % 1000}")
        self._at(self.clock.now + self.rng.uniform(0.1, 1.0), "beat", (rank, new.incarnation))

    def _failover(self, *, crash: bool) -> None:
        if self.cands:
            if crash:  # the serving candidate's coordinator restarts
                i = next((i for i, c in enumerate(self.cands) if c is self.coord), 0)
                self.note(f"FAULT coordinator candidate {i} (epoch {self.coord.epoch}) crashes")
                self._candidate_restarts(self.cand_rank[i], down=False)
            else:  # deposed while still answering: the other candidate takes over for the hosts cut from it
                self._partition()
            return
        old = self.coord
        self.epoch = max(self.epoch, old.epoch) + 1
        self.coord = self._new_coordinator(self.epoch)
        self.note(f"FAULT coordinator failover: epoch {old.epoch} -> {self.coord.epoch} "
                  f"({'crashed' if crash else 'deposed, still answering'})")
        if crash:
            old.deactivate("crashed")
        else:
            self.deposed.append(old)
        self.deposed = [c for c in self.deposed if c.active][-2:]
        self.last_version = None


def _summary(resp: pb.HeartbeatResponse) -> str:
    parts = [f"newest {resp.newest_complete_step}"]
    if resp.copies:
        parts.append("copies " + ",".join(f"{c.owner_rank}/{c.step}<-{c.source_rank}" for c in resp.copies))
    if resp.deletions:
        parts.append("del " + ",".join(f"{'parity ' if d.tier == tier_pb2.TIER_PARITY else ''}{d.owner_rank}/{d.step}"
                                       for d in resp.deletions))
    if resp.parity:
        parts.append("parity " + ",".join(str(t.step) for t in resp.parity))
    if resp.HasField("restore"):
        parts.append(f"restore {resp.restore.step} from "
                     + ",".join(f"{s.kind}:{s.holder_rank}/{s.owner_rank}" for s in resp.restore.sources))
    if resp.HasField("backup"):
        parts.append(f"backup {resp.backup.step} {resp.backup.staging} ranks {list(resp.backup.ranks)}")
    if not resp.acked_digest:
        parts.append("no ack")
    return "; ".join(parts)
