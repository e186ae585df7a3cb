"""The coordinator service's per-step bookkeeping beyond the planner: the restore target and its GC hold,
and first-seen times.

Not thread-safe: the service's lock guards both.
"""

from __future__ import annotations

from replicator.coordinator.planner import CoordinatorState


class RestoreTarget:
    """The step every host should hold locally (a pinned restore, else the newest complete step), and the
    restore's hold against GC.

    A restore is pinned by PrepareRestore (or the operator's ``--restore-from-backup``, ``forced``). As the
    target, a pin of a step older than the newest complete one (a rollback: the operator's, or a restore
    naming an older step) is released, once served, when a step newer than every step known at that time
    completes (training resumed and saved); until it is served, it is kept. A pin of the newest complete
    step (what ``CheckpointManager.restore()`` and PrepareRestore without a step take) stops being the
    target as soon as any newer step completes: a step known but incomplete when it was pinned (a host's
    report was late, a save was cut short) that completes afterwards, or is saved again after the restore,
    is progress nobody rolled back from, and the next restore must not take the older step over it (found
    by the simulation, seed 14687). Such a pin also ends when its step is unrecoverable: every host not
    declared lost has reported its inventory, some rank's data of the step is on none of them nor in the
    bucket, and an older step is complete. The restore of the newest step then takes that one, where every
    PrepareRestore used to fail on the lost step until the job started from scratch (simulation seed 4358:
    the hosts holding ranks 0 and 2's step 3 were replaced). A step incomplete only until a host that
    registered again reports (its RAM disk may have survived) keeps the pin. A rollback's pin stays: the job
    asked for that step, not the newest.

    The GC hold is kept apart from the target: the pinned step stays on every host until a step newer than
    every step known when it was pinned completes, another restore is pinned, or :meth:`release`. When the
    target moves on to a step that completed late, the job may still be reading the step it was told to
    restore, until its next PrepareRestore (found by the simulation, seeds 44803, 62014, 82150: a host cut
    off reported step 3 again mid-restore of step 1, and GC deleted step 1 under the restore).
    """

    def __init__(self, state: CoordinatorState, forced: int | None = None):
        self._state = state
        self.pinned: int | None = forced  # the target
        self._floor: int | None = None  # the target's: None = not served yet
        self.held: int | None = forced  # pinned against GC in ``state``
        self._hold_until: int | None = None  # the hold's: None = not served yet
        self._plain = False  # the pin was of the newest complete step when pinned (not a rollback)
        if forced is not None:
            state.pin(forced)

    def current(self) -> int | None:
        newest = self._state.newest_complete_step()
        if newest is not None and self._hold_until is not None and newest > self._hold_until:
            self._drop_hold()
        if self.pinned is not None:
            if self._floor is not None and newest is not None and newest > self._floor:
                self.pinned = self._floor = None
            elif self._plain and newest is not None and newest < self.pinned and self._state.all_reported():
                self.pinned = self._floor = None  # unrecoverable: no live host nor the bucket has all of it
            else:
                return self.pinned
        return newest

    def served(self) -> int | None:
        """The pinned step when it is the target (a forced restore), marking it served; else None."""
        target = self.current()
        if target is None or self.pinned is None or target != self.pinned:
            return None
        if self._floor is None:
            self._floor = self._hold_until = self._newest_known(target)
        return target

    def pin(self, step: int) -> None:
        """A restore of ``step`` was planned (the planner pinned it): replaces any other pin, served now."""
        if self.held is not None and self.held != step:
            self._state.unpin(self.held)
        self.pinned = self.held = step
        newest = self._state.newest_complete_step()
        self._hold_until = self._newest_known(step)
        self._plain = newest is not None and step >= newest
        self._floor = step if self._plain else self._hold_until

    def release(self, step: int) -> bool:
        """Forget a restore pinned on ``step``; False when ``step`` is not the pinned (held) one."""
        if self.held != step:
            return False
        self._drop_hold()
        self.pinned = self._floor = None
        return True

    def _drop_hold(self) -> None:
        if self.held is not None:
            self._state.unpin(self.held)
        self.held = self._hold_until = None

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
