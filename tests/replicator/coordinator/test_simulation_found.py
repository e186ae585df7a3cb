"""Coordinator defects found by the control-plane simulation (tests/simulation), each as a focused test.

The simulation seeds that found them are the guards in tests/simulation (they replay the whole schedule).
"""

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology


class Ctx:
    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")

    def is_active(self):
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def beat(coord, rank, holdings):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                              newest_saved_step=3, full_report=True,
                              holdings=[pb.Holding(owner_rank=rank, step=s, content_hash=f"h{s}.{rank % 2}",
                                                   size=10, tier=tier_pb2.TIER_LOCAL) for s in holdings])
    return coord.Heartbeat(req, Ctx())


def test_no_deletion_on_a_picture_of_lost_hosts_without_a_complete_step():
    """Simulation seeds 158 and 486: a coordinator (e.g. a deposed one, still answering the one host that
    has not heard of its successor's epoch) that hears only from host 1 declares the others lost; with
    them lost no step is complete, and it used to tell host 1 to delete step 1 (beyond keep_local 2), the
    newest step complete on the hosts that moved to the successor."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    assert not beat(coord, 1, [1, 2, 3]).deletions
    clock.now += 10.0  # hosts 0, 2 and 3 silent: declared lost
    resp = beat(coord, 1, [1, 2, 3])
    assert sorted(coord.state.lost) == [0, 2, 3]
    assert coord.state.newest_complete_step() is None
    assert [(d.owner_rank, d.step) for d in resp.deletions] == []
    # A host that comes back (its RAM disk kept) completes step 1 again: nothing was lost.
    for r in (0, 2, 3):
        beat(coord, r, [1])
    assert coord.state.newest_complete_step() == 1


def test_gc_still_runs_with_lost_hosts_once_a_step_is_complete():
    clock = Clock()
    coord = Coordinator(JobTopology(2, 1, 1), "t", keep_local=1, clock=clock, host_lost_seconds=4.0)
    peer = [pb.Holding(owner_rank=1, step=2, content_hash="h2.1", size=10, tier=tier_pb2.TIER_PEER)]
    req = pb.HeartbeatRequest(job="t", rank=0, incarnation=1, address="127.0.0.1:7000", full_report=True,
                              holdings=[pb.Holding(owner_rank=0, step=s, content_hash=f"h{s}.0", size=10,
                                                   tier=tier_pb2.TIER_LOCAL) for s in (1, 2)] + peer)
    coord.Heartbeat(req, Ctx())
    beat(coord, 1, [1, 2])
    clock.now += 10.0  # host 1 lost; its step 2 survives as host 0's peer copy
    resp = coord.Heartbeat(req, Ctx())
    assert sorted(coord.state.lost) == [1]
    assert coord.state.newest_complete_step() == 2
    assert [(d.owner_rank, d.step) for d in resp.deletions] == [(0, 1)]
