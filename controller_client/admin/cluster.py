"""Admin commands on the running job: status, steps, restore, pin/unpin, backup now, gc --dry-run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import grpc

from controller_client.admin.common import (
    ENV_COORDINATOR,
    EXIT_DEGRADED,
    EXIT_ERROR,
    EXIT_OK,
    Conn,
    UsageError,
    age,
    console,
    emit_json,
    fmt_bytes,
    progress,
    ranges,
    redundancy_text,
    table,
    when,
)
from controller_client.admin.restores import handshake_doc, handshake_text, restore_doc, restore_text
from mtc_rpc import admin_pb2 as pb
from mtc_rpc import control_pb2, control_pb2_grpc
from replicator.coordinator.tier_wire import tier_name
from sidecar.layout import control_socket
from sidecar.saves import parse_rank_span


def summary_doc(s: Any) -> dict[str, Any]:
    return {
        "job": s.job, "nodes": s.nodes, "hosts_registered": s.hosts_registered, "lost_ranks": list(s.lost_ranks),
        "redundancy": s.redundancy or None,
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
        "last_restore": ({"rank": s.last_restore_rank, **restore_doc(s.last_restore)}
                         if s.HasField("last_restore") else None),
        "slowest_handshake": ({"rank": s.slowest_handshake_rank, **handshake_doc(s.slowest_handshake)}
                              if s.HasField("slowest_handshake") else None),
    }

def _local_status(args: argparse.Namespace) -> int:
    sock = control_socket(args.local_dir)
    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            resp = control_pb2_grpc.LocalControlStub(ch).GetLocalStatus(
                control_pb2.GetLocalStatusRequest(), timeout=args.timeout_seconds)
    except grpc.RpcError as e:
        print(f"mtc status: no replicator answers on {sock}: {e.code().name}", file=sys.stderr)
        return EXIT_ERROR
    doc = local_status_doc(resp)
    if args.output == "json":
        emit_json(doc)
        return EXIT_OK
    t = table(f"replicator rank {resp.rank} of job {resp.job}", ["", ""])
    t.show_header = False
    for k in ("address", "metrics_address", "own_steps", "peer_steps", "newest_complete_step", "in_flight"):
        t.add_row(k, json.dumps(doc[k]))
    for k, v in sorted(resp.counters.items()):
        t.add_row(k, str(v))
    if resp.has_backup:
        t.add_row("backup uploaded bytes", str(resp.backup_uploaded_bytes))
        if resp.backup_last_error:
            t.add_row("backup last error", resp.backup_last_error)
    if resp.HasField("last_restore"):
        t.add_row("last restore", restore_text(resp.last_restore))
    if resp.HasField("last_handshake"):
        t.add_row("last handshake", handshake_text(resp.last_handshake))
    if resp.recent_errors:
        t.add_row("recent errors", "\n".join(list(resp.recent_errors)[-5:]))
    console().print(t)
    return EXIT_OK


def local_status_doc(resp: Any) -> dict[str, Any]:
    """``mtc status --local-dir -o json``: the typed answer as plain data (a stable, documented shape)."""
    doc: dict[str, Any] = {
        "job": resp.job, "rank": resp.rank, "nodes": resp.nodes, "address": resp.address,
        "metrics_address": resp.metrics_address or None, "own_steps": list(resp.own_steps),
        "peer_steps": [[p.owner_rank, p.step] for p in resp.peer_steps],
        "newest_complete_step": resp.newest_complete_step if resp.newest_complete_step >= 0 else None,
        "in_flight": [f"{t.kind}:{t.owner_rank}:{t.step}" for t in resp.in_flight],
        "counters": dict(sorted(resp.counters.items())), "recent_errors": list(resp.recent_errors),
        "last_restore": restore_doc(resp.last_restore) if resp.HasField("last_restore") else None,
        "last_handshake": handshake_doc(resp.last_handshake) if resp.HasField("last_handshake") else None,
    }
    if resp.has_backup:
        doc["backup"] = {"uploaded_bytes": resp.backup_uploaded_bytes, "last_error": resp.backup_last_error}
    return doc

def _jobset_status(args: argparse.Namespace) -> int:
    """``--jobset`` alone: the JobSet controller's verdict (no replicator needed: after maxRestarts none runs)."""
    from controller_client.admin.jobset import read_jobset

    try:
        js = read_jobset(args.jobset, args.namespace, args.kubeconfig)
    except LookupError as e:
        raise UsageError(str(e)) from None
    if args.output == "json":
        emit_json({"jobset": js.to_dict()})
    else:
        console().print(f"JobSet {js.namespace}/{js.name}: {js.text()}")
    return EXIT_DEGRADED if js.failed else EXIT_OK


def cmd_status(args: argparse.Namespace, conn: Conn | None) -> int:
    if args.local_dir:
        return _local_status(args)
    if conn is None and getattr(args, "jobset", None):
        return _jobset_status(args)
    if conn is None:
        raise UsageError(f"give --coordinator HOST:PORT (or set ${ENV_COORDINATOR}), --local-dir DIR or --jobset NAME")
    s = conn.admin.GetSummary(pb.GetSummaryRequest(), timeout=conn.timeout)
    doc = summary_doc(s)
    steps = conn.admin.ListSteps(pb.ListStepsRequest(), timeout=conn.timeout)
    doc["steps"] = [step_doc(i) for i in steps.steps]
    hosts = None
    if args.hosts:
        first, last = _rank_range(args.ranks)
        hosts = conn.admin.ListHosts(pb.ListHostsRequest(first_rank=first, last_rank=last),
                                     timeout=conn.timeout).hosts
        doc["hosts"] = [{"rank": h.rank, "address": h.address, "incarnation": h.incarnation or None,
                         "seconds_since_report": h.seconds_since_report if h.seconds_since_report >= 0 else None,
                         "lost": h.lost, "steps": list(h.steps), "pieces": h.pieces, "bytes": h.bytes,
                         "last_restore": restore_doc(h.last_restore) if h.HasField("last_restore") else None,
                         "last_handshake": handshake_doc(h.last_handshake) if h.HasField("last_handshake") else None}
                        for h in hosts]
    if args.output == "json":
        emit_json(doc)
    else:
        t = table(f"job {s.job}: {s.nodes} hosts", ["", ""])
        t.show_header = False
        t.add_row("hosts", f"{s.hosts_registered}/{s.nodes} reporting" +
                  (f", lost: {ranges(s.lost_ranks)}" if s.lost_ranks else ""))
        t.add_row("redundancy", redundancy_text(s.redundancy))
        newest = "none" if s.newest_complete_step < 0 else (
            f"{s.newest_complete_step} ({fmt_bytes(s.newest_complete_bytes)}, "
            f"{'redundant' if s.newest_redundant else 'NOT redundant'})")
        t.add_row("newest complete step", newest)
        t.add_row("restore target", "-" if s.restore_target < 0 else str(s.restore_target))
        t.add_row("pinned", ranges(s.pinned_steps))
        if s.backup_url:
            every = (f"every {s.backup_interval_steps} steps" if s.backup_interval_steps
                     else f"every {age(s.backup_interval_seconds)}")
            t.add_row("bucket", f"{s.backup_url} ({every})")
            t.add_row("newest backup", "none" if s.newest_backup_step < 0 else
                      f"step {s.newest_backup_step}, {when(s.backup_last_success_unix)}")
            if s.backup_in_progress_step >= 0:
                t.add_row("backing up", f"step {s.backup_in_progress_step}")
            t.add_row("backups skipped / failed", f"{s.backup_skipped} / {s.backup_failures}")
            if s.backup_last_error:
                t.add_row("last backup error", s.backup_last_error)
        else:
            t.add_row("bucket", "none configured")
        if s.HasField("last_restore"):
            t.add_row("last restore", f"rank {s.last_restore_rank}: {restore_text(s.last_restore)}")
        if s.HasField("slowest_handshake"):
            t.add_row("slowest handshake", f"rank {s.slowest_handshake_rank}: {handshake_text(s.slowest_handshake)}")
        t.add_row("health", "DEGRADED: " + "; ".join(s.problems) if s.degraded else "ok")
        con = console()
        con.print(t)
        if hosts is not None:
            shaken = any(x.HasField("last_handshake") for x in hosts)
            h = table("hosts", ["rank", "address", "last report", "state", "steps held", "bytes", "last restore",
                                *(["last handshake"] if shaken else [])])
            for x in hosts:
                last = f"{x.seconds_since_report:.1f}s ago" if x.seconds_since_report >= 0 else "never"
                h.add_row(str(x.rank), x.address or "-", last, "LOST" if x.lost else "ok", ranges(x.steps),
                          fmt_bytes(x.bytes),
                          restore_text(x.last_restore, short=True) if x.HasField("last_restore") else "-",
                          *([handshake_text(x.last_handshake, short=True) if x.HasField("last_handshake") else "-"]
                            if shaken else []))
            con.print(h)
    return EXIT_DEGRADED if s.degraded else EXIT_OK

def _rank_range(text: str | None) -> tuple[int, int]:
    """``--ranks`` as (first, last) (:func:`sidecar.saves.parse_rank_span`; last -1 = to the end). None = every rank."""
    if not text:
        return 0, -1
    try:
        return parse_rank_span(text)
    except ValueError:
        raise UsageError(f"--ranks must be A-B, A- or A, got {text!r}") from None


def step_doc(i: Any) -> dict[str, Any]:
    return {"step": i.step, "complete": i.complete, "redundant": i.redundant, "pinned": i.pinned,
            "backing_up": i.backing_up, "backed_up": i.backed_up, "restore_target": i.restore_target,
            "local_ranks": list(i.local_ranks), "peer_ranks": list(i.peer_ranks),
            "bucket_ranks": list(i.bucket_ranks), "missing_ranks": list(i.missing_ranks), "bytes": i.bytes,
            "first_seen_unix": i.first_seen_unix or None, "complete_unix": i.complete_unix or None,
            "backup_unix": i.backup_unix or None}

def cmd_steps(args: argparse.Namespace, conn: Conn) -> int:
    resp = conn.admin.ListSteps(pb.ListStepsRequest(), timeout=conn.timeout)
    s = conn.admin.GetSummary(pb.GetSummaryRequest(), timeout=conn.timeout)
    if args.output == "json":
        emit_json({"job": resp.job, "nodes": resp.nodes, "redundancy": s.redundancy or None,
                    "newest_complete_step": resp.newest_complete_step if resp.newest_complete_step >= 0 else None,
                    "steps": [step_doc(i) for i in resp.steps], "degraded": s.degraded, "problems": list(s.problems)})
    else:
        t = table(f"job {resp.job} ({s.redundancy or 'redundancy unknown'}): steps by tier (ranks; "
                  f"{resp.nodes} in all)",
                   ["step", "state", "local", "peer", "bucket", "missing", "bytes", "flags", "completed",
                    "backup"])
        for i in resp.steps:
            flags = [n for n, v in (("pinned", i.pinned), ("backing up", i.backing_up),
                                    ("restore", i.restore_target)) if v]
            state = "redundant" if i.complete and i.redundant else "complete" if i.complete else "incomplete"
            t.add_row(str(i.step), state, ranges(i.local_ranks), ranges(i.peer_ranks), ranges(i.bucket_ranks),
                      ranges(i.missing_ranks), fmt_bytes(i.bytes), "\n".join(flags) or "-",
                      when(i.complete_unix, short=True), when(i.backup_unix, short=True))
        con = console()
        con.print(t)
        if s.degraded:
            con.print("DEGRADED: " + "; ".join(s.problems))
    return EXIT_DEGRADED if s.degraded else EXIT_OK

def cmd_restore(args: argparse.Namespace, conn: Conn) -> int:
    deadline = time.monotonic() + args.wait_seconds
    resp = None
    quiet = args.output == "json"
    prog = None if quiet else progress(transient=False, hosts=True)
    task = None
    try:
        if prog is not None:
            prog.start()
        while True:
            wait = max(0.0, min(2.0, deadline - time.monotonic()))
            # A coordinator that just took over or restarted answers UNAVAILABLE until every host reported:
            # waited for within --wait-seconds, as the hosts ready.
            resp = conn.call_until("RestoreStep", pb.RestoreStepRequest(step=args.step, wait_seconds=wait),
                                   deadline, extra_seconds=wait)
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
        emit_json(doc)
    elif resp.ready:
        print(f"every host holds step {resp.step}; the next restore() gets it ({resp.reason})")
    else:
        print(f"step {resp.step} pinned; {len(resp.ready_ranks)}/{resp.nodes} hosts ready after "
              f"{args.wait_seconds:.0f}s: {resp.reason}")
    return EXIT_OK if resp.ready else EXIT_ERROR

def cmd_pin(args: argparse.Namespace, conn: Conn) -> int:
    call = conn.admin.Pin if args.command == "pin" else conn.admin.Unpin
    resp = call(pb.PinRequest(step=args.step), timeout=conn.timeout)
    if args.output == "json":
        emit_json({"step": args.step, "action": args.command, "pinned_steps": list(resp.pinned_steps)})
    else:
        print(f"{args.command}ned step {args.step}; pinned now: {ranges(resp.pinned_steps)}")
    return EXIT_OK

def cmd_backup_now(args: argparse.Namespace, conn: Conn) -> int:
    resp = conn.admin.BackupNow(pb.BackupNowRequest(step=-1 if args.step is None else args.step),
                                timeout=conn.timeout)
    state = resp.state
    if args.wait_seconds > 0 and state != "already-backed-up":
        deadline = time.monotonic() + args.wait_seconds
        while time.monotonic() < deadline:
            steps = conn.call_until("ListSteps", pb.ListStepsRequest(), deadline)
            if any(i.step == resp.step and i.backed_up for i in steps.steps):
                state = "backed-up"
                break
            time.sleep(0.5)
    if args.output == "json":
        emit_json({"step": resp.step, "state": state})
    else:
        print(f"backup of step {resp.step}: {state}")
    if args.wait_seconds > 0 and state not in ("backed-up", "already-backed-up"):
        print(f"mtc backup now: step {resp.step} not committed after {args.wait_seconds:.0f}s", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK

def cmd_gc(args: argparse.Namespace, conn: Conn) -> int:
    if not args.dry_run:
        raise UsageError("only `mtc gc --dry-run` exists: collection runs on its own on every host")
    resp = conn.admin.GcPlan(pb.GcPlanRequest(), timeout=conn.timeout)
    items = [{"tier": tier_name(i.tier), "holder_rank": i.holder_rank if i.holder_rank >= 0 else None,
              "owner_rank": i.owner_rank if i.owner_rank >= 0 else None, "step": i.step, "bytes": i.size,
              "reason": i.reason} for i in resp.items]
    if args.output == "json":
        emit_json({"would_delete": items, "protected_steps": list(resp.protected_steps)})
    else:
        t = table(f"gc --dry-run: {len(items)} pieces would be deleted; protected steps "
                   f"{ranges(resp.protected_steps)}", ["tier", "holder", "rank", "step", "bytes", "why"])
        for x in items:
            t.add_row(x["tier"], "bucket" if x["holder_rank"] is None else str(x["holder_rank"]),
                      "all" if x["owner_rank"] is None else str(x["owner_rank"]), str(x["step"]),
                      fmt_bytes(x["bytes"]) if x["bytes"] else "-", x["reason"])
        console().print(t if items else f"gc --dry-run: nothing would be deleted; protected steps "
                          f"{ranges(resp.protected_steps)}")
    return EXIT_OK
