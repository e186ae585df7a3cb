"""The coordinator service's per-step bookkeeping beyond the planner: the restore target and first-seen times.

Not thread-safe: the service's lock guards both.
"""

from __future__ import annotations

from replicator.coordinator.planner import CoordinatorState


class RestoreTarget:
    """The step every host should hold locally: a pinned restore, else the newest complete step.

    A restore is pinned by PrepareRestore (or the operator's ``--restore-from-backup``, ``forced``). Once
    served, the pin is released when a step newer than every step known at that time completes (training
    resumed and saved); until it is served, it is kept.
    """

    def __init__(self, state: CoordinatorState, forced: int | None = None):
        self._state = state
        self.pinned: int | None = forced
        self._floor: int | None = None  # None = not served yet
        if forced is not None:
            state.pin(forced)

    def current(self) -> int | None:
        newest = self._state.newest_complete_step()
        if self.pinned is not None:
            if self._floor is not None and newest is not None and newest > self._floor:
                self._state.unpin(self.pinned)
                self.pinned = self._floor = None
            else:
                return self.pinned
        return newest

    def served(self) -> int | None:
        """The pinned step when it is the target (a forced restore), marking it served; else None."""
        target = self.current()
        if target is None or self.pinned is None or target != self.pinned:
            return None
        if self._floor is None:
            self._floor = self._newest_known(target)
        return target

    def pin(self, step: int) -> None:
        """A restore of ``step`` was planned (the planner pinned it): replaces any other pin, served now."""
        if self.pinned is not None and self.pinned != step:
            self._state.unpin(self.pinned)
        self.pinned = step
        self._floor = self._newest_known(step)

    def release(self, step: int) -> bool:
        """Forget a restore pinned on ``step``; False when ``step`` is not the pinned one."""
        if self.pinned != step:
            return False
        self._state.unpin(step)
        self.pinned = self._floor = None
        return True

    def _newest_known(self, step: int) -> int:
        known = self._state.known_steps()
        return max(known[-1], step) if known else step


class FirstSeen:
    """When the coordinator first heard of each step it still tracks for replication (the copy grace
    period counts from it)."""

    def __init__(self) -> None:
        self._at: dict[int, float] = {}

    def note(self, step: int, now: float) -> float:
        """The time ``step`` was first seen (``now`` if this is the first time)."""
        return self._at.setdefault(step, now)

    def forget(self, step: int) -> None:
        self._at.pop(step, None)

    def ages(self, now: float) -> dict[int, float]:
        """step -> seconds since first seen, ascending by step."""
        return {s: now - t for s, t in sorted(self._at.items())}
