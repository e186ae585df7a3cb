"""The job's preemption notice as the coordinator keeps it: which registered hosts' processes got one.

Every heartbeat of a preempting host says so. The job's notice lasts while one of them is registered: a
replacement (a new process, not preempting) or a declared loss ends it, so the job restarted after a
preemption is not told again. Not thread-safe: the service's lock guards it.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class PreemptingHosts:
    """Ranks whose current process reports a preemption notice."""

    def __init__(self) -> None:
        self._ranks: set[int] = set()
        # rank -> the steps in the bucket a GetSteps of its preemption flush was last told of.
        self._told: dict[int, frozenset[int]] = {}

    @property
    def noticed(self) -> bool:
        """Some registered host's current process got a preemption notice (the job's notice)."""
        return bool(self._ranks)

    def report(self, rank: int, preempting: bool) -> None:
        """Host ``rank``'s heartbeat said whether its process got a notice."""
        if preempting and rank not in self._ranks:
            log.warning("rank %d received a preemption notice: emergency backup of the newest complete step", rank)
            self._ranks.add(rank)
        elif not preempting and rank in self._ranks:
            self._ranks.discard(rank)  # a new process on that host (replaced): its notice is over
            self._told.pop(rank, None)
            log.info("rank %d reports no preemption notice any more (a new process)%s", rank,
                     "" if self._ranks else ": the job's notice is over")

    def forget(self, rank: int) -> None:
        """Host ``rank`` was declared lost: its notice is over."""
        self._ranks.discard(rank)
        self._told.pop(rank, None)

    def told(self, rank: int, backed_up: list[int]) -> None:
        """Host ``rank``'s preemption flush asked GetSteps and was told these steps are in the bucket."""
        self._told[rank] = frozenset(backed_up)

    def all_told(self, step: int, me: int) -> bool:
        """Every preempting host but ``me`` has been told that ``step`` is in the bucket (``step`` < 0: has
        been answered at all), so this coordinator's host may go."""
        return all(r == me or (r in self._told and (step < 0 or step in self._told[r])) for r in self._ranks)
