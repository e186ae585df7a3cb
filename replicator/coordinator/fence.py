"""Coordinator failover state: whether this candidate serves, under which epoch, and the highest epoch seen.

Hosts report the highest epoch they accepted; a coordinator that hears of a newer one than its own has
been deposed (another candidate took over) and stops serving. See ``docs/coordinator.md``. Not
thread-safe: the service's lock guards it.
"""

from __future__ import annotations


class EpochFence:
    """``active``/``epoch`` of this candidate and ``max_seen``, the highest epoch any host reported."""

    def __init__(self) -> None:
        self.active = False
        self.epoch = 0
        self.max_seen = 0

    def activate(self, epoch: int) -> None:
        """Serve with ``epoch``, raised above every epoch a host may have accepted before."""
        self.epoch = max(int(epoch), self.max_seen + 1)
        self.active = True

    def deactivate(self) -> None:
        self.active = False

    def observe(self, known_epoch: int) -> bool:
        """Record a host's accepted epoch; True (and inactive from now on) when it is newer than ours."""
        self.max_seen = max(self.max_seen, known_epoch)
        if known_epoch > self.epoch:
            self.active = False
            return True
        return False
