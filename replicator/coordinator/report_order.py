"""Heartbeat report order: a delayed or duplicated older report of a host is refused, never taken as current.

Each replicator numbers its reports (``HeartbeatRequest.report_seq``, increasing per process). The network
may deliver a report twice, or an older one after a newer one (a request queued in another server thread);
an older report's inventory is no longer the host's, and taken as current it makes the coordinator count
pieces the host has since deleted (issue #33, seeds 22603 and 34231 of tests/simulation). Not thread-safe:
the service's lock guards it.
"""

from __future__ import annotations


class StaleReportError(Exception):
    """A report not newer than the last one taken from the same incarnation of the host."""


class ReportOrder:
    """rank -> (incarnation, number of the newest report taken from it)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}

    def check(self, rank: int, incarnation: int, seq: int) -> None:
        """Raise :class:`StaleReportError` if this incarnation's report ``seq`` is not above the last one
        taken. ``seq`` 0 (a daemon that does not number its reports) is always in order."""
        last = self._last.get(rank)
        if seq > 0 and last is not None and last[0] == incarnation and seq <= last[1]:
            raise StaleReportError(f"report {seq} of rank {rank} (incarnation {incarnation}) is not newer than "
                                   f"report {last[1]} taken before: a delayed or duplicated one, ignored")

    def taken(self, rank: int, incarnation: int, seq: int) -> None:
        """Record that report ``seq`` of this incarnation was taken (after :meth:`check` and registration)."""
        if seq > 0:
            self._last[rank] = (incarnation, seq)
