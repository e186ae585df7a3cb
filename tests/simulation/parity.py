"""The simulation's erasure coding (``--redundancy ec:K+M``, docs/peer.md "Erasure coding"; issue #35 item 5).

A share of the schedules (drawn from a generator of their own, so the copies schedules stay as they were) run
the job at ``ec:2+1``, ``ec:2+2`` or ``ec:3+1`` with hosts whose data differ (no byte-identical data-parallel
replicas: the case ec is for). Modelled as the daemon does it (``replicator/erasure/duty.py``,
``replicator/heartbeat.py``, ``replicator/fetch.py``):

- a host's parity is keyed (step, group digest) apart from its data, reported as a Holding of tier PARITY
  (owner = the holder, content hash = the digest, with its code group) in full and delta reports, gone parity
  as a ``removed`` Deletion of tier PARITY; the inventory digest covers data and parity;
- a ``ParityTask`` runs on the task pool (single-flight per (kind, rank, step), the same back-off as a copy)
  for a modelled while; it computes the parity only if, when it ends, every member of the task's group is
  the same process that was up when it started and holds its data of the step with the hash the group names
  (``compute_parity`` reads every member over the peer tier and checks their hashes before and after
  encoding); else it fails and writes nothing;
- a Deletion of tier PARITY deletes that parity (of that digest; all of the step's when empty), skipped while
  a task of the step's own data runs (``TaskRunner.busy``), and never the step's data;
- a restore source of tier PARITY rebuilds the host's own data: it succeeds only if, when it runs, each of the
  K rotations the rank gives data to has at least K intact fragments among the members the source names
  (an address in its group): data fragments of members up holding their data with the group's hash, parity
  fragments of members up holding parity of the group's digest. Derived here from the
  :class:`~replicator.erasure.group.GroupLayout` rotations, not from the coordinator's own view;
- faults: a host lost while a ParityTask runs on it or on another member of its group, up to M hosts of a
  code group lost together, bit rot in a parity holding (the holder drops it, as ``ParityStore.record`` does
  for a bad record, and reports it gone), a replicator restarted mid-restore (its rebuild is lost).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.erasure.group import GroupLayout
from replicator.erasure.placement import code_groups
from replicator.erasure.redundancy import Redundancy
from replicator.erasure.wire import CodeGroupSpec
from replicator.tier_wire import holding_to_wire
from replicator.tiers import Holding, Tier

if TYPE_CHECKING:
    from replicator.coordinator.service import Coordinator
    from tests.simulation.model import Host, Sim

ParityKey = tuple[int, str]  # (step, group digest)
# The longest a parity task may be retried after (``PARITY_RETRY_MIN_SECONDS``: a ParityTask whose answer was
# lost goes out again only then) and the work after it: the quiet phase of an ec schedule is this much longer,
# so that the liveness check sees the parity recomputed.
# Seed 18913: a ParityTask that failed was asked again 1 s later, within the host's retry back-off, so the host
# dropped it and the next one came a 20 s retry later: the quiet phase must hold a dropped ask and a retry.
EC_EXTRA_QUIET_SECONDS = 12.0  # a back-off + 20 s retry + a beat + a task - the usual 16 s quiet phase
# Of a ParityTask / a rebuild started in the fault window: that a member is lost while it runs / that the
# rebuilding host's replicator restarts while it runs (the ec faults aimed at a running task).
P_LOST_MID_PARITY = 0.04
P_RESTART_MID_REBUILD = 0.3


@dataclasses.dataclass(frozen=True)
class EcConfig:
    """Whether a schedule runs in ec mode, and its K, M (drawn from the seed, apart from the main draws)."""

    on: bool
    k: int
    m: int
    p_fault: float  # of a fault in the fault window, that it is one of the ec faults below

    @classmethod
    def draw(cls, seed: int, on: bool | None = None) -> EcConfig:
        rng = random.Random(seed * 40503 + 35)
        share = rng.random()
        k, m = rng.choice([(2, 1), (2, 2), (2, 2), (3, 1)])
        return cls(on=share < 0.3 if on is None else on, k=k, m=m, p_fault=rng.choice([0.3, 0.5]))


def put_parity(h: Host, x: Holding) -> None:
    """Parity lands on ``h``'s RAM disk. ``h.parity`` is replaced, never changed in place: a reference to it is
    the snapshot a heartbeat reported (``Sim._request``)."""
    h.parity = {**h.parity, (x.step, x.content_hash): x}
    h.version += 1


def drop_parity(h: Host, step: int, digest: str | None) -> bool:
    """Delete ``h``'s parity of ``step`` (only that of ``digest`` when given); whether any went."""
    keep = {key: x for key, x in h.parity.items() if not (key[0] == step and (not digest or key[1] == digest))}
    if len(keep) == len(h.parity):
        return False
    h.parity = keep
    h.version += 1
    return True


def report(req: pb.HeartbeatRequest, rank: int, held: dict[ParityKey, Holding],
           acked: dict[ParityKey, Holding] | None) -> None:
    """Add to ``req`` the parity new since ``acked`` (all when None) and the parity gone since
    (``ParityDuty.report``)."""
    for key, x in held.items():
        if acked is not None and acked.get(key) == x:
            continue
        holding_to_wire(x, req.holdings.add())
    if acked is not None:
        req.removed.extend(pb.Deletion(owner_rank=rank, step=s, content_hash=d, tier=tier_pb2.TIER_PARITY)
                           for s, d in acked if (s, d) not in held)


def source_spec(s: pb.RestoreSource) -> CodeGroupSpec | None:
    """The code group of a rebuild source (tier PARITY), None for any other source."""
    return CodeGroupSpec.from_proto(s.group) if s.kind == tier_pb2.TIER_PARITY else None


def enough_fragments(layout: GroupLayout, rank: int, data_ok: Callable[[int], bool],
                     parity_ok: Callable[[int], bool]) -> bool:
    """Each of the K rotations ``rank`` gives data to has at least K intact fragments besides ``rank``'s own:
    fragment i < K of a rotation is its holder's data (``data_ok(holder)``), the others its parity
    (``parity_ok(holder)``). What a rebuild needs (``GroupDecoder.stream``: every shard of the rank)."""
    k = layout.k
    for shard in range(k):
        holders = layout.holders(layout.data_rotation(rank, shard))
        intact = sum(1 for i, y in enumerate(holders)
                     if y != rank and (data_ok(y) if i < k else parity_ok(y)))
        if intact < k:
            return False
    return True


class ParityModel:
    """One ec schedule's erasure coding: the hosts' parity work and the ec faults (module docstring)."""

    def __init__(self, sim: Sim, cfg: EcConfig):
        self.sim, self.cfg = sim, cfg
        self.rng = random.Random(sim.seed * 7919 + 35)  # its own draws: the main generator's stay as they were
        self.redundancy = Redundancy.ec(cfg.k, cfg.m)
        topo = sim.topo
        self.groups = code_groups(topo.data_parallelism, topo.hosts_per_slice, cfg.k, cfg.m)
        # (holder, step, digest) of parity dropped by bit rot: its holder's next report tells the coordinator.
        self.rotted: set[tuple[int, int, str]] = set()
        # What the schedule exercised (``run_seeds`` sums them: the suite checks the ec schedules cover parity).
        self.counts: collections.Counter[str] = collections.Counter()

    def group_of(self, rank: int) -> GroupLayout:
        return next(g for g in self.groups if rank in g.members)

    # ------------------------------------------------------------------ a host acting on an answer
    def act(self, h: Host, resp: pb.HeartbeatResponse, coord: Coordinator, ordered: frozenset[int]) -> None:
        """Parity deletions now, a task for each parity asked for and not held (``ParityDuty.act``); ``ordered``:
        the steps protected when ``coord`` answered (``invariants.check_deletion``)."""
        sim = self.sim
        for d in resp.deletions:
            if d.tier != tier_pb2.TIER_PARITY or d.owner_rank != h.rank or h.busy(h.rank, d.step):
                continue
            held = sim.inv.model_holds(sim, d.step)
            if drop_parity(h, d.step, d.content_hash or None):
                sim.note(f"host {h.rank}: deleted its parity of step {d.step}")
                sim.disk_changed = True
                if held:
                    sim.inv.check_parity_deletion(sim, h.rank, d.step, coord, ordered)
        for task in resp.parity:
            spec = CodeGroupSpec.from_proto(task.group)
            spec.layout.position(h.rank)  # the coordinator names this host a member (ValueError otherwise)
            if (task.step, spec.digest()) in h.parity:
                continue
            incs = tuple(sim.hosts[y].incarnation if sim.hosts[y].up else None for y in spec.members)
            sim._submit(h, "parity", h.rank, task.step, self.rng.uniform(0.2, 2.0), (spec, incs))
            if sim.faulty and self.rng.random() < P_LOST_MID_PARITY:
                victim = self.rng.choice(spec.members)
                sim._at(sim.clock.now + self.rng.uniform(0.05, 0.2), "ec", ("lost", victim, task.step))
        if (resp.HasField("restore") and sim.faulty and ("restore", h.rank, resp.restore.step) in h.in_flight
                and any(s.kind == tier_pb2.TIER_PARITY for s in resp.restore.sources)
                and self.rng.random() < P_RESTART_MID_REBUILD):
            sim._at(sim.clock.now + self.rng.uniform(0.02, 0.1), "ec", ("restart", h.rank, resp.restore.step))

    def event(self, what: str, rank: int, step: int) -> None:
        """An ec fault aimed at a task started in the fault window (see :meth:`act`)."""
        sim = self.sim
        if not sim.faulty or not sim.hosts[rank].up:
            return
        if what == "lost":
            sim._replace([rank], f"host {rank} lost while its code group computes parity of step {step}")
            self.counts["fault: member lost mid-parity"] += 1
        else:
            sim._restart_replicator(rank, keep_disk=True, why=f"replicator restarted while it rebuilds step {step}")
            self.counts["fault: restart mid-rebuild"] += 1

    def compute(self, h: Host, step: int, spec: CodeGroupSpec, incs: tuple[int | None, ...]) -> bool:
        """A ParityTask ends: the parity is committed only if every member is the process that was up when
        the task started and holds its data of ``step`` with the group's hash (``compute_parity``)."""
        sim = self.sim
        for y, want, inc in zip(spec.members, spec.content_hashes, incs, strict=True):
            host = sim.hosts[y]
            x = host.bytes_of(y, step)
            if inc is None or not host.up or host.incarnation != inc or x is None or x.content_hash != want:
                self.counts["parity tasks failed"] += 1
                sim.note(f"host {h.rank}: parity of step {step} failed (rank {y}'s data unavailable or changed)")
                return False
        group = dataclasses.replace(spec, addresses=("",) * len(spec.members))
        put_parity(h, Holding(h.rank, step, spec.digest(), max(1, 1048576 * spec.m // spec.k), Tier.PARITY,
                              group=group))
        self.counts["parity tasks done"] += 1
        sim.note(f"host {h.rank}: computed its parity of step {step}")
        return True

    def rebuild(self, h: Host, step: int, owner: int, spec: CodeGroupSpec) -> bool:
        """A restore source of tier PARITY: rebuild ``h``'s own data of ``step`` from the members the source
        names (``rebuild_own``)."""
        sim = self.sim
        if owner != h.rank:
            return False  # rebuilt only on its own host (ParitySource.bring: ValueError, the next source)
        helpers = {y for y, a in zip(spec.members, spec.addresses, strict=True) if a and y != owner}
        ok = enough_fragments(spec.layout, owner, lambda y: y in helpers and self.data_intact(y, step, spec),
                              lambda y: y in helpers and self.parity_intact(y, step, spec.digest()))
        if not ok:
            self.counts["rebuilds failed"] += 1
            sim.note(f"host {h.rank}: rebuild of step {step} from its code group failed (fewer than K intact)")
            return False
        h.put(Holding(owner, step, spec.hash_of(owner), 1048576, Tier.LOCAL))
        self.counts["rebuilds"] += 1
        sim.note(f"host {h.rank}: rebuilt step {step} from its code group (helpers {sorted(helpers)})")
        return True

    def within_m(self, lost: set[int]) -> bool:
        """At most M members of each code group are among ``lost``: what the code survives."""
        return all(len(lost & set(g.members)) <= self.cfg.m for g in self.groups)

    # ------------------------------------------------------------------ the model's truth
    def data_intact(self, y: int, step: int, spec: CodeGroupSpec) -> bool:
        host = self.sim.hosts[y]
        x = host.bytes_of(y, step) if host.up else None
        return x is not None and x.tier is not Tier.REPLICA and x.content_hash == spec.hash_of(y)

    def parity_intact(self, y: int, step: int, digest: str) -> bool:
        host = self.sim.hosts[y]
        return host.up and (step, digest) in host.parity

    def rebuildable(self, step: int, rank: int, want: str) -> bool:
        """``rank``'s data of ``step`` with hash ``want`` can be rebuilt from what the up hosts hold now: some
        parity of its group held of ``step`` names ``want`` for it, and each rotation it gives data to has K
        intact fragments (of any member: what could be read if the coordinator named them all)."""
        layout = self.group_of(rank)
        specs: dict[str, CodeGroupSpec] = {}
        for y in layout.members:
            host = self.sim.hosts[y]
            for (s, digest), x in host.parity.items():
                if s == step and x.group is not None and x.group.hash_of(rank) == want:
                    specs.setdefault(digest, x.group)
        for digest, spec in sorted(specs.items()):
            if spec.layout != layout:
                continue
            if enough_fragments(layout, rank, functools.partial(self.data_intact, step=step, spec=spec),
                                functools.partial(self.parity_intact, step=step, digest=digest)):
                return True
        return False

    # ------------------------------------------------------------------ faults
    def fault(self) -> bool:
        """Maybe inject one of the ec faults (False: none fits now, the schedule's usual faults go on)."""
        if self.rng.random() >= self.cfg.p_fault:
            return False
        sim, rng = self.sim, self.rng
        kind = rng.random()
        if kind < 0.3:  # a host lost while a parity task runs on it or on another member of its group
            running = sorted(h.rank for h in sim.hosts if h.up and any(k[0] == "parity" for k in h.in_flight))
            if not running:
                return False
            members = self.group_of(rng.choice(running)).members
            victim = rng.choice(members)
            sim._replace([victim], f"host {victim} lost while its code group computes parity")
            self.counts["fault: member lost mid-parity"] += 1
        elif kind < 0.5:  # up to M hosts of one code group lost together
            members = rng.choice(self.groups).members
            lost = sorted(rng.sample(members, min(2, self.cfg.m)))
            sim._replace(lost, f"{len(lost)} host(s) of code group {list(members)} lost together")
            self.counts[f"fault: {len(lost)} of a group lost"] += 1
        elif kind < 0.75:  # bit rot in a parity holding: the holder finds its record bad and drops it
            held = [(h.rank, key) for h in sim.hosts if h.up for key in sorted(h.parity)]
            if not held:
                return False
            rank, (step, digest) = rng.choice(held)
            drop_parity(sim.hosts[rank], step, digest)
            self.rotted.add((rank, step, digest))
            sim.note(f"FAULT bit rot: host {rank} drops its corrupt parity of step {step}")
            self.counts["fault: parity bit rot"] += 1
        else:  # a replicator restarted while it restores (a rebuild in flight is lost)
            restoring = sorted(h.rank for h in sim.hosts if h.up and any(k[0] == "restore" for k in h.in_flight))
            if not restoring:
                return False
            sim._restart_replicator(rng.choice(restoring), keep_disk=True, why="replicator restarted mid-restore")
            self.counts["fault: restart mid-restore"] += 1
        return True
