"""Start the replicator daemon from validated options and serve until SIGTERM."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from replicator.options import ReplicatorOptions

log = logging.getLogger(__name__)


def build_replicator(opts: ReplicatorOptions, store: Any = None) -> Any:
    """A :class:`replicator.daemon.Replicator` for fully resolved options (rank and nodes known).

    ``store``: a :class:`replicator.store.LocalStore` (subclass) to use instead of the default one.
    """
    from replicator.daemon import Replicator

    backup = None
    scheduler = None
    if opts.backup_url:
        from replicator.backup_tier import make_backup

        backup, scheduler = make_backup(opts, opts.job, opts.rank, opts.nodes)
    return Replicator(opts, rank=opts.rank, nodes=opts.nodes, job=opts.job,
                      data_parallelism=opts.data_parallelism, backup=backup,
                      backup_scheduler_factory=scheduler, store=store)


def run(opts: ReplicatorOptions) -> int:
    """Run the daemon in the foreground; prints ``LISTENING HOST:PORT`` once serving."""
    if opts.nice > 0:
        try:
            os.nice(opts.nice)
        except OSError as e:
            log.warning("cannot change niceness by %d: %s", opts.nice, e)
    if opts.orbax_mode:
        from replicator.orbax_mode import run_orbax_mode

        return run_orbax_mode(opts)
    try:
        # Opening the bucket checks what it supports (atomic folder rename or create-only writes) and
        # fails here, clearly, when it supports neither.
        daemon = build_replicator(opts)
        daemon.start()
    except Exception as e:  # an unusable bucket, a bind failure and the like: one line, non-zero exit
        print(f"mtc replicator: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"LISTENING {daemon.address}", flush=True)
    daemon.wait_for_signal()
    # In-flight transfers were abandoned (their temporary directories removed by stop()); do not let
    # worker threads hold the exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
