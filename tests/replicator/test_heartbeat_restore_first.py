"""A host restoring its own data of a step does not meanwhile copy a data-parallel replica's identical data of
that step (the restore brings the same bytes; the copy would move them twice and slow the restore the job waits
for); other copies go on, and the held-back one is taken once the restore is over. The host's rules
(:func:`replicator.host_protocol.work`), as the daemon's heartbeat and the simulation call them."""

from __future__ import annotations

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator import host_protocol as hp


def _copy(owner: int, step: int, content_hash: str) -> pb.CopyTask:
    return pb.CopyTask(owner_rank=owner, step=step, source_rank=owner, content_hash=content_hash)


def _kinds(work: hp.Work) -> list[tuple[str, int, int]]:
    return [(type(c).__name__, c.task.owner_rank, c.task.step) for c in work.copies]


def test_a_restoring_host_holds_back_the_copy_of_identical_data_until_its_restore_is_over() -> None:
    restore = pb.RestoreTask(step=4, sources=[pb.RestoreSource(kind=tier_pb2.TIER_BUCKET, holder_rank=-1,
                                                               owner_rank=2, content_hash="H")])
    # The restore and, in the same answer, a copy of rank 0's identical data and one of rank 1's (other) data.
    first = hp.work(pb.HeartbeatResponse(restore=restore, copies=[_copy(0, 4, "H"), _copy(1, 4, "G")]), 2, {}, ())
    assert _kinds(first) == [("HoldBack", 0, 4), ("Copy", 1, 4)]
    assert first.restore == restore and first.restoring == {4: frozenset({"H"})}
    # A later answer (the restore still running) asks again for the copy of rank 0's data: still held back, and
    # so is a copy of identical data of another step only when that step is being restored.
    running = [("restore", 2, 4)]
    later = hp.work(pb.HeartbeatResponse(copies=[_copy(0, 4, "H"), _copy(0, 5, "H")]), 2, first.restoring, running)
    assert _kinds(later) == [("HoldBack", 0, 4), ("Copy", 0, 5)]
    assert later.restore is None and later.restoring == {4: frozenset({"H"})}
    # The restore is over (it failed, say): the copy the coordinator still asks for is taken.
    over = hp.work(pb.HeartbeatResponse(copies=[_copy(0, 4, "H")]), 2, later.restoring, [("copy", 1, 4)])
    assert _kinds(over) == [("Copy", 0, 4)] and over.restoring == {}


def test_another_ranks_restore_of_the_step_holds_nothing_back() -> None:
    """Only this host's own restore (its rank's task) brings bytes here."""
    work = hp.work(pb.HeartbeatResponse(copies=[_copy(0, 4, "H")]), 2, {4: frozenset({"H"})}, [("restore", 3, 4)])
    assert _kinds(work) == [("Copy", 0, 4)] and work.restoring == {}
