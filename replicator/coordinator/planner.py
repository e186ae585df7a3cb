"""The coordinator's decisions (replication, global completeness, restore, GC) as pure functions of hosts' reports.

No I/O, no threads, no clocks: a :class:`CoordinatorState` is fed events (registrations, inventories,
committed steps, backups, hosts declared lost — liveness takes ``now`` from the caller) and answers
queries. Every answer depends only on the *current* facts, never on the order they arrived in, so a
restarted coordinator that receives every host's report again gives the same answers. (One fact is the
coordinator's own: the deletions it ordered that the holder has not reported on yet, :meth:`deleting`.)
Derived views are maintained incrementally; ``tests/replicator/coordinator/test_incremental.py`` checks them
against a from-scratch recomputation. Rules are summarised in ``docs/coordinator.md``.

Vocabulary: a piece of data is one rank's (``owner_rank``) data for one ``step``, identified by the
``content_hash`` of its manifest (:attr:`sidecar.layout.StepManifest.content_hash`). Data-parallel
replicas of a rank usually hold data with the same hash; such a replica counts as a verified copy.
The value objects it takes and returns are the shared vocabulary's (:class:`~replicator.tiers.Holding`,
``Tier``: :mod:`replicator.tiers`) and its own (``CopyTask``, ``RestorePlan`` ...: :mod:`replicator.coordinator.model`).

:class:`CoordinatorState` is the one entry point and composes its parts, each in its own module, each
derived view reading only the stages before it:

- :mod:`~replicator.coordinator.hosts`: registrations (incarnations) and liveness;
- :mod:`~replicator.coordinator.facts`: the holdings, the bucket's ranks, saves (generations, savers),
  deletions in flight, protected steps, and which replica groups changed;
- :mod:`~replicator.coordinator.parity`: erasure coding (``ec:K+M``): which parity counts, which is missing,
  which rank can be rebuilt;
- :mod:`~replicator.coordinator.coverage`: accepted hashes, sources per rank, completeness;
- :mod:`~replicator.coordinator.copies`: copy tasks per destination host;
- :mod:`~replicator.coordinator.restore_plan` and :mod:`~replicator.coordinator.gc_plan`: the restore
  and GC answers, computed from the above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from replicator.coordinator import copies, gc_plan, restore_plan
from replicator.coordinator.coverage import Coverage
from replicator.coordinator.ec import ErasureCoding, checked_redundancy
from replicator.coordinator.facts import Facts, carries_bytes
from replicator.coordinator.hosts import HostRegistry
from replicator.coordinator.model import (
    CopyTask,
    NotRegisteredError,
    RestorePlan,
    Source,
    StaleIncarnationError,
)
from replicator.coordinator.parity import ParityView
from replicator.coordinator.topology import JobTopology
from replicator.erasure.placement import code_groups
from replicator.erasure.redundancy import Redundancy
from replicator.tiers import Holding, Key, check_int
from sidecar.saves import format_ranks


class CoordinatorState:
    """The coordinator's global view, built only from hosts' reports; every query is deterministic.

    Derived views are maintained incrementally: a change to one rank's data of one step marks its *replica
    group* (the ranks with the same in-slice index, ``data_parallelism`` of them) dirty for that step, and
    the next query recomputes only dirty groups. Per step that gives each rank's sources (who covers it),
    the set of globally complete steps, and each destination host's copy tasks; GC and restore answers for
    one host then cost O(what that host holds). Declaring a host lost (rare) re-plans every group.
    :attr:`version` changes with every fact; whole-job plans (:meth:`restore_plan`) are memoised per
    version. Liveness takes ``now`` from the caller: the planner itself has no clock.

    ``redundancy`` (default ``copies:<topology.replicas>``): with ``ec:K+M`` no whole copies are planned; hosts
    compute parity of their code group (:attr:`ec`), and a rank whose data no host holds counts as covered
    when it can be rebuilt from it (:mod:`~replicator.coordinator.parity`). ``elastic``: the job may save
    with subsets of its ranks (refused with ec:K+M).
    """

    def __init__(self, topology: JobTopology, redundancy: Redundancy | None = None, *, elastic: bool = False):
        if not isinstance(topology, JobTopology):
            raise ValueError(f"topology must be a JobTopology, got {type(topology).__name__}")
        self.topology = topology
        self.redundancy = red = checked_redundancy(topology, redundancy, elastic)
        groups = code_groups(topology.data_parallelism, topology.hosts_per_slice, red.k, red.m) if red.is_ec else ()
        self._hosts = HostRegistry(topology)
        self._facts = Facts(topology, groups)
        self._parity = ParityView(self._facts)
        self._coverage = Coverage(self._facts, self._parity)
        self._copies = copies.CopyPlanner(self._facts, self._coverage, self._hosts, 0 if red.is_ec else red.copies)
        # The erasure-coding queries (parity tasks, parity GC, rebuildable ranks); inert in copies mode.
        self.ec = ErasureCoding(self._facts, self._coverage, self._parity, self._memos, self._check_reporter)
        self._memo: dict[Any, Any] = {}
        self._memo_version = -1
        # rank -> (step, since when): its restore waits for a byte-identical replica's fetch from the bucket.
        self._restore_held: dict[int, tuple[int, float]] = {}

    @property
    def version(self) -> int:
        """Changes with every fact (whole-job answers are memoised per version)."""
        return self._facts.version

    @property
    def reregistered(self) -> int:
        """How many times a host declared lost registered again."""
        return self._hosts.reregistered

    # ----------------------------------------------------------------------------------------- events

    def register(self, rank: int, incarnation: int) -> bool:
        """Register a host's process. Returns True when it is a new incarnation (it must report inventory).

        Incarnations are random nonces, not clock readings (a host restarted with its clock stepped back
        must not be refused, and no number can outrank every future one): the registration that arrives
        last wins. Another incarnation than the registered one drops what the host held before (its RAM
        disk may not have survived); one that a later registration superseded raises
        :class:`StaleIncarnationError` (the process should pick a new nonce and report everything again);
        the same one is a no-op. A host declared lost registers again as a new incarnation.
        """
        self.topology.check_rank(rank)
        check_int("incarnation", incarnation)
        if not self._hosts.admit(rank, incarnation):
            return False
        self._facts.drop_holdings(rank)
        if self._hosts.found(rank):
            self._replan_all()
        self._facts.version += 1
        return True

    def forget_host(self, rank: int, now: float = 0.0) -> None:
        """The host is lost or its RAM disk was wiped: drop its registration and everything it held.

        It is no destination for copies until it registers again (see :meth:`lost`).
        """
        self.topology.check_rank(rank)
        self._facts.drop_holdings(rank)
        if self._hosts.forget(rank, now):
            self._replan_all()
        self._facts.version += 1

    def reinstate(self, ranks: Iterable[int], now: float) -> list[int]:
        """Lost hosts expected again, as at a takeover: not lost, watched from ``now``, their next report their
        first (a coordinator that was itself cut off declared them lost; issue #33). Returns those reinstated."""
        back = [r for r in ranks if self._hosts.found(r)]
        for r in back:
            self._hosts.watch(r, now)
        if back:
            self._replan_all()
            self._facts.version += 1
        return back

    def watch(self, ranks: Iterable[int], now: float) -> None:
        """Start the lost-host clock of ``ranks`` at ``now`` (a coordinator taking over expects them all)."""
        for r in ranks:
            self.topology.check_rank(r)
            self._hosts.watch(r, now)

    def seen(self, rank: int, now: float) -> None:
        """Host ``rank`` reported at ``now`` (monotonic; O(1))."""
        self._hosts.saw(rank, now)

    def expire(self, now: float, lost_after_seconds: float) -> list[int]:
        """Declare lost every watched host silent for ``lost_after_seconds``; returns them (O(1) when none)."""
        out = []
        while (oldest := self._hosts.oldest()) is not None:
            rank, last = oldest
            if now - last < lost_after_seconds:
                break
            self.forget_host(rank, last + lost_after_seconds)
            out.append(rank)
        return out

    def report_inventory(
        self, rank: int, holdings: Iterable[Holding], incarnation: int | None = None
    ) -> None:
        """Replace everything host ``rank`` holds with ``holdings`` (validated first; bad input changes nothing)."""
        self._check_reporter(rank, incarnation)
        facts = self._facts
        new, new_parity = facts.split(rank, holdings)
        old = facts.holdings.get(rank, {})
        for key in [k for k, h in old.items() if new.get(k) != h]:
            facts.remove(rank, key)
        for key, h in new.items():
            if old.get(key) != h:
                facts.add(rank, h)
        old_parity = facts.parity.get(rank, {})
        for step in [s for s, h in old_parity.items() if new_parity.get(s) != h]:
            facts.remove_parity(rank, step)
        for step, h in new_parity.items():
            if old_parity.get(step) != h:
                facts.add_parity(rank, h)
        reported = self._hosts.reported
        if rank not in reported:
            reported.add(rank)
            facts.version += 1

    def report_committed(self, rank: int, holding: Holding, incarnation: int | None = None) -> None:
        """Host ``rank`` committed one piece of data (its own step or a peer copy; or its parity of a step);
        replaces the same key (the parity of the same step)."""
        self._check_reporter(rank, incarnation)
        facts = self._facts
        data, parity = facts.split(rank, [holding])
        for step, h in parity.items():
            if facts.parity.get(rank, {}).get(step) != h:
                facts.add_parity(rank, h)
        for h in data.values():
            if facts.holdings.get(rank, {}).get(h.key) == h:
                return
            facts.remove(rank, h.key)
            facts.add(rank, h)

    def report_removed(self, rank: int, keys: Iterable[Key], incarnation: int | None = None) -> None:
        """Host ``rank`` deleted these ``(owner_rank, step)`` pieces (e.g. after GC); unknown keys are ignored."""
        self._check_reporter(rank, incarnation)
        checked = []
        for key in keys:
            if not isinstance(key, tuple | list) or len(key) != 2:
                raise ValueError(f"key must be (owner_rank, step), got {key!r}")
            self.topology.check_rank(key[0])
            checked.append((key[0], check_int("step", key[1])))
        for key in checked:
            self._facts.remove(rank, key)

    def report_backup(
        self, step: int, committed: bool = True, content_hashes: Mapping[int, str] | None = None
    ) -> None:
        """A backup of ``step`` holding every rank was committed (``committed=False``: it is gone or failed).

        Either way the step is no longer being backed up.
        """
        check_int("step", step)
        facts = self._facts
        if committed:
            hashes = facts.validated_bucket_hashes(content_hashes or {})
            # A backup of a step saved by some ranks only (elastic training) holds just those ranks.
            ranks = sorted(hashes) if hashes else range(self.topology.nodes)
            facts.set_backup(step, {r: hashes.get(r) for r in ranks})
        else:
            facts.set_backup(step, None)
        facts.backups_in_progress.discard(step)
        facts.version += 1

    def report_backup_ranks(self, step: int, content_hashes: Mapping[int, str | None]) -> None:
        """The bucket holds committed data of these ranks for ``step`` (hash None: not known)."""
        check_int("step", step)
        self._facts.add_backup_ranks(step, self._facts.validated_bucket_hashes(content_hashes))

    def mark_backup_in_progress(self, step: int) -> None:
        """``step`` is being uploaded: GC must not touch it until :meth:`report_backup` or the clear call."""
        self._facts.backups_in_progress.add(check_int("step", step))
        self._facts.version += 1

    def clear_backup_in_progress(self, step: int) -> None:
        self._facts.backups_in_progress.discard(check_int("step", step))
        self._facts.version += 1

    def pin(self, step: int) -> None:
        """An active restore uses ``step``: GC keeps every copy of it until :meth:`unpin`."""
        self._facts.pinned.add(check_int("step", step))
        self._facts.version += 1

    def unpin(self, step: int) -> None:
        self._facts.pinned.discard(check_int("step", step))
        self._facts.version += 1

    def deleting(self, holder: int, keys: Iterable[Key]) -> None:
        """This coordinator ordered host ``holder`` to delete these pieces (its GC answer).

        Until the holder's next accepted report (:meth:`deletions_acted`) they count toward nothing:
        no coverage, completeness, restore source, copy source or accepted hash. Otherwise, when the
        newest complete step stops being complete, the fallback could be an older step whose pieces
        are being deleted right now, and a restore of it would fail (issue #19, found by
        tests/simulation). O(len(keys)).
        """
        self._facts.mark_deleting(holder, keys)

    def deletions_acted(self, holder: int) -> None:
        """Host ``holder``'s report after its deletions was applied: what it still holds counts again
        (a deletion it skipped, e.g. while a task used the piece, or an answer it never received).
        O(the deletions in flight)."""
        self._facts.deletions_acted(holder)

    def deletions_in_flight(self) -> dict[int, list[Key]]:
        """holder -> pieces with a deletion in flight (for tests and from-scratch comparisons)."""
        return {r: sorted(keys) for r, keys in sorted(self._facts.deleting.items())}

    # ---------------------------------------------------------------------------------------- queries

    @property
    def registered(self) -> dict[int, int]:
        """rank -> incarnation of every registered host."""
        return dict(sorted(self._hosts.incarnation.items()))

    def incarnation_of(self, rank: int) -> int | None:
        """The incarnation host ``rank`` registered (None: not registered); O(1), :attr:`registered` copies."""
        return self._hosts.incarnation.get(rank)

    @property
    def lost(self) -> dict[int, float]:
        """rank -> since when (caller's clock) of every host declared lost and not registered again."""
        return dict(sorted(self._hosts.lost.items()))

    def is_lost(self, rank: int) -> bool:
        """Host ``rank`` is declared lost and not registered again (O(1); :attr:`lost` copies and sorts)."""
        return rank in self._hosts.lost

    def lost_count(self) -> int:
        """How many hosts are declared lost (O(1); :attr:`lost` copies and sorts)."""
        return len(self._hosts.lost)

    def all_reported(self) -> bool:
        """Every host not declared lost has reported its inventory to this coordinator (O(1)): what the live
        hosts hold is known, not waited for (a host that registered again has not reported yet)."""
        return len(self._hosts.reported) + len(self._hosts.lost) >= self.topology.nodes

    def is_reported(self, rank: int) -> bool:
        return rank in self._hosts.reported

    @property
    def reported_count(self) -> int:
        return len(self._hosts.reported)

    def all_heard_since(self, since: float) -> bool:
        """Every watched (live) host reported at ``since`` or later (O(1): the oldest report decides)."""
        oldest = self._hosts.oldest()
        return oldest is None or oldest[1] >= since

    def heard_since(self, since: float, at_most: int) -> int:
        """How many live hosts reported at ``since`` or later, counted up to ``at_most`` (O(at_most))."""
        return self._hosts.heard_since(since, at_most)

    def last_seen(self, rank: int) -> float | None:
        return self._hosts.seen.get(rank)

    def holding(self, rank: int, key: Key) -> Holding | None:
        """What host ``rank`` reported for ``(owner_rank, step)``, if anything (O(1))."""
        return self._facts.holdings.get(rank, {}).get(key)

    def piece_count(self, rank: int) -> int:
        return len(self._facts.holdings.get(rank, {})) + len(self._facts.parity.get(rank, {}))

    def check_holdings(self, rank: int, holdings: Iterable[Holding]) -> list[Holding]:
        """Validate what host ``rank`` reports without changing anything (ValueError on bad input)."""
        self.topology.check_rank(rank)
        data, parity = self._facts.split(rank, holdings)
        return [*data.values(), *parity.values()]

    def holdings_of(self, rank: int) -> list[Holding]:
        self.topology.check_rank(rank)
        return sorted(self._facts.holdings.get(rank, {}).values(), key=lambda h: (h.step, h.owner_rank))

    def backup_ranks(self, step: int) -> dict[int, str | None]:
        """rank -> hash of every rank the bucket holds for ``step``."""
        return dict(sorted(self._facts.bucket.get(step, {}).items()))

    def backup_rank_count(self, step: int) -> int:
        return len(self._facts.bucket.get(step, {}))

    def known_steps(self) -> list[int]:
        return self._facts.known_steps()

    def sources(self, step: int) -> dict[int, list[Source]]:
        """Every usable source of every rank's data for ``step``, fastest tier first (ranks without any omitted)."""
        check_int("step", step)
        return self._coverage.sources(step)

    def rank_sources(self, step: int, rank: int) -> list[Source]:
        """Usable sources of one rank's ``step`` data, fastest first (O(replicas), no whole-job scan)."""
        return self._coverage.rank_sources(step, rank)

    def covered_count(self, step: int) -> int:
        """How many ranks' ``step`` data is on some tier."""
        return self._coverage.covered_count(step)

    def missing_ranks(self, step: int) -> list[int]:
        """Ranks whose ``step`` data is on no tier."""
        check_int("step", step)
        return self._coverage.missing_ranks(step)

    def is_complete(self, step: int) -> bool:
        return self._coverage.is_complete(step)

    def globally_complete_steps(self) -> list[int]:
        """Steps whose every saver's data is on at least one tier (and not abandoned), ascending."""
        return self._coverage.complete_steps()

    def newest_complete_step(self) -> int | None:
        return self._coverage.newest_complete_step()

    def newest_redundant_step(self) -> int | None:
        """The newest redundant step (:meth:`is_redundant`; GC keeps it, and the newest durable one)."""
        return self._coverage.newest_redundant_step()

    def is_redundant(self, step: int) -> bool:
        """Copies mode: ``step`` stays complete whichever one host is lost (each rank's data, and the record that it
        is that rank's, on two hosts or one and the bucket). ec mode: every code group has all its parity too."""
        return self._coverage.is_redundant(step)

    def verified_replicas(self, step: int) -> list[tuple[int, int, str]]:
        """``(owner_rank, replica_rank, content_hash)`` where both hosts hold identical local data now.

        A daemon may persist these on the replica and report them as ``Tier.REPLICA`` holdings, so the
        equivalence survives the owner's loss and a coordinator restart.
        """
        check_int("step", step)
        return copies.verified_replicas(self._facts, step)

    def replication_plan(self, step: int) -> list[CopyTask]:
        """Tasks that put every rank's ``step`` data on ``1 + replicas`` distinct hosts (capped at nodes).

        A data-parallel replica whose local step has the same content hash is a verified copy: it
        gets a ``hash_only`` task (record the equivalence, move no bytes) and, with the default
        ``replicas=1``, nothing is copied for that rank. Otherwise byte copies go to the rank's
        ``copy_preference`` order (hosts not declared lost and without a valid copy), with sources
        spread across the hosts holding valid data of the replica group, least bytes assigned first.
        The answer depends only on the current state; call it again after reports arrive (done tasks
        drop out).
        """
        check_int("step", step)
        return self._copies.replication_plan(step)

    def tasks_for(self, dest: int, step: int) -> list[CopyTask]:
        """The copy tasks of ``step`` whose destination is host ``dest`` (O(its tasks))."""
        return self._copies.tasks_for(dest, step)

    def restore_witnesses(self, rank: int, step: int, content_hashes: set[str]) -> list[CopyTask]:
        """Hash-only tasks that go with host ``rank``'s restore of ``step`` (see :meth:`CopyPlanner.restore_witnesses`)."""
        return self._copies.restore_witnesses(rank, step, content_hashes)

    def restore_sources(self, step: int, rank: int, live: restore_plan.Liveness) -> list[Source]:
        """Where host ``rank`` fetches ``step`` from, best first ([] while a replica fetches it from the bucket)."""
        self.topology.check_rank(rank)
        self._coverage.refresh()
        return restore_plan.restore_sources(self._facts, self._coverage, self._hosts, self._restore_held, step, rank, live)

    def restore_plan(self, restoring: bool = True, force_step: int | None = None) -> RestorePlan:
        """The newest step recoverable for every rank, and per rank the fastest source.

        Local first (the host's own data, or a replica's identical data already on it), then a peer
        (the holder with the fewest bytes assigned so far, ties by ring distance, so no single host
        serves everybody), then the bucket. ``restoring=True`` pins the chosen step against GC until
        :meth:`unpin`. ``force_step`` (operator override) must be recoverable for every rank, else
        ValueError. With nothing recoverable the plan has ``step=None`` and a reason. Memoised per
        :attr:`version`.
        """
        if force_step is not None:
            check_int("force_step", force_step)
        self._coverage.refresh()
        memo = self._memos()
        key = ("restore", force_step)
        if key not in memo:
            try:
                memo[key] = restore_plan.plan_restore(self._facts, self._coverage, self._hosts, force_step)
            except ValueError as e:
                memo[key] = e
        plan = memo[key]
        if isinstance(plan, ValueError):
            raise ValueError(str(plan))
        if restoring and plan.step is not None and plan.step not in self._facts.pinned:
            self.pin(plan.step)
            self._memos()[key] = plan  # pinning changes no source
        return plan

    def gc_plan(self, keep_local: int) -> dict[int, list[Key]]:
        """What each host may delete: ``{holder_rank: [(owner_rank, step), ...]}`` (hosts with nothing omitted).

        Never touched: the newest globally complete step, steps being backed up, pinned steps (but copies of
        an abandoned save of them go: a rolled-back job saved the step again). Each
        host keeps its ``keep_local`` newest steps (local and peer together); older steps go, and so
        do incomplete steps older than the newest complete one and copies whose hash contradicts the
        owner's (or the bucket's) definitive hash.
        """
        plan = {}
        for holder in sorted(self._facts.holdings):
            doomed = self.gc_for(holder, keep_local)
            if doomed:
                plan[holder] = doomed
        return plan

    def gc_for(self, holder: int, keep_local: int) -> list[Key]:
        """:meth:`gc_plan` for one host, in O(what it holds); memoised per :attr:`version` (every heartbeat
        asks, and a heartbeat that reports nothing new changes no fact)."""
        check_int("keep_local", keep_local, 1)
        self._coverage.refresh()
        memo = self._memos()
        key = ("gc", holder, keep_local)
        if key not in memo:
            memo[key] = gc_plan.gc_for(self._facts, self._coverage, holder, keep_local)
        return list(memo[key])

    # --------------------------------------------------------------- elastic: savers and generations
    # (the rule: see :class:`~replicator.coordinator.facts.Facts`)

    def step_generation(self, step: int) -> int:
        return self._facts.step_generation(step)

    def expected_ranks(self, step: int) -> list[int]:
        """The ranks whose data make up ``step``: its newest save's savers (a bucket-only step: the
        ranks its backup holds; nothing known: every rank)."""
        return self._facts.expected_ranks(step)

    def is_abandoned(self, step: int) -> bool:
        """An older step number carries a newer save: the job rolled back past ``step``."""
        return self._facts.is_abandoned(step)

    def pinned_steps(self) -> list[int]:
        """Steps pinned against GC (restores, the operator), ascending."""
        return sorted(self._facts.pinned)

    def backups_in_progress(self) -> list[int]:
        """Steps being uploaded to the bucket, ascending."""
        return sorted(self._facts.backups_in_progress)

    def status(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) for tests and small jobs: every host and every rank's sources.

        O(nodes x steps): the coordinator's typed, bounded status is built in the service.
        """
        return _plain_status(self, self._facts, self._hosts, self._parity.enabled)

    def rebuilt(self) -> CoordinatorState:
        """A copy whose derived views are recomputed from scratch (for tests: incremental == from scratch)."""
        import copy

        other = copy.deepcopy(self)
        other._coverage.clear()
        other._copies.clear()
        other._parity.clear()
        other._memo = {}
        other._memo_version = -1
        other._facts.dirty = {}
        other._facts.ec_dirty = {}
        for step in other.known_steps():
            other._facts.touch_all_groups(step)
        return other

    # -------------------------------------------------------------------------------------- internals

    def _memos(self) -> dict[Any, Any]:
        if self._memo_version != self._facts.version:
            self._memo = {}
            self._memo_version = self._facts.version
        return self._memo

    def _replan_all(self) -> None:
        """The set of lost hosts changed: copy destinations of every group may change (O(1) now; the
        next query for copy tasks re-derives them once, however many hosts were lost meanwhile).
        Coverage, completeness and restore plans do not depend on it and stay as they are."""
        self._facts.version += 1
        self._copies.stale_all = True

    def _check_reporter(self, rank: int, incarnation: int | None) -> None:
        self.topology.check_rank(rank)
        known = self._hosts.incarnation.get(rank)
        if known is None:
            raise NotRegisteredError(
                f"rank {rank} is not registered; register and report the inventory again"
            )
        if incarnation is not None and check_int("incarnation", incarnation) != known:
            raise StaleIncarnationError(
                f"rank {rank}: report from incarnation {incarnation}, registered {known}"
            )


def _plain_status(st: CoordinatorState, facts: Facts, hosts: HostRegistry, parity: bool) -> dict[str, Any]:
    """:meth:`CoordinatorState.status`: a plain dump of the state (a view over it, built from its parts)."""
    complete = st.globally_complete_steps()
    newest = complete[-1] if complete else None
    out_hosts = {}
    for rank in sorted(set(hosts.incarnation) | set(facts.holdings)):
        held = facts.holdings.get(rank, {})
        out_hosts[rank] = {
            "incarnation": hosts.incarnation.get(rank),
            "inventory_reported": rank in hosts.reported,
            "steps": sorted({s for _, s in held}),
            "pieces": len(held),
            "bytes": sum(h.size for h in held.values() if carries_bytes(h)),
            **({"parity_steps": sorted(facts.parity.get(rank, {}))} if parity else {}),
        }
    steps = {}
    for step in st.known_steps():
        found = st.sources(step)
        steps[step] = {
            "complete": st.is_complete(step),
            "redundant": st.is_redundant(step),
            **({"rebuildable_ranks": st.ec.rebuild_ranks(step)} if parity else {}),
            "savers": format_ranks(st.expected_ranks(step)),
            "missing_ranks": [r for r in st.expected_ranks(step) if r not in found],
            "ranks": {
                r: [{"kind": str(s.kind), "holder": s.holder_rank, "owner": s.owner_rank} for s in srcs]
                for r, srcs in found.items()
            },
        }
    return {
        "topology": st.topology.to_dict(),
        "redundancy": str(st.redundancy),
        "hosts": out_hosts,
        "lost": dict(sorted(hosts.lost.items())),
        "steps": steps,
        "complete_steps": complete,
        "newest_complete_step": newest,
        "backups": {
            s: {"ranks": sorted(b), "complete": len(b) == st.topology.nodes}
            for s, b in sorted(facts.bucket.items())
        },
        "in_flight": {
            "saving": [s for s in st.known_steps() if newest is None or s > newest],
            "backing_up": sorted(facts.backups_in_progress),
            "pinned": sorted(facts.pinned),
        },
    }
