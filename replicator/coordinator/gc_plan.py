"""What a host may delete from its RAM disk. Part of :class:`CoordinatorState` (see its :meth:`gc_plan`)."""

from __future__ import annotations

from replicator.coordinator.coverage import Coverage
from replicator.coordinator.facts import Facts
from replicator.coordinator.model import Key, Tier


def gc_for(facts: Facts, coverage: Coverage, holder: int, keep_local: int) -> list[Key]:
    """The pieces host ``holder`` may delete, in O(what it holds) (``keep_local`` is validated)."""
    held = facts.holdings.get(holder)
    if not held:
        return []
    complete = set(coverage.complete_steps())
    newest = max(complete) if complete else None
    protected = facts.backups_in_progress | facts.pinned
    # The newest step every rank of which has two copies stays until a newer one has them too: while the
    # newest complete step has one copy of some rank (its copies in flight, or their holder cut off and not
    # yet declared lost), it is the step that survives a loss (issue #33).
    redundant = coverage.newest_redundant_step()
    if redundant is not None and redundant != newest:
        protected = protected | {redundant}
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
        drop = step not in newest_held
        drop = drop or (newest is not None and step < newest and step not in complete)
        drop = drop or not facts.current(h) or (newest is not None and facts.is_abandoned(step))
        if not drop and h.tier is not Tier.LOCAL:
            a = coverage.auth.get(step, {}).get(h.owner_rank)
            drop = a is not None and a.definitive and a.content_hash != h.content_hash
        if drop:
            doomed.append(key)
    return sorted(doomed, key=lambda k: (k[1], k[0]))
