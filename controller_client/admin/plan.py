"""`mtc plan`: the RAM disk each host needs, for copies:N or ec:K+M, from a saved step or from flags."""

from __future__ import annotations

import argparse
import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

from controller_client.admin.common import (
    EXIT_OK,
    Conn,
    UsageError,
    console,
    emit_json,
    fmt_bytes,
    open_backup,
    redundancy_text,
    table,
)
from controller_client.admin.content import manifests_from_bucket, manifests_from_cluster
from mtc_rpc import admin_pb2 as pb
from replicator.erasure.group import GroupLayout, shard_bytes_for
from replicator.erasure.placement import max_fragments_in_a_slice
from replicator.erasure.redundancy import Redundancy
from replicator.options import ConfigError, job_code_groups, resolve_redundancy

# Groups listed member by member in the table (the JSON lists every group).
SHOWN_GROUPS = 3


def _budget(keep: int, per_step: int) -> int:
    return -(-(keep + 1) * per_step * 11 // 10)  # x 1.1, rounded up, in integers


def ram_disk_plan(per_rank_bytes: int, *, slices: int, replicas: int, keep: int,
                  distinct_replicas: bool = False, snapshotter: bool = False) -> dict[str, Any]:
    """RAM disk per host at copies:``replicas`` for a rank holding ``per_rank_bytes`` of its own data per step.

    Each host holds, per kept step, its own shards plus the byte copies it keeps for other ranks:
    ``replicas`` copies per rank, of which the ``slices - 1`` data-parallel replicas are free when they
    hold byte-identical data (verified by hash). One more step is being written while ``keep`` are kept,
    and 10 % headroom covers manifests and temporary directories.
    """
    extra = replicas if distinct_replicas else max(0, replicas - (slices - 1))
    per_step = per_rank_bytes * (1 + extra)
    rule = ("ram_disk_per_host = (keep + 1) x own_bytes_per_step x (1 + byte_copies) x 1.1, "
            "byte_copies = replicas - (slices - 1) when data-parallel replicas are byte-identical, "
            "else replicas")
    plan = {"redundancy": str(Redundancy.copies_of(replicas)), "mode": "copies",
            "own_bytes_per_step": per_rank_bytes, "byte_copies_per_rank": extra, "keep": keep,
            "losses_survived": replicas, "survives_slice_loss": slices > 1 and replicas >= 1,
            "ram_disk_bytes_per_host": _budget(keep, per_step), "rule": rule}
    return _with_snapshotter(plan, per_rank_bytes, snapshotter)


def ec_ram_disk_plan(rank_bytes: Mapping[int, int], *, slices: int, k: int, m: int, keep: int,
                     stream_bytes: Mapping[int, int] | None = None, snapshotter: bool = False) -> dict[str, Any]:
    """RAM disk per host at ec:K+M: each host keeps, per step, its own data and the M parity shards it holds.

    ``rank_bytes``: every rank's own bytes per step (ranks 0..n-1); ``stream_bytes``: the length of its step
    stream (MANIFEST.json + files; default its own bytes). A group's shard is ceil(longest stream / K), 64-byte
    aligned (:func:`replicator.erasure.group.shard_bytes_for`): shorter streams are padded to the longest.
    """
    nodes = len(rank_bytes)
    if sorted(rank_bytes) != list(range(nodes)):
        raise ValueError(f"rank_bytes must cover ranks 0..{nodes - 1}")
    streams = stream_bytes or rank_bytes
    red = Redundancy.ec(k, m)
    groups = job_code_groups(red, nodes, slices)
    hosts_per_slice = nodes // slices
    worst_rank, worst_step, parity_of = 0, -1, {}
    group_docs = []
    for g in groups:
        shard = shard_bytes_for([streams[r] for r in g.members], k)
        for r in g.members:
            parity_of[r] = m * shard
            if rank_bytes[r] + m * shard > worst_step:
                worst_rank, worst_step = r, rank_bytes[r] + m * shard
        in_a_slice = max_fragments_in_a_slice(g, hosts_per_slice)
        group_docs.append({"members": list(g.members), "shard_bytes": shard, "parity_bytes_per_member": m * shard,
                           "losses_survived": m, "max_fragments_in_a_slice": in_a_slice,
                           "survives_slice_loss": slices > 1 and in_a_slice <= m})
    own = rank_bytes[worst_rank]
    parity = parity_of[worst_rank]
    padding = parity / own - m / k if own else 0.0
    rule = ("ram_disk_per_host = (keep + 1) x own_bytes_per_step x (1 + M/K + padding) x 1.1; the M parity "
            "shards a host holds are each ceil(longest stream of its code group / K), 64-byte aligned: padding "
            "is what shorter steps are padded to the group's longest (with equal-size hosts, the alignment only)")
    plan = {"redundancy": str(red), "mode": "ec", "own_bytes_per_step": own, "byte_copies_per_rank": 0,
            "keep": keep, "parity_bytes_per_host": parity, "parity_factor": m / k, "padding": padding,
            "losses_survived": m, "losses_survived_per": "code group",
            "survives_slice_loss": all(d["survives_slice_loss"] for d in group_docs),
            "code_groups": {"count": len(groups), "summary": groups_summary(groups), "groups": group_docs},
            "ram_disk_bytes_per_host": _budget(keep, own + parity), "rule": rule}
    return _with_snapshotter(plan, own, snapshotter)


def _with_snapshotter(plan: dict[str, Any], own: int, snapshotter: bool) -> dict[str, Any]:
    # Orbax's in-memory Snapshotter (the guide's loop, docs/elastic.md) keeps one more copy of the host's own
    # shards in pinned host memory: not on the RAM disk, but in the same host RAM the RAM disk is carved from.
    snapshot = own if snapshotter else 0
    plan.update(snapshot_bytes_per_host=snapshot, host_ram_bytes_per_host=plan["ram_disk_bytes_per_host"] + snapshot)
    if snapshotter:
        plan["rule"] += "; host_ram = ram_disk_per_host + own_bytes_per_step (the Snapshotter's pinned-host copy)"
    return plan


def groups_summary(groups: Sequence[GroupLayout]) -> str:
    """``4 groups of 6`` or ``2 groups of 7, 1 of 6``: one line whatever the number of hosts."""
    sizes = collections.Counter(g.n for g in groups)
    parts = [f"{count} {'group' if count == 1 else 'groups'} of {size}" if i == 0 else f"{count} of {size}"
             for i, (size, count) in enumerate(sorted(sizes.items(), reverse=True))]
    return ", ".join(parts)


def _groups_cell(doc: dict[str, Any]) -> str:
    groups = doc["groups"]
    lines = [f"{doc['summary']} hosts (ranks in position order):"]
    lines += [f"  {i}: {','.join(map(str, g['members']))}" for i, g in enumerate(groups[:SHOWN_GROUPS])]
    if len(groups) > SHOWN_GROUPS:
        lines.append(f"  ... {len(groups) - SHOWN_GROUPS} more (-o json lists every group)")
    return "\n".join(lines)


def _slice_cell(plan: dict[str, Any], slices: int) -> str:
    if slices == 1:
        return "no (one slice: it is the whole job)"
    if plan["mode"] == "copies":
        return "yes (copies go to other slices first)" if plan["survives_slice_loss"] else "no (no copies)"
    worst = max(g["max_fragments_in_a_slice"] for g in plan["code_groups"]["groups"])
    m = plan["losses_survived"]
    return (f"yes (at most {worst} fragment(s) of a rotation per slice, <= M={m})" if plan["survives_slice_loss"]
            else f"NO: a slice holds up to {worst} fragments of a rotation, more than M={m}")


def _sized_from_step(args: argparse.Namespace, conn: Conn | None) -> tuple[dict[int, Any], str]:
    if args.backup_url:
        backup = open_backup(args.backup_url, args.job)
        steps = backup.committed_steps()
        if args.step is None and not steps:
            raise FileNotFoundError(f"{backup.store.url} holds no backup of job {backup.job}")
        step = args.step if args.step is not None else steps[-1]
        return manifests_from_bucket(backup, step), f"step {step} in {backup.store.url}"
    assert conn is not None
    step = args.step
    if step is None:
        step = conn.admin.GetSummary(pb.GetSummaryRequest(), timeout=conn.timeout).newest_complete_step
        if step < 0:
            raise FileNotFoundError("no globally complete step to size from: give --step or --state-bytes")
    return manifests_from_cluster(conn, step), f"step {step} on cluster {conn.address}"


def cmd_plan(args: argparse.Namespace, conn: Conn | None) -> int:
    try:
        red = resolve_redundancy(args.redundancy or "", args.replicas)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    distinct = False
    if args.state_bytes is not None:
        if not args.hosts:
            raise UsageError("--state-bytes needs --hosts (and --slices if more than one)")
        if args.hosts % args.slices:
            raise UsageError(f"--hosts {args.hosts} is not a multiple of --slices {args.slices}")
        per_rank = math.ceil(args.state_bytes / (args.hosts // args.slices))
        rank_bytes = {r: per_rank for r in range(args.hosts)}
        streams, source = None, "flags"
    elif args.backup_url or args.step is not None or conn is not None:
        manifests, source = _sized_from_step(args, conn)
        rank_bytes = {r: m.total_bytes for r, m in manifests.items()}
        streams = {r: len(m.to_json()) + m.total_bytes for r, m in manifests.items()}
        per_rank = max(rank_bytes.values())
        hashes = [m.content_hash for m in manifests.values()]
        distinct = len(set(hashes)) == len(hashes) and args.slices > 1
        if len(manifests) % args.slices:
            raise UsageError(f"the step has {len(manifests)} ranks, not a multiple of --slices {args.slices}")
    else:
        raise UsageError("give --state-bytes with --hosts, or a saved step (--coordinator [--step N], or "
                         "--backup-url [--step N])")
    if red.is_ec:
        try:
            plan = ec_ram_disk_plan(rank_bytes, slices=args.slices, k=red.k, m=red.m, keep=args.keep,
                                    stream_bytes=streams, snapshotter=args.snapshotter)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    else:
        plan = ram_disk_plan(per_rank, slices=args.slices, replicas=red.copies, keep=args.keep,
                             distinct_replicas=distinct, snapshotter=args.snapshotter)
    plan.update(source=source, slices=args.slices, hosts=len(rank_bytes), replicas=red.copies)
    if red.is_ec and args.slices > 1 and not distinct:
        plan["note"] = (f"if the {args.slices} slices' data-parallel replicas are byte-identical, copies:"
                        f"{args.slices - 1} costs no RAM at all (the replicas are the copies)")
    if args.output == "json":
        emit_json(plan)
    else:
        _print(plan, args)
    return EXIT_OK


def _print(plan: dict[str, Any], args: argparse.Namespace) -> None:
    t = table(f"RAM disk per host (from {plan['source']})", ["", ""])
    t.show_header = False
    t.add_row("redundancy", redundancy_text(plan["redundancy"]))
    t.add_row("own data per step", fmt_bytes(plan["own_bytes_per_step"]))
    if plan["mode"] == "ec":
        t.add_row("code groups", _groups_cell(plan["code_groups"]))
        t.add_row("parity held per host", f"{fmt_bytes(plan['parity_bytes_per_host'])} (M/K = "
                  f"{plan['parity_factor']:.3f} of its own step, + padding {plan['padding']:.4f})")
    else:
        t.add_row("byte copies held per rank", str(plan["byte_copies_per_rank"]))
    t.add_row("a lost slice survived", _slice_cell(plan, args.slices))
    t.add_row("steps kept (+1 being written)", f"{args.keep} (+1)")
    t.add_row("RAM disk per host", f"{fmt_bytes(plan['ram_disk_bytes_per_host'])} "
              f"({plan['ram_disk_bytes_per_host']} bytes)")
    if args.snapshotter:
        t.add_row("Snapshotter's pinned-host copy", fmt_bytes(plan["snapshot_bytes_per_host"]))
        t.add_row("host RAM per host (both)", f"{fmt_bytes(plan['host_ram_bytes_per_host'])} "
                  f"({plan['host_ram_bytes_per_host']} bytes)")
    t.add_row("rule", plan["rule"])
    if "note" in plan:
        t.add_row("note", plan["note"])
    console().print(t)
