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
            log.info("rank %d reports no preemption notice any more (a new process)%s", rank,
                     "" if self._ranks else ": the job's notice is over")

    def forget(self, rank: int) -> None:
        """Host ``rank`` was declared lost: its notice is over."""
        self._ranks.discard(rank)
