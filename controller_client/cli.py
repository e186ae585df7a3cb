"""The `mtc` command line: the demo, the replicator daemon and admin commands."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from controller_client.demo import run_demo

    return run_demo(args.workdir, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtc",
        description="multitier-checkpoint: RAM-disk, peer and bucket checkpointing for JAX training jobs.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on 8 CPU devices as 4 simulated hosts, crash, restore")
    d.add_argument("--workdir", help="directory for the simulated hosts' RAM dirs (default: a temp dir "
                   "under /dev/shm, removed afterwards)")
    d.add_argument("--keep", action="store_true", help="keep the working directory")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
