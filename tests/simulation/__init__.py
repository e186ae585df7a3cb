"""Deterministic simulation of the control plane (issue #19 item 3); see docs/testing.md."""

from __future__ import annotations

import time
from typing import Any


def run_seeds(seeds: range | list[int], *, keep_trace: bool = False) -> dict[str, Any]:
    """Run one schedule per seed; returns counts and, per invariant, the seeds that violated it."""
    from tests.simulation.model import Sim

    t0 = time.perf_counter()
    events = 0
    by_invariant: dict[str, list[int]] = {}
    first: dict[str, str] = {}
    shortest: dict[str, tuple[int, int]] = {}  # invariant -> (seed, events until its violation), fewest events
    for seed in seeds:
        sim = Sim(seed, keep_trace=keep_trace)
        found = sim.run()
        events += sim.events
        for name, msg in found.items():
            by_invariant.setdefault(name, []).append(seed)
            first.setdefault(name, f"seed {seed}: {msg}")
            n = sim.violation_events[name]
            if name not in shortest or n < shortest[name][1]:
                shortest[name] = (seed, n)
    return {"schedules": len(seeds), "events": events,
            "violations": sum(len(v) for v in by_invariant.values()),
            "seconds": round(time.perf_counter() - t0, 2), "by_invariant": by_invariant, "first": first,
            "shortest": shortest}


def replay(seed: int) -> tuple[dict[str, str], list[str]]:
    """Run one seed again with its event trace."""
    from tests.simulation.model import Sim

    sim = Sim(seed, keep_trace=True)
    return sim.run(), sim.trace
