"""``python -m tests.simulation --seeds N``: run N schedules, print one JSON line of counts.

``durable_fraction`` / ``complete_fraction``: the share of schedules in which some step was durable / complete
at some point (what ``newest-complete-regressed`` and ``complete-step-lost`` need to guard anything).
``--replay SEED`` runs one schedule and prints its event trace and violations.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from tests.simulation import replay, run_seeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.simulation", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1000, help="schedules to run (seeds first..first+N-1)")
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--replay", type=int, help="replay this seed with its event trace")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    ap.add_argument("--details", action="store_true", help="also print the seeds per violated invariant")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the coordinator logs every fault it handles
    if args.replay is not None:
        found, trace = replay(args.replay)
        print("\n".join(trace))
        for msg in found.values():
            print(msg)
        return 1 if found else 0
    res = run_seeds(range(args.first, args.first + args.seeds), workers=args.workers)
    keys = ("schedules", "events", "violations", "durable_fraction", "complete_fraction", "seconds")
    out = {k: res[k] for k in keys} | {"workers": args.workers}
    if args.details:
        out["by_invariant"] = {k: v[:20] for k, v in res["by_invariant"].items()}
        out["first"] = res["first"]
        out["shortest"] = res["shortest"]
        out["ec"] = res["ec"]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
