"""Which step every rank restores and, per rank, the fastest source of its data. Part of :class:`CoordinatorState`
(which memoises the answer per version and pins the chosen step)."""

from __future__ import annotations

import collections

from replicator.coordinator.coverage import Coverage
from replicator.coordinator.facts import Facts
from replicator.coordinator.hosts import HostRegistry
from replicator.coordinator.model import RestorePlan, Source
from replicator.tiers import Tier
from sidecar.saves import format_ranks


def plan_restore(facts: Facts, coverage: Coverage, hosts: HostRegistry, force_step: int | None) -> RestorePlan:
    """The plan :meth:`CoordinatorState.restore_plan` describes (coverage is current); ValueError when
    ``force_step`` is not recoverable for every rank."""
    waiting = tuple(sorted(set(hosts.incarnation) - hosts.reported))
    if force_step is not None:
        missing = coverage.missing_ranks(force_step)
        if missing:
            raise ValueError(
                f"step {force_step} is not recoverable: no tier holds ranks {format_ranks(missing)}"
            )
        step = force_step
    else:
        newest_complete = coverage.newest_complete_step()
        if newest_complete is None:
            known = facts.known_steps()
            if known:
                newest = known[-1]
                reason = (
                    f"no step is recoverable for every rank; newest known step {newest} lacks ranks "
                    f"{format_ranks(coverage.missing_ranks(newest))}"
                )
            else:
                reason = "no step is recoverable for every rank: nothing reported on any tier"
            return RestorePlan(None, {}, reason, waiting)
        step = newest_complete
    found = coverage.cov[step]
    ring_distance = facts.topology.ring_distance
    load: collections.Counter[int] = collections.Counter()
    count: collections.Counter[int] = collections.Counter()
    chosen: dict[int, Source] = {}
    for rank in facts.expected_ranks(step):
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
                    ring_distance(r, s.holder_rank),
                    s.owner_rank,
                ),
            )
            load[pick.holder_rank] += pick.size
            count[pick.holder_rank] += 1
        else:
            pick = srcs[0]  # a rebuild from parity (ec mode), else the bucket
        chosen[rank] = pick
    kinds = collections.Counter(str(s.kind) for s in chosen.values())
    how = ", ".join(f"{kinds[k]} {k}" for k in (Tier.LOCAL, Tier.PEER, Tier.PARITY, Tier.BUCKET) if kinds[k])
    what = "operator-forced step" if force_step is not None else "newest globally complete step"
    return RestorePlan(step, chosen, f"{what} {step}: {how}", waiting)
