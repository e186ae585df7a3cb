"""The shape of a schedule in time (issue #45 item 3): bursts of faults with lulls between them, and the quiet
phase's end once the job has settled.

Faults at a fixed rate rarely left a step time to become durable (in seeds 0-299, 42 % of the schedules never
made a step durable and 20 % never completed one), so ``newest-complete-regressed``, ``complete-step-lost``
and ``gc-protected`` had nothing to guard there. Now the fault window is a series of lulls and bursts:

- a lull lasts until the trainer trains and a step saved after the lull began is durable (by the invariants'
  own check: it stays complete whichever single host is lost), or ``LULL_MAX_SECONDS`` at most (a host still
  down, a partition, a restore that cannot finish); the first fault of the next burst then comes within
  ``FIRST_FAULT_SECONDS`` (often right after the step became durable: the case the invariants guard);
- a burst is 1-3 of the schedule's faults at its usual rate; after the second lull the faults go on at that
  rate until the window ends (``MAX_LULLS``);
- a lull's time does not count towards the fault window (``Sim.fault_end`` moves on by it), which is
  ``WINDOW_SECONDS`` of faults (8-16 s before the lulls), and only the discrete faults pause: lost,
  duplicated and delayed messages go on;
- one schedule in ``P_START_WITH_BURST`` starts with a burst (faults before any step is durable), the others
  with a lull.

The trainer saves until ``SAVES_AFTER_WINDOW_SECONDS`` after the window (4 s before the lulls). The quiet phase
then ends early once the job has settled (:meth:`Phases.settled`): every host up and idle, the trainer
training, every host's newest report taken by the serving coordinator, whose facts have not changed for
``SETTLED_SECONDS``, no backup running, and every liveness invariant holding of a complete step; otherwise it
runs its full length (16 s). Settled, nothing is left to happen without a new save or fault: each heartbeat
reports the digest the coordinator acknowledged and is answered with no work. What is given up: a defect
that would show only after a settled job sat idle for longer.

Draws come from a generator of their own (``calm=False``: the schedule as before, for the guard seeds).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.simulation.model import Sim

LULL_MAX_SECONDS = 10.0  # a save every 1.5-4 s, its commits, a report, copies and the next report: ~3-8 s
MAX_LULLS = 2
WINDOW_SECONDS = (5.0, 10.0)  # the fault window without its lulls, drawn uniformly
POLL_SECONDS = 0.5  # how often a lull looks whether it is over
FIRST_FAULT_SECONDS = 1.0  # the next burst's first fault comes within this after the lull ends
P_START_WITH_BURST = 0.1
SETTLED_SECONDS = 2.0  # the coordinator's facts unchanged this long (two heartbeats) before the quiet phase ends
SAVES_AFTER_WINDOW_SECONDS = 2.0


class Phases:
    """One schedule's lulls and bursts, and whether its quiet phase may end (module docstring)."""

    def __init__(self, seed: int, on: bool | None):
        self.on = True if on is None else on
        self.rng = random.Random(seed * 1000003 + 45)
        self.goal: int | None = None  # in a lull: a step at least this new must become durable
        self.since = 0.0  # when the lull began
        self.burst_left = 0
        self.lulls_calm = 0  # lulls that ended with a new durable step
        self.lulls_timed_out = 0
        self.lulls = 0
        self._settled: tuple[int, int] | None = None  # (coordinator id, facts version) when first seen settled
        self._settled_at = 0.0
        self.window = self.rng.uniform(*WINDOW_SECONDS)

    def start(self, sim: Sim) -> tuple[float, str]:
        """At virtual time 0: when the first fault event comes, or the first lull's first look."""
        if not self.on:
            return sim.cfg.fault_every, "fault"
        # The window without lulls (an ec schedule's 4 s longer: a step's parity takes a while).
        sim.fault_end = self.window + (4.0 if sim.ec is not None else 0.0)
        if self.rng.random() < P_START_WITH_BURST:
            self.burst_left = self.rng.randint(1, 3)
            return sim.cfg.fault_every, "fault"
        self._lull(sim)
        return POLL_SECONDS, "lull"

    def saves_until(self, sim: Sim) -> float:
        return sim.fault_end + (SAVES_AFTER_WINDOW_SECONDS if self.on else 4.0)

    def _lull(self, sim: Sim) -> None:
        self.goal, self.since = sim.next_step, sim.clock.now
        self.lulls += 1
        sim.fault_end += LULL_MAX_SECONDS  # the lull's time does not count: the end moves back when it ends
        sim.note(f"lull: no fault until a step >= {self.goal} is durable ({LULL_MAX_SECONDS:.0f} s at most)")

    def lull_over(self, sim: Sim) -> float | None:
        """In a lull: None while it lasts, else the seconds until the next burst's first fault."""
        assert self.goal is not None
        now = sim.clock.now
        calm = sim.training and (sim.max_durable_seen or -1) >= self.goal
        if not calm and now - self.since < LULL_MAX_SECONDS:
            return None
        sim.fault_end -= LULL_MAX_SECONDS - (now - self.since)
        if calm:
            self.lulls_calm += 1
        else:
            self.lulls_timed_out += 1
        sim.note(f"lull ends ({'step ' + str(sim.max_durable_seen) + ' is durable' if calm else 'timed out'})")
        self.goal = None
        self.burst_left = self.rng.randint(1, 3)
        return self.rng.uniform(0.0, FIRST_FAULT_SECONDS)

    def after_fault(self, sim: Sim) -> bool:
        """A fault of the burst was injected (or drawn): True when the burst is over and a lull begins."""
        self.burst_left -= 1
        if self.burst_left != 0 or self.lulls >= MAX_LULLS:
            return False
        self._lull(sim)
        return True

    def settled(self, sim: Sim) -> bool:
        """The quiet phase may end now (module docstring); called after the saves stopped."""
        if not self.on or not sim.training or sim.restoring_since is not None:
            return False
        coord = sim.coord
        st = coord.state
        version = (id(coord), st.version)
        if (any(not h.up or h.in_flight or h.reported_to is not coord or not h.reported_current for h in sim.hosts)
                or not coord._all_reported() or st.lost_count() or getattr(coord.backup, "current", None) is not None):
            self._settled = None
            return False
        if version != self._settled:
            self._settled, self._settled_at = version, sim.clock.now
            return False
        if sim.clock.now - self._settled_at < SETTLED_SECONDS:
            return False
        return sim.inv.liveness_holds(sim)
