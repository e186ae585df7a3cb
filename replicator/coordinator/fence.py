"""Coordinator failover state: whether this candidate serves, under which epoch, and the highest epoch seen.

Hosts report the highest epoch they accepted; a coordinator that hears of a newer one than its own has
been deposed (another candidate took over) and stops serving. See ``docs/coordinator.md``. Not
thread-safe: the service's lock guards it.
"""

from __future__ import annotations

# The low bits of an epoch name the candidate that chose it, so two candidates never serve under the same
# epoch: both fall back to "highest epoch seen + 1" when their clocks are behind it (clock skew), and with
# equal epochs the fence cannot tell the newer coordinator (issue #33, simulation seed 81300).
CANDIDATE_BITS = 8
MAX_CANDIDATES = 1 << CANDIDATE_BITS


def candidate_epoch(at_least: int, candidate: int) -> int:
    """The smallest epoch >= ``at_least`` whose low :data:`CANDIDATE_BITS` bits are ``candidate``."""
    if not 0 <= candidate < MAX_CANDIDATES:
        raise ValueError(f"candidate index {candidate} outside 0..{MAX_CANDIDATES - 1}")
    return at_least + (candidate - at_least) % MAX_CANDIDATES


class EpochFence:
    """``active``/``epoch`` of this candidate and ``max_seen``, the highest epoch any host reported.

    ``candidate``: this coordinator's index among the candidates (its epochs end in it, see
    :func:`candidate_epoch`); None (a single coordinator, tests): epochs as given.
    """

    def __init__(self, candidate: int | None = None) -> None:
        if candidate is not None:
            candidate_epoch(0, candidate)  # validates the index
        self.candidate = candidate
        self.active = False
        self.epoch = 0
        self.max_seen = 0

    def activate(self, epoch: int) -> None:
        """Serve with ``epoch``, raised above every epoch a host may have accepted before (and to the next
        one that names this candidate)."""
        epoch = max(int(epoch), self.max_seen + 1)
        self.epoch = epoch if self.candidate is None else candidate_epoch(epoch, self.candidate)
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
