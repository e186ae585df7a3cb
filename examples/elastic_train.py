"""Elastic training with multi-tier checkpointing: the Pathways loop on 8 CPU devices as 2 slices.

    python examples/elastic_train.py [--state fsdp|replicated|both] [--keep --workdir DIR]

Same as ``mtc demo --elastic``. The loop itself is ``controller_client.demo.elastic.train_elastic``: one
``pathwaysutils`` elastic ``Manager``, ``@elastic_retry(minimum_slice_count=1)``, a mesh from the active
devices, a restore at the start of each attempt, a save every few steps, and a scale-up when
``available_inactive_slices`` is non-empty. Slice 1 fails (a simulated ``DATA_LOSS`` slice-down error),
training continues on slice 0 from the newest complete step, slice 1 returns and training goes on on both;
the losses equal an uninterrupted run's. The data is a grain pipeline read through grain's
``ElasticIterator``, one shard per active slice; its state is saved with the train state and restored
with it onto however many slices are active. Needs the ``[elastic]`` extra (pathwaysutils, grain).
"""

from __future__ import annotations

import argparse
import sys

from controller_client.demo.elastic import run_elastic_demo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", choices=["fsdp", "replicated", "both"], default="both")
    p.add_argument("--workdir", help="directory for the simulated hosts' RAM dirs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    args = p.parse_args(argv)
    kinds = ("replicated", "fsdp") if args.state == "both" else (args.state,)
    return run_elastic_demo(args.workdir, keep=args.keep, kinds=kinds)


if __name__ == "__main__":
    sys.exit(main())
