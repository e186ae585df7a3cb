"""The invariants the simulation checks, after every event and at the end of a schedule.

Each has a name (the key of ``Sim.violations``); docs/testing.md says what each means for a user. In ec mode
(tests/simulation/parity.py) the model "holds" a rank's data also when its code group's intact fragments can
rebuild it, and a rebuild source is checked against the fragments the model holds.

After every event (safety):

- ``plan-from-scratch``: the coordinator's incrementally maintained views (completeness, every step's
  sources, copy plans, GC plan, restore plan) equal those of ``CoordinatorState.rebuilt()``.
- ``complete-is-restorable``: every rank of the newest complete step has a source whose content hash is
  the rank's true content, and at least one source is really there: on a host that is up and holds those
  bytes, or committed in the bucket. (A source on a host that died and the coordinator has not yet declared
  lost is excused: it cannot know yet.)
- ``newest-complete-regressed``: once every live host reported, the newest complete step is never older
  than the newest step that was ever *durable* (by the coordinator's own facts it stays complete whichever
  single host is lost) while the model (RAM disks of up hosts, the bucket) still holds every rank's data of
  that step. A step that was complete but not yet durable may be lost with one host: the coordinator
  cannot know a replica's data is identical once the only record of it is gone; so may a durable step
  with several hosts lost together, unless a serving coordinator's facts without them keep it complete
  (:func:`hosts_wiped`). Not checked while a host that is up is declared lost (its heartbeats were lost):
  the coordinator cannot know what it holds until it reports again; nor while a live host's newest report
  went to another coordinator (seed 38544); bytes count once the host's newest report named them (seed 1744).
- ``gc-protected``: no host deletes (on a coordinator's order) a piece of the newest complete step (the
  coordinator's, or the newest durable one if newer), of the step the backup uploads, or of the step pinned
  for a restore, while the model holds it.
- ``restore-older-than-newest`` / ``restore-not-held``: a restore declared ready is of the newest complete
  step (not older than the newest durable one the model still holds) and every host it did not declare
  lost really holds its rank's data of it.

- ``backup-share-held``: a backup share (rank, step) is handed only to a host that, by the coordinator's
  current facts, holds the piece to upload (the share follows the data, not the host's old incarnation).
- ``stale-epoch-order``: no host process acts on an answer of a coordinator of an older epoch than one it
  accepted before (with duplicated, delayed and reordered answers and two candidates serving at once).
- ``backup-run-fenced``: the scheduler never tries to commit a staging a saver did not upload into (an
  upload report of another run, e.g. a deposed coordinator's, must not count).
- ``scratch-beside-backup``: the trainer never starts from scratch while the bucket holds a committed backup
  with every rank's true data (the bucket outlives every host).

At the end of the quiet phase (liveness):

- ``backup-reaches-newest``: the bucket's newest committed backup is the newest complete step.
- ``complete-step-lost``: the newest complete step is not older than the newest step ever durable, if the
  model holds it.
- ``job-resumed``: the trainer is training again (its restore finished).
- ``parity-redundant-again`` (ec mode): the newest complete step has all its parity again.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.planner import CoordinatorState
from replicator.tiers import Tier
from sidecar import saves
from tests.simulation.parity import enough_fragments

if TYPE_CHECKING:
    from replicator.coordinator.service import Coordinator
    from tests.simulation.model import Sim


# The from-scratch comparisons (the costly checks) run on a change of the coordinator's facts, at most this
# often in virtual time (a stale incremental view stays stale until touched, so it is still caught), and
# at every fault.
PLAN_CHECK_SECONDS = 8.0
# Whether the newest complete step became durable (survives any one host's loss): once it has two copies of
# every rank (cheap to ask), then at most this often in virtual time (it rebuilds the state once per host).
# Every 8 s, before, a step durable for a few seconds between two faults was often never seen durable.
DURABLE_CHECK_SECONDS = 1.0


def violate(sim: Sim, name: str, msg: str) -> None:
    if name not in sim.violations:
        sim.violations[name] = f"{name}: {msg} (t={sim.clock.now:.3f}, event {sim.events})"
        sim.violation_events[name] = sim.events
        sim.note(f"VIOLATION {sim.violations[name]}")


def model_holds(sim: Sim, step: int, *, reported: bool = False) -> bool:
    """Every rank's true data of ``step`` is on an up host's RAM disk (its own or a byte-identical
    replica's), committed in the bucket, or (ec mode) can be rebuilt from its code group's intact fragments.
    ``reported``: bytes on a RAM disk count only if the host's newest taken report named them (a coordinator
    cannot count a restore or a copy that landed since: seed 1744, a rebuild reported one beat later)."""
    hps = sim.topo.hosts_per_slice

    def told(h: Any, x: Any) -> bool:
        y = h.reported_inv.get((x.owner_rank, x.step))
        return not reported or (y is not None and y.content_hash == x.content_hash)

    for r in range(sim.cfg.nodes):
        want = sim.content(r, step)
        if sim.bucket is not None and sim.bucket.holds(step, r, want):
            continue
        if not any(h.up and any(x.step == step and x.tier is not Tier.REPLICA and x.content_hash == want
                                and x.owner_rank % hps == r % hps and told(h, x) for x in h.disk.values())
                   for h in sim.hosts) and (sim.ec is None or not sim.ec.rebuildable(step, r, want)):
            return False
    return True


VIEW_NAMES = ("complete", "newest", "sources", "redundant", "copies", "gc", "restore", "parity")


def _views(st: CoordinatorState, keep: int) -> tuple:
    steps = st.known_steps()
    try:
        plan = st.restore_plan(restoring=False)
        restore = (plan.step, dict(plan.sources))
    except ValueError as e:
        restore = str(e)
    parity: tuple = ()
    if st.ec.enabled:  # the erasure-coding views: parity tasks and parity GC per host, rebuildable ranks
        ranks = range(st.topology.nodes)
        parity = ({r: st.ec.tasks_for(r) for r in ranks}, {r: st.ec.gc_for(r, keep) for r in ranks},
                  {s: (st.ec.parity_complete(s), st.ec.rebuild_ranks(s)) for s in steps})
    return (
        st.globally_complete_steps(), st.newest_complete_step(),
        {s: st.sources(s) for s in steps}, {s: st.is_redundant(s) for s in steps},
        {s: st.replication_plan(s) for s in steps}, st.gc_plan(keep), restore, parity,
    )


def from_facts(st: CoordinatorState, without: int | Collection[int] | None = None, *,
               upto: int | None = None) -> CoordinatorState:
    """A new state fed the same facts in a fixed order (rank order, then the bucket) and the same records of
    the coordinator's own orders (deletions in flight, pins, backups running, ParityTasks sent): what it would
    compute from scratch. ``without``: as if that host (or those hosts) had been lost.
    ``upto``: only the facts of steps up to this one (all that ``is_complete(upto)`` depends on: a step's
    coverage is derived from its own facts, whether it is abandoned from older steps' saves)."""
    gone = set() if without is None else {without} if isinstance(without, int) else set(without)
    new = CoordinatorState(st.topology, st.redundancy)
    for r, since in st.lost.items():
        new.forget_host(r, since)
    for r, inc in st.registered.items():
        if r in gone:
            continue
        new.register(r, inc)
        if st.is_reported(r):
            held = st.holdings_of(r) + st.ec.parity_of(r)  # its data and (ec mode) its parity
            new.report_inventory(r, held if upto is None else [h for h in held if h.step <= upto], inc)
    for r in sorted(gone):
        new.forget_host(r, 0.0)
    for step in st.known_steps():
        if upto is not None and step > upto:
            break
        ranks = st.backup_ranks(step)
        if ranks:
            new.report_backup_ranks(step, ranks)
    for r, keys in st.deletions_in_flight().items():
        if r not in gone:
            new.deleting(r, keys)
    for r, steps in st.ec.deletions_in_flight().items():
        if r not in gone:
            new.ec.deleting(r, [s for s in steps if upto is None or s <= upto])
    for step in st.pinned_steps():
        new.pin(step)
    for step in st.ec.asked_steps():  # the ParityTasks it sent: its record, as pins are
        if upto is None or step <= upto:
            new.ec.asked(step)
    for step in st.backups_in_progress():
        new.mark_backup_in_progress(step)
    return new


def check_backup_task(sim: Sim, coord: Coordinator, rank: int, task: pb.BackupTask) -> None:
    """A backup share goes to a host that, by the coordinator's current facts, holds the piece it uploads."""
    st = coord.state
    owners = list(task.source_owner_ranks) or list(task.ranks)
    for r, owner in zip(task.ranks, owners, strict=True):
        h = st.holding(rank, (owner, task.step))
        if h is None or h.tier is Tier.REPLICA:
            violate(sim, "backup-share-held",
                    f"epoch {coord.epoch} hands host {rank} (incarnation {st.registered.get(rank, 0) % 1000}) the "
                    f"upload of rank {r}'s data of step {task.step} from rank {owner}'s directory, which it does "
                    f"not hold (it reported {[x.key for x in st.holdings_of(rank)]})")
            return


# Events that inject faults (``ec``: one aimed at a running erasure-coding task, tests/simulation/parity.py).
_FAULTS = frozenset({"fault", "ec"})
# Events that change no host's RAM disk (an answer does when it deletes: ``Sim.disk_changed``).
_NO_DISK_CHANGE = frozenset({"beat", "redeliver", "timeout", "save", "restore_poll", "settle", "lull"})


def check_after_event(sim: Sim, kind: str) -> None:
    coord = sim.coord
    st = coord.state
    if sim.bucket is not None and len(sim.bucket.incomplete) > sim.incomplete_seen:
        sid, missing = sim.bucket.incomplete[sim.incomplete_seen]
        sim.incomplete_seen = len(sim.bucket.incomplete)
        violate(sim, "backup-run-fenced",
                f"the scheduler committed staging {sid} believing every saver uploaded, but ranks {missing} "
                f"uploaded into another staging (a report of an older run, e.g. a deposed coordinator's, was "
                f"counted)")
    version = (id(coord), st.version)
    if version != sim.last_version and (sim.clock.now - sim.last_plan_check >= PLAN_CHECK_SECONDS
                                        or kind in _FAULTS):
        sim.last_version = version
        sim.last_plan_check = sim.clock.now
        sim.plan_checks += 1
        # Every 16th check against the planner's own rebuilt() (a deep copy: slow), else against a state
        # fed the same facts from scratch.
        scratch_state = st.rebuilt() if sim.plan_checks % 16 == 0 else from_facts(st)
        mine, scratch = _views(st, sim.keep_local), _views(scratch_state, sim.keep_local)
        if mine != scratch:
            diff = [n for n, a, b in zip(VIEW_NAMES, mine, scratch, strict=True) if a != b]
            violate(sim, "plan-from-scratch", f"incremental views differ from a recomputation in {diff}")
    elif version == sim.facts_seen and (kind in _NO_DISK_CHANGE or (kind == "answer" and not sim.disk_changed)):
        return  # neither the hosts' RAM disks nor the coordinator's facts changed
    sim.facts_seen = version
    sim.disk_changed = False
    newest = st.newest_complete_step()
    if newest is not None:
        _check_restorable(sim, newest)
    if not coord._all_reported():
        return
    if newest is not None:
        sim.max_complete_seen = max(sim.max_complete_seen or -1, newest)
        if (newest > (sim.max_durable_seen or -1) and sim.durable_checked != version
                and (sim.clock.now - sim.last_durable_check >= DURABLE_CHECK_SECONDS or kind in _FAULTS)
                and st.is_redundant(newest)):
            sim.durable_checked = version
            sim.last_durable_check = sim.clock.now
            if _durable(sim, newest):
                sim.max_durable_seen = newest
                sim.durable_ever = True
    top = sim.max_durable_seen
    lost = st.lost
    for h in sim.hosts:
        if not h.up:
            continue
        if h.rank in lost:
            return  # a live host whose reports were lost was declared lost: the coordinator cannot know better
        if h.reported_to is not None and (h.reported_to is not coord or not h.reported_current):
            # Its newest report went to another coordinator (or is not the one this one took): this one is
            # judged on what the hosts last told it, once they tell it again (seed 38544: the newest
            # candidate's host was replaced; the next one, which had served the other side of a partition,
            # held host 3's report from before host 3 went over to the newer one).
            return
    if top is not None and (newest is None or newest < top) and model_holds(sim, top, reported=True):
        violate(sim, "newest-complete-regressed",
                f"the newest complete step is {newest} although step {top} survived the loss of any one host "
                f"and the hosts and bucket still hold every rank's data of it")


def wiped_unheard(sim: Sim, st: CoordinatorState) -> set[int]:
    """Hosts whose RAM disk was wiped since the incarnation ``st`` last heard from: its facts of them are
    gone from the world (a replicator restarted with its RAM disk keeps them: its disk is the same)."""
    return {r for r, inc in st.registered.items() if inc not in sim.disk_incarnations[r]}


def _durable(sim: Sim, step: int) -> bool:
    """By the coordinator's own facts, ``step`` stays complete whichever single host is lost. Facts of a
    host wiped since it last reported do not count (seed 81627: a check right after a slice was replaced
    found step 1 durable on the copies the replaced hosts had held)."""
    st = sim.coord.state
    gone = wiped_unheard(sim, st)
    facts = _StepFacts(st, step)
    return all(facts.complete_without(gone | {r}) for r in range(sim.cfg.nodes))


class _StepFacts:
    """``from_facts(st, without=..., upto=step).is_complete(step)`` for many ``without``, cheaply: ``step``'s
    coverage is derived from its own facts only (its holdings, parity, bucket ranks and deletions in flight),
    so a state fed just those gives the same coverage of it; whether it is abandoned depends on the newest
    generation of every older step, taken here from the same hosts' holdings (as ``Facts.is_abandoned``).
    Without it, the durability check fed every step's facts to one new state per host (13 % of a schedule)."""

    def __init__(self, st: CoordinatorState, step: int):
        self.st, self.step = st, step
        self.hosts: list[tuple[int, int, list[Any], dict[int, int]]] = []  # (rank, inc, its step facts, gens)
        for r, inc in st.registered.items():
            held: list[Any] = []
            gens: dict[int, int] = {}
            if st.is_reported(r):
                for h in st.holdings_of(r):
                    if h.step <= step:
                        gens[h.step] = max(gens.get(h.step, h.generation), h.generation)
                        if h.step == step:
                            held.append(h)
                held.extend(h for h in st.ec.parity_of(r) if h.step == step)
            self.hosts.append((r, inc, held, gens))
        self.backup = st.backup_ranks(step)
        self.deleting = {r: [k for k in keys if k[1] == step] for r, keys in st.deletions_in_flight().items()}
        self.ec_deleting = {r: [s for s in steps if s == step] for r, steps in st.ec.deletions_in_flight().items()}

    def complete_without(self, gone: Collection[int]) -> bool:
        st, step = self.st, self.step
        newest: dict[int, int] = {}
        for r, _, _, gens in self.hosts:
            if r not in gone:
                for s, g in gens.items():
                    if g > newest.get(s, -1):
                        newest[s] = g
        if saves.rolled_back(step, newest.get(step, 0), newest.items()):
            return False  # abandoned
        new = CoordinatorState(st.topology, st.redundancy)
        for r, inc, held, _ in self.hosts:
            if r in gone:
                continue
            new.register(r, inc)
            if held:
                new.report_inventory(r, held, inc)
        if self.backup:
            new.report_backup_ranks(step, self.backup)
        for r, keys in self.deleting.items():
            if r not in gone and keys:
                new.deleting(r, keys)
        for r, steps in self.ec_deleting.items():
            if r not in gone and steps:
                new.ec.deleting(r, steps)
        return new.is_complete(step)


def hosts_wiped(sim: Sim, ranks: list[int]) -> None:
    """Hosts ``ranks`` lose their RAM disks at once. Durable means the step survives the loss of any *one*
    host; when more are lost together (a slice), the newest durable step still counts only if, by the facts
    of a coordinator serving now, it stays complete without all of them. Otherwise the only record of some
    rank's identity may go with them (seeds 16536, 61225: rank 3's data of step 1 was known identical to
    rank 0's only to hosts of the replaced slice, the candidate that knew it among them; a partition had kept
    the other candidate from learning it), and no coordinator can prove the step complete again from what
    the surviving hosts report, even if their bytes are the same. The newest step that does stay complete
    by those facts (if any) takes its place: losing that one later is still a violation.

    In ec mode a step that has all its parity (by the serving coordinator's facts) is held to through the loss
    of up to M hosts of each code group together: what ``ec:K+M`` promises. Its data then stays rebuildable
    (``model_holds`` asks the model's fragments, not the coordinator), and newest-complete-regressed and
    complete-step-lost judge it as any durable step."""
    top = sim.max_durable_seen
    if top is None:
        return
    if sim.ec is not None:
        st = sim.coord.state
        if st.ec.parity_complete(top) and sim.ec.within_m(set(ranks) | wiped_unheard(sim, st)):
            sim.note(f"step {top} has all its parity: it stays durable with hosts {ranks} lost (ec)")
            return
    coords = {id(c): c for c in (sim.coord, *sim.deposed, *sim.cands) if c is not None and c.active}
    states = []
    for c in coords.values():
        gone = set(ranks) | wiped_unheard(sim, c.state)
        if len(gone) < 2:
            return  # one host lost: a durable step survives it by definition
        states.append(from_facts(c.state, without=gone))
    kept = max((s for st in states for s in st.globally_complete_steps() if s <= top), default=None)
    if kept != top:
        sim.max_durable_seen = kept
        sim.note(f"step {top} is no longer durable: with hosts {ranks} lost together no coordinator's facts "
                 f"keep it complete (newest that stays complete: {kept})")


def _check_restorable(sim: Sim, step: int) -> None:
    st = sim.coord.state
    for r in st.expected_ranks(step):
        srcs = st.rank_sources(step, r)
        want = sim.content(r, step)
        bad = [s for s in srcs if s.content_hash is not None and s.content_hash != want]
        if bad:
            violate(sim, "complete-is-restorable",
                    f"step {step} rank {r}: source {bad[0]} is not rank {r}'s data ({want})")
            return
        ok = False
        for s in srcs:
            if s.kind is Tier.PARITY:
                ok = _rebuild_source_holds(sim, step, r, s)
            elif s.kind is Tier.BUCKET:
                ok = sim.bucket is not None and sim.bucket.holds(step, r, want)
            else:
                h = sim.hosts[s.holder_rank]
                if not h.up or st.incarnation_of(s.holder_rank) != h.incarnation:
                    ok = True  # the coordinator has not heard yet that this host is gone
                else:
                    x = h.bytes_of(s.owner_rank, step)
                    ok = x is not None and x.content_hash == s.content_hash
            if ok:
                break
        if not ok:
            violate(sim, "complete-is-restorable",
                    f"step {step} is reported complete but no source of rank {r} holds its data: {srcs}")
            return


def _rebuild_source_holds(sim: Sim, step: int, rank: int, s: Any) -> bool:
    """A rebuild source (tier PARITY) of ``rank``: by what the model's hosts hold (not the coordinator's
    view), each rotation the rank gives data to has K intact fragments among the members the source names
    (``parity.enough_fragments``). A fragment on a host that died and the coordinator has not heard of yet,
    or parity its holder dropped as corrupt and has not reported gone yet, counts: it cannot know yet."""
    assert sim.ec is not None and s.group is not None
    st = sim.coord.state
    spec, helpers, digest = s.group, set(s.helpers), s.group.digest()

    def unheard(y: int) -> bool:
        h = sim.hosts[y]
        return not h.up or st.registered.get(y) != h.incarnation

    def rotted(y: int) -> bool:
        return (y, step, digest) in sim.ec.rotted and any(
            x.step == step and x.content_hash == digest for x in st.ec.parity_of(y))

    return enough_fragments(
        spec.layout, rank, lambda y: y in helpers and (unheard(y) or sim.ec.data_intact(y, step, spec)),
        lambda y: y in helpers and (unheard(y) or rotted(y) or sim.ec.parity_intact(y, step, digest)))


def _protected(sim: Sim, coord: Coordinator) -> dict[int, str]:
    """Steps no host may delete a piece of on ``coord``'s order while the model holds them: step -> why."""
    newest = max(sim.max_durable_seen or -1, sim.coord.state.newest_complete_step() or -1,
                 coord.state.newest_complete_step() or -1)
    protected = {newest: "the newest complete step"}
    ordering_newest = coord.state.newest_complete_step()
    for c in {id(x): x for x in (coord, sim.coord)}.values():
        cur = getattr(c.backup, "current", None)
        # Another coordinator's backup (one serving other hosts in a partition, or the successor of a
        # deposed one) of a step older than the ordering one's newest complete step is stale work: it
        # fails and retries on a newer step (backup-reaches-newest checks that it catches up).
        if cur is not None and (c is coord or ordering_newest is None or cur.step >= ordering_newest):
            protected.setdefault(cur.step, "being backed up")
    by = sim.restore_by
    if sim.restore_step is not None and by is not None and by[0].active and by[0].epoch == by[1]:
        # A pin lives in the coordinator that answered PrepareRestore: one that crashed, stepped down or
        # took over again (a fresh view) lost it (by design), and the trainer's next PrepareRestore pins again on the serving one.
        protected.setdefault(sim.restore_step, "pinned for a restore")
    return protected


def protected_at_order(sim: Sim, coord: Coordinator, resp: pb.HeartbeatResponse) -> frozenset[int]:
    """The steps protected (:func:`_protected`) when ``coord`` answers with deletions (empty without any)."""
    return frozenset(_protected(sim, coord)) if resp.deletions else frozenset()


def check_deletion(sim: Sim, rank: int, owner: int, step: int, coord: Coordinator, ordered: frozenset[int]) -> None:
    """``coord`` ordered host ``rank`` to delete ``owner``'s data of ``step`` (it may be a deposed one).
    ``ordered``: the steps protected when it answered. A step protected now but not then is not held against
    it: the answer came late (a delayed answer), and meanwhile the newest complete step fell back to it (ec
    mode, seeds 2739 and 5082: a host re-registered after a replicator restart, or hosts were declared lost,
    while the newest step lacked parity; the step fell back to one complete from the bucket). The ordering
    coordinator counts the piece for nothing from its order on (``CoordinatorState.deleting``), and a host
    cannot tell that the view regressed: a piece another coordinator still counts is caught by
    complete-is-restorable once it is gone."""
    protected = _protected(sim, coord)
    if step in protected and step in ordered and model_holds(sim, step):
        violate(sim, "gc-protected", f"host {rank} deletes rank {owner}'s data of step {step} "
                f"({protected[step]}) on the order of epoch {coord.epoch}")


def check_parity_deletion(sim: Sim, rank: int, step: int, coord: Coordinator, ordered: frozenset[int]) -> None:
    """Host ``rank`` deleted its parity of ``step`` on ``coord``'s order, and the model held the step before:
    it must hold it still if the step is protected, now and when the order was given (:func:`check_deletion`):
    the parity was the only way left to rebuild a rank."""
    protected = _protected(sim, coord)
    if step in protected and step in ordered and not model_holds(sim, step):
        violate(sim, "gc-protected", f"host {rank} deletes its parity of step {step} ({protected[step]}) on the "
                f"order of epoch {coord.epoch}, and some rank of it can no longer be rebuilt")


def check_scratch_start(sim: Sim) -> None:
    """The trainer starts from scratch: no committed backup holds every rank's true data."""
    if sim.bucket is None:
        return
    for step in sorted(sim.bucket.committed, reverse=True):
        if all(sim.bucket.holds(step, r, sim.content(r, step)) for r in range(sim.cfg.nodes)):
            violate(sim, "scratch-beside-backup", f"the trainer starts from scratch although the bucket holds "
                    f"a complete backup of step {step}")
            return


def check_order(sim: Sim, h: Any, epoch: int, coord: Coordinator) -> None:
    """Host ``h`` acts on an answer of ``epoch``: never older than an epoch this process accepted before."""
    key = (h.rank, h.incarnation)
    seen = sim.accepted.get(key, 0)
    if epoch < seen:
        violate(sim, "stale-epoch-order", f"host {h.rank} acts on an answer of epoch {epoch} (coordinator "
                f"epoch {coord.epoch}) after accepting epoch {seen}")
    else:
        sim.accepted[key] = epoch


def check_restore(sim: Sim, step: int, lost: set[int], coord: Coordinator | None = None) -> None:
    """PrepareRestore said ``step`` is ready on every host but the ``lost`` ones (not waited for)."""
    top = sim.max_durable_seen
    if top is not None and step < top and model_holds(sim, top):
        violate(sim, "restore-older-than-newest",
                f"a restore is ready at step {step} although step {top} is complete and held")
    for h in sim.hosts:
        if h.rank not in lost and not sim._holds_data_for(h, step, sim.content(h.rank, step)):
            violate(sim, "restore-not-held", f"restore of step {step} declared ready but host {h.rank} "
                    f"does not hold rank {h.rank}'s data")
            return


def _liveness(sim: Sim) -> dict[str, str]:
    """The liveness invariants that do not hold now: name -> why."""
    st = sim.coord.state
    newest = st.newest_complete_step()
    top = sim.max_durable_seen
    out = {}
    if top is not None and (newest is None or newest < top) and model_holds(sim, top):
        out["complete-step-lost"] = (f"after the quiet phase the newest complete step is {newest}, although step "
                                     f"{top} was complete and the hosts and bucket hold every rank's data of it")
    if sim.bucket is not None and newest is not None and (sim.bucket.newest() or -1) < newest:
        out["backup-reaches-newest"] = (f"after the quiet phase the bucket's newest backup is {sim.bucket.newest()}, "
                                        f"the newest complete step {newest} (backup status {sim.coord.backup.status()})")
    if not sim.training:
        out["job-resumed"] = "the trainer is still waiting for its restore after the quiet phase"
    if sim.ec is not None and newest is not None and not st.ec.parity_complete(newest):
        lacking = {r: [(h.step, h.content_hash[:12]) for h in st.ec.parity_of(r)] for r in range(sim.cfg.nodes)}
        out["parity-redundant-again"] = (
            f"after the quiet phase the newest complete step {newest} lacks parity (parity held: {lacking}; "
            f"due: {[(r, st.ec.tasks_for(r)) for r in range(sim.cfg.nodes) if st.ec.tasks_for(r)]})")
    return out


def liveness_holds(sim: Sim) -> bool:
    """Every liveness invariant holds now, of a newest complete step (while none is, a coordinator still
    lists the bucket every few seconds: not settled)."""
    return sim.coord.state.newest_complete_step() is not None and not _liveness(sim)


def check_at_end(sim: Sim) -> None:
    for name, msg in _liveness(sim).items():
        violate(sim, name, msg)


INVARIANTS = (
    "backup-share-held", "backup-run-fenced", "plan-from-scratch", "complete-is-restorable", "newest-complete-regressed", "gc-protected",
    "restore-older-than-newest", "restore-not-held", "backup-reaches-newest", "complete-step-lost",
    "job-resumed", "stale-epoch-order", "parity-redundant-again",
)
