"""Goodput under failure, side by side: what a training job keeps of its wall time with us and Orbax's managers.

    python -m bench.goodput [--mib 1024] [--seconds 600] [--step-seconds 1] [--mtbf-seconds 120]
        [--replace-seconds 5] [--grace-seconds 25] [--seed 19] [--systems ours,orbax_p2p,...]

The same job (4 JAX processes, 2 slices x 2 hosts on 8 CPU devices, bench.emergency's ``--mib`` state
sharded within a slice and replicated across slices, a train step of ``--step-seconds``) runs for
``--seconds`` of wall time under the same seeded failure schedule with each system in turn
(bench/goodput_run.py plays Kubernetes, bench/goodput_worker.py is the training process). Each system
checkpoints at its Young/Daly interval from its own measured save cost. One JSON line: per system the ETTR
(the ideal time of the steps kept / the wall time), every failure's steps lost, downtime and phases, the
means per failure kind, and our ETTR and downtimes against the best Orbax manager's (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import goodput_run
from bench.children import scratch_dir
from bench.goodput_run import KINDS, RunOptions, schedule
from bench.goodput_worker import SYSTEMS

ORBAX = ("orbax_p2p", "orbax_emergency", "orbax_standard")
PHASES = ("detect", "replace", "failed_attempt", "restart", "plan", "fetch_verify_load", "first_step")


def ettr(steps_kept: int, step_seconds: float, wall_seconds: float) -> float:
    """Effective training time ratio: the ideal time of the steps kept over the wall time."""
    if wall_seconds <= 0 or step_seconds <= 0 or steps_kept < 0:
        raise ValueError("wall and step seconds must be > 0, steps kept >= 0")
    return steps_kept * step_seconds / wall_seconds


def by_kind(failures: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per failure kind: count, mean downtime and phases, steps lost (sum), and ``failed`` (the first error)
    when a recovery of that kind failed (its downtime then includes starting over from nothing)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        recs = [r for r in failures if r["kind"] == kind]
        if not recs:
            continue
        entry: dict[str, Any] = {
            "count": len(recs),
            "downtime_seconds": round(statistics.mean(r["downtime_seconds"] for r in recs), 4),
            "steps_lost": sum(r["steps_lost"] for r in recs),
            "phases": {p: round(statistics.mean(r["phases"].get(p, 0.0) for r in recs), 4) for p in PHASES
                       if any(p in r["phases"] for r in recs)}}
        failed = [r["failed"] for r in recs if "failed" in r]
        if failed:
            entry["failed"] = failed[0]
        out[kind] = entry
    return out


def compare(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``ettr_minus_best_orbax`` and ``downtime_<kind>_vs_best_orbax`` (ours / the best Orbax manager that
    survived that kind; None when no Orbax manager survived it or a side never saw it), and which was best."""
    out: dict[str, Any] = {}
    ours = systems.get("ours")
    orbax = {s: r for s, r in systems.items() if s in ORBAX and "error" not in r}
    if not ours or "error" in ours or not orbax:
        return out
    best = max(orbax, key=lambda s: orbax[s]["ettr"])
    out["ettr_minus_best_orbax"] = round(ours["ettr"] - orbax[best]["ettr"], 4)
    out["best_orbax"] = {"ettr": best}
    for kind in KINDS:
        key = f"downtime_{kind}_vs_best_orbax"
        mine = ours["by_kind"].get(kind)
        alive = {s: r["by_kind"][kind] for s, r in orbax.items()
                 if kind in r["by_kind"] and "failed" not in r["by_kind"][kind]}
        if mine is None or not alive:
            out[key] = None
            continue
        b = min(alive, key=lambda s: alive[s]["downtime_seconds"])
        out[key] = round(mine["downtime_seconds"] / alive[b]["downtime_seconds"], 3)
        out["best_orbax"][kind] = b
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the train state (MiB, default 1024)")
    p.add_argument("--seconds", type=float, default=600.0, help="wall time of each system's run (default 600)")
    p.add_argument("--step-seconds", type=float, default=1.0, help="the fixed cost of a train step (default 1)")
    p.add_argument("--mtbf-seconds", type=float, default=120.0, help="mean time between failures (default 120)")
    p.add_argument("--replace-seconds", type=float, default=5.0,
                   help="from a failed job's end to its new processes (replacement Pods; default 5)")
    p.add_argument("--grace-seconds", type=float, default=25.0, help="preemption notice to kill (default 25)")
    p.add_argument("--bucket-seconds", type=float, default=None,
                   help="interval of the bucket tier for the systems that have a local one (default 4 x MTBF)")
    # 19: at the defaults (600 s, MTBF 120 s) one failure of each of the five kinds, each recovery over before the
    # next failure (seed 0 held only two failures in 600 s).
    p.add_argument("--seed", type=int, default=19, help="seed of the failure schedule (default 19: every kind once "
                   "at the default --seconds and --mtbf-seconds)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--keep", help="run in this directory and keep it (every process's log) instead of a "
                   "temporary one on /dev/shm")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if (args.mib < 1 or min(args.seconds, args.step_seconds, args.mtbf_seconds) <= 0
            or min(args.replace_seconds, args.grace_seconds) < 0 or not set(systems) <= set(SYSTEMS)):
        p.error("--mib >= 1; --seconds, --step-seconds, --mtbf-seconds > 0; --replace-seconds, "
                "--grace-seconds >= 0; --systems a subset of " + ",".join(SYSTEMS))
    bucket_seconds = args.bucket_seconds if args.bucket_seconds is not None else 4 * args.mtbf_seconds
    failures = tuple(schedule(args.seed, args.seconds, args.mtbf_seconds))
    if args.keep:
        scratch = Path(args.keep)
        scratch.mkdir(parents=True, exist_ok=True)
    else:
        scratch = scratch_dir("mtc-bench-goodput-")
    results: dict[str, dict[str, Any]] = {}
    run_seconds: dict[str, float] = {}
    try:
        for name in systems:
            t0 = time.monotonic()
            opts = RunOptions(system=name, mib=args.mib, seconds=args.seconds, step_seconds=args.step_seconds,
                              mtbf_seconds=args.mtbf_seconds, replace_seconds=args.replace_seconds,
                              grace_seconds=args.grace_seconds, bucket_seconds=bucket_seconds, failures=failures)
            got = goodput_run.run(opts, scratch)
            if "error" not in got:
                got["by_kind"] = by_kind(got["failures"])
            results[name] = got
            run_seconds[name] = round(time.monotonic() - t0, 1)
            if not args.keep:
                shutil.rmtree(scratch / name, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "goodput", "mib": args.mib, "seconds": args.seconds, "step_seconds": args.step_seconds,
        "mtbf_seconds": args.mtbf_seconds, "replace_seconds": args.replace_seconds,
        "grace_seconds": args.grace_seconds, "bucket_seconds": bucket_seconds, "seed": args.seed,
        "schedule": [f.to_dict() for f in failures], "run_seconds": run_seconds, "systems": results}
    result.update(compare(results))
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
