"""Hosts a client knows are gone: a hint that shortens the wait for a coordinator after a slice is lost.

On Pathways the controller learns that a slice is down from the platform (its programs fail with the slice's
``DATA_LOSS``; pathwaysutils counts the slice down) long before any heartbeat rule would: a host is declared
lost only after :meth:`~replicator.coordinator.serving.CoordinatorCore.lost_after` of silence, and a standby
candidate takes over only after its lower candidates were silent for ``takeover_after``. When the slice lost is
the one whose first host served the coordinator, the surviving slices' restore waited for both, one after the
other (``bench.goodput --pathways``: 13.9-18 s against 0.7 s for the other slice).

So a client's ``GetSteps`` / ``PrepareRestore`` may name the ranks it knows are gone (``gone_ranks``; our
``CheckpointManager`` sends the ranks with no device among the active ones). For :data:`HINT_SECONDS` a
serving coordinator declares each of them lost as soon as it is silent: never heard by this coordinator, or
not for 1.5 heartbeat intervals (a host that still reports, e.g. of a slice back but not yet rejoined, is never
declared lost by a hint). A standby keeps the hint too: its host takes over at once when every lower
candidate's host is among the gone ones (and none of them answers its heartbeat), and once it serves, the
gone hosts it never heard are lost at once. Two coordinators never decide
together because of a hint: a host accepts the newer epoch, and its next report to the older coordinator
deposes it, as after any takeover (docs/coordinator.md).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

# How long a hint counts: long enough for the standby's host to reach its next heartbeat and take over.
HINT_SECONDS = 30.0


class GoneHint:
    """The ranks the last client named gone, and when (not thread-safe: the coordinator's lock guards it)."""

    def __init__(self) -> None:
        self.ranks: frozenset[int] = frozenset()
        self.at = float("-inf")

    def note(self, ranks: Iterable[int], now: float) -> None:
        self.ranks = frozenset(ranks)
        self.at = now

    def fresh(self, now: float) -> frozenset[int]:
        """The ranks named gone within :data:`HINT_SECONDS` of ``now`` (empty when none or too old)."""
        return self.ranks if now - self.at <= HINT_SECONDS else frozenset()

    def covers(self, ranks: Collection[int], now: float) -> bool:
        """Every one of ``ranks`` (non-empty) was named gone recently."""
        return bool(ranks) and set(ranks) <= self.fresh(now)
