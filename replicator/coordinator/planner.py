"""The coordinator's decisions (replication, global completeness, restore, GC) as pure functions of hosts' reports.

No I/O, no threads, no clocks: a :class:`CoordinatorState` is fed events (registrations, inventories,
committed steps, backups, hosts declared lost — liveness takes ``now`` from the caller) and answers
queries. Every answer depends only on the *current* facts, never on the order they arrived in, so a
restarted coordinator that receives every host's report again gives the same answers. (One fact is the
coordinator's own: the deletions it ordered that the holder has not reported on yet, :meth:`deleting`.)
Derived views are maintained incrementally (see :class:`CoordinatorState`); ``tests/replicator/coordinator/
test_incremental.py`` checks them against a from-scratch recomputation. Rules are summarised in
``docs/coordinator.md``.

Vocabulary: a piece of data is one rank's (``owner_rank``) data for one ``step``, identified by the
``content_hash`` of its manifest (:attr:`sidecar.layout.StepManifest.content_hash`). Data-parallel
replicas of a rank usually hold data with the same hash; such a replica counts as a verified copy.
The value objects it takes and returns (:class:`~replicator.coordinator.model.Holding`, ``Tier``,
``CopyTask``, ``RestorePlan`` ...) are in :mod:`replicator.coordinator.model`.

Why one ~1,000-line module: it is one class whose derived views (per-group completeness, copy plans, the
restorable step, GC pins) are updated together on every event; split across modules they would share
private state, which is what the incremental-vs-recomputed test guards.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from replicator.coordinator.model import (
    CopyTask,
    Holding,
    Key,
    NotRegisteredError,
    RestorePlan,
    Source,
    StaleIncarnationError,
    Tier,
    check_hash,
    check_int,
    ranges,
)
from replicator.coordinator.topology import JobTopology
from sidecar import saves

_BUCKET_HOLDER = "bucket"
RETIRED_INCARNATIONS_KEPT = 8  # per rank: bounds memory; older stale processes are long gone


@dataclasses.dataclass(frozen=True)
class _Auth:
    """The accepted content hash of one rank's step and whether it is definitive (owner or bucket said so)."""

    content_hash: str | None
    definitive: bool


class CoordinatorState:
    """The coordinator's global view, built only from hosts' reports; every query is deterministic.

    Derived views are maintained incrementally: a change to one rank's data of one step marks its
    *replica group* (the ranks with the same in-slice index, ``data_parallelism`` of them) dirty for
    that step, and the next query recomputes only dirty groups. Per step that gives each rank's
    sources (who covers it), the set of globally complete steps, and each destination host's copy
    tasks; GC and restore answers for one host then cost O(what that host holds). Declaring a host
    lost (rare) re-plans every group. :attr:`version` changes with every fact; whole-job plans
    (:meth:`restore_plan`) are memoised per version. Liveness takes ``now`` from the caller: the
    planner itself has no clock.
    """

    def __init__(self, topology: JobTopology):
        if not isinstance(topology, JobTopology):
            raise ValueError(f"topology must be a JobTopology, got {type(topology).__name__}")
        self.topology = topology
        h = self._h = topology.hosts_per_slice
        self._members: list[tuple[int, ...]] = [
            tuple(s * h + i for s in range(topology.data_parallelism)) for i in range(h)
        ]
        self._incarnation: dict[int, int] = {}
        # rank -> incarnations that a newer registration superseded (bounded): their reports are stale.
        self._retired: dict[int, collections.deque[int]] = {}
        self._reported: set[int] = set()
        self._holdings: dict[int, dict[Key, Holding]] = {}
        # step -> owner_rank -> holder_rank -> Holding (the same objects as in _holdings), without the
        # pieces whose deletion this coordinator ordered and the holder has not reported on since.
        self._index: dict[int, dict[int, dict[int, Holding]]] = {}
        # holder -> (owner_rank, step) pieces with a deletion in flight: they count for nothing (see
        # :meth:`deleting`), so that no answer names a step whose pieces are just being deleted.
        self._deleting: dict[int, set[Key]] = {}
        # step -> rank -> content hash (None: committed in the bucket, hash not reported).
        self._bucket: dict[int, dict[int, str | None]] = {}
        self._backups_in_progress: set[int] = set()
        self._pinned: set[int] = set()
        # Liveness: rank -> when it was declared lost; rank -> last report, oldest first.
        self._lost: dict[int, float] = {}
        self._lost_per_slice: collections.Counter[int] = collections.Counter()
        self._seen: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.reregistered = 0
        # Derived views, refreshed lazily per dirty (step, replica group).
        self.version = 0
        self._dirty: dict[int, set[int]] = {}  # step -> groups whose coverage (and then tasks) changed
        self._tasks_dirty: dict[int, set[int]] = {}  # step -> groups whose copy tasks must be re-derived
        self._stale_all = False
        self._auth: dict[int, dict[int, _Auth]] = {}
        self._cov: dict[int, dict[int, tuple[Source, ...]]] = {}
        self._complete: set[int] = set()
        # Completeness, kept incrementally: step -> (what its expected ranks are keyed by, that set, how
        # many of them no tier covers). Re-deriving a group adjusts the count by its own members only.
        self._expected: dict[int, tuple[Any, frozenset[int]]] = {}
        self._uncovered: dict[int, int] = {}
        self._tasks: dict[int, dict[int, tuple[CopyTask, ...]]] = {}  # step -> group -> tasks
        self._by_dest: dict[int, dict[int, dict[int, tuple[CopyTask, ...]]]] = {}  # step -> dest -> group -> tasks
        self._memo: dict[Any, Any] = {}
        # Elastic: step -> generation -> number of holdings of that save; (step, generation) -> savers ranges.
        self._generations: dict[int, collections.Counter[int]] = {}
        # step -> is_abandoned(step), valid while the set of (step, generation) saves is unchanged (it
        # changes only when a save appears or its last piece goes; asked per holding on every heartbeat).
        self._abandoned: dict[int, bool] = {}
        self._savers: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
        self._memo_version = -1

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
        known = self._incarnation.get(rank)
        if known == incarnation:
            return False
        retired = self._retired.setdefault(rank, collections.deque(maxlen=RETIRED_INCARNATIONS_KEPT))
        if incarnation in retired:
            raise StaleIncarnationError(f"rank {rank}: incarnation {incarnation} was superseded by {known}")
        if known is not None:
            retired.append(known)
        self._drop_holdings(rank)
        self._reported.discard(rank)
        self._incarnation[rank] = incarnation
        if self._lost.pop(rank, None) is not None:
            self._lost_per_slice[self.topology.slice_of(rank)] -= 1
            self.reregistered += 1
            self._replan_all()
        self.version += 1
        return True

    def forget_host(self, rank: int, now: float = 0.0) -> None:
        """The host is lost or its RAM disk was wiped: drop its registration and everything it held.

        It is no destination for copies until it registers again (see :meth:`lost`).
        """
        self.topology.check_rank(rank)
        self._drop_holdings(rank)
        self._reported.discard(rank)
        self._incarnation.pop(rank, None)
        self._seen.pop(rank, None)
        if rank not in self._lost:
            self._lost[rank] = now
            self._lost_per_slice[self.topology.slice_of(rank)] += 1
            self._replan_all()
        self.version += 1

    def watch(self, ranks: Iterable[int], now: float) -> None:
        """Start the lost-host clock of ``ranks`` at ``now`` (a coordinator taking over expects them all)."""
        for r in ranks:
            self.topology.check_rank(r)
            if r not in self._lost and r not in self._seen:
                self._seen[r] = now

    def seen(self, rank: int, now: float) -> None:
        """Host ``rank`` reported at ``now`` (monotonic; O(1))."""
        self._seen[rank] = now
        self._seen.move_to_end(rank)

    def expire(self, now: float, lost_after_seconds: float) -> list[int]:
        """Declare lost every watched host silent for ``lost_after_seconds``; returns them (O(1) when none)."""
        out = []
        while self._seen:
            rank, last = next(iter(self._seen.items()))
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
        new = self._validated(rank, holdings)
        old = self._holdings.get(rank, {})
        for key in [k for k, h in old.items() if new.get(k) != h]:
            self._remove(rank, key)
        for key, h in new.items():
            if old.get(key) != h:
                self._add(rank, h)
        if rank not in self._reported:
            self._reported.add(rank)
            self.version += 1

    def report_committed(self, rank: int, holding: Holding, incarnation: int | None = None) -> None:
        """Host ``rank`` committed one piece of data (its own step or a peer copy); replaces the same key."""
        self._check_reporter(rank, incarnation)
        (h,) = self._validated(rank, [holding]).values()
        if self._holdings.get(rank, {}).get(h.key) == h:
            return
        self._remove(rank, h.key)
        self._add(rank, h)

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
            self._remove(rank, key)

    def report_backup(
        self, step: int, committed: bool = True, content_hashes: Mapping[int, str] | None = None
    ) -> None:
        """A backup of ``step`` holding every rank was committed (``committed=False``: it is gone or failed).

        Either way the step is no longer being backed up.
        """
        check_int("step", step)
        if committed:
            hashes = self._validated_bucket_hashes(content_hashes or {})
            # A backup of a step saved by some ranks only (elastic training) holds just those ranks.
            ranks = sorted(hashes) if hashes else range(self.topology.nodes)
            self._bucket[step] = {r: hashes.get(r) for r in ranks}
            self._touch_all_groups(step)
        elif self._bucket.pop(step, None) is not None:
            self._touch_all_groups(step)
        self._backups_in_progress.discard(step)
        self.version += 1

    def report_backup_ranks(self, step: int, content_hashes: Mapping[int, str | None]) -> None:
        """The bucket holds committed data of these ranks for ``step`` (hash None: not known)."""
        check_int("step", step)
        hashes = self._validated_bucket_hashes(content_hashes)
        if hashes:
            self._bucket.setdefault(step, {}).update(hashes)
            for r in hashes:
                self._touch(step, r)

    def mark_backup_in_progress(self, step: int) -> None:
        """``step`` is being uploaded: GC must not touch it until :meth:`report_backup` or the clear call."""
        self._backups_in_progress.add(check_int("step", step))
        self.version += 1

    def clear_backup_in_progress(self, step: int) -> None:
        self._backups_in_progress.discard(check_int("step", step))
        self.version += 1

    def pin(self, step: int) -> None:
        """An active restore uses ``step``: GC keeps every copy of it until :meth:`unpin`."""
        self._pinned.add(check_int("step", step))
        self.version += 1

    def unpin(self, step: int) -> None:
        self._pinned.discard(check_int("step", step))
        self.version += 1

    def deleting(self, holder: int, keys: Iterable[Key]) -> None:
        """This coordinator ordered host ``holder`` to delete these pieces (its GC answer).

        Until the holder's next accepted report (:meth:`deletions_acted`) they count toward nothing:
        no coverage, completeness, restore source, copy source or accepted hash. Otherwise, when the
        newest complete step stops being complete, the fallback could be an older step whose pieces
        are being deleted right now, and a restore of it would fail (issue #19, found by
        tests/simulation). O(len(keys)).
        """
        held = self._holdings.get(holder)
        if not held:
            return
        marked = self._deleting.setdefault(holder, set())
        for key in keys:
            if key in held and key not in marked:
                marked.add(key)
                self._unindex(holder, held[key])
        if not marked:
            del self._deleting[holder]

    def deletions_acted(self, holder: int) -> None:
        """Host ``holder``'s report after its deletions was applied: what it still holds counts again
        (a deletion it skipped, e.g. while a task used the piece, or an answer it never received).
        O(the deletions in flight)."""
        marked = self._deleting.pop(holder, None)
        held = self._holdings.get(holder, {})
        for key in sorted(marked or ()):
            h = held.get(key)
            if h is not None:
                self._index_add(holder, h)

    def deletions_in_flight(self) -> dict[int, list[Key]]:
        """holder -> pieces with a deletion in flight (for tests and from-scratch comparisons)."""
        return {r: sorted(keys) for r, keys in sorted(self._deleting.items())}

    # ---------------------------------------------------------------------------------------- queries

    @property
    def registered(self) -> dict[int, int]:
        """rank -> incarnation of every registered host."""
        return dict(sorted(self._incarnation.items()))

    @property
    def lost(self) -> dict[int, float]:
        """rank -> since when (caller's clock) of every host declared lost and not registered again."""
        return dict(sorted(self._lost.items()))

    def is_reported(self, rank: int) -> bool:
        return rank in self._reported

    @property
    def reported_count(self) -> int:
        return len(self._reported)

    def last_seen(self, rank: int) -> float | None:
        return self._seen.get(rank)

    def holding(self, rank: int, key: Key) -> Holding | None:
        """What host ``rank`` reported for ``(owner_rank, step)``, if anything (O(1))."""
        return self._holdings.get(rank, {}).get(key)

    def piece_count(self, rank: int) -> int:
        return len(self._holdings.get(rank, {}))

    def check_holdings(self, rank: int, holdings: Iterable[Holding]) -> list[Holding]:
        """Validate what host ``rank`` reports without changing anything (ValueError on bad input)."""
        self.topology.check_rank(rank)
        return list(self._validated(rank, holdings).values())

    def holdings_of(self, rank: int) -> list[Holding]:
        self.topology.check_rank(rank)
        return sorted(self._holdings.get(rank, {}).values(), key=lambda h: (h.step, h.owner_rank))

    def backup_ranks(self, step: int) -> dict[int, str | None]:
        """rank -> hash of every rank the bucket holds for ``step``."""
        return dict(sorted(self._bucket.get(step, {}).items()))

    def backup_rank_count(self, step: int) -> int:
        return len(self._bucket.get(step, {}))

    def known_steps(self) -> list[int]:
        return sorted(set(self._index) | set(self._bucket))

    def sources(self, step: int) -> dict[int, list[Source]]:
        """Every usable source of every rank's data for ``step``, fastest tier first (ranks without any omitted)."""
        check_int("step", step)
        self._refresh()
        return {r: list(s) for r, s in sorted(self._cov.get(step, {}).items())}

    def rank_sources(self, step: int, rank: int) -> list[Source]:
        """Usable sources of one rank's ``step`` data, fastest first (O(replicas), no whole-job scan)."""
        self._refresh()
        return list(self._cov.get(step, {}).get(rank, ()))

    def covered_count(self, step: int) -> int:
        """How many ranks' ``step`` data is on some tier."""
        self._refresh()
        return len(self._cov.get(step, {}))

    def missing_ranks(self, step: int) -> list[int]:
        """Ranks whose ``step`` data is on no tier."""
        check_int("step", step)
        self._refresh()
        found = self._cov.get(step, {})
        return [r for r in self.expected_ranks(step) if r not in found]

    def is_complete(self, step: int) -> bool:
        self._refresh()
        return step in self._complete and not self.is_abandoned(step)

    def globally_complete_steps(self) -> list[int]:
        """Steps whose every saver's data is on at least one tier (and not abandoned), ascending."""
        self._refresh()
        return sorted(s for s in self._complete if not self.is_abandoned(s))

    def newest_complete_step(self) -> int | None:
        self._refresh()
        for step in sorted(self._complete, reverse=True):
            if not self.is_abandoned(step):
                return step
        return None

    def is_redundant(self, step: int) -> bool:
        """Every rank's data has at least two copies on distinct hosts (the bucket counts as one)."""
        self._refresh()
        found = self._cov.get(step, {})
        if len(found) < len(self.expected_ranks(step)):
            return False
        return all(len({_holder_id(s) for s in srcs}) >= 2 for srcs in found.values())

    def verified_replicas(self, step: int) -> list[tuple[int, int, str]]:
        """``(owner_rank, replica_rank, content_hash)`` where both hosts hold identical local data now.

        A daemon may persist these on the replica and report them as ``Tier.REPLICA`` holdings, so the
        equivalence survives the owner's loss and a coordinator restart.
        """
        check_int("step", step)
        by_owner = self._index.get(step, {})
        out = []
        for owner in range(self.topology.nodes):
            mine = by_owner.get(owner, {}).get(owner)
            if mine is None or mine.tier is not Tier.LOCAL:
                continue
            for rep in self.topology.replicas_of(owner):
                theirs = by_owner.get(rep, {}).get(rep)
                if (
                    theirs is not None
                    and theirs.tier is Tier.LOCAL
                    and theirs.content_hash == mine.content_hash
                ):
                    out.append((owner, rep, mine.content_hash))
        return out

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
        self._refresh(tasks=True)
        tasks = [t for group in self._tasks.get(step, {}).values() for t in group]
        tasks.sort(key=lambda t: (t.owner_rank, not t.hash_only, t.dest_rank))
        return tasks

    def tasks_for(self, dest: int, step: int) -> list[CopyTask]:
        """The copy tasks of ``step`` whose destination is host ``dest`` (O(its tasks))."""
        self._refresh(tasks=True)
        groups = self._by_dest.get(step, {}).get(dest, {})
        out = [t for g in groups.values() for t in g]
        out.sort(key=lambda t: (t.owner_rank, not t.hash_only, t.dest_rank))
        return out

    def _holds_local(self, step: int, rank: int, content_hash: str) -> bool:
        mine = self._index.get(step, {}).get(rank, {}).get(rank)
        return mine is not None and mine.tier is Tier.LOCAL and mine.content_hash == content_hash

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
        self._refresh()
        memo = self._memos()
        key = ("restore", force_step)
        if key not in memo:
            try:
                memo[key] = self._restore_plan(force_step)
            except ValueError as e:
                memo[key] = e
        plan = memo[key]
        if isinstance(plan, ValueError):
            raise ValueError(str(plan))
        if restoring and plan.step is not None and plan.step not in self._pinned:
            self.pin(plan.step)
            self._memos()[key] = plan  # pinning changes no source
        return plan

    def _restore_plan(self, force_step: int | None) -> RestorePlan:
        waiting = tuple(sorted(set(self._incarnation) - self._reported))
        if force_step is not None:
            missing = self.missing_ranks(force_step)
            if missing:
                raise ValueError(
                    f"step {force_step} is not recoverable: no tier holds ranks {ranges(missing)}"
                )
            step = force_step
        else:
            step = self.newest_complete_step()
            if step is None:
                known = self.known_steps()
                if known:
                    newest = known[-1]
                    reason = (
                        f"no step is recoverable for every rank; newest known step {newest} lacks ranks "
                        f"{ranges(self.missing_ranks(newest))}"
                    )
                else:
                    reason = "no step is recoverable for every rank: nothing reported on any tier"
                return RestorePlan(None, {}, reason, waiting)
        found = self._cov[step]
        load: collections.Counter[int] = collections.Counter()
        count: collections.Counter[int] = collections.Counter()
        chosen: dict[int, Source] = {}
        for rank in self.expected_ranks(step):
            srcs = found[rank]
            if srcs[0].kind is Tier.LOCAL:
                local = [s for s in srcs if s.kind is Tier.LOCAL]
                pick = min(local, key=lambda s, r=rank: (s.owner_rank != r, s.owner_rank))
            elif srcs[0].kind is Tier.PEER:
                peers = [s for s in srcs if s.kind is Tier.PEER]
                pick = min(
                    peers,
                    key=lambda s, r=rank: (
                        load[s.holder_rank],
                        count[s.holder_rank],
                        s.owner_rank != r,
                        self.topology.ring_distance(r, s.holder_rank),
                        s.owner_rank,
                    ),
                )
                load[pick.holder_rank] += pick.size
                count[pick.holder_rank] += 1
            else:
                pick = srcs[-1]
            chosen[rank] = pick
        kinds = collections.Counter(str(s.kind) for s in chosen.values())
        how = ", ".join(f"{kinds[k]} {k}" for k in (Tier.LOCAL, Tier.PEER, Tier.BUCKET) if kinds[k])
        what = "operator-forced step" if force_step is not None else "newest globally complete step"
        return RestorePlan(step, chosen, f"{what} {step}: {how}", waiting)

    def gc_plan(self, keep_local: int) -> dict[int, list[Key]]:
        """What each host may delete: ``{holder_rank: [(owner_rank, step), ...]}`` (hosts with nothing omitted).

        Never touched: the newest globally complete step, steps being backed up, pinned steps (but copies of
        an abandoned save of them go: a rolled-back job saved the step again). Each
        host keeps its ``keep_local`` newest steps (local and peer together); older steps go, and so
        do incomplete steps older than the newest complete one and copies whose hash contradicts the
        owner's (or the bucket's) definitive hash.
        """
        plan = {}
        for holder in sorted(self._holdings):
            doomed = self.gc_for(holder, keep_local)
            if doomed:
                plan[holder] = doomed
        return plan

    def gc_for(self, holder: int, keep_local: int) -> list[Key]:
        """:meth:`gc_plan` for one host, in O(what it holds)."""
        check_int("keep_local", keep_local, 1)
        held = self._holdings.get(holder)
        if not held:
            return []
        self._refresh()
        complete = set(self.globally_complete_steps())
        newest = max(complete) if complete else None
        protected = self._backups_in_progress | self._pinned
        newest_held = set(sorted({s for _, s in held}, reverse=True)[:keep_local])
        doomed = []
        for key, h in held.items():
            step = h.step
            if not self._current(h):
                # A copy of an abandoned save of the step (the job rolled back and saved it again): never a
                # source, whatever protects the step (its newest save may be the newest complete step).
                doomed.append(key)
                continue
            if step in protected or step == newest:
                continue
            drop = step not in newest_held
            drop = drop or (newest is not None and step < newest and step not in complete)
            drop = drop or not self._current(h) or (newest is not None and self.is_abandoned(step))
            if not drop and h.tier is not Tier.LOCAL:
                a = self._auth.get(step, {}).get(h.owner_rank)
                drop = a is not None and a.definitive and a.content_hash != h.content_hash
            if drop:
                doomed.append(key)
        return sorted(doomed, key=lambda k: (k[1], k[0]))

    # --------------------------------------------------------------- elastic: savers and generations
    # A step may be saved by a subset of the ranks (the active hosts of an elastic job); it is complete
    # when every rank that saved it has its data on some tier. After a rollback the same step number may
    # be saved again: the save with the highest generation is the step, older copies are abandoned; and a
    # step is abandoned when an older step number was saved later (the job rolled back past it).

    def step_generation(self, step: int) -> int:
        # saves.newest_generation inlined: asked ~20 times per heartbeat at 10k hosts (bench.scale).
        gens = self._generations.get(step)
        return max(gens) if gens else 0

    def expected_ranks(self, step: int) -> list[int]:
        """The ranks whose data make up ``step``: its newest save's savers (a bucket-only step: the
        ranks its backup holds; nothing known: every rank)."""
        gens = self._generations.get(step)
        if gens:
            ranges = self._savers.get((step, max(gens)), ())
            if ranges:
                return [r for a, b in ranges for r in range(a, min(b, self.topology.nodes - 1) + 1)]
            return list(range(self.topology.nodes))
        bucket = self._bucket.get(step)
        if bucket:
            return sorted(bucket)
        return list(range(self.topology.nodes))

    def is_abandoned(self, step: int) -> bool:
        """An older step number carries a newer save: the job rolled back past ``step``."""
        hit = self._abandoned.get(step)
        if hit is None:
            newest = ((s, max(gens)) for s, gens in self._generations.items() if s < step)
            hit = self._abandoned[step] = saves.rolled_back(step, self.step_generation(step), newest)
        return hit

    def _current(self, h: Holding) -> bool:
        return h.generation >= self.step_generation(h.step)

    def pinned_steps(self) -> list[int]:
        """Steps pinned against GC (restores, the operator), ascending."""
        return sorted(self._pinned)

    def backups_in_progress(self) -> list[int]:
        """Steps being uploaded to the bucket, ascending."""
        return sorted(self._backups_in_progress)

    def status(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) for tests and small jobs: every host and every rank's sources.

        O(nodes x steps): the coordinator's typed, bounded status is built in the service.
        """
        complete = self.globally_complete_steps()
        newest = complete[-1] if complete else None
        hosts = {}
        for rank in sorted(set(self._incarnation) | set(self._holdings)):
            held = self._holdings.get(rank, {})
            hosts[rank] = {
                "incarnation": self._incarnation.get(rank),
                "inventory_reported": rank in self._reported,
                "steps": sorted({s for _, s in held}),
                "pieces": len(held),
                "bytes": sum(h.size for h in held.values() if _carries_bytes(h)),
            }
        steps = {}
        for step in self.known_steps():
            found = self.sources(step)
            steps[step] = {
                "complete": self.is_complete(step),
                "redundant": self.is_redundant(step),
                "savers": ranges(self.expected_ranks(step)),
                "missing_ranks": [r for r in self.expected_ranks(step) if r not in found],
                "ranks": {
                    r: [{"kind": str(s.kind), "holder": s.holder_rank, "owner": s.owner_rank} for s in srcs]
                    for r, srcs in found.items()
                },
            }
        return {
            "topology": self.topology.to_dict(),
            "hosts": hosts,
            "lost": dict(sorted(self._lost.items())),
            "steps": steps,
            "complete_steps": complete,
            "newest_complete_step": newest,
            "backups": {
                s: {"ranks": sorted(b), "complete": len(b) == self.topology.nodes}
                for s, b in sorted(self._bucket.items())
            },
            "in_flight": {
                "saving": [s for s in self.known_steps() if newest is None or s > newest],
                "backing_up": sorted(self._backups_in_progress),
                "pinned": sorted(self._pinned),
            },
        }

    @property
    def pinned(self) -> list[int]:
        return sorted(self._pinned)

    @property
    def backing_up(self) -> list[int]:
        return sorted(self._backups_in_progress)

    def rebuilt(self) -> CoordinatorState:
        """A copy whose derived views are recomputed from scratch (for tests: incremental == from scratch)."""
        import copy

        other = copy.deepcopy(self)
        for name in ("_auth", "_cov", "_tasks", "_by_dest", "_memo", "_expected", "_uncovered"):
            getattr(other, name).clear()
        other._complete.clear()
        other._memo_version = -1
        other._dirty = {}
        other._tasks_dirty = {}
        other._stale_all = False
        for step in other.known_steps():
            other._touch_all_groups(step)
        return other

    # -------------------------------------------------------------------------------------- internals

    def _memos(self) -> dict[Any, Any]:
        if self._memo_version != self.version:
            self._memo = {}
            self._memo_version = self.version
        return self._memo

    def _check_reporter(self, rank: int, incarnation: int | None) -> None:
        self.topology.check_rank(rank)
        known = self._incarnation.get(rank)
        if known is None:
            raise NotRegisteredError(
                f"rank {rank} is not registered; register and report the inventory again"
            )
        if incarnation is not None and check_int("incarnation", incarnation) != known:
            raise StaleIncarnationError(
                f"rank {rank}: report from incarnation {incarnation}, registered {known}"
            )

    def _validated(self, holder: int, holdings: Iterable[Holding]) -> dict[Key, Holding]:
        out: dict[Key, Holding] = {}
        for h in holdings:
            if not isinstance(h, Holding):
                raise ValueError(f"expected a Holding, got {type(h).__name__}")
            self.topology.check_rank(h.owner_rank)
            if h.tier is Tier.LOCAL and h.owner_rank != holder:
                raise ValueError(f"host {holder} reports rank {h.owner_rank}'s data as local")
            if h.tier is Tier.PEER and h.owner_rank == holder:
                raise ValueError(f"host {holder} reports its own data as a peer copy")
            if (h.tier is Tier.REPLICA and h.owner_rank != holder
                    and h.owner_rank not in self.topology.replicas_of(holder)):
                raise ValueError(f"rank {h.owner_rank} is not a data-parallel replica of host {holder}")
            prev = out.get(h.key)
            if prev is not None and prev != h:
                raise ValueError(
                    f"host {holder} reports (owner_rank, step) {h.key} twice with different data"
                )
            out[h.key] = h
        return out

    def _validated_bucket_hashes(self, hashes: Mapping[int, str | None]) -> dict[int, str | None]:
        if not isinstance(hashes, Mapping):
            raise ValueError(f"content_hashes must be a mapping rank -> hash, got {type(hashes).__name__}")
        return {self.topology.check_rank(r): check_hash(h, optional=True) for r, h in hashes.items()}

    def _add(self, holder: int, h: Holding) -> None:
        self._holdings.setdefault(holder, {})[h.key] = h
        self._index.setdefault(h.step, {}).setdefault(h.owner_rank, {})[holder] = h
        gens = self._generations.setdefault(h.step, collections.Counter())
        newest = max(gens) if gens else None
        if h.generation not in gens:
            self._abandoned.clear()  # a new save: which steps are abandoned may change
        gens[h.generation] += 1
        if h.savers or (h.step, h.generation) not in self._savers:
            self._savers[(h.step, h.generation)] = h.savers
        if newest is not None and h.generation != newest:
            self._touch_all_groups(h.step)  # another save of this step: which copies count may change
        self._touch(h.step, h.owner_rank)

    def _remove(self, holder: int, key: Key) -> None:
        held = self._holdings.get(holder)
        if not held or key not in held:
            return
        gone = held.pop(key)
        if not held:
            del self._holdings[holder]
        gens = self._generations[gone.step]
        before = max(gens)
        gens[gone.generation] -= 1
        if gens[gone.generation] <= 0:
            del gens[gone.generation]
            self._abandoned.clear()
            self._savers.pop((gone.step, gone.generation), None)
            if not gens:
                del self._generations[gone.step]
            elif max(gens) != before:
                self._touch_all_groups(gone.step)
        marked = self._deleting.get(holder)
        if marked is not None and key in marked:
            marked.discard(key)  # not indexed while its deletion was in flight
            if not marked:
                del self._deleting[holder]
            self._touch(gone.step, gone.owner_rank)
        else:
            self._unindex(holder, gone)

    def _unindex(self, holder: int, h: Holding) -> None:
        owner, step = h.key
        by_owner = self._index[step]
        del by_owner[owner][holder]
        if not by_owner[owner]:
            del by_owner[owner]
        if not by_owner:
            del self._index[step]
        self._touch(step, owner)

    def _index_add(self, holder: int, h: Holding) -> None:
        self._index.setdefault(h.step, {}).setdefault(h.owner_rank, {})[holder] = h
        self._touch(h.step, h.owner_rank)

    def _drop_holdings(self, holder: int) -> None:
        for key in list(self._holdings.get(holder, {})):
            self._remove(holder, key)

    def _touch(self, step: int, owner: int) -> None:
        """A fact about ``owner``'s ``step`` data changed: its replica group must be re-derived."""
        self.version += 1
        self._dirty.setdefault(step, set()).add(owner % self._h)

    def _touch_all_groups(self, step: int) -> None:
        self.version += 1
        self._dirty.setdefault(step, set()).update(range(self.topology.hosts_per_slice))

    def _replan_all(self) -> None:
        """The set of lost hosts changed: copy destinations of every group may change (O(1) now; the
        next query for copy tasks re-derives them once, however many hosts were lost meanwhile).
        Coverage, completeness and restore plans do not depend on it and stay as they are."""
        self.version += 1
        self._stale_all = True

    def _refresh(self, tasks: bool = False) -> None:
        """Bring the derived views up to date: coverage and completeness always, copy tasks when asked
        (only :meth:`replication_plan` and :meth:`tasks_for` read them, so a restore right after a slice
        is lost does not wait for every group's copy plan)."""
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            for step, groups in dirty.items():
                self._refresh_coverage(step, groups)
        if not tasks:
            return
        if self._stale_all:
            self._stale_all = False
            every = set(range(self.topology.hosts_per_slice))
            for step in self.known_steps():
                self._tasks_dirty[step] = set(every)
        if self._tasks_dirty:
            dirty, self._tasks_dirty = self._tasks_dirty, {}
            for step, groups in dirty.items():
                for g in groups:
                    self._derive_tasks(step, g)

    def _refresh_coverage(self, step: int, groups: set[int]) -> None:
        if step not in self._index and step not in self._bucket:
            for view in (self._auth, self._cov, self._tasks, self._by_dest, self._expected, self._uncovered,
                         self._tasks_dirty):
                view.pop(step, None)
            self._complete.discard(step)
            return
        self._tasks_dirty.setdefault(step, set()).update(groups)
        key = self._expected_key(step)
        cached = self._expected.get(step)
        cov = self._cov.setdefault(step, {})
        if cached is None or cached[0] != key or step not in self._uncovered:
            for g in groups:
                self._derive_coverage(step, g)
            expected = frozenset(self.expected_ranks(step))
            self._expected[step] = (key, expected)
            uncovered = sum(1 for r in expected if r not in cov)
        else:
            expected = cached[1]
            uncovered = self._uncovered[step]
            for g in groups:
                members = self._members[g]
                before = sum(1 for r in members if r in expected and r in cov)
                self._derive_coverage(step, g)
                uncovered -= sum(1 for r in members if r in expected and r in cov) - before
        self._uncovered[step] = uncovered
        if uncovered == 0:
            self._complete.add(step)
        else:
            self._complete.discard(step)

    def _expected_key(self, step: int) -> Any:
        """What :meth:`expected_ranks` of ``step`` depends on, cheaply (a bucket-only step: its ranks)."""
        gens = self._generations.get(step)
        if gens:
            gen = max(gens)
            return ("saved", gen, self._savers.get((step, gen), ()))
        bucket = self._bucket.get(step)
        return ("bucket", frozenset(bucket) if bucket else None)

    def _derive_coverage(self, step: int, group: int) -> None:
        """Recompute the accepted hashes and sources of one replica group of one step from the facts."""
        members = self._members[group]
        by_owner = self._index.get(step, {})
        bucket = self._bucket.get(step, {})
        auth = self._auth.setdefault(step, {})
        for o in members:
            current = {x: h for x, h in by_owner.get(o, {}).items() if self._current(h)}
            a = self._auth_one(current, bucket, o)
            if a is None:
                auth.pop(o, None)
            else:
                auth[o] = a
        cov = self._cov.setdefault(step, {})
        for r in members:
            found = self._rank_sources(step, r, auth)
            if found:
                cov[r] = tuple(found)
            else:
                cov.pop(r, None)

    def _derive_tasks(self, step: int, group: int) -> None:
        """Recompute the copy tasks of one replica group of one step (its coverage is current)."""
        auth = self._auth.get(step, {})
        by_dest = self._by_dest.setdefault(step, {})
        for t in self._tasks.get(step, {}).get(group, ()):
            slot = by_dest.get(t.dest_rank)
            if slot is not None:
                slot.pop(group, None)
                if not slot:
                    del by_dest[t.dest_rank]
        tasks = self._group_tasks(step, group, auth)
        per_dest: dict[int, list[CopyTask]] = {}
        for t in tasks:
            per_dest.setdefault(t.dest_rank, []).append(t)
        for dest, ts in per_dest.items():
            by_dest.setdefault(dest, {})[group] = tuple(ts)
        if tasks:
            self._tasks.setdefault(step, {})[group] = tuple(tasks)
        else:
            self._tasks.get(step, {}).pop(group, None)

    def _group_tasks(self, step: int, group: int, auth: Mapping[int, _Auth]) -> list[CopyTask]:
        by_owner = self._index.get(step, {})
        want_total = min(1 + self.topology.replicas, self.topology.nodes)
        load: collections.Counter[int] = collections.Counter()
        count: collections.Counter[int] = collections.Counter()
        tasks = []
        for owner in self._members[group]:
            a = auth.get(owner)
            if a is None or a.content_hash is None:
                continue
            pieces = by_owner.get(owner, {})
            holders = sorted(
                x for x, h in pieces.items() if _carries_bytes(h) and h.content_hash == a.content_hash
            )
            attested, identical = [], []
            for rep in self._members[group]:
                if rep == owner or not self._holds_local(step, rep, a.content_hash):
                    continue
                claim = pieces.get(rep)
                if claim is not None and claim.tier is Tier.REPLICA and claim.content_hash == a.content_hash:
                    attested.append(rep)
                else:
                    identical.append(rep)
            for rep in identical:
                rep_size = by_owner[rep][rep].size
                tasks.append(CopyTask(owner, step, rep, rep, a.content_hash, rep_size, hash_only=True))
            have = set(holders) | set(attested) | set(identical)
            mine = pieces.get(owner)
            if mine is not None and mine.tier is Tier.REPLICA and mine.content_hash == a.content_hash:
                have.add(owner)  # the owner's host holds it as a replica's bytes (restored from them)
            needed = want_total - len(have)
            if needed <= 0 or not holders:
                continue  # enough copies, or no bytes of this rank's data to copy from
            size = pieces[holders[0]].size
            dests = list(
                itertools.islice(
                    (x for x in self._live_preference(owner) if x not in self._lost and x not in have),
                    needed,
                )
            )
            for dest in dests:
                src = min(
                    holders,
                    key=lambda x, d=dest: (load[x], count[x], self.topology.ring_distance(x, d), x),
                )
                load[src] += size
                count[src] += 1
                tasks.append(CopyTask(owner, step, src, dest, a.content_hash, size))
        return tasks

    def _live_preference(self, owner: int) -> Iterator[int]:
        """:meth:`JobTopology.iter_copy_preference` without the slices whose every host is lost.

        Same order; skipping dead slices keeps re-planning after a slice loss O(hosts), not O(hosts^2).
        """
        d, h = self.topology.data_parallelism, self._h
        s, i = divmod(owner, h)
        lost_in: collections.Counter[int] = self._lost_per_slice
        others = [(s + ds) % d for ds in range(1, d) if lost_in[(s + ds) % d] < h]
        if others:
            for di in range(h):
                for sl in others:
                    yield sl * h + (i + di) % h
        if lost_in[s] < h:
            for di in range(1, h):
                yield s * h + (i + di) % h

    @staticmethod
    def _auth_one(holders: Mapping[int, Holding], bucket: Mapping[int, str | None], owner: int) -> _Auth | None:
        """The accepted hash of ``owner``'s data of one step.

        Definitive: the owner's local copy, else the bucket's. Otherwise the hash most copies (and
        replica attestations) agree on, ties by smallest hash.
        """
        mine = holders.get(owner)
        if mine is not None and mine.tier is Tier.LOCAL:
            return _Auth(mine.content_hash, True)
        if bucket.get(owner) is not None:
            return _Auth(bucket[owner], True)
        if holders:
            votes = collections.Counter(h.content_hash for h in holders.values())
            best = min(votes.items(), key=lambda kv: (-kv[1], kv[0]))[0]
            return _Auth(best, False)
        if owner in bucket:
            return _Auth(None, False)
        return None

    def _rank_sources(self, step: int, rank: int, auth: Mapping[int, _Auth]) -> list[Source]:
        """Valid sources of ``rank``'s data: its own or an identical replica's, local < peer < bucket."""
        by_owner = self._index.get(step, {})
        mine = auth.get(rank)
        want = mine.content_hash if mine is not None else None
        found = []
        group = self._members[rank % self._h]
        for owner in (rank, *(m for m in group if m != rank)):
            a = auth.get(owner)
            for holder, h in by_owner.get(owner, {}).items():
                if not self._current(h):
                    continue  # a copy of an abandoned save of this step number (before a rollback)
                if not _carries_bytes(h) or a is None or h.content_hash != a.content_hash:
                    continue  # an attestation, or a stale copy of an older save of this step
                if owner != rank and h.content_hash != want:
                    continue  # a replica's data counts only when proven identical
                kind = Tier.LOCAL if holder == rank else Tier.PEER
                found.append(Source(kind, holder, owner, h.content_hash, h.size))
        bucket = self._bucket.get(step, {})
        if rank in bucket:
            b = bucket[rank]
            if b is None or want is None or b == want:
                size = found[0].size if found else 0
                found.append(Source(Tier.BUCKET, None, rank, b if b is not None else want, size))
        order = {Tier.LOCAL: 0, Tier.PEER: 1, Tier.BUCKET: 2}
        found.sort(key=lambda s: (order[s.kind], s.owner_rank != rank, s.holder_rank or 0, s.owner_rank))
        return found


def _carries_bytes(h: Holding) -> bool:
    return h.tier is not Tier.REPLICA


def _holder_id(s: Source) -> int | str:
    return _BUCKET_HOLDER if s.holder_rank is None else s.holder_rank
