"""The coordinator's hosts: which process (incarnation) of each rank is registered, which reported an inventory,
and liveness (when each was last heard from, which were declared lost). Part of :class:`CoordinatorState`.

Pure bookkeeping: the caller validates ranks and incarnations and passes ``now`` (the planner has no clock).
"""

from __future__ import annotations

import collections

from replicator.coordinator.model import StaleIncarnationError
from replicator.coordinator.topology import JobTopology

RETIRED_INCARNATIONS_KEPT = 8  # per rank: bounds memory; older stale processes are long gone


class HostRegistry:
    """Registrations and liveness of the job's hosts (rank -> incarnation, reported, last seen, lost since)."""

    def __init__(self, topology: JobTopology):
        self.topology = topology
        self.incarnation: dict[int, int] = {}
        # rank -> incarnations that a newer registration superseded (bounded): their reports are stale.
        self._retired: dict[int, collections.deque[int]] = {}
        self.reported: set[int] = set()
        # Liveness: rank -> when it was declared lost; rank -> last report, oldest first.
        self.lost: dict[int, float] = {}
        self.lost_per_slice: collections.Counter[int] = collections.Counter()
        self.seen: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.reregistered = 0

    def admit(self, rank: int, incarnation: int) -> bool:
        """Record ``incarnation`` as ``rank``'s process; True when it is a new one (it must report again).

        The registration that arrives last wins; one that a later registration superseded raises
        :class:`StaleIncarnationError`.
        """
        known = self.incarnation.get(rank)
        if known == incarnation:
            return False
        retired = self._retired.setdefault(rank, collections.deque(maxlen=RETIRED_INCARNATIONS_KEPT))
        if incarnation in retired:
            raise StaleIncarnationError(f"rank {rank}: incarnation {incarnation} was superseded by {known}")
        if known is not None:
            retired.append(known)
        self.reported.discard(rank)
        self.incarnation[rank] = incarnation
        return True

    def found(self, rank: int) -> bool:
        """``rank`` registered again: True when it had been declared lost (the set of lost hosts changed)."""
        if self.lost.pop(rank, None) is None:
            return False
        self.lost_per_slice[self.topology.slice_of(rank)] -= 1
        self.reregistered += 1
        return True

    def forget(self, rank: int, now: float) -> bool:
        """Drop ``rank``'s registration and declare it lost at ``now``; True when it was not lost already."""
        self.reported.discard(rank)
        self.incarnation.pop(rank, None)
        self.seen.pop(rank, None)
        if rank in self.lost:
            return False
        self.lost[rank] = now
        self.lost_per_slice[self.topology.slice_of(rank)] += 1
        return True

    def watch(self, rank: int, now: float) -> None:
        """Start ``rank``'s lost-host clock at ``now`` unless it is lost or already watched."""
        if rank not in self.lost and rank not in self.seen:
            self.seen[rank] = now

    def saw(self, rank: int, now: float) -> None:
        """``rank`` reported at ``now`` (O(1): the watch list stays ordered oldest first)."""
        self.seen[rank] = now
        self.seen.move_to_end(rank)

    def oldest(self) -> tuple[int, float] | None:
        """The watched host heard from longest ago and when, or None when none is watched."""
        return next(iter(self.seen.items()), None)

    def heard_since(self, since: float, at_most: int) -> int:
        """How many watched hosts reported at ``since`` or later, counted up to ``at_most`` (O(at_most): the
        watch list is ordered oldest first, so the newest reports are at its end)."""
        n = 0
        for t in reversed(self.seen.values()):
            if t < since or n >= at_most:
                break
            n += 1
        return n
