"""Isolation: a serving coordinator that is most likely the one cut off decides nothing until it hears again.

Serving, with other candidates, a host declared lost and every host but one (its own) silent for at least the
takeover delay (long enough for another candidate to have taken them over): most likely this coordinator is
the one cut off (a partition), and another candidate serves the rest with a newer epoch. It then decides
nothing (no deletion, copy, restore or backup task) and answers no client (``UNAVAILABLE``: callers try the
next candidate), until another host reports again — whose report deposes it if that host accepted a newer
epoch meanwhile. Its view is stale, not wrong to keep.

Isolated from the *first* host declared lost, not the last: the others fall silent together but are declared
lost one by one (a beat apart), and a view without some of them may say an older newest complete step than it
did a moment before (make test-faults, coordinator-host-cut: hosts 1 and 3, the two holders of rank 1's data,
declared lost before host 2: newest complete step 1, from the bucket, after 3).

When another host reports again, the hosts it declared lost are expected again (``reinstate``): it was the one
cut off, so it rebuilds its view from their reports as after a takeover (clients are answered once each
reported or was declared lost afresh), instead of answering from a view without them.

:func:`cut_off` is the question (no state changes); :meth:`Isolation.follow` the one command that enters and
leaves isolation. Not thread-safe: the service's lock guards it.
"""

from __future__ import annotations

import logging

from replicator.coordinator.planner import CoordinatorState
from sidecar.saves import format_ranks

log = logging.getLogger(__name__)


def cut_off(st: CoordinatorState, *, now: float, takeover_after: float, other_candidates: bool,
            active: bool) -> bool:
    """Is a coordinator with this view isolated at ``now`` (see the module docstring)?"""
    return (other_candidates and active and st.topology.nodes > 1 and st.lost_count() > 0
            and st.heard_since(now - takeover_after, 2) <= 1)


class Isolation:
    """Since when the coordinator has been isolated (``since``; None: it is not)."""

    def __init__(self) -> None:
        self.since: float | None = None

    def follow(self, isolated: bool, st: CoordinatorState, *, now: float, epoch: int, takeover_after: float) -> bool:
        """Enter or leave isolation as :func:`cut_off` answered (``isolated``); leaving it expects the hosts
        declared lost again. Returns ``isolated``."""
        if isolated and self.since is None:
            self.since = now
            log.warning("coordinator (epoch %d) is isolated: hosts %s declared lost and every other host but one "
                        "silent for %.1fs or more; it decides nothing and answers no client until another host "
                        "reports", epoch, format_ranks(sorted(st.lost)), takeover_after)
        elif not isolated and self.since is not None:
            back = st.reinstate(sorted(st.lost), now)
            log.info("coordinator (epoch %d) hears other hosts again after %.1fs isolated; ranks %s expected "
                     "again", epoch, now - self.since, format_ranks(back) or "none")
            self.since = None
        return isolated
