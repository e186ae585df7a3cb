"""Cost of the operator's views at scale: one JSON line, milliseconds per call at N and 10 x N hosts, and ratios.

    python -m bench.admin [--hosts 1000] [--steps 3]

A coordinator is filled in-process with ``hosts`` hosts in 2 slices (each host: its own data of every
step and an identical-replica attestation), then each view is timed: ``GetSummary`` (``mtc status``),
``ListSteps`` (``mtc steps``), ``ListHosts`` (``mtc status --hosts``) and the metrics scrape
(``cluster_view``). ``*_ratio`` = time at 10 x hosts / time at hosts: about 10 means linear in hosts
(the views summarise every rank), which keeps them at a few hundred ms at 10,000 hosts.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from mtc_rpc import admin_pb2 as apb
from replicator.coordinator.admin import AdminServicer, cluster_view
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding, Tier


def build(hosts: int, steps: int) -> tuple[Coordinator, AdminServicer]:
    coord = Coordinator(JobTopology(hosts, 2, 1), "bench", heartbeat_seconds=2.0)
    per_slice = hosts // 2
    now = coord._clock()
    for r in range(hosts):
        coord.state.register(r, 1)
        rep = (r + per_slice) % hosts
        held = []
        for s in range(1, steps + 1):
            digest = f"{r % per_slice:08x}{s:056x}"
            held.append(Holding(r, s, digest, 1 << 20, Tier.LOCAL))
            held.append(Holding(rep, s, digest, 0, Tier.REPLICA))
        coord.state.report_inventory(r, held, 1)
        coord.state.seen(r, now)  # what a heartbeat records (bench only)
        coord._addresses[r] = f"host-{r}:7070"
    return coord, AdminServicer(coord)


def timed(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def measure(hosts: int, steps: int, repeats: int) -> dict[str, float]:
    coord, admin = build(hosts, steps)
    return {
        "summary_ms": timed(lambda: admin.GetSummary(apb.GetSummaryRequest(), None), repeats),
        "steps_ms": timed(lambda: admin.ListSteps(apb.ListStepsRequest(), None), repeats),
        "hosts_ms": timed(lambda: admin.ListHosts(apb.ListHostsRequest(first_rank=0, last_rank=-1), None), repeats),
        "scrape_ms": timed(lambda: cluster_view(coord), repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hosts", type=int, default=1000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    small = measure(a.hosts, a.steps, a.repeats)
    large = measure(10 * a.hosts, a.steps, a.repeats)
    out: dict[str, Any] = {"bench": "admin", "hosts": a.hosts, "steps": a.steps}
    for k in small:
        out[k.replace("_ms", "_ratio")] = round(large[k] / max(small[k], 1e-9), 2)
        out[f"{k}_at_{10 * a.hosts}"] = round(large[k], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
