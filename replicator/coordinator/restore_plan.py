"""Which step every rank restores and, per rank, the fastest source of its data. Part of :class:`CoordinatorState`
(which memoises the answer per version and pins the chosen step)."""

from __future__ import annotations

import collections
import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Liveness:
    """What a host's restore sources depend on besides the facts: the caller's clock and its bounds.

    ``silent_after_seconds``: a host not heard from for longer is taken to be restarting (its daemon down: a
    fetch from it waits for its restart first). ``peer_wait_seconds``: how long a rank whose data comes from
    the bucket waits for a byte-identical replica's host that fetches it (then copies from that host) before
    it is sent to the bucket itself.
    """

    now: float
    silent_after_seconds: float
    peer_wait_seconds: float


def restore_sources(facts: Facts, coverage: Coverage, hosts: HostRegistry, held: dict[int, tuple[int, float]],
                    step: int, rank: int, live: Liveness) -> list[Source]:
    """Where host ``rank`` fetches its data of ``step`` from, best first ([]: it waits for now).

    :meth:`Coverage.rank_sources`, with two rules of the restore's own:

    - one fetch per replica group from the bucket: when no host holds ``rank``'s data and a byte-identical
      data-parallel replica whose data no host holds either (same hash in the bucket) is fetched by a live
      host of a smaller rank, ``rank`` waits (no source) until that host holds it (then it is a peer source,
      faster than the bucket) or for ``live.peer_wait_seconds`` (then the bucket, as before). Each bucket read
      of a replica group's content is then made once, not once per replica (issue #48: ``restore_all_lost``).
      ``held``: rank -> (step, since when it waits), the coordinator's own record (one entry per rank).
    - a peer that is restarting, has not reported since its registration, or is itself restoring ``step`` is
      offered after the settled ones (it holds the data, but asking it first waits for its restart or competes
      with its own restore; issue #48).
    """
    srcs = coverage.rank_sources(step, rank)
    if srcs and srcs[0].kind is Tier.BUCKET and _fetching_replica(facts, coverage, hosts, step, rank, live) is not None:
        since = held.get(rank)
        if since is None or since[0] != step:
            since = held[rank] = (step, live.now)
        if live.now - since[1] < live.peer_wait_seconds:
            return []
        return srcs
    held.pop(rank, None)
    if sum(1 for s in srcs if s.kind is Tier.PEER) < 2:
        return srcs
    cov = coverage.cov.get(step, {})

    def unsettled(s: Source) -> bool:
        x = s.holder_rank
        if s.kind is not Tier.PEER or x is None:
            return False
        if not _live(hosts, x, live):
            return True
        own = cov.get(x)
        return own is not None and own[0].kind is not Tier.LOCAL  # it is restoring its own data of the step

    return sorted(srcs, key=lambda s: (s.kind is not Tier.LOCAL, s.kind is not Tier.PEER, unsettled(s)))


def _live(hosts: HostRegistry, rank: int, live: Liveness) -> bool:
    """``rank`` reported its inventory to this coordinator since it registered and was heard from lately."""
    seen = hosts.seen.get(rank)
    return rank in hosts.reported and seen is not None and live.now - seen <= live.silent_after_seconds


def _fetching_replica(facts: Facts, coverage: Coverage, hosts: HostRegistry, step: int, rank: int,
                      live: Liveness) -> int | None:
    """The smallest rank among ``rank``'s byte-identical data-parallel replicas whose data only the bucket holds
    and whose host will fetch it from there (:func:`_coming`), when that is not ``rank`` itself; else None."""
    bucket = facts.bucket.get(step, {})
    mine = bucket.get(rank)
    if mine is None:
        return None  # no hash recorded in the bucket: identity unproven
    cov = coverage.cov.get(step, {})
    for m in sorted(facts.topology.replicas_of(rank)):
        if m > rank:
            break
        theirs = cov.get(m)
        if bucket.get(m) == mine and theirs and theirs[0].kind is Tier.BUCKET and _coming(hosts, m, live):
            return m
    return None


def _coming(hosts: HostRegistry, rank: int, live: Liveness) -> bool:
    """``rank``'s host will fetch its data: it is live, or it has not reported since this coordinator or its
    process started (a job's hosts start one by one; one that never reports is waited for at most
    ``live.peer_wait_seconds``). Not when it is lost or silent since its report (restarting again)."""
    if rank in hosts.lost:
        return False
    return rank not in hosts.reported or _live(hosts, rank, live)
