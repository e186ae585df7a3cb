"""A host's work in a heartbeat's answer: its copies, deletions, restore and the witnesses of that restore.

Functions over the planner's state (:class:`~replicator.coordinator.planner.CoordinatorState`) that the
service calls under its lock; they read the clock only through ``now`` and the rest through their arguments.
Each is O(the host's tasks and holdings), no whole-job scan. What they decide and why (the whole picture
before byte copies and deletions, nothing newer than the newest complete step while hosts are silent) is
documented where it is decided, here. Parity tasks are :mod:`replicator.coordinator.parity_answer`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator import answers
from replicator.coordinator.model import Source
from replicator.coordinator.parity_answer import parity_deletion
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.restore_plan import Liveness
from replicator.coordinator.step_tracking import FirstSeen
from replicator.tiers import Tier

# A host's restore waits this long at least (and this many heartbeats) for a byte-identical replica's host that
# fetches the same bytes from the bucket, then fetches its own (issue #48: one bucket read per replica group).
RESTORE_PEER_WAIT_MIN_SECONDS = 3.0
RESTORE_PEER_WAIT_INTERVALS = 4
# Beyond two heartbeat intervals of silence, a host counts as restarting: its copies are offered last.
SILENT_JITTER_SECONDS = 0.5


def copy_tasks(st: CoordinatorState, rank: int, *, now: float, floor: int, first_seen: FirstSeen, whole: bool,
               grace: float, addresses: Mapping[int, str]) -> list[pb.CopyTask]:
    """The copies host ``rank`` makes of the steps from ``floor`` (the newest complete one) on; the first-seen
    times of older steps are forgotten. ``whole``: every live host reported (or long enough passed)."""
    out = []
    for step in st.known_steps():
        if step < floor:
            first_seen.forget(step)
            continue
        first = first_seen.note(step, now)
        tasks = st.tasks_for(rank, step)
        if not tasks:
            continue
        # Hosts commit a step at about the same time; until all have reported it (or a grace period
        # passed), a data-parallel replica may just be late, and a byte copy to it would be wasted:
        # its own identical data only needs a hash comparison. A host that never comes back must not
        # block re-replication forever: after a while the copies go out on the picture there is.
        settled = whole and (st.is_complete(step) or now - first >= grace)
        for t in tasks:
            if not (t.hash_only or settled):
                continue
            addr = addresses.get(t.source_rank, "")
            if not t.hash_only and not addr:
                continue
            out.append(pb.CopyTask(owner_rank=t.owner_rank, step=t.step, source_rank=t.source_rank,
                                   source_address=addr, content_hash=t.content_hash))
    return out


def order_deletions(st: CoordinatorState, rank: int, *, keep_local: int, newest: int | None,
                    quiet: bool) -> list[pb.Deletion]:
    """What host ``rank`` deletes (its data and its parity), recorded as deletions in flight.

    Called only with the whole picture (every live rank reported to this coordinator: after its own restart,
    hosts come back one by one, and an older step can look incomplete only because its holders have not
    reported yet), and not while no step is complete and hosts are declared lost (the lost hosts may be alive
    and hold the rest of an older step: a deposed coordinator, cut off from the hosts that moved to its
    successor, sees them all as lost; with nothing complete deleting saves no step; issue #19, found by
    tests/simulation). ``quiet``: no host is declared lost nor silent for longer than a beat's jitter.
    """
    doomed = st.gc_for(rank, keep_local)
    parity_doomed = st.ec.gc_for(rank, keep_local)
    if not quiet:
        # Nor a step newer than the newest complete one while hosts are declared lost or silent for
        # longer than a beat's jitter: with their pieces it may be complete (a partition: another
        # candidate serves them and counts it complete; a candidate takes over only after at least
        # two intervals of silence from this one, so a host silent for less cannot have moved yet).
        # It goes once they report again or are replaced (issue #33, tests/simulation seeds 1005
        # and 15775). With no step complete, nothing goes: every step is newer than the newest
        # complete one (seed 42569: a deposed coordinator, the other hosts silent to it, told host
        # 0 to delete step 1 beyond keep_local, complete on its successor).
        doomed = [k for k in doomed if newest is not None and k[1] <= newest]
        parity_doomed = [h for h in parity_doomed if newest is not None and h.step <= newest]
    out = []
    for owner, step in doomed:
        h = st.holding(rank, (owner, step))
        out.append(pb.Deletion(owner_rank=owner, step=step, content_hash=h.content_hash if h is not None else ""))
    # Counted for nothing from now until the host's next report: no fallback to a step whose
    # pieces are being deleted (issue #19, found by tests/simulation).
    st.deleting(rank, doomed)
    out.extend(parity_deletion(h) for h in parity_doomed)
    st.ec.deleting(rank, [h.step for h in parity_doomed])
    return out


def holds_restorable(st: CoordinatorState, rank: int, step: int, sources: list[Source]) -> bool:
    """Does host ``rank`` hold its data of ``step`` (or a byte-identical replica's) on its RAM disk?"""
    for s in sources:
        if not s.content_hash:
            continue
        h = st.holding(rank, (s.owner_rank, step))
        if h is not None and h.tier is not Tier.REPLICA and h.content_hash == s.content_hash:
            return True
    return False


def liveness(now: float, interval: float) -> Liveness:
    """The bounds of a restore's sources at ``now`` with heartbeats every ``interval`` seconds: a host silent
    for two beats and a jitter is restarting (or gone); a rank waits up to ``RESTORE_PEER_WAIT_INTERVALS``
    beats (at least ``RESTORE_PEER_WAIT_MIN_SECONDS``) for a replica's host that fetches the same bytes from
    the bucket (it would wait one beat for the news that they landed, and about a bucket fetch of them)."""
    return Liveness(now, 2 * interval + SILENT_JITTER_SECONDS,
                    max(RESTORE_PEER_WAIT_MIN_SECONDS, RESTORE_PEER_WAIT_INTERVALS * interval))


def restore_task(st: CoordinatorState, rank: int, step: int | None, addresses: Mapping[int, str],
                 live: Liveness) -> pb.RestoreTask | None:
    """Host ``rank``'s restore of ``step`` (the restore target), unless it holds its data of it already or waits
    for a replica's host to fetch the same bytes (:meth:`CoordinatorState.restore_sources`)."""
    if step is None:
        return None
    sources = st.restore_sources(step, rank, live)
    if not sources or holds_restorable(st, rank, step, sources):
        return None
    # Fastest tier first (the daemon tries them in order); not its own copy, nor a host of unknown address.
    out = [w for s in sources if s.kind is not Tier.LOCAL and (w := answers.wire_source(s, addresses))]
    return pb.RestoreTask(step=step, sources=out) if out else None


def witness_copies(st: CoordinatorState, rank: int, task: pb.RestoreTask, told: set[tuple[int, int]],
                   address: str) -> list[pb.CopyTask]:
    """Hash-only copies by which the restoring host ``rank`` attests the replicas its restore's data is
    identical to (those not ``told`` already in this answer)."""
    hashes = {s.content_hash for s in task.sources if s.content_hash}
    return [pb.CopyTask(owner_rank=t.owner_rank, step=t.step, source_rank=rank, source_address=address,
                        content_hash=t.content_hash)
            for t in st.restore_witnesses(rank, task.step, hashes) if (t.owner_rank, t.step) not in told]
