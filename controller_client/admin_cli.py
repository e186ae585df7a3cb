"""The operator's `mtc` commands: steps, inspect, verify, restore, pin, backups, export, plan, gc, status.

Each command prints a table (``rich``) or, with ``-o json``, one JSON document; decisions use the
coordinator's typed Admin service (``proto/admin.proto``), never parsed text. Exit codes: 0 ok,
1 error, 2 usage, 3 degraded (see ``docs/operations.md``). The offline commands (``backups``,
``export``, ``inspect --backup-url``, ``verify --tier bucket --backup-url``, ``plan --backup-url``)
need only the bucket. TensorStore is imported by ``mtc export`` alone. The commands live in
:mod:`controller_client.admin`; this module builds their parsers.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

import grpc

from controller_client.admin.bucket import (
    CHUNK_BYTES,
    EXPORT_DESCRIPTION,
    cmd_backups_download,
    cmd_backups_list,
    cmd_export,
)
from controller_client.admin.cluster import (
    cmd_backup_now,
    cmd_gc,
    cmd_pin,
    cmd_restore,
    cmd_status,
    cmd_steps,
)
from controller_client.admin.common import (
    EXIT_CODES_HELP,
    EXIT_ERROR,
    EXIT_USAGE,
    Conn,
    UsageError,
    add_bucket,
    add_connection,
    add_output,
)
from controller_client.admin.content import cmd_inspect, cmd_verify
from controller_client.admin.plan import cmd_plan
from replicator.options import DEFAULT_REPLICAS


def _example(text: str) -> dict[str, Any]:
    return {"epilog": f"example:\n  {text}\n\n{EXIT_CODES_HELP}", "formatter_class": argparse.RawDescriptionHelpFormatter}

Adder = Callable[..., argparse.ArgumentParser]


def register(sub: Any, log_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the admin commands to ``mtc``'s subparsers (``log_args`` adds the shared logging flags)."""

    def add(name: str, help_: str, example: str, fn: Callable[..., int], *, online: bool = True,
            parent: Any = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_, description=help_, **_example(example))
        add_output(p)
        add_connection(p)
        log_args(p)
        p.set_defaults(func=_runner(fn, online))
        return p

    _register_job_commands(add)
    _register_bucket_commands(sub, add)


def _register_job_commands(add: Adder) -> None:
    """The commands on the running job: status, steps, inspect, verify, restore, pin/unpin."""
    p = add("status", "a short summary of the job's health and the last restore's phases (exit 3 when degraded)",
            "mtc status --coordinator 10.0.0.2:7070", cmd_status, online=False)
    p.add_argument("--local-dir", help="ask this host's replicator over its Unix socket instead")
    p.add_argument("--hosts", action="store_true", help="also list every host: address, last report, lost, "
                   "steps held, last restore")
    p.add_argument("--ranks", help="with --hosts: only ranks A-B (or A-, or A)")
    p.add_argument("--jobset", help="without --coordinator: the JobSet NAME's state from the Kubernetes API (Failed, "
                   "Completed, Running; why; restarts against maxRestarts; exit 3 when Failed; needs the [k8s] extra)")
    p.add_argument("--namespace", default="default", help="with --jobset: its namespace (default: default)")
    p.add_argument("--kubeconfig", default=None, help="with --jobset: a kubeconfig (default: in-cluster, then "
                   "~/.kube/config)")
    add("steps", "every step by tier: which ranks are local, on a peer, in the bucket; complete, redundant, "
        "pinned, backing up", "mtc steps --coordinator 10.0.0.2:7070 -o json", cmd_steps)
    p = add("inspect", "a step's leaves (shape, dtype, sharding), shards per host, bytes and checksums",
            "mtc inspect 1200 --coordinator 10.0.0.2:7070   |   mtc inspect 1200 --backup-url gs://b/ckpt",
            cmd_inspect, online=False)
    p.add_argument("step", type=int)
    p.add_argument("--files", action="store_true", help="also list every file with its crc32c")
    add_bucket(p, required=False)
    p = add("verify", "re-read a step on a tier and check every crc32c; bad copies are reported to the "
            "coordinator, which stops using them", "mtc verify 1200 --tier peer --coordinator 10.0.0.2:7070",
            cmd_verify, online=False)
    p.add_argument("step", type=int)
    p.add_argument("--tier", choices=("local", "peer", "bucket"), help="default: every tier")
    p.add_argument("--parallel", type=int, default=4, help="copies read at once (default 4)")
    add_bucket(p, required=False)
    p = add("restore", "make every host hold STEP (fastest tier first) and pin it for the next restore()",
            "mtc restore 1100 --coordinator 10.0.0.2:7070", cmd_restore)
    p.add_argument("step", type=int)
    p.add_argument("--wait-seconds", type=float, default=600.0, help="give up after this long (default 600)")
    for name, what in (("pin", "keep STEP on every tier (GC skips it)"), ("unpin", "release a pinned STEP")):
        p = add(name, what, f"mtc {name} 1100 --coordinator 10.0.0.2:7070", cmd_pin)
        p.add_argument("step", type=int)


def _register_bucket_commands(sub: Any, add: Adder) -> None:
    """The bucket's commands (on the running job, and on the bucket alone), export and plan."""
    b = sub.add_parser("backup", help="bucket actions on the running job",
                       description="bucket actions on the running job", **_example("mtc backup now --wait-seconds 600"))
    bsub = b.add_subparsers(dest="backup_command", required=True)
    p = add("now", "back up the newest complete step as soon as the bucket tier is free",
            "mtc backup now --coordinator 10.0.0.2:7070 --wait-seconds 600", cmd_backup_now, parent=bsub)
    p.add_argument("step", type=int, nargs="?", help="default: the newest complete step")
    p.add_argument("--wait-seconds", type=float, default=0.0, help="wait until committed (default: do not)")
    p = add("gc", "what garbage collection would delete now, and why", "mtc gc --dry-run", cmd_gc)
    p.add_argument("--dry-run", action="store_true", help="required: show, delete nothing")
    bk = sub.add_parser("backups", help="the bucket alone (no running job needed)",
                        description="the bucket alone (no running job needed)",
                        **_example("mtc backups list --backup-url gs://b/ckpt"))
    ksub = bk.add_subparsers(dest="backups_command", required=True)
    p = add("list", "committed backups in the bucket (exit 3 when there is none)",
            "mtc backups list --backup-url gs://b/ckpt", cmd_backups_list, online=False, parent=ksub)
    add_bucket(p, required=True)
    p = add("download", "every rank of a backed-up step into DEST/<rank>/steps/<step>, verified",
            "mtc backups download 1200 --backup-url gs://b/ckpt --dest /scratch/1200", cmd_backups_download,
            online=False, parent=ksub)
    p.add_argument("step", type=int)
    p.add_argument("--dest", required=True)
    p.add_argument("--parallel", type=int, default=4, help="ranks downloaded at once (default 4)")
    add_bucket(p, required=True)
    p = add("export", "write a backed-up step as a standard Orbax checkpoint, streamed in bounded memory (needs "
            "the [jax] extra)", "mtc export 1200 --backup-url gs://b/ckpt --dest /scratch/ckpt-1200", cmd_export,
            online=False)
    p.description = EXPORT_DESCRIPTION
    p.add_argument("step", type=int)
    p.add_argument("--dest", required=True, help="directory to create (must not exist)")
    p.add_argument("--parallel", type=int, default=4, help="ranks downloaded at once (default 4)")
    p.add_argument("--scratch", default=None, help="where to stage the download (default: the temp dir); on disk, "
                   "not a tmpfs, when memory is limited")
    p.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES >> 20,
                   help=f"zarr chunk size, the unit of reading and writing (default {CHUNK_BYTES >> 20}); memory "
                        "is at most 9 chunks plus ~70 MiB")
    add_bucket(p, required=True)
    p = add("plan", "RAM-disk size per host for copies:N or ec:K+M, from a saved step or from --state-bytes/--hosts",
            "mtc plan --state-bytes 80e9 --hosts 64 --slices 4 --redundancy ec:4+2 --keep 2", cmd_plan,
            online=False)
    p.add_argument("--step", type=int, default=None,
                   help="the saved step to size from (default: the newest complete one, or the newest backup)")
    p.add_argument("--state-bytes", type=float, default=None, help="bytes of one copy of the training state")
    p.add_argument("--hosts", type=int, default=None)
    p.add_argument("--slices", type=int, default=1)
    p.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS,
                   help="--replicas of the replicators (default 1): the same as --redundancy copies:N")
    p.add_argument("--redundancy", default="",
                   help="--redundancy of the replicators: copies:N or ec:K+M (default copies:<--replicas>); "
                        "prints the code groups and what they survive")
    p.add_argument("--keep", type=int, default=2, help="--keep-local of the replicators (default 2)")
    p.add_argument("--snapshotter", action="store_true",
                   help="the loop also snapshots with Orbax's in-memory Snapshotter: count its pinned-host copy "
                        "of each host's shards in the host RAM budget")
    add_bucket(p, required=False)

def _runner(fn: Callable[..., int], online: bool) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        conn = None
        name = args.command if args.command not in ("backup", "backups") else \
            f"{args.command} {getattr(args, 'backup_command', None) or getattr(args, 'backups_command', '')}"
        try:
            if online or args.coordinator:
                conn = Conn(args)
            return fn(args, conn) if (online or fn in _MAYBE_ONLINE) else fn(args)
        except UsageError as e:
            print(f"mtc {name}: {e}", file=sys.stderr)
            return EXIT_USAGE
        except grpc.RpcError as e:
            where = f"coordinator {args.coordinator}" if args.coordinator else "peer"
            print(f"mtc {name}: {where}: {e.code().name}: {e.details()}", file=sys.stderr)
            return EXIT_ERROR
        except Exception as e:  # one line for the operator; the traceback with --log-level debug
            logging.getLogger(__name__).debug("mtc %s failed", name, exc_info=True)
            print(f"mtc {name}: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            if conn is not None:
                conn.close()

    return run

_MAYBE_ONLINE = {cmd_inspect, cmd_verify, cmd_plan, cmd_status}
