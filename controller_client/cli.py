"""The `mtc` command line: the demo, the replicator daemon and admin commands."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from controller_client import manifests, preempt
from controller_client.admin_cli import register
from replicator import logs
from replicator.main import configure_parser


def _version() -> str:

    try:
        return version("multitier-checkpoint")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _demo(args: argparse.Namespace) -> int:
    # The demos import JAX (after setting XLA_FLAGS): imported only here, so that every other command
    # (the replicator daemon, manifests, admin) starts without loading JAX.
    if args.elastic and args.snapshotter:
        from controller_client.demo.elastic_snapshot import run_snapshot_demo

        return run_snapshot_demo(args.workdir, keep=args.keep, pause_resume=args.pause_resume)
    if args.elastic:
        from controller_client.demo.elastic import run_elastic_demo

        return run_elastic_demo(args.workdir, keep=args.keep)
    from controller_client.demo.run import run_demo

    return run_demo(args.workdir, keep=args.keep)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtc",
        description="multitier-checkpoint: RAM-disk, peer and bucket checkpointing for JAX training jobs.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    logs.add_arguments(p)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a small model on 8 CPU devices as 4 simulated hosts, crash, restore")
    d.add_argument("--workdir", help="directory for the simulated hosts' RAM dirs (default: a temp dir "
                   "under /dev/shm, removed afterwards)")
    d.add_argument("--keep", action="store_true", help="keep the working directory")
    d.add_argument("--elastic", action="store_true", help="instead: the Pathways elastic loop (pathwaysutils, "
                   "a grain ElasticIterator input pipeline) on 2 simulated slices; slice 1 fails and returns, "
                   "replicated and FSDP state")
    d.add_argument("--snapshotter", action="store_true", help="with --elastic: the Pathways guide's loop, Orbax's "
                   "in-memory Snapshotter for elastic events and our checkpoints for the rest (slice lost, "
                   "in-place scale-up, controller restart, slice replaced empty)")
    d.add_argument("--pause-resume", action="store_true", help="with --elastic --snapshotter: pause and resume "
                   "on the same mesh (minimum_slice_count=None) instead of shrinking")
    logs.add_arguments(d, default=argparse.SUPPRESS)
    d.set_defaults(func=_demo)


    r = sub.add_parser("replicator", help="run the per-host replicator daemon (same as mtc-replicator)")
    configure_parser(r, log_default=argparse.SUPPRESS)
    r.set_defaults(prog="mtc replicator")


    m = sub.add_parser("manifests", help="render a ready-to-apply Kubernetes set (JobSet, RAM disk, policy) for a job",
                       description="Render the Kubernetes objects of one job; see docs/deploy.md.")
    manifests.add_arguments(m)
    m.set_defaults(func=manifests.run)


    pre = sub.add_parser("preempt", help="tell this host's replicator of a preemption notice (a Pod's preStop hook)",
                         description=preempt.__doc__.split("\n\n")[0])
    preempt.add_arguments(pre)
    pre.set_defaults(func=preempt.run)

    # The operator's commands (status, steps, inspect, verify, restore, pin, backups, export, plan, gc).

    register(sub, lambda sp: logs.add_arguments(sp, default=argparse.SUPPRESS))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(manifests.bind_verbatim_values(sys.argv[1:] if argv is None else argv))
    logs.configure(logs.level_from(args), logs.format_from(args))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
