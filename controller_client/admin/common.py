"""Shared by the admin commands: exit codes, output (rich tables, JSON, progress), connection, bucket."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from mtc_rpc import admin_pb2_grpc
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from replicator.coordinator.client import Candidates, FailoverStub, parse_addresses
from replicator.erasure.redundancy import Redundancy
from replicator.net import rpc
from replicator.net.security import TlsOptions, read_token_file
from sidecar.saves import format_ranks

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DEGRADED = 0, 1, 2, 3

ENV_COORDINATOR = "MTC_COORDINATOR"

ENV_TOKEN_FILE = "MTC_TOKEN_FILE"

EXIT_CODES_HELP = "exit codes: 0 ok, 1 error, 2 usage, 3 degraded (no redundant complete step, a lost host, " \
                  "or the newest backup overdue)"

class UsageError(ValueError):
    """Bad command-line input: printed on one line, exit 2."""

def console(stderr: bool = False) -> Any:
    stream = sys.stderr if stderr else sys.stdout
    # Not a terminal (a pipe, a test, a log) and no $COLUMNS: wide enough that cells are rarely wrapped.
    width = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160
    return Console(file=stream, width=width, highlight=False)

def ranges(ranks: Iterable[int]) -> str:
    """:func:`sidecar.saves.format_ranks` for a table cell: ``[0, 1, 2, 5]`` -> ``"0-2,5"``; ``-`` when empty."""
    return format_ranks(ranks) or "-"

def redundancy_text(spec: str) -> str:
    """``copies:1 (survives 1 lost host)``, ``ec:4+2 (survives 2 lost hosts per code group)``; "" is unknown
    (a coordinator that does not say); a spec this client cannot parse is shown as it is."""
    if not spec:
        return "unknown"
    try:
        red = Redundancy.parse(spec)
    except ValueError:
        return spec
    n = red.losses_survived
    if n == 0:
        return f"{red} (no peer copy: a lost host's step comes from the bucket)"
    hosts = f"{n} lost host{'s' if n > 1 else ''}"
    return f"{red} (survives {hosts} per code group)" if red.is_ec else f"{red} (survives {hosts})"

def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"

def when(unix: float, short: bool = False) -> str:
    if not unix:
        return "-"
    ago = f"{age(time.time() - unix)} ago"
    return ago if short else f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(unix))}Z ({ago})"

def age(seconds: float) -> str:
    s = int(max(0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"

def table(title: str, columns: list[str]) -> Any:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    return t

def emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))

def progress(transient: bool = True, hosts: bool = False) -> Any:
    if hosts:
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console(stderr=True), transient=transient)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console(stderr=True), transient=transient)

def add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("table", "json"), default="table",
                   help="table for people (default) or json for scripts")

def add_connection(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR, ""),
                   help=f"HOST:PORT of the coordinator, or its candidates in order, comma-separated "
                        f"(default ${ENV_COORDINATOR})")
    g.add_argument("--token-file", default=os.environ.get(ENV_TOKEN_FILE, ""),
                   help=f"file with the bearer token (default ${ENV_TOKEN_FILE})")
    g.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS: the job's admin "
                   "certificate (URI SAN mtc://JOB/admin; docs/security.md)")
    g.add_argument("--tls-key", help="client key (PEM)")
    g.add_argument("--tls-ca", help="CA bundle (PEM) that signed the replicators' certificates")
    g.add_argument("--timeout-seconds", type=float, default=10.0, help="deadline of each call (default 10)")

def add_bucket(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--backup-url", required=required, default=None,
                   help="the bucket (file:///path, gs://bucket/prefix, any fsspec URL)")
    p.add_argument("--job", default=None, help="job name in the bucket (default: the only job there)")

class Conn:
    """The coordinator's Admin stub plus what is needed to reach each host's Peer service."""

    def __init__(self, args: argparse.Namespace):
        if not args.coordinator:
            raise UsageError(f"give --coordinator HOST:PORT[,HOST:PORT...] (or set ${ENV_COORDINATOR})")
        self.token = read_token_file(Path(args.token_file)) if args.token_file else None
        self.tls = TlsOptions.from_args(args.tls_cert, args.tls_key, args.tls_ca)
        self.timeout = args.timeout_seconds
        self.address = args.coordinator
        # The coordinator candidates in order (one per slice): a standby answers UNAVAILABLE and the next
        # one is tried, as the hosts and the CheckpointManager do.
        self._candidates = Candidates(parse_addresses(args.coordinator),
                                      lambda a: rpc.make_channel(a, token=self.token, tls=self.tls),
                                      stub_class=admin_pb2_grpc.AdminStub, fence_epochs=True)
        self.admin = FailoverStub(self._candidates)

    def call_until(self, method: str, request: Any, deadline: float, extra_seconds: float = 0.0) -> Any:
        """``self.admin.<method>(request)``, retried across the candidates with backoff while none serves
        (UNAVAILABLE: a standby, an isolated one, or one still rebuilding its view after a restart; or a
        deadline passed) until ``deadline`` (monotonic); then the last error is raised. ``extra_seconds``: how
        long the call itself may wait on top of the connection's timeout (a long poll)."""
        return self._candidates.call_until(method, request, self.timeout + extra_seconds, deadline)

    def close(self) -> None:
        self._candidates.close()

def open_backup(url: str, job: str | None) -> Any:
    """A read-only :class:`BackupStore` on ``url`` for ``job`` (the only job in the bucket when None)."""
    store = open_store(url)
    if job is None:
        jobs = sorted({o.name.strip("/").split("/")[0] for o in store.list("", shallow=True)} - {""})
        jobs = [j for j in jobs if store.list(f"{j}/commits", shallow=True) or store.list(f"{j}/steps", shallow=True)]
        if len(jobs) != 1:
            raise UsageError(f"{url} holds backups of jobs {jobs or 'none'}: give --job NAME")
        job = jobs[0]
    return BackupStore(store, job)
