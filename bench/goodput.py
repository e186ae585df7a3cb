"""Goodput under failure, side by side: what a training job keeps of its wall time with us and Orbax's managers.

    python -m bench.goodput [--mib 1024] [--seconds 600] [--step-seconds 1] [--mtbf-seconds 120]
        [--replace-seconds 5] [--grace-seconds 25] [--seed 19] [--ramdisk csi]
        [--trainer-start with-replicator|after-probe] [--probe-seconds 1] [--systems ours,orbax_p2p,...]
    python -m bench.goodput --pathways [--mib 16] [--seconds 120] [--step-seconds 0.3] [--mtbf-seconds 120]
        [--replace-seconds 10] [--poll-seconds 1] [--seed 3] [--systems ours,orbax]

``--pathways`` measures the Pathways elastic path instead (bench/goodput_pathways.py: slices lost and back on
the simulated Pathways, the single controller never restarted, ours against the guide's Snapshotter loop).

The same job (4 JAX processes, 2 slices x 2 hosts on 8 CPU devices, bench.emergency's ``--mib`` state
sharded within a slice and replicated across slices, a train step of ``--step-seconds``) runs for
``--seconds`` of wall time under the same seeded failure schedule with each system in turn
(bench/goodput_run.py plays Kubernetes, bench/goodput_worker.py is the training process). Each system
checkpoints at its Young/Daly interval from its own measured save cost. Every system meets the same lifecycle (every Pod
restart the rendered JobSets make, our replicators included), the same faults (a corruption hits the copy
each system would restore first) and the same operator's policy after a failed or wrong restore (the newest
intact step in any tier, else from scratch, its time charged). One JSON line: the deploy mode measured; per
system the ETTR (the ideal time of the steps kept / the wall time), every failure's steps lost, downtime and
phases, the means per failure kind; whether each system detected its corrupted copy and the steps that cost
it; our ETTR and downtimes against the best Orbax manager's (docs/benchmarks.md).
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
from bench.goodput_run import KINDS, RAMDISKS, STARTUP_PROBE_SECONDS, TRAINER_STARTS, RunOptions, schedule
from bench.goodput_worker import SYSTEMS

ORBAX = ("orbax_p2p", "orbax_emergency", "orbax_standard")
PHASES = ("detect", "replace", "failed_attempt", "restart", "plan", "restore", "first_step")
# The kinds whose downtime holds the platform's replacement wait and the rest, ours to cut.
CONTROLLABLE_KINDS = ("host_lost", "slice_lost", "preemption", "job_restart")


def ettr(steps_kept: int, step_seconds: float, wall_seconds: float) -> float:
    """Effective training time ratio: the ideal time of the steps kept over the wall time."""
    if wall_seconds <= 0 or step_seconds <= 0 or steps_kept < 0:
        raise ValueError("wall and step seconds must be > 0, steps kept >= 0")
    return steps_kept * step_seconds / wall_seconds


def by_kind(failures: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per failure kind: count, mean downtime, phases and fetch-verify-load seconds, steps lost (sum), and
    ``failed`` (the first error) when a first restore of that kind failed or was wrong (its downtime then
    includes the operator's roll-back)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        recs = [r for r in failures if r["kind"] == kind]
        if not recs:
            continue
        entry: dict[str, Any] = {
            "count": len(recs),
            "downtime_seconds": round(statistics.mean(r["downtime_seconds"] for r in recs), 4),
            "steps_lost": sum(r["steps_lost"] for r in recs),
            "fetch_verify_load_seconds": round(statistics.mean(r.get("fetch_verify_load_seconds", 0.0)
                                                               for r in recs), 4),
            "phases": {p: round(statistics.mean(r["phases"].get(p, 0.0) for r in recs), 4) for p in PHASES
                       if any(p in r["phases"] for r in recs)}}
        failed = [r["failed"] for r in recs if "failed" in r]
        if failed:
            entry["failed"] = failed[0]
        out[kind] = entry
    return out


def _best(orbax: dict[str, dict[str, Any]], kind: str, value: Any) -> tuple[str, float] | None:
    """The Orbax manager with the least ``value(by_kind entry)`` for ``kind``, and that value."""
    met = {s: value(r["by_kind"][kind]) for s, r in orbax.items() if kind in r["by_kind"]}
    if not met:
        return None
    best = min(met, key=lambda s: met[s])
    return best, met[best]


def compare(systems: dict[str, dict[str, Any]], replace_seconds: float = 0.0) -> dict[str, Any]:
    """Ours against the best Orbax manager: ``ettr_minus_best_orbax``; ``downtime_<kind>_vs_best_orbax``
    (our mean downtime / the least of the Orbax managers that met that kind: every recovery finishes, a
    failed or wrong restore with the operator's roll-back in its downtime); for the kinds the platform
    replaces or restarts Pods in, ``controllable_downtime_<kind>_vs_best_orbax``, the same with
    ``replace_seconds`` (the platform's replacement wait) subtracted from every system's; and which manager
    was best. None where a side never met the kind (or nothing is left after the subtraction)."""
    out: dict[str, Any] = {}
    ours = systems.get("ours")
    orbax = {s: r for s, r in systems.items() if s in ORBAX and "error" not in r}
    if not ours or "error" in ours or not orbax:
        return out
    best = max(orbax, key=lambda s: orbax[s]["ettr"])
    out["ettr_minus_best_orbax"] = round(ours["ettr"] - orbax[best]["ettr"], 4)
    out["best_orbax"] = {"ettr": best}
    for kind in KINDS:
        mine = ours["by_kind"].get(kind)
        found = _best(orbax, kind, lambda e: e["downtime_seconds"])
        key = f"downtime_{kind}_vs_best_orbax"
        out[key] = None if mine is None or found is None else round(mine["downtime_seconds"] / found[1], 3)
        if found is not None:
            out["best_orbax"][kind] = found[0]
    for kind in CONTROLLABLE_KINDS:
        mine = ours["by_kind"].get(kind)
        found = _best(orbax, kind, lambda e: e["downtime_seconds"] - replace_seconds)
        key = f"controllable_downtime_{kind}_vs_best_orbax"
        mine_c = None if mine is None else mine["downtime_seconds"] - replace_seconds
        out[key] = (None if mine_c is None or found is None or found[1] <= 0
                    else round(max(0.0, mine_c) / found[1], 3))
        if found is not None:
            out["best_orbax"][f"controllable_{kind}"] = found[0]
    return out


def corruption(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per system: ``corrupt_copy_detected`` (every corrupted copy it met refused or read around, rather
    than restored as saved bytes: None when it met none) and ``corrupt_copy_steps_lost`` (summed)."""
    detected: dict[str, bool | None] = {}
    lost: dict[str, int | None] = {}
    for name, r in systems.items():
        recs = [f for f in r.get("failures", []) if f["kind"] == "corrupt_copy"]
        detected[name] = all(f["corruption_detected"] for f in recs) if recs else None
        lost[name] = sum(f["steps_lost"] for f in recs) if recs else None
    return {"corrupt_copy_detected": detected, "corrupt_copy_steps_lost": lost}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--pathways" in argv:  # the Pathways elastic path: its own module and options
        from bench import goodput_pathways

        return goodput_pathways.main([a for a in argv if a != "--pathways"])
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
    p.add_argument("--ramdisk", default="csi", choices=RAMDISKS,
                   help="the RAM disk measured, as `mtc manifests --ramdisk`: csi (default; the node's RAM disk "
                   "outlives the Pods on surviving hosts) or memory (an emptyDir: every restart loses it)")
    p.add_argument("--trainer-start", default=TRAINER_STARTS[0], choices=TRAINER_STARTS,
                   help="ours: how each host's training process starts beside its replicator sidecar: "
                   "with-replicator (default, the rendered JobSet's: together, the manager waits for its replicator "
                   "in-process) or after-probe (the JobSet before: once the replicator passed its startup probe)")
    p.add_argument("--probe-seconds", type=float, default=STARTUP_PROBE_SECONDS,
                   help="after-probe: period of the replicator sidecar's startup probe (default "
                   f"{STARTUP_PROBE_SECONDS:g}, as it was rendered; 0: starts once it serves)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--keep", help="run in this directory and keep it (every process's log) instead of a "
                   "temporary one on /dev/shm")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if (args.mib < 1 or min(args.seconds, args.step_seconds, args.mtbf_seconds) <= 0
            or min(args.replace_seconds, args.grace_seconds, args.probe_seconds) < 0
            or not set(systems) <= set(SYSTEMS)):
        p.error("--mib >= 1; --seconds, --step-seconds, --mtbf-seconds > 0; --replace-seconds, "
                "--grace-seconds, --probe-seconds >= 0; --systems a subset of " + ",".join(SYSTEMS))
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
                              grace_seconds=args.grace_seconds, bucket_seconds=bucket_seconds, failures=failures,
                              ramdisk=args.ramdisk, probe_seconds=args.probe_seconds,
                              trainer_start=args.trainer_start)
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
        "bench": "goodput", "deploy": goodput_run.deploy(args.ramdisk, args.probe_seconds, args.trainer_start), "mib": args.mib, "seconds": args.seconds, "step_seconds": args.step_seconds,
        "mtbf_seconds": args.mtbf_seconds, "replace_seconds": args.replace_seconds,
        "grace_seconds": args.grace_seconds, "bucket_seconds": bucket_seconds, "seed": args.seed,
        "schedule": [f.to_dict() for f in failures], "run_seconds": run_seconds, "systems": results}
    result.update(compare(results, args.replace_seconds))
    result.update(corruption(results))
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
