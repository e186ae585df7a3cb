"""The operator's `mtc` commands: steps, inspect, verify, restore, pin, backups, export, plan, gc, status.

Each command prints a table (``rich``) or, with ``-o json``, one JSON document; decisions use the
coordinator's typed Admin service (``proto/admin.proto``), never parsed text. Exit codes: 0 ok,
1 error, 2 usage, 3 degraded (see ``docs/operations.md``). The offline commands (``backups``,
``export``, ``inspect --backup-url``, ``verify --tier bucket --backup-url``, ``plan --backup-url``)
need only the bucket. jax and Orbax are imported by ``mtc export`` alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DEGRADED = 0, 1, 2, 3
ENV_COORDINATOR = "MTC_COORDINATOR"
ENV_TOKEN_FILE = "MTC_TOKEN_FILE"

EXIT_CODES_HELP = "exit codes: 0 ok, 1 error, 2 usage, 3 degraded (no redundant complete step, a lost host, " \
                  "or the newest backup overdue)"


class UsageError(ValueError):
    """Bad command-line input: printed on one line, exit 2."""


# --------------------------------------------------------------------------- shared plumbing

def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Not a terminal (a pipe, a test, a log) and no $COLUMNS: wide enough that cells are rarely wrapped.
    width = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160
    return Console(file=stream, width=width, highlight=False)


def _ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``; ``-`` when empty."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(unix: float, short: bool = False) -> str:
    if not unix:
        return "-"
    age = f"{_age(time.time() - unix)} ago"
    return age if short else f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(unix))}Z ({age})"


def _age(seconds: float) -> str:
    s = int(max(0, seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _table(title: str, columns: list[str]) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    return t


def _emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def _progress(transient: bool = True, hosts: bool = False) -> Any:
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

    if hosts:
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=_console(stderr=True), transient=transient)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=_console(stderr=True), transient=transient)


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", choices=("table", "json"), default="table",
                   help="table for people (default) or json for scripts")


def _add_connection(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR, ""),
                   help=f"HOST:PORT of the coordinator (default ${ENV_COORDINATOR})")
    g.add_argument("--token-file", default=os.environ.get(ENV_TOKEN_FILE, ""),
                   help=f"file with the bearer token (default ${ENV_TOKEN_FILE})")
    g.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS")
    g.add_argument("--tls-key", help="client key (PEM)")
    g.add_argument("--tls-ca", help="CA bundle (PEM) that signed the replicators' certificates")
    g.add_argument("--timeout-seconds", type=float, default=10.0, help="deadline of each call (default 10)")


def _add_bucket(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--backup-url", required=required, default=None,
                   help="the bucket (file:///path, gs://bucket/prefix, any fsspec URL)")
    p.add_argument("--job", default=None, help="job name in the bucket (default: the only job there)")


class Conn:
    """The coordinator's Admin stub plus what is needed to reach each host's Peer service."""

    def __init__(self, args: argparse.Namespace):
        from replicator.net import rpc
        from replicator.net.security import TlsOptions

        if not args.coordinator:
            raise UsageError(f"give --coordinator HOST:PORT (or set ${ENV_COORDINATOR})")
        self.token = Path(args.token_file).read_text().strip() if args.token_file else None
        self.tls = TlsOptions.from_args(args.tls_cert, args.tls_key, args.tls_ca)
        self.timeout = args.timeout_seconds
        self.address = args.coordinator
        self.channel = rpc.make_channel(args.coordinator, token=self.token, tls=self.tls)
        from mtc_rpc import admin_pb2_grpc

        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()


def _open_backup(url: str, job: str | None) -> Any:
    """A read-only :class:`BackupStore` on ``url`` for ``job`` (the only job in the bucket when None)."""
    from replicator.backup.bucket import BackupStore
    from replicator.backup.storage import open_store

    store = open_store(url)
    if job is None:
        jobs = sorted({o.name.strip("/").split("/")[0] for o in store.list("", shallow=True)} - {""})
        jobs = [j for j in jobs if store.list(f"{j}/commits", shallow=True) or store.list(f"{j}/steps", shallow=True)]
        if len(jobs) != 1:
            raise UsageError(f"{url} holds backups of jobs {jobs or 'none'}: give --job NAME")
        job = jobs[0]
    return BackupStore(store, job)


# --------------------------------------------------------------------------- status / steps

def summary_doc(s: Any) -> dict[str, Any]:
    return {
        "job": s.job, "nodes": s.nodes, "hosts_registered": s.hosts_registered, "lost_ranks": list(s.lost_ranks),
        "newest_complete_step": s.newest_complete_step if s.newest_complete_step >= 0 else None,
        "newest_complete_bytes": s.newest_complete_bytes, "newest_redundant": s.newest_redundant,
        "pinned_steps": list(s.pinned_steps),
        "restore_target": s.restore_target if s.restore_target >= 0 else None,
        "backup": None if not s.backup_url else {
            "url": s.backup_url,
            "newest_step": s.newest_backup_step if s.newest_backup_step >= 0 else None,
            "last_success_unix": s.backup_last_success_unix or None,
            "interval_seconds": s.backup_interval_seconds, "interval_steps": s.backup_interval_steps,
            "skipped": s.backup_skipped, "failures": s.backup_failures, "last_error": s.backup_last_error,
            "in_progress_step": s.backup_in_progress_step if s.backup_in_progress_step >= 0 else None,
        },
        "degraded": s.degraded, "problems": list(s.problems),
    }


def _local_status(args: argparse.Namespace) -> int:
    import grpc

    from mtc_rpc import control_pb2, control_pb2_grpc
    from sidecar.layout import control_socket

    sock = control_socket(args.local_dir)
    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            resp = control_pb2_grpc.LocalControlStub(ch).GetLocalStatus(
                control_pb2.GetLocalStatusRequest(), timeout=args.timeout_seconds)
    except grpc.RpcError as e:
        print(f"mtc status: no replicator answers on {sock}: {e.code().name}", file=sys.stderr)
        return EXIT_ERROR
    doc = json.loads(resp.status_json)
    if args.output == "json":
        _emit_json(doc)
        return EXIT_OK
    t = _table(f"replicator rank {doc.get('rank')} of job {doc.get('job')}", ["", ""])
    t.show_header = False
    for k in ("address", "metrics_address", "own_steps", "peer_steps", "newest_complete_step", "in_flight"):
        t.add_row(k, json.dumps(doc.get(k)))
    for k, v in sorted(doc.get("counters", {}).items()):
        t.add_row(k, str(v))
    if doc.get("recent_errors"):
        t.add_row("recent errors", "\n".join(doc["recent_errors"][-5:]))
    _console().print(t)
    return EXIT_OK


def cmd_status(args: argparse.Namespace, conn: Conn | None) -> int:
    from mtc_rpc import admin_pb2 as pb

    if args.local_dir:
        return _local_status(args)
    if conn is None:
        raise UsageError(f"give --coordinator HOST:PORT (or set ${ENV_COORDINATOR}) or --local-dir DIR")
    s = conn.admin.GetSummary(pb.GetSummaryRequest(), timeout=conn.timeout)
    doc = summary_doc(s)
    if args.output == "json":
        _emit_json(doc)
    else:
        t = _table(f"job {s.job}: {s.nodes} hosts", ["", ""])
        t.show_header = False
        t.add_row("hosts", f"{s.hosts_registered}/{s.nodes} reporting" +
                  (f", lost: {_ranges(s.lost_ranks)}" if s.lost_ranks else ""))
        newest = "none" if s.newest_complete_step < 0 else (
            f"{s.newest_complete_step} ({_bytes(s.newest_complete_bytes)}, "
            f"{'redundant' if s.newest_redundant else 'NOT redundant'})")
        t.add_row("newest complete step", newest)
        t.add_row("restore target", "-" if s.restore_target < 0 else str(s.restore_target))
        t.add_row("pinned", _ranges(s.pinned_steps))
        if s.backup_url:
            every = (f"every {s.backup_interval_steps} steps" if s.backup_interval_steps
                     else f"every {_age(s.backup_interval_seconds)}")
            t.add_row("bucket", f"{s.backup_url} ({every})")
            t.add_row("newest backup", "none" if s.newest_backup_step < 0 else
                      f"step {s.newest_backup_step}, {_when(s.backup_last_success_unix)}")
            if s.backup_in_progress_step >= 0:
                t.add_row("backing up", f"step {s.backup_in_progress_step}")
            t.add_row("backups skipped / failed", f"{s.backup_skipped} / {s.backup_failures}")
            if s.backup_last_error:
                t.add_row("last backup error", s.backup_last_error)
        else:
            t.add_row("bucket", "none configured")
        t.add_row("health", "DEGRADED: " + "; ".join(s.problems) if s.degraded else "ok")
        _console().print(t)
    return EXIT_DEGRADED if s.degraded else EXIT_OK


def step_doc(i: Any) -> dict[str, Any]:
    return {"step": i.step, "complete": i.complete, "redundant": i.redundant, "pinned": i.pinned,
            "backing_up": i.backing_up, "backed_up": i.backed_up, "restore_target": i.restore_target,
            "local_ranks": list(i.local_ranks), "peer_ranks": list(i.peer_ranks),
            "bucket_ranks": list(i.bucket_ranks), "missing_ranks": list(i.missing_ranks), "bytes": i.bytes,
            "first_seen_unix": i.first_seen_unix or None, "backup_unix": i.backup_unix or None}


def cmd_steps(args: argparse.Namespace, conn: Conn) -> int:
    from mtc_rpc import admin_pb2 as pb

    resp = conn.admin.ListSteps(pb.ListStepsRequest(), timeout=conn.timeout)
    s = conn.admin.GetSummary(pb.GetSummaryRequest(), timeout=conn.timeout)
    if args.output == "json":
        _emit_json({"job": resp.job, "nodes": resp.nodes,
                    "newest_complete_step": resp.newest_complete_step if resp.newest_complete_step >= 0 else None,
                    "steps": [step_doc(i) for i in resp.steps], "degraded": s.degraded, "problems": list(s.problems)})
    else:
        t = _table(f"job {resp.job}: steps by tier (ranks; {resp.nodes} in all)",
                   ["step", "state", "local", "peer", "bucket", "missing", "bytes", "flags", "backed up"])
        for i in resp.steps:
            flags = [n for n, v in (("pinned", i.pinned), ("backing-up", i.backing_up),
                                    ("restore-target", i.restore_target)) if v]
            state = "redundant" if i.complete and i.redundant else "complete" if i.complete else "incomplete"
            t.add_row(str(i.step), state, _ranges(i.local_ranks), _ranges(i.peer_ranks), _ranges(i.bucket_ranks),
                      _ranges(i.missing_ranks), _bytes(i.bytes), "\n".join(flags) or "-",
                      _when(i.backup_unix, short=True))
        con = _console()
        con.print(t)
        if s.degraded:
            con.print("DEGRADED: " + "; ".join(s.problems))
    return EXIT_DEGRADED if s.degraded else EXIT_OK


# --------------------------------------------------------------------------- inspect / verify

def _cluster_pieces(conn: Conn, step: int) -> Any:
    from mtc_rpc import admin_pb2 as pb

    return conn.admin.LocateStep(pb.LocateStepRequest(step=step), timeout=conn.timeout)


def _manifests_from_cluster(conn: Conn, step: int) -> dict[int, Any]:
    """rank -> the manifest of the data it restores from (its own, or an identical replica's), from a host."""
    from replicator.peer import client as peer_client

    loc = _cluster_pieces(conn, step)
    best: dict[int, Any] = {}
    for p in loc.pieces:
        if p.tier == "bucket" or not p.address:
            continue
        if p.owner_rank not in best or (p.tier == "local" and best[p.owner_rank].tier != "local"):
            best[p.owner_rank] = p
    owners = {r.rank: r.owner_rank for r in loc.ranks}
    if any(o not in best for o in owners.values()) and loc.backup_url:
        return _manifests_from_bucket(_open_backup(loc.backup_url, loc.job), step)  # some only in the bucket
    fetched: dict[int, Any] = {}
    out = {}
    for rank, owner in sorted(owners.items()):
        if owner not in fetched:
            p = best[owner]
            fetched[owner] = peer_client.get_manifest(p.address, owner, step, timeout_seconds=conn.timeout,
                                                      token=conn.token, tls=conn.tls)
        out[rank] = fetched[owner]
    return out


def _manifests_from_bucket(backup: Any, step: int) -> dict[int, Any]:
    rec, _ = backup.commit_record(step)
    return {r: backup.read_manifest(step, r) for r in range(rec.nodes)}


def _sharding_of(shards: Iterable[Any], shape: tuple[int, ...]) -> str:
    """How the saved shards split the array: ``replicated`` or the number of pieces per dimension."""
    idx = {s.index for s in shards}
    if not shape or idx == {tuple((0, n) for n in shape)}:
        return "replicated"
    per_dim = [len({i[d] for i in idx}) for d in range(len(shape))]
    return "x".join(str(n) for n in per_dim) + " shards"


def inspect_doc(step: int, manifests: dict[int, Any], source: str) -> dict[str, Any]:
    leaves: dict[str, dict[str, Any]] = {}
    ranks = []
    for rank, m in sorted(manifests.items()):
        ranks.append({"rank": rank, "data_of_rank": m.rank, "kind": m.kind, "bytes": m.total_bytes, "files": len(m.files),
                      "content_hash": m.content_hash,
                      "shards": sum(len(a.shards) for a in m.arrays),
                      "file_checksums": [{"name": f.name, "size": f.size, "crc32c": f"{f.crc32c:08x}"}
                                         for f in m.files]})
        for a in m.arrays:
            leaf = leaves.setdefault(a.path, {"path": a.path, "shape": list(a.global_shape), "dtype": a.dtype,
                                              "key_impl": a.key_impl, "shards": [], "bytes": 0})
            for s in a.shards:
                leaf["shards"].append({"rank": rank, "index": [list(x) for x in s.index], "bytes": s.length,
                                       "crc32c": f"{s.crc32c:08x}"})
        for v in m.values:
            leaves.setdefault(v.path, {"path": v.path, "value": v.value})
    for leaf in leaves.values():
        if "shards" in leaf:
            distinct = {tuple(tuple(x) for x in s["index"]): s["bytes"] for s in leaf["shards"]}
            leaf["bytes"] = sum(distinct.values())
            leaf["sharding"] = _sharding_of([_Idx(k) for k in distinct], tuple(leaf["shape"]))
    return {"step": step, "source": source, "nodes": len(manifests), "kind": ranks[0]["kind"] if ranks else None,
            "bytes": sum(r["bytes"] for r in ranks), "leaves": list(leaves.values()), "ranks": ranks}


class _Idx:
    def __init__(self, index: tuple) -> None:
        self.index = index


def cmd_inspect(args: argparse.Namespace, conn: Conn | None) -> int:
    if args.backup_url:
        backup = _open_backup(args.backup_url, args.job)
        manifests, source = _manifests_from_bucket(backup, args.step), backup.store.url
    else:
        assert conn is not None
        manifests, source = _manifests_from_cluster(conn, args.step), f"cluster {conn.address}"
    doc = inspect_doc(args.step, manifests, source)
    if args.output == "json":
        _emit_json(doc)
        return EXIT_OK
    con = _console()
    t = _table(f"step {args.step} from {source}: {doc['nodes']} ranks, {_bytes(doc['bytes'])} ({doc['kind']})",
               ["leaf", "shape", "dtype", "sharding", "bytes"])
    for leaf in doc["leaves"]:
        if "value" in leaf:
            t.add_row(leaf["path"], "-", type(leaf["value"]).__name__, "value", repr(leaf["value"]))
        else:
            dtype = leaf["dtype"] + (f" (key {leaf['key_impl']})" if leaf.get("key_impl") else "")
            t.add_row(leaf["path"], str(tuple(leaf["shape"])), dtype, leaf["sharding"], _bytes(leaf["bytes"]))
    con.print(t)
    h = _table("per host", ["rank", "shards", "files", "bytes", "content hash"])
    for r in doc["ranks"]:
        same = f" (= rank {r['data_of_rank']})" if r["data_of_rank"] != r["rank"] else ""
        h.add_row(f"{r['rank']}{same}", str(r["shards"]), str(r["files"]), _bytes(r["bytes"]),
                  r["content_hash"][:16])
    con.print(h)
    if args.files:
        f = _table("files", ["rank", "file", "bytes", "crc32c"])
        for r in doc["ranks"]:
            for x in r["file_checksums"]:
                f.add_row(str(r["rank"]), x["name"], str(x["size"]), x["crc32c"])
        con.print(f)
    return EXIT_OK


def _verify_on_host(conn: Conn, piece: Any, step: int) -> tuple[int, list[str]]:
    """Re-read every file of one host's copy through its Peer service; (bytes read, bad file names)."""
    from mtc_rpc import peer_pb2, peer_pb2_grpc
    from replicator.net import rpc
    from replicator.peer import client as peer_client
    from sidecar import layout

    m = peer_client.get_manifest(piece.address, piece.owner_rank, step, timeout_seconds=conn.timeout,
                                 token=conn.token, tls=conn.tls)
    crcs = [0] * len(m.files)
    sizes = [0] * len(m.files)
    ch = rpc.make_channel(piece.address, token=conn.token, tls=conn.tls)
    try:
        stream = peer_pb2_grpc.PeerStub(ch).ReadFiles(
            peer_pb2.ReadFilesRequest(rank=piece.owner_rank, step=step), timeout=max(60.0, conn.timeout * 30))
        for c in stream:
            crcs[c.file_index] = layout.crc32c_extend(crcs[c.file_index], c.data)
            sizes[c.file_index] += len(c.data)
    finally:
        ch.close()
    bad = [f.name for f, crc, n in zip(m.files, crcs, sizes, strict=True) if crc != f.crc32c or n != f.size]
    return sum(sizes), bad


def _verify_bucket_rank(backup: Any, step: int, rank: int) -> tuple[int, list[str]]:
    from sidecar.layout import ChecksumError

    tmp = Path(tempfile.mkdtemp(prefix="mtc-verify-"))
    try:
        got = backup.download_rank(step, rank, tmp)
        return sum(p.stat().st_size for p in got.rglob("*") if p.is_file()), []
    except ChecksumError as e:
        return 0, [str(e)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_verify(args: argparse.Namespace, conn: Conn | None) -> int:
    from mtc_rpc import admin_pb2 as pb

    tiers = [args.tier] if args.tier else ["local", "peer", "bucket"]
    jobs: list[tuple[str, int, int, Callable[[], tuple[int, list[str]]]]] = []  # tier, holder, owner, fn
    backup_url = args.backup_url
    job = args.job
    if conn is not None:
        loc = _cluster_pieces(conn, args.step)
        backup_url = backup_url or loc.backup_url
        job = job or loc.job
        for p in loc.pieces:
            if p.tier in tiers and p.tier != "bucket":
                jobs.append((p.tier, p.holder_rank, p.owner_rank, lambda p=p: _verify_on_host(conn, p, args.step)))
    elif set(tiers) != {"bucket"}:
        raise UsageError("without --coordinator only --tier bucket (with --backup-url) can be verified")
    if "bucket" in tiers and backup_url:
        backup = _open_backup(backup_url, job)
        try:
            rec, _ = backup.commit_record(args.step)
        except FileNotFoundError:
            rec = None
            if args.tier == "bucket":
                raise
        if rec is not None:
            for r in range(rec.nodes):
                jobs.append(("bucket", -1, r, lambda r=r: _verify_bucket_rank(backup, args.step, r)))
    elif args.tier == "bucket":
        raise UsageError("no bucket: give --backup-url (or a coordinator with a backup tier)")
    if not jobs:
        print(f"mtc verify: step {args.step} has no copy on tier(s) {', '.join(tiers)}", file=sys.stderr)
        return EXIT_ERROR
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futs = {pool.submit(fn): (tier, holder, owner) for tier, holder, owner, fn in jobs}
        for fut in concurrent.futures.as_completed(futs):
            tier, holder, owner = futs[fut]
            try:
                nbytes, bad = fut.result()
                err = ""
            except Exception as e:  # an unreachable host or unreadable copy is a failure too
                nbytes, bad, err = 0, [], f"{type(e).__name__}: {e}"
            results.append({"tier": tier, "holder_rank": holder if holder >= 0 else None, "owner_rank": owner,
                            "bytes": nbytes, "bad_files": bad, "error": err, "ok": not bad and not err})
    results.sort(key=lambda x: (x["tier"], x["owner_rank"], x["holder_rank"] or -1))
    reported = []
    if conn is not None:
        for x in results:
            if x["bad_files"]:
                resp = conn.admin.ReportBadCopy(pb.ReportBadCopyRequest(
                    step=args.step, owner_rank=x["owner_rank"],
                    holder_rank=-1 if x["holder_rank"] is None else x["holder_rank"], tier=x["tier"],
                    file=x["bad_files"][0]), timeout=conn.timeout)
                reported.append(resp.action)
    ok = all(x["ok"] for x in results)
    if args.output == "json":
        _emit_json({"step": args.step, "ok": ok, "copies": results, "reported": reported})
    else:
        t = _table(f"verify step {args.step}", ["tier", "holder", "rank", "bytes", "result"])
        for x in results:
            res = "ok" if x["ok"] else ("BAD: " + ", ".join(x["bad_files"]) if x["bad_files"] else x["error"])
            t.add_row(x["tier"], "bucket" if x["holder_rank"] is None else str(x["holder_rank"]),
                      str(x["owner_rank"]), _bytes(x["bytes"]), res)
        con = _console()
        con.print(t)
        for a in reported:
            con.print(f"reported to the coordinator: {a}")
    for x in results:
        for f in x["bad_files"]:
            where = "bucket" if x["holder_rank"] is None else f"host {x['holder_rank']}"
            print(f"mtc verify: bad file {f} (rank {x['owner_rank']} on {where}, {x['tier']} tier)",
                  file=sys.stderr)
    return EXIT_OK if ok else EXIT_ERROR


# --------------------------------------------------------------------------- actions

def cmd_restore(args: argparse.Namespace, conn: Conn) -> int:
    from mtc_rpc import admin_pb2 as pb

    deadline = time.monotonic() + args.wait_seconds
    resp = None
    quiet = args.output == "json"
    prog = None if quiet else _progress(transient=False, hosts=True)
    task = None
    try:
        if prog is not None:
            prog.start()
        while True:
            wait = max(0.0, min(2.0, deadline - time.monotonic()))
            resp = conn.admin.RestoreStep(pb.RestoreStepRequest(step=args.step, wait_seconds=wait),
                                          timeout=wait + conn.timeout)
            if prog is not None:
                if task is None:
                    task = prog.add_task(f"step {resp.step}: hosts ready", total=resp.nodes)
                prog.update(task, completed=len(resp.ready_ranks))
            if resp.ready or time.monotonic() >= deadline:
                break
    finally:
        if prog is not None:
            prog.stop()
    doc = {"step": resp.step, "ready": resp.ready, "ready_ranks": list(resp.ready_ranks), "nodes": resp.nodes,
           "reason": resp.reason, "pinned_for_next_restore": True}
    if quiet:
        _emit_json(doc)
    elif resp.ready:
        print(f"every host holds step {resp.step}; the next restore() gets it ({resp.reason})")
    else:
        print(f"step {resp.step} pinned; {len(resp.ready_ranks)}/{resp.nodes} hosts ready after "
              f"{args.wait_seconds:.0f}s: {resp.reason}")
    return EXIT_OK if resp.ready else EXIT_ERROR


def cmd_pin(args: argparse.Namespace, conn: Conn) -> int:
    from mtc_rpc import admin_pb2 as pb

    call = conn.admin.Pin if args.command == "pin" else conn.admin.Unpin
    resp = call(pb.PinRequest(step=args.step), timeout=conn.timeout)
    if args.output == "json":
        _emit_json({"step": args.step, "action": args.command, "pinned_steps": list(resp.pinned_steps)})
    else:
        print(f"{args.command}ned step {args.step}; pinned now: {_ranges(resp.pinned_steps)}")
    return EXIT_OK


def cmd_backup_now(args: argparse.Namespace, conn: Conn) -> int:
    from mtc_rpc import admin_pb2 as pb

    resp = conn.admin.BackupNow(pb.BackupNowRequest(step=-1 if args.step is None else args.step),
                                timeout=conn.timeout)
    state = resp.state
    if args.wait_seconds > 0 and state != "already-backed-up":
        deadline = time.monotonic() + args.wait_seconds
        while time.monotonic() < deadline:
            steps = conn.admin.ListSteps(pb.ListStepsRequest(), timeout=conn.timeout)
            if any(i.step == resp.step and i.backed_up for i in steps.steps):
                state = "backed-up"
                break
            time.sleep(0.5)
    if args.output == "json":
        _emit_json({"step": resp.step, "state": state})
    else:
        print(f"backup of step {resp.step}: {state}")
    if args.wait_seconds > 0 and state not in ("backed-up", "already-backed-up"):
        print(f"mtc backup now: step {resp.step} not committed after {args.wait_seconds:.0f}s", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def cmd_gc(args: argparse.Namespace, conn: Conn) -> int:
    from mtc_rpc import admin_pb2 as pb

    if not args.dry_run:
        raise UsageError("only `mtc gc --dry-run` exists: collection runs on its own on every host")
    resp = conn.admin.GcPlan(pb.GcPlanRequest(), timeout=conn.timeout)
    items = [{"tier": i.tier, "holder_rank": i.holder_rank if i.holder_rank >= 0 else None,
              "owner_rank": i.owner_rank if i.owner_rank >= 0 else None, "step": i.step, "bytes": i.size,
              "reason": i.reason} for i in resp.items]
    if args.output == "json":
        _emit_json({"would_delete": items, "protected_steps": list(resp.protected_steps)})
    else:
        t = _table(f"gc --dry-run: {len(items)} pieces would be deleted; protected steps "
                   f"{_ranges(resp.protected_steps)}", ["tier", "holder", "rank", "step", "bytes", "why"])
        for x in items:
            t.add_row(x["tier"], "bucket" if x["holder_rank"] is None else str(x["holder_rank"]),
                      "all" if x["owner_rank"] is None else str(x["owner_rank"]), str(x["step"]),
                      _bytes(x["bytes"]) if x["bytes"] else "-", x["reason"])
        _console().print(t if items else f"gc --dry-run: nothing would be deleted; protected steps "
                          f"{_ranges(resp.protected_steps)}")
    return EXIT_OK


# --------------------------------------------------------------------------- offline (bucket only)

def cmd_backups_list(args: argparse.Namespace) -> int:
    backup = _open_backup(args.backup_url, args.job)
    rows = []
    for step in backup.committed_steps():
        rec, _ = backup.commit_record(step)
        rows.append({"step": step, "nodes": rec.nodes, "bytes": rec.total_bytes,
                     "committed_unix": rec.committed_unix, "strategy": rec.strategy})
    if args.output == "json":
        _emit_json({"url": backup.store.url, "job": backup.job, "backups": rows})
    else:
        t = _table(f"backups of job {backup.job} in {backup.store.url}", ["step", "ranks", "bytes", "committed"])
        for r in rows:
            t.add_row(str(r["step"]), str(r["nodes"]), _bytes(r["bytes"]), _when(r["committed_unix"]))
        _console().print(t)
    return EXIT_OK if rows else EXIT_DEGRADED


def download_step(backup: Any, step: int, dest: Path, *, ranks: list[int] | None = None, parallel: int = 4,
                  show_progress: bool = True) -> dict[int, Path]:
    """Every rank's data of committed ``step`` into ``dest/<rank>/steps/<step>``, verified, in parallel."""
    rec, _ = backup.commit_record(step)
    ranks = list(range(rec.nodes)) if ranks is None else ranks
    manifests = {r: backup.read_manifest(step, r) for r in ranks}
    for r in ranks:
        if (dest / str(r) / "steps" / str(step)).exists():
            raise FileExistsError(f"{dest / str(r) / 'steps' / str(step)} exists already")
    prog = _progress() if show_progress else None
    out: dict[int, Path] = {}
    try:
        if prog is not None:
            prog.start()
            task = prog.add_task(f"step {step}: {len(ranks)} ranks", total=sum(m.total_bytes for m in
                                                                               manifests.values()))

        def one(r: int) -> tuple[int, Path]:
            parent = dest / str(r) / "steps"
            parent.mkdir(parents=True, exist_ok=True)
            path = backup.download_rank(step, r, parent)
            if prog is not None:
                prog.advance(task, manifests[r].total_bytes)
            return r, path

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for r, path in pool.map(one, ranks):
                out[r] = path
    finally:
        if prog is not None:
            prog.stop()
    return out


def cmd_backups_download(args: argparse.Namespace) -> int:
    backup = _open_backup(args.backup_url, args.job)
    dest = Path(args.dest)
    t0 = time.monotonic()
    got = download_step(backup, args.step, dest, parallel=args.parallel, show_progress=args.output == "table")
    total = sum(sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) for d in got.values())
    secs = time.monotonic() - t0
    if args.output == "json":
        _emit_json({"step": args.step, "dest": str(dest), "ranks": {str(r): str(p) for r, p in sorted(got.items())},
                    "bytes": total, "seconds": round(secs, 3), "verified": True})
    else:
        print(f"downloaded step {args.step}: {len(got)} ranks, {_bytes(total)} in {secs:.1f}s, every file "
              f"verified (crc32c) -> {dest}/<rank>/steps/{args.step}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from controller_client.export import export_step

    backup = _open_backup(args.backup_url, args.job)
    dest = Path(args.dest)
    with tempfile.TemporaryDirectory(prefix="mtc-export-", dir=args.scratch) as tmp:
        download_step(backup, args.step, Path(tmp), parallel=args.parallel,
                      show_progress=args.output == "table")
        info = export_step(args.step, [Path(tmp) / d for d in sorted(os.listdir(tmp))], dest)
    if args.output == "json":
        _emit_json(info)
    else:
        print(f"exported step {args.step} as an Orbax checkpoint: {dest} ({info['leaves']} leaves, "
              f"{_bytes(info['bytes'])}); load it with orbax.checkpoint.StandardCheckpointer().restore(path)")
    return EXIT_OK


def ram_disk_plan(per_rank_bytes: int, *, slices: int, replicas: int, keep: int,
                  distinct_replicas: bool = False) -> dict[str, Any]:
    """RAM disk per host for a rank holding ``per_rank_bytes`` of its own data per step.

    Each host holds, per kept step, its own shards plus the byte copies it keeps for other ranks:
    ``replicas`` copies per rank, of which the ``slices - 1`` data-parallel replicas are free when they
    hold byte-identical data (verified by hash). One more step is being written while ``keep`` are kept,
    and 10 % headroom covers manifests and temporary directories.
    """
    extra = replicas if distinct_replicas else max(0, replicas - (slices - 1))
    per_step = per_rank_bytes * (1 + extra)
    need = -(-(keep + 1) * per_step * 11 // 10)  # x 1.1, rounded up, in integers
    rule = ("ram_disk_per_host = (keep + 1) x own_bytes_per_step x (1 + byte_copies) x 1.1, "
            "byte_copies = replicas - (slices - 1) when data-parallel replicas are byte-identical, "
            "else replicas")
    return {"own_bytes_per_step": per_rank_bytes, "byte_copies_per_rank": extra, "keep": keep,
            "ram_disk_bytes_per_host": need, "rule": rule}


def cmd_plan(args: argparse.Namespace, conn: Conn | None) -> int:
    source = "flags"
    distinct = False
    if args.state_bytes is not None:
        if not args.hosts:
            raise UsageError("--state-bytes needs --hosts (and --slices if more than one)")
        if args.hosts % args.slices:
            raise UsageError(f"--hosts {args.hosts} is not a multiple of --slices {args.slices}")
        per_rank = math.ceil(args.state_bytes / (args.hosts // args.slices))
    elif args.backup_url or args.step is not None:
        if args.backup_url:
            backup = _open_backup(args.backup_url, args.job)
            step = args.step if args.step is not None else backup.committed_steps()[-1]
            manifests = _manifests_from_bucket(backup, step)
            source = f"step {step} in {backup.store.url}"
        else:
            if conn is None:
                raise UsageError("give --coordinator, --backup-url, or --state-bytes with --hosts")
            manifests = _manifests_from_cluster(conn, args.step)
            source = f"step {args.step} on cluster {conn.address}"
        per_rank = max(m.total_bytes for m in manifests.values())
        hashes = [m.content_hash for m in manifests.values()]
        distinct = len(set(hashes)) == len(hashes) and args.slices > 1
    else:
        raise UsageError("give --state-bytes with --hosts, or a saved step (--step with --coordinator, or "
                         "--backup-url)")
    plan = ram_disk_plan(per_rank, slices=args.slices, replicas=args.replicas, keep=args.keep,
                         distinct_replicas=distinct)
    plan.update(source=source, slices=args.slices, replicas=args.replicas)
    if args.output == "json":
        _emit_json(plan)
    else:
        t = _table(f"RAM disk per host (from {source})", ["", ""])
        t.show_header = False
        t.add_row("own data per step", _bytes(per_rank))
        t.add_row("byte copies held per rank", str(plan["byte_copies_per_rank"]))
        t.add_row("steps kept (+1 being written)", f"{args.keep} (+1)")
        t.add_row("RAM disk per host", f"{_bytes(plan['ram_disk_bytes_per_host'])} "
                  f"({plan['ram_disk_bytes_per_host']} bytes)")
        t.add_row("rule", plan["rule"])
        _console().print(t)
    return EXIT_OK


# --------------------------------------------------------------------------- parser

_ONLINE = {"status", "steps", "restore", "pin", "unpin", "backup", "gc"}


def _example(text: str) -> dict[str, Any]:
    return {"epilog": f"example:\n  {text}\n\n{EXIT_CODES_HELP}", "formatter_class": argparse.RawDescriptionHelpFormatter}


def register(sub: Any, log_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the admin commands to ``mtc``'s subparsers (``log_args`` adds the shared logging flags)."""

    def add(name: str, help_: str, example: str, fn: Callable[..., int], *, online: bool = True,
            parent: Any = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_, description=help_, **_example(example))
        _add_output(p)
        _add_connection(p)
        log_args(p)
        p.set_defaults(func=_runner(fn, online))
        return p

    p = add("status", "a short summary of the job's health (exit 3 when degraded)",
            "mtc status --coordinator 10.0.0.2:7070", cmd_status, online=False)
    p.add_argument("--local-dir", help="ask this host's replicator over its Unix socket instead")
    add("steps", "every step by tier: which ranks are local, on a peer, in the bucket; complete, redundant, "
        "pinned, backing up", "mtc steps --coordinator 10.0.0.2:7070 -o json", cmd_steps)
    p = add("inspect", "a step's leaves (shape, dtype, sharding), shards per host, bytes and checksums",
            "mtc inspect 1200 --coordinator 10.0.0.2:7070   |   mtc inspect 1200 --backup-url gs://b/ckpt",
            cmd_inspect, online=False)
    p.add_argument("step", type=int)
    p.add_argument("--files", action="store_true", help="also list every file with its crc32c")
    _add_bucket(p, required=False)
    p = add("verify", "re-read a step on a tier and check every crc32c; bad copies are reported to the "
            "coordinator, which stops using them", "mtc verify 1200 --tier peer --coordinator 10.0.0.2:7070",
            cmd_verify, online=False)
    p.add_argument("step", type=int)
    p.add_argument("--tier", choices=("local", "peer", "bucket"), help="default: every tier")
    _add_bucket(p, required=False)
    p = add("restore", "make every host hold STEP (fastest tier first) and pin it for the next restore()",
            "mtc restore 1100 --coordinator 10.0.0.2:7070", cmd_restore)
    p.add_argument("step", type=int)
    p.add_argument("--wait-seconds", type=float, default=600.0, help="give up after this long (default 600)")
    for name, what in (("pin", "keep STEP on every tier (GC skips it)"), ("unpin", "release a pinned STEP")):
        p = add(name, what, f"mtc {name} 1100 --coordinator 10.0.0.2:7070", cmd_pin)
        p.add_argument("step", type=int)
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
    _add_bucket(p, required=True)
    p = add("download", "every rank of a backed-up step into DEST/<rank>/steps/<step>, verified",
            "mtc backups download 1200 --backup-url gs://b/ckpt --dest /scratch/1200", cmd_backups_download,
            online=False, parent=ksub)
    p.add_argument("step", type=int)
    p.add_argument("--dest", required=True)
    p.add_argument("--parallel", type=int, default=4, help="ranks downloaded at once (default 4)")
    _add_bucket(p, required=True)
    p = add("export", "write a backed-up step as a standard Orbax checkpoint (needs the [jax] extra)",
            "mtc export 1200 --backup-url gs://b/ckpt --dest /scratch/ckpt-1200", cmd_export, online=False)
    p.add_argument("step", type=int)
    p.add_argument("--dest", required=True, help="directory to create (must not exist)")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--scratch", default=None, help="where to stage the download (default: the temp dir)")
    _add_bucket(p, required=True)
    p = add("plan", "RAM-disk size per host, from a saved step or from --state-bytes/--hosts",
            "mtc plan --state-bytes 80e9 --hosts 64 --slices 4 --replicas 1 --keep 2", cmd_plan, online=False)
    p.add_argument("--step", type=int, default=None, help="a saved step to size from (with --coordinator)")
    p.add_argument("--state-bytes", type=float, default=None, help="bytes of one copy of the training state")
    p.add_argument("--hosts", type=int, default=None)
    p.add_argument("--slices", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--keep", type=int, default=2, help="--keep-local of the replicators (default 2)")
    _add_bucket(p, required=False)


def _runner(fn: Callable[..., int], online: bool) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import grpc

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
        except (OSError, ValueError, RuntimeError, TimeoutError) as e:
            print(f"mtc {name}: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            if conn is not None:
                conn.close()

    return run


_MAYBE_ONLINE = {cmd_inspect, cmd_verify, cmd_plan, cmd_status}
