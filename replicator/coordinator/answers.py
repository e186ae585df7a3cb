"""What the coordinator answers on the wire, built from its state under its lock (read-only views).

``status_response`` (``GetStatus``): the service fills in what only it knows (job, epoch, address, restore
target, intervals) as ``header``; everything derived from the facts — complete and backed-up steps, lost
hosts by age, per-step summaries, per-host and per-rank detail for the asked range — is built here.
``wire_source``: one source of a rank's data as a restore task or ``LocateStep`` names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.backup_status import BackupSchedulerStatus
from replicator.coordinator.model import Source
from replicator.coordinator.parity_answer import parity_source
from replicator.coordinator.planner import CoordinatorState
from replicator.tier_wire import holder_to_wire, to_wire
from replicator.tiers import Tier
from sidecar.saves import format_ranks

LOST_AGE_GROUPS_SHOWN = 64  # lost hosts are summarised by how long ago they were lost, this many groups at most


def status_response(st: CoordinatorState, request: pb.GetStatusRequest, header: pb.GetStatusResponse, *,
                    now: float, in_bucket: Callable[[int], bool], backup: BackupSchedulerStatus | None,
                    addresses: Mapping[int, str]) -> pb.GetStatusResponse:
    """``header`` completed with the summary, and the detail ``request`` asks for (ranks
    ``rank_first .. rank_first + rank_count - 1``; ``rank_count`` 0: through the last rank)."""
    nodes = header.topology.nodes
    complete = st.globally_complete_steps()
    lost = st.lost
    pinned, backing = set(st.pinned_steps()), set(st.backups_in_progress())
    resp = pb.GetStatusResponse()
    resp.CopyFrom(header)
    resp.newest_complete_step = complete[-1] if complete else -1
    resp.complete_steps.extend(complete)
    resp.pinned_steps.extend(sorted(pinned))
    resp.backing_up_steps.extend(sorted(backing))
    resp.hosts_registered = len(st.registered)
    resp.hosts_reported = st.reported_count
    resp.hosts_lost = len(lost)
    resp.lost_ranks = format_ranks(lost)
    resp.hosts_reregistered = st.reregistered
    by_time: dict[int, list[int]] = {}
    for r, since in lost.items():
        by_time.setdefault(int(now - since), []).append(r)
    for age, rs in sorted(by_time.items())[:LOST_AGE_GROUPS_SHOWN]:
        resp.lost.append(pb.LostHosts(ranks=format_ranks(rs), lost_for_seconds=float(age)))
    for step in st.known_steps():
        backed_up = in_bucket(step)
        if backed_up:
            resp.backed_up_steps.append(step)
        missing = st.missing_ranks(step)
        resp.steps.append(pb.StepSummary(
            step=step, complete=st.is_complete(step), redundant=st.is_redundant(step),
            ranks_covered=st.covered_count(step), missing_ranks=format_ranks(missing) if missing else "",
            ranks_backed_up=st.backup_rank_count(step), backed_up=backed_up, pinned=step in pinned,
            backing_up=step in backing, savers=format_ranks(st.expected_ranks(step))))
    if (b := backup) is not None:
        resp.backup.CopyFrom(pb.BackupStatus(
            url=b.url, committed_steps=b.committed_steps, in_progress_step=b.in_progress_step,
            in_progress_done_ranks=len(b.in_progress_done_ranks), skipped=b.skipped, failures=b.failures,
            last_error=b.last_error, interval_steps=b.interval_steps, interval_minutes=b.interval_minutes,
            keep=b.keep))
    first = max(0, request.rank_first)
    last = nodes - 1 if request.rank_count <= 0 else min(first + request.rank_count, nodes) - 1
    detail = range(first, last + 1)
    if request.hosts:
        registered = st.registered
        for r in detail:
            held = st.holdings_of(r)
            seen = st.last_seen(r)
            resp.hosts.append(pb.HostStatus(
                rank=r, address=addresses.get(r, ""), incarnation=registered.get(r, 0),
                inventory_reported=st.is_reported(r),
                last_report_age_seconds=-1.0 if seen is None or r not in registered else now - seen,
                lost=r in lost, lost_for_seconds=now - lost[r] if r in lost else 0.0,
                steps=sorted({h.step for h in held}), pieces=len(held),
                bytes=sum(h.size for h in held if h.tier is not Tier.REPLICA)
                + sum(h.size for h in st.ec.parity_of(r))))
    for step in request.detail_steps:
        d = resp.step_details.add(step=step)
        for r in detail:
            d.ranks.append(pb.RankSources(rank=r, sources=[
                pb.SourceInfo(kind=to_wire(s.kind), holder_rank=holder_to_wire(s.holder_rank), owner_rank=s.owner_rank)
                for s in st.rank_sources(step, r)]))
    return resp


def wire_source(s: Source, addresses: Mapping[int, str]) -> pb.RestoreSource | None:
    """``s`` with its holder's address; None for a host that has not told its address (not reachable). A
    rebuild from parity (ec mode) names its code group with the addresses of the members it reads."""
    if s.kind is Tier.PARITY:
        return parity_source(s, addresses)
    addr = addresses.get(s.holder_rank, "") if s.holder_rank is not None else ""
    if s.kind is not Tier.BUCKET and not addr:
        return None
    return pb.RestoreSource(kind=to_wire(s.kind), holder_rank=holder_to_wire(s.holder_rank), holder_address=addr,
                            owner_rank=s.owner_rank, content_hash=s.content_hash or "")
