"""``bench.goodput --pathways``: the Pathways elastic path under slice losses, ours against the guide's Orbax path.

    python -m bench.goodput --pathways [--mib 16] [--seconds 120] [--step-seconds 0.3] [--mtbf-seconds 120]
        [--replace-seconds 10] [--poll-seconds 1] [--seed 3] [--systems ours,orbax] [--keep DIR]

On the simulated Pathways (tests/kits/pathways_sim.py: this benchmark's children are the single controller,
one worker process per host plays the colocated-Python sidecar), 2 slices x 2 hosts x 2 devices, each system
trains for ``--seconds`` under the same seeded schedule of slice losses (exponential gaps of mean
``--mtbf-seconds``, the slice drawn from the same generator); the surviving slice keeps training without a
controller restart, the lost slice comes back ``--replace-seconds`` later (replacement hosts: empty RAM disks)
and rejoins (bench/goodput_pathways_loop.py has the two loops, bench/goodput_pathways_rig.py what they meet
alike). One JSON line: per system the slice-loss pauses (from the failure to the survivors' next completed
step, re-jit included) and their median, the rejoin pauses, every pause's phases, the steps kept (a step on
fewer slices counts by the fraction of slices active) and the ETTR; ours as
``pathways_slice_lost_pause_seconds`` and ``pathways_ettr``, and ``pathways_ettr_minus_orbax``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.children import bound_to_us, scratch_dir
from bench.emergency_common import REPO
from bench.goodput_pathways_loop import SYSTEMS
from bench.goodput_pathways_rig import SLICES, PathwaysOptions
from bench.goodput_pods import env

RUN_OVERHEAD_SECONDS = 300.0  # a child's start-up, calibration and stop beyond its --seconds
# A loss is kept in the schedule only this long after the previous one's replacement (its slice then has
# rejoined: every loss meets two active slices and no pause in progress).
REJOIN_MARGIN_SECONDS = 20.0
DEPLOY_MODE = "pathways-simulated"


def slice_losses(
    seed: int, seconds: float, mtbf_seconds: float, replace_seconds: float
) -> list[tuple[float, int]]:
    """(seconds after the clock starts, slice) of each loss within ``seconds``: exponential gaps of mean
    ``mtbf_seconds`` (as bench.goodput_run.schedule), the slice from the same seeded generator; a loss within
    ``replace_seconds + REJOIN_MARGIN_SECONDS`` of the previous kept one is dropped (for every system)."""
    if seconds <= 0 or mtbf_seconds <= 0 or replace_seconds < 0:
        raise ValueError("seconds and mtbf_seconds must be > 0, replace_seconds >= 0")
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_seconds)
        index = rng.randrange(SLICES)
        if t >= seconds:
            return out
        if not out or t >= out[-1][0] + replace_seconds + REJOIN_MARGIN_SECONDS:
            out.append((round(t, 3), index))


def run_system(system: str, opts: PathwaysOptions, scratch: Path) -> dict[str, Any]:
    """One system's run in its own controller process; its JSON, or ``{"error": ...}``."""
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "bench.goodput_pathways_loop",
        "--system",
        system,
        "--options",
        json.dumps(dataclasses.asdict(opts)),
        "--scratch",
        str(scratch),
    ]
    log = scratch / "controller.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            bound_to_us(cmd),
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=str(REPO),
            env=dict(env(), XLA_FLAGS="--xla_force_host_platform_device_count=8"),
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=opts.seconds + RUN_OVERHEAD_SECONDS)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {opts.seconds + RUN_OVERHEAD_SECONDS:.0f}s"}
        finally:
            # What a controller that died (or hung) left in its session: its replicators and workers, which
            # would otherwise run on beside the next system's run (they are of this run only).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)[-1500:]}"}
    return json.loads(lines[-1])


def platform_ceiling(opts: PathwaysOptions) -> float:
    """The ETTR of a system that pauses for nothing, loses no step and takes no time to save, under
    ``opts.losses``: each lost slice away for ``--replace-seconds`` (the platform's wait), the others training
    on at their fraction. Issue 47's ETTR target is judged against it: what no loop can win back."""
    away = sum(min(opts.replace_seconds, max(0.0, opts.seconds - at)) for at, _ in opts.losses)
    return round(1.0 - away / SLICES / opts.seconds, 4)


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ours' two keys and the ETTR difference with the guide's Orbax path (None where a side is missing)."""
    ours, orbax = results.get("ours", {}), results.get("orbax", {})
    ok = "error" not in ours and bool(ours)
    out: dict[str, Any] = {
        "pathways_slice_lost_pause_seconds": ours.get("slice_lost_pause_median_seconds") if ok else None,
        "pathways_ettr": ours.get("ettr") if ok else None,
    }
    both = ok and orbax and "error" not in orbax and None not in (ours.get("ettr"), orbax.get("ettr"))
    out["pathways_ettr_minus_orbax"] = round(ours["ettr"] - orbax["ettr"], 4) if both else None
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.goodput --pathways", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=16, help="size of the train state (MiB, default 16)")
    p.add_argument("--seconds", type=float, default=120.0, help="each system's clocked run (default 120)")
    p.add_argument(
        "--step-seconds", type=float, default=0.3, help="the fixed cost of a train step (default 0.3)"
    )
    p.add_argument(
        "--mtbf-seconds", type=float, default=120.0, help="mean time between slice losses (default 120)"
    )
    p.add_argument(
        "--replace-seconds",
        type=float,
        default=10.0,
        help="from a slice's loss to its replacement hosts being healthy (default 10)",
    )
    p.add_argument(
        "--poll-seconds",
        type=float,
        default=1.0,
        help="elastic_retry's poll_interval: the Manager's health monitor period (default 1)",
    )
    p.add_argument(
        "--bucket-seconds",
        type=float,
        default=None,
        help="interval of the persistent tier (ours: the replicators' backup; Orbax: its "
        "CheckpointManager; default 4 x MTBF, as bench.goodput)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=3,
        help="seed of the loss schedule (default 3: slice 0 lost 33 s in, slice 1 at 88 s)",
    )
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS)
    )
    p.add_argument("--keep", help="run in this directory and keep it (every process's log)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if (
        args.mib < 1
        or min(args.seconds, args.step_seconds, args.mtbf_seconds, args.poll_seconds) <= 0
        or args.replace_seconds < 0
        or not systems
        or not set(systems) <= set(SYSTEMS)
    ):
        p.error(
            "--mib >= 1; --seconds, --step-seconds, --mtbf-seconds, --poll-seconds > 0; --replace-seconds >= 0; "
            "--systems a subset of " + ",".join(SYSTEMS)
        )
    bucket = args.bucket_seconds if args.bucket_seconds is not None else 4 * args.mtbf_seconds
    losses = tuple(slice_losses(args.seed, args.seconds, args.mtbf_seconds, args.replace_seconds))
    opts = PathwaysOptions(
        mib=args.mib,
        seconds=args.seconds,
        step_seconds=args.step_seconds,
        mtbf_seconds=args.mtbf_seconds,
        replace_seconds=args.replace_seconds,
        poll_seconds=args.poll_seconds,
        bucket_seconds=bucket,
        losses=losses,
    )
    scratch = Path(args.keep) if args.keep else scratch_dir("mtc-bench-pathways-")
    results: dict[str, dict[str, Any]] = {}
    run_seconds: dict[str, float] = {}
    try:
        for name in systems:
            t0 = time.monotonic()
            results[name] = run_system(name, opts, scratch / name)
            run_seconds[name] = round(time.monotonic() - t0, 1)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    result: dict[str, Any] = {
        "bench": "goodput",
        "mode": "pathways",
        "deploy": {"mode": DEPLOY_MODE, "slices": SLICES, "hosts_per_slice": 2, "devices_per_host": 2},
        "mib": args.mib,
        "seconds": args.seconds,
        "step_seconds": args.step_seconds,
        "mtbf_seconds": args.mtbf_seconds,
        "replace_seconds": args.replace_seconds,
        "poll_seconds": args.poll_seconds,
        "bucket_seconds": bucket,
        "seed": args.seed,
        "schedule": [{"at_seconds": at, "slice": s} for at, s in losses],
        "run_seconds": run_seconds,
        "systems": results,
    }
    result.update(summary(results))
    result["pathways_ettr_platform_ceiling"] = platform_ceiling(opts)
    print(json.dumps(result))
    sys.stdout.flush()
    return 0
