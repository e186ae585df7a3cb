"""The coordinator service's per-step bookkeeping beyond the planner: the restore target and first-seen times.

Not thread-safe: the service's lock guards both.
"""

from __future__ import annotations

from replicator.coordinator.planner import CoordinatorState


class RestoreTarget:
    """The step every host should hold locally: a pinned restore, else the newest complete step.

    A restore is pinned by PrepareRestore (or the operator's ``--restore-from-backup``, ``forced``). A pin of
    a step older than the newest complete one (a rollback: the operator's, or a restore naming an older
    step) is released, once served, when a step newer than every step known at that time completes
    (training resumed and saved); until it is served, it is kept. A pin of the newest complete step (what
    ``CheckpointManager.restore()`` and PrepareRestore without a step take) is released as soon as any newer
    step completes: a step known but incomplete when it was pinned (a host's report was late, a save was
    cut short) that completes afterwards, or is saved again after the restore, is progress nobody rolled
    back from, and the next restore must not take the older step over it (found by the simulation, seed
    14687).
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
        newest = self._state.newest_complete_step()
        self._floor = step if newest is not None and step >= newest else self._newest_known(step)

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
