"""`mtc-replicator` (also `mtc replicator`): parse options, start the daemon and serve until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from replicator import logs
from replicator.options import ConfigError, ReplicatorOptions, add_arguments, from_args

log = logging.getLogger(__name__)


def run(opts: ReplicatorOptions) -> int:
    """Run the daemon in the foreground; prints ``LISTENING HOST:PORT`` once serving."""
    if opts.nice > 0:
        try:
            os.nice(opts.nice)
        except OSError as e:
            log.warning("cannot change niceness by %d: %s", opts.nice, e)
    if opts.orbax_mode:
        # Imported here: `mtc --help` and the admin commands import this module for its parser only.
        from replicator.orbax.mode import run_orbax_mode

        return run_orbax_mode(opts)
    from replicator.preemption import ShutdownLatch

    latch = ShutdownLatch().install()  # a SIGTERM while the daemon starts still gets its flush rule
    try:
        # Opening the bucket checks what it supports (atomic folder rename or create-only writes) and
        # fails here, clearly, when it supports neither.
        from replicator.daemon import build_replicator

        daemon = build_replicator(opts)
        daemon.start()
    except Exception as e:  # an unusable bucket, a bind failure and the like: one line, non-zero exit
        print(f"mtc replicator: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"LISTENING {daemon.address}", flush=True)
    daemon.wait_for_signal(latch)
    # In-flight transfers were abandoned (their temporary directories removed by stop()); do not let
    # worker threads hold the exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


DESCRIPTION = (
    "The per-host replicator: peer copies, coordinator (on the coordinator rank), backup and restore. "
    "Options also come from MTC_<NAME> environment variables and a --config YAML file. Without "
    "--rank/--nodes it runs in Orbax mode and takes them from <local-dir>/replicator.yaml."
)
EPILOG = """example:
  mtc-replicator --local-dir /local --listen 0.0.0.0:7070 --job myjob --rank 3 --nodes 4 \\
      --data-parallelism 2 --peer-address-template '{job}-workers-{slice}-{host}.{job}:7070' \\
      --backup-url gs://my-bucket/ckpt --token-file /secrets/token --log-level info
"""


def configure_parser(p: argparse.ArgumentParser, *, log_default: str | None = None) -> None:
    """The daemon's flags on ``p`` (the ``mtc replicator`` subparser or ``mtc-replicator``'s own)."""
    p.description = DESCRIPTION
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(p)
    logs.add_arguments(p, default=log_default)
    p.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Validate the parsed flags (exit 2 with one line naming the problem) and run the daemon."""
    prog = getattr(args, "prog", "mtc-replicator")
    try:
        opts = from_args(args).check_exposure()  # no open service beyond loopback unless --insecure
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return run(opts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtc-replicator")
    configure_parser(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(logs.level_from(args), logs.format_from(args))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
