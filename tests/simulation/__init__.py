"""Deterministic simulation of the control plane (issue #19 item 3); see docs/testing.md."""

from __future__ import annotations

import time
from typing import Any

Result = tuple[int, int, dict[str, str], dict[str, int], dict[str, int], tuple[bool, bool]]


def _run_chunk(seeds: list[int]) -> list[Result]:
    """(seed, events, violations, events until each violation, what an ec schedule exercised, whether a step
    was ever durable / complete) per schedule."""
    import logging

    from tests.simulation.model import Sim

    logging.disable(logging.WARNING)  # a worker process: the coordinator logs every fault it handles
    out = []
    for seed in seeds:
        sim = Sim(seed, keep_trace=False)
        found = sim.run()
        ec = {"ec schedules": 1, **sim.ec.counts} if sim.ec is not None else {}
        if sim.ec is not None:
            ec["ec durable"] = int(sim.durable_ever)
            ec["ec complete"] = int(sim.max_complete_seen is not None)
        out.append((seed, sim.events, found, dict(sim.violation_events), ec,
                    (sim.durable_ever, sim.max_complete_seen is not None)))
    return out


def run_seeds(seeds: range | list[int], *, workers: int = 1) -> dict[str, Any]:
    """Run one schedule per seed (in ``workers`` processes); returns counts and, per invariant, the seeds
    that violated it (in seed order, whatever the number of workers)."""
    t0 = time.perf_counter()
    seeds = list(seeds)
    if workers > 1 and len(seeds) > 1:
        import multiprocessing

        step = 250
        chunks = [seeds[i:i + step] for i in range(0, len(seeds), step)]
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = [r for chunk in pool.imap(_run_chunk, chunks) for r in chunk]
    else:
        results = _run_chunk(seeds)
    events = 0
    by_invariant: dict[str, list[int]] = {}
    first: dict[str, str] = {}
    shortest: dict[str, tuple[int, int]] = {}  # invariant -> (seed, events until its violation), fewest events
    ec: dict[str, int] = {}  # what the ec schedules exercised, summed (tests/simulation/parity.py)
    durable = complete = 0  # schedules in which a step was durable / complete at some point
    for seed, n_events, found, at, counts, (was_durable, was_complete) in results:
        events += n_events
        durable += was_durable
        complete += was_complete
        for k, v in counts.items():
            ec[k] = ec.get(k, 0) + v
        for name, msg in found.items():
            by_invariant.setdefault(name, []).append(seed)
            first.setdefault(name, f"seed {seed}: {msg}")
            n = at[name]
            if name not in shortest or n < shortest[name][1]:
                shortest[name] = (seed, n)
    n = max(1, len(seeds))
    return {"schedules": len(seeds), "events": events,
            "violations": sum(len(v) for v in by_invariant.values()),
            "durable_fraction": round(durable / n, 4), "complete_fraction": round(complete / n, 4),
            "seconds": round(time.perf_counter() - t0, 2), "by_invariant": by_invariant, "first": first,
            "shortest": shortest, "ec": dict(sorted(ec.items()))}


def replay(seed: int, network: bool | None = None, ec: bool | None = None,
           calm: bool | None = None) -> tuple[dict[str, str], list[str]]:
    """Run one seed again with its event trace (``network=False``: as before the network was modelled;
    ``ec=False``: as before erasure coding was, a copies schedule whatever the seed draws; ``calm=False``: as
    before the lulls between faults, tests/simulation/phases.py)."""
    from tests.simulation.model import Sim

    sim = Sim(seed, keep_trace=True, network=network, ec=ec, calm=calm)
    return sim.run(), sim.trace
