"""Admin commands that need only the bucket: backups list/download, export, and RAM-disk planning."""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from controller_client.admin.common import (
    EXIT_DEGRADED,
    EXIT_OK,
    Conn,
    UsageError,
    console,
    emit_json,
    fmt_bytes,
    open_backup,
    progress,
    table,
    when,
)
from controller_client.admin.content import manifests_from_bucket, manifests_from_cluster
from mtc_rpc import admin_pb2 as pb


def cmd_backups_list(args: argparse.Namespace) -> int:
    backup = open_backup(args.backup_url, args.job)
    rows = []
    for step in backup.committed_steps():
        rec, _ = backup.commit_record(step)
        rows.append({"step": step, "nodes": rec.nodes, "bytes": rec.total_bytes,
                     "committed_unix": rec.committed_unix, "strategy": rec.strategy})
    if args.output == "json":
        emit_json({"url": backup.store.url, "job": backup.job, "backups": rows})
    else:
        t = table(f"backups of job {backup.job} in {backup.store.url}", ["step", "ranks", "bytes", "committed"])
        for r in rows:
            t.add_row(str(r["step"]), str(r["nodes"]), fmt_bytes(r["bytes"]), when(r["committed_unix"]))
        console().print(t)
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
    prog = progress() if show_progress else None
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
    backup = open_backup(args.backup_url, args.job)
    dest = Path(args.dest)
    t0 = time.monotonic()
    got = download_step(backup, args.step, dest, parallel=args.parallel, show_progress=args.output == "table")
    total = sum(sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) for d in got.values())
    secs = time.monotonic() - t0
    if args.output == "json":
        emit_json({"step": args.step, "dest": str(dest), "ranks": {str(r): str(p) for r, p in sorted(got.items())},
                    "bytes": total, "seconds": round(secs, 3), "verified": True})
    else:
        print(f"downloaded step {args.step}: {len(got)} ranks, {fmt_bytes(total)} in {secs:.1f}s, every file "
              f"verified (crc32c) -> {dest}/<rank>/steps/{args.step}")
    return EXIT_OK

def cmd_export(args: argparse.Namespace) -> int:
    # Imported here: export needs JAX and Orbax ([jax] extra); the other admin commands run without them.
    from controller_client.export import export_step

    backup = open_backup(args.backup_url, args.job)
    dest = Path(args.dest)
    with tempfile.TemporaryDirectory(prefix="mtc-export-", dir=args.scratch) as tmp:
        download_step(backup, args.step, Path(tmp), parallel=args.parallel,
                      show_progress=args.output == "table")
        info = export_step(args.step, [Path(tmp) / d for d in sorted(os.listdir(tmp))], dest)
    if args.output == "json":
        emit_json(info)
    else:
        print(f"exported step {args.step} as an Orbax checkpoint: {dest} ({info['leaves']} leaves, "
              f"{fmt_bytes(info['bytes'])}); load it with orbax.checkpoint.StandardCheckpointer().restore(path)")
    return EXIT_OK

def ram_disk_plan(per_rank_bytes: int, *, slices: int, replicas: int, keep: int,
                  distinct_replicas: bool = False, snapshotter: bool = False) -> dict[str, Any]:
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
    # Orbax's in-memory Snapshotter (the guide's loop, docs/elastic.md) keeps one more copy of the host's own
    # shards in pinned host memory: not on the RAM disk, but in the same host RAM the RAM disk is carved from.
    snapshot = per_rank_bytes if snapshotter else 0
    return {"own_bytes_per_step": per_rank_bytes, "byte_copies_per_rank": extra, "keep": keep,
            "ram_disk_bytes_per_host": need, "snapshot_bytes_per_host": snapshot,
            "host_ram_bytes_per_host": need + snapshot,
            "rule": rule + ("; host_ram = ram_disk_per_host + own_bytes_per_step (the Snapshotter's pinned-host "
                            "copy)" if snapshotter else "")}

def cmd_plan(args: argparse.Namespace, conn: Conn | None) -> int:
    source = "flags"
    distinct = False
    if args.state_bytes is not None:
        if not args.hosts:
            raise UsageError("--state-bytes needs --hosts (and --slices if more than one)")
        if args.hosts % args.slices:
            raise UsageError(f"--hosts {args.hosts} is not a multiple of --slices {args.slices}")
        per_rank = math.ceil(args.state_bytes / (args.hosts // args.slices))
    elif args.backup_url or args.step is not None or conn is not None:
        if args.backup_url:
            backup = open_backup(args.backup_url, args.job)
            steps = backup.committed_steps()
            if args.step is None and not steps:
                raise FileNotFoundError(f"{backup.store.url} holds no backup of job {backup.job}")
            step = args.step if args.step is not None else steps[-1]
            manifests = manifests_from_bucket(backup, step)
            source = f"step {step} in {backup.store.url}"
        else:
            assert conn is not None
            step = args.step
            if step is None:
                step = conn.admin.GetSummary(pb.GetSummaryRequest(), timeout=conn.timeout).newest_complete_step
                if step < 0:
                    raise FileNotFoundError("no globally complete step to size from: give --step or --state-bytes")
            manifests = manifests_from_cluster(conn, step)
            source = f"step {step} on cluster {conn.address}"
        per_rank = max(m.total_bytes for m in manifests.values())
        hashes = [m.content_hash for m in manifests.values()]
        distinct = len(set(hashes)) == len(hashes) and args.slices > 1
    else:
        raise UsageError("give --state-bytes with --hosts, or a saved step (--coordinator [--step N], or "
                         "--backup-url [--step N])")
    plan = ram_disk_plan(per_rank, slices=args.slices, replicas=args.replicas, keep=args.keep,
                         distinct_replicas=distinct, snapshotter=args.snapshotter)
    plan.update(source=source, slices=args.slices, replicas=args.replicas)
    if args.output == "json":
        emit_json(plan)
    else:
        t = table(f"RAM disk per host (from {source})", ["", ""])
        t.show_header = False
        t.add_row("own data per step", fmt_bytes(per_rank))
        t.add_row("byte copies held per rank", str(plan["byte_copies_per_rank"]))
        t.add_row("steps kept (+1 being written)", f"{args.keep} (+1)")
        t.add_row("RAM disk per host", f"{fmt_bytes(plan['ram_disk_bytes_per_host'])} "
                  f"({plan['ram_disk_bytes_per_host']} bytes)")
        if args.snapshotter:
            t.add_row("Snapshotter's pinned-host copy", fmt_bytes(plan["snapshot_bytes_per_host"]))
            t.add_row("host RAM per host (both)", f"{fmt_bytes(plan['host_ram_bytes_per_host'])} "
                      f"({plan['host_ram_bytes_per_host']} bytes)")
        t.add_row("rule", plan["rule"])
        console().print(t)
    return EXIT_OK
