"""What a host may delete from its RAM disk. Part of :class:`CoordinatorState` (see its :meth:`gc_plan`)."""

from __future__ import annotations

from collections.abc import Callable

from replicator.coordinator.coverage import Coverage
from replicator.coordinator.facts import Facts
from replicator.tiers import Holding, Key, Tier


def _protected(facts: Facts, coverage: Coverage) -> tuple[set[int], int | None, set[int]]:
    """(complete steps, the newest of them, the steps GC never touches)."""
    complete = set(coverage.complete_steps())
    newest = max(complete) if complete else None
    protected = facts.backups_in_progress | facts.pinned
    # The newest durable step (it stays complete whichever one host is lost: each rank's data and the record
    # that it is that rank's) stays until a newer one is durable too: while the newest complete step is not (its
    # copies or witnesses in flight, or their holder cut off and not yet declared lost), it is the step that
    # survives a loss (issue #33; seed 19 of tests/simulation: two holders of a rank's bytes, its identity known
    # from one host's report, are not durable). In ec mode also the newest step every code group of which has
    # all its parity (it survives M hosts of each group).
    for kept in (coverage.newest_durable_step(), coverage.newest_redundant_step()):
        if kept is not None and kept != newest:
            protected = protected | {kept}
    # ec mode: the step whose parity is being computed stays until it has it (every member's data is read for it).
    coding = coverage.coding_step()
    if coding is not None:
        protected = protected | {coding}
    return complete, newest, protected


def _too_old(facts: Facts, step: int, newest_held: set[int], complete: set[int], newest: int | None) -> bool:
    """``step`` is beyond the host's newest steps, older than the newest complete step and incomplete, or
    rolled back past."""
    return (step not in newest_held or (newest is not None and step < newest and step not in complete)
            or (newest is not None and facts.is_abandoned(step)))


def gc_for(facts: Facts, coverage: Coverage, holder: int, keep_local: int) -> list[Key]:
    """The pieces host ``holder`` may delete, in O(what it holds) (``keep_local`` is validated)."""
    held = facts.holdings.get(holder)
    if not held:
        return []
    complete, newest, protected = _protected(facts, coverage)
    newest_held = set(sorted({s for _, s in held}, reverse=True)[:keep_local])
    doomed = []
    for key, h in held.items():
        step = h.step
        if not facts.current(h):
            # A copy of an abandoned save of the step (the job rolled back and saved it again): never a
            # source, whatever protects the step (its newest save may be the newest complete step).
            doomed.append(key)
            continue
        if step in protected or step == newest:
            continue
        drop = _too_old(facts, step, newest_held, complete, newest)
        if not drop and h.tier is not Tier.LOCAL:
            a = coverage.auth.get(step, {}).get(h.owner_rank)
            drop = a is not None and a.definitive and a.content_hash != h.content_hash
        if drop:
            doomed.append(key)
    return sorted(doomed, key=lambda k: (k[1], k[0]))


def parity_gc_for(facts: Facts, coverage: Coverage, counts: Callable[[int, int], bool], holder: int,
                  keep_local: int) -> list[Holding]:
    """The parity holdings host ``holder`` may delete: parity that counts for nothing (corrupt, of another code
    group, made obsolete by a re-save, or any parity in copies mode) whatever protects its step, and parity of a
    step its data would go with (the rules of :func:`gc_for`). ``counts(holder, step)``: that parity counts
    (:meth:`~replicator.coordinator.parity.ParityView.counts`)."""
    mine = facts.parity.get(holder)
    if not mine:
        return []
    deleting = facts.parity_deleting.get(holder, set())
    complete, newest, protected = _protected(facts, coverage)
    steps = {s for _, s in facts.holdings.get(holder, {})} | set(mine)
    newest_held = set(sorted(steps, reverse=True)[:keep_local])
    doomed = []
    for step, h in sorted(mine.items()):
        if step in deleting:
            continue
        if not counts(holder, step):
            doomed.append(h)
        elif step not in protected and step != newest and _too_old(facts, step, newest_held, complete, newest):
            doomed.append(h)
    return doomed
