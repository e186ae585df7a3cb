"""A host restoring its own data of a step does not meanwhile copy a data-parallel replica's identical data of
that step (the restore brings the same bytes; the copy would move them twice and slow the restore the job waits
for); other copies go on, and the deferred one is taken once the restore is over. The real :class:`Heartbeat`;
the store and the task runner are stand-ins that record what is asked of them."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.heartbeat import Heartbeat, Reporter, Wakeup


class _Tasks:
    def __init__(self) -> None:
        self.submitted: list[tuple[str, int, int]] = []
        self.running: set[tuple[str, int, int]] = set()

    def busy(self, *a) -> bool:
        return False

    def submit(self, kind: str, owner: int, step: int, fn, *args, **kw) -> None:
        self.submitted.append((kind, owner, step))
        if kind == "restore":
            self.running.add((kind, owner, step))

    def in_flight(self) -> list[tuple[str, int, int]]:
        return sorted(self.running)


def _heartbeat(rank: int, tasks: _Tasks) -> Heartbeat:
    store = SimpleNamespace(has=lambda *a: False, attest_replica=lambda *a, **kw: False, delete=lambda *a, **kw: False)
    parts = SimpleNamespace(store=store, coordinator=None, wakeup=Wakeup(), stopping=threading.Event(),
                            metrics=SimpleNamespace(counters=SimpleNamespace(add=lambda *a: None)),
                            tasks=tasks, fetcher=SimpleNamespace(copy=lambda c: None), bucket=None, parity=None)
    opts = SimpleNamespace(rpc_timeout_seconds=5.0, heartbeat_seconds=1.0)
    return Heartbeat(opts, Reporter(job="t", rank=rank, nodes=4), parts, incarnation=1)


def _copy(owner: int, step: int, content_hash: str) -> pb.CopyTask:
    return pb.CopyTask(owner_rank=owner, step=step, source_rank=owner, content_hash=content_hash)


def test_a_restoring_host_defers_the_copy_of_identical_data_until_its_restore_is_over() -> None:
    tasks = _Tasks()
    hb = _heartbeat(2, tasks)
    restore = pb.RestoreTask(step=4, sources=[pb.RestoreSource(kind=tier_pb2.TIER_BUCKET, holder_rank=-1,
                                                               owner_rank=2, content_hash="H")])
    # The restore and, in the same answer, a copy of rank 0's identical data and one of rank 1's (other) data.
    hb._act(pb.HeartbeatResponse(restore=restore, copies=[_copy(0, 4, "H"), _copy(1, 4, "G")]))
    assert tasks.submitted == [("copy", 1, 4), ("restore", 2, 4)]
    # A later answer (the restore still running) asks again for the copy of rank 0's data: still deferred, and so
    # is a copy of identical data of another step only when that step is being restored.
    tasks.submitted.clear()
    hb._act(pb.HeartbeatResponse(copies=[_copy(0, 4, "H"), _copy(0, 5, "H")]))
    assert tasks.submitted == [("copy", 0, 5)]
    # The restore is over (it failed, say): the copy the coordinator still asks for is taken.
    tasks.running.clear()
    tasks.submitted.clear()
    hb._act(pb.HeartbeatResponse(copies=[_copy(0, 4, "H")]))
    assert tasks.submitted == [("copy", 0, 4)]
