"""Admin commands that need only the bucket: backups list/download and export."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from controller_client.admin.common import (
    EXIT_DEGRADED,
    EXIT_OK,
    UsageError,
    console,
    emit_json,
    fmt_bytes,
    open_backup,
    progress,
    table,
    when,
)


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

# Here, not in controller_client.export, which imports TensorStore: `mtc --help` must not need it.
CHUNK_BYTES = 16 << 20  # controller_client.export.CHUNK_BYTES (a test checks they agree)
EXPORT_DESCRIPTION = """\
Download and verify every rank of STEP into --scratch, then write it to --dest as a standard Orbax checkpoint
(one OCDBT database of zarr arrays, as orbax.checkpoint.StandardCheckpointer writes) that plain Orbax restores:
ocp.StandardCheckpointer().restore(DEST).

Streamed: each saved shard is read once, one chunk at a time, verified by its crc32c on the way, and written
chunk by chunk with TensorStore; no array is ever whole in memory. Memory is bounded whatever the step's size:
the write holds at most (4 x 2 + 1) x --chunk-mib of chunk buffers (2 writes pending, each its chunk and its
encoding, and the one being read: 144 MiB at the default 16 MiB) on top of ~70 MiB of interpreter and
TensorStore, and the download before it a few 8 MiB buffers per rank fetched at once (--parallel). Measured:
157 MiB peak exporting 256 MiB; 361 MiB peak for the whole command on a 4 GiB step under a 1 GiB memory limit
(241 MiB by the end of its download). Put --scratch and --dest on disk, not a tmpfs, under a memory limit:
pages written to a tmpfs count against it.

Typed PRNG keys are written as their uint32 key data (jax.random.wrap_key_data(x, impl=...); the impl is in
`mtc inspect`). A corrupt copy of a shard is skipped for a replica's; with none left the export fails and
leaves nothing at --dest.
"""


def cmd_export(args: argparse.Namespace) -> int:
    # Imported here: export needs TensorStore ([jax] extra); the other admin commands run without it.
    from controller_client.export import ExportOptions, export_step
    from controller_client.export.stream import peak_rss_bytes

    if args.chunk_mib < 1:
        raise UsageError("--chunk-mib must be at least 1")
    options = ExportOptions(chunk_bytes=args.chunk_mib << 20)
    backup = open_backup(args.backup_url, args.job)
    dest = Path(args.dest)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mtc-export-", dir=args.scratch) as tmp:
        download_step(backup, args.step, Path(tmp), parallel=args.parallel,
                      show_progress=args.output == "table")
        downloaded = time.monotonic() - t0
        after_download = peak_rss_bytes()
        info = export_step(args.step, [Path(tmp) / d for d in sorted(os.listdir(tmp))], dest, options)
    info["download_seconds"] = round(downloaded, 3)
    info["download_peak_rss_bytes"] = after_download  # the peak up to the end of the download
    if args.output == "json":
        emit_json(info)
    else:
        print(f"exported step {args.step} as an Orbax checkpoint: {dest} ({info['leaves']} leaves, "
              f"{fmt_bytes(info['bytes'])}; downloaded in {downloaded:.1f}s, written in {info['seconds']:.1f}s, "
              f"streamed in chunks of {fmt_bytes(options.chunk_bytes)}); load it with "
              "orbax.checkpoint.StandardCheckpointer().restore(path)")
        for bad in info["bad_copies"]:
            print(f"  skipped a corrupt copy: {bad}")
    return EXIT_OK
