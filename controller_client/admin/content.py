"""`mtc inspect` and `mtc verify`: a step's manifests and a re-read of every file on a tier."""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from controller_client.admin.common import (
    EXIT_ERROR,
    EXIT_OK,
    Conn,
    UsageError,
    console,
    emit_json,
    fmt_bytes,
    open_backup,
    ranges,
    table,
)
from mtc_rpc import admin_pb2 as pb
from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.coordinator.model import Tier
from replicator.coordinator.tier_wire import from_wire, to_wire
from replicator.net import rpc
from replicator.peer import client as peer_client
from sidecar import checksums
from sidecar.checksums import ChecksumError


def _cluster_pieces(conn: Conn, step: int) -> Any:
    return conn.admin.LocateStep(pb.LocateStepRequest(step=step), timeout=conn.timeout)

def manifests_from_cluster(conn: Conn, step: int) -> dict[int, Any]:
    """rank -> the manifest of the data it restores from (its own, or an identical replica's), from a host."""
    loc = _cluster_pieces(conn, step)
    best: dict[int, Any] = {}
    for p in loc.pieces:
        if from_wire(p.tier) is Tier.BUCKET or not p.address:
            continue
        if p.owner_rank not in best or (from_wire(p.tier) is Tier.LOCAL
                                        and from_wire(best[p.owner_rank].tier) is not Tier.LOCAL):
            best[p.owner_rank] = p
    owners = {r.rank: r.owner_rank for r in loc.ranks}
    if any(o not in best for o in owners.values()) and loc.backup_url:
        return manifests_from_bucket(open_backup(loc.backup_url, loc.job), step)  # some only in the bucket
    missing = sorted(set(owners.values()) - set(best))
    if missing:
        raise FileNotFoundError(f"step {step}: no host holds the data of ranks {ranges(missing)}")

    def get(owner: int) -> tuple[int, Any]:
        p = best[owner]
        return owner, peer_client.get_manifest(p.address, owner, step, timeout_seconds=conn.timeout,
                                               token=conn.token, tls=conn.tls)

    # One manifest per distinct owner (identical replicas share one), a few hosts at a time.
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        fetched = dict(pool.map(get, sorted(set(owners.values()))))
    return {rank: fetched[owner] for rank, owner in sorted(owners.items())}


def manifests_from_bucket(backup: Any, step: int) -> dict[int, Any]:
    rec, _ = backup.commit_record(step)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        return dict(zip(range(rec.nodes), pool.map(lambda r: backup.read_manifest(step, r), range(rec.nodes)),
                        strict=True))

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
        backup = open_backup(args.backup_url, args.job)
        manifests, source = manifests_from_bucket(backup, args.step), backup.store.url
    else:
        assert conn is not None
        manifests, source = manifests_from_cluster(conn, args.step), f"cluster {conn.address}"
    doc = inspect_doc(args.step, manifests, source)
    if args.output == "json":
        emit_json(doc)
        return EXIT_OK
    con = console()
    t = table(f"step {args.step} from {source}: {doc['nodes']} ranks, {fmt_bytes(doc['bytes'])} ({doc['kind']})",
               ["leaf", "shape", "dtype", "sharding", "bytes"])
    for leaf in doc["leaves"]:
        if "value" in leaf:
            t.add_row(leaf["path"], "-", type(leaf["value"]).__name__, "value", repr(leaf["value"]))
        else:
            dtype = leaf["dtype"] + (f" (key {leaf['key_impl']})" if leaf.get("key_impl") else "")
            t.add_row(leaf["path"], str(tuple(leaf["shape"])), dtype, leaf["sharding"], fmt_bytes(leaf["bytes"]))
    con.print(t)
    h = table("per host", ["rank", "shards", "files", "bytes", "content hash"])
    for r in doc["ranks"]:
        same = f" (= rank {r['data_of_rank']})" if r["data_of_rank"] != r["rank"] else ""
        h.add_row(f"{r['rank']}{same}", str(r["shards"]), str(r["files"]), fmt_bytes(r["bytes"]),
                  r["content_hash"][:16])
    con.print(h)
    if args.files:
        f = table("files", ["rank", "file", "bytes", "crc32c"])
        for r in doc["ranks"]:
            for x in r["file_checksums"]:
                f.add_row(str(r["rank"]), x["name"], str(x["size"]), x["crc32c"])
        con.print(f)
    return EXIT_OK

def _verify_on_host(conn: Conn, piece: Any, step: int) -> tuple[int, list[str]]:
    """Re-read every file of one host's copy through its Peer service; (bytes read, bad file names)."""
    m = peer_client.get_manifest(piece.address, piece.owner_rank, step, timeout_seconds=conn.timeout,
                                 token=conn.token, tls=conn.tls)
    crcs = [0] * len(m.files)
    sizes = [0] * len(m.files)
    ch = rpc.make_channel(piece.address, token=conn.token, tls=conn.tls)
    try:
        stream = peer_pb2_grpc.PeerStub(ch).ReadFiles(
            peer_pb2.ReadFilesRequest(rank=piece.owner_rank, step=step), timeout=max(60.0, conn.timeout * 30))
        for c in stream:
            crcs[c.file_index] = checksums.crc32c_extend(crcs[c.file_index], c.data)
            sizes[c.file_index] += len(c.data)
    finally:
        ch.close()
    bad = [f.name for f, crc, n in zip(m.files, crcs, sizes, strict=True) if crc != f.crc32c or n != f.size]
    return sum(sizes), bad

def _verify_bucket_rank(backup: Any, step: int, rank: int) -> tuple[int, list[str]]:
    tmp = Path(tempfile.mkdtemp(prefix="mtc-verify-"))
    try:
        got = backup.download_rank(step, rank, tmp)
        return sum(p.stat().st_size for p in got.rglob("*") if p.is_file()), []
    except ChecksumError as e:
        return 0, [str(e)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def cmd_verify(args: argparse.Namespace, conn: Conn | None) -> int:
    tiers = [Tier(args.tier)] if args.tier else [Tier.LOCAL, Tier.PEER, Tier.BUCKET]
    jobs: list[tuple[Tier, int, int, Callable[[], tuple[int, list[str]]]]] = []  # tier, holder, owner, fn
    backup_url = args.backup_url
    job = args.job
    if conn is not None:
        loc = _cluster_pieces(conn, args.step)
        backup_url = backup_url or loc.backup_url
        job = job or loc.job
        for p in loc.pieces:
            tier = from_wire(p.tier)
            if tier in tiers and tier is not Tier.BUCKET:
                jobs.append((tier, p.holder_rank, p.owner_rank, lambda p=p: _verify_on_host(conn, p, args.step)))
    elif set(tiers) != {Tier.BUCKET}:
        raise UsageError("without --coordinator only --tier bucket (with --backup-url) can be verified")
    if Tier.BUCKET in tiers and backup_url:
        backup = open_backup(backup_url, job)
        try:
            rec, _ = backup.commit_record(args.step)
        except FileNotFoundError:
            rec = None
            if tiers == [Tier.BUCKET]:
                raise
        if rec is not None:
            for r in range(rec.nodes):
                jobs.append((Tier.BUCKET, -1, r, lambda r=r: _verify_bucket_rank(backup, args.step, r)))
    elif tiers == [Tier.BUCKET]:
        raise UsageError("no bucket: give --backup-url (or a coordinator with a backup tier)")
    if not jobs:
        print(f"mtc verify: step {args.step} has no copy on tier(s) {', '.join(map(str, tiers))}", file=sys.stderr)
        return EXIT_ERROR
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        futs = {pool.submit(fn): (tier, holder, owner) for tier, holder, owner, fn in jobs}
        for fut in concurrent.futures.as_completed(futs):
            tier, holder, owner = futs[fut]
            try:
                nbytes, bad = fut.result()
                err = ""
            except Exception as e:  # an unreachable host or unreadable copy is a failure too
                nbytes, bad, err = 0, [], f"{type(e).__name__}: {e}"
            results.append({"tier": str(tier), "holder_rank": holder if holder >= 0 else None, "owner_rank": owner,
                            "bytes": nbytes, "bad_files": bad, "error": err, "ok": not bad and not err})
    results.sort(key=lambda x: (x["tier"], x["owner_rank"], x["holder_rank"] or -1))
    reported = []
    if conn is not None:
        for x in results:
            if x["bad_files"]:
                resp = conn.admin.ReportBadCopy(pb.ReportBadCopyRequest(
                    step=args.step, owner_rank=x["owner_rank"],
                    holder_rank=-1 if x["holder_rank"] is None else x["holder_rank"], tier=to_wire(x["tier"]),
                    file=x["bad_files"][0]), timeout=conn.timeout)
                reported.append(resp.action)
    ok = all(x["ok"] for x in results)
    if args.output == "json":
        emit_json({"step": args.step, "ok": ok, "copies": results, "reported": reported})
    else:
        t = table(f"verify step {args.step}", ["tier", "holder", "rank", "bytes", "result"])
        for x in results:
            res = "ok" if x["ok"] else ("BAD: " + ", ".join(x["bad_files"]) if x["bad_files"] else x["error"])
            t.add_row(x["tier"], "bucket" if x["holder_rank"] is None else str(x["holder_rank"]),
                      str(x["owner_rank"]), fmt_bytes(x["bytes"]), res)
        con = console()
        con.print(t)
        for a in reported:
            con.print(f"reported to the coordinator: {a}")
    for x in results:
        for f in x["bad_files"]:
            where = "bucket" if x["holder_rank"] is None else f"host {x['holder_rank']}"
            print(f"mtc verify: bad file {f} (rank {x['owner_rank']} on {where}, {x['tier']} tier)",
                  file=sys.stderr)
    return EXIT_OK if ok else EXIT_ERROR
