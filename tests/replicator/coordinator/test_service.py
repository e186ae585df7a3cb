"""The coordinator service in-process: what it hands out before and after every host has reported."""

import grpc
import pytest

from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology


class Ctx:
    """The two ServicerContext methods the coordinator uses."""

    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")

    def is_active(self):
        return True


def beat(coord, rank, holdings):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                              newest_saved_step=3, full_report=True,
                              holdings=[pb.Holding(owner_rank=o, step=s, content_hash=h, size=10, tier=t)
                                        for o, s, h, t in holdings])
    return coord.Heartbeat(req, Ctx())


# After a restart, 2 slices x 2 hosts, replicas identical (0~2, 1~3). Host 0 attests rank 2's step 3 only,
# host 1 rank 3's step 3: with just hosts 0 and 1 reported, step 3 looks complete and step 2 does not.
HOLDINGS = {
    0: [(0, 2, "A2", "local"), (0, 3, "A3", "local"), (2, 3, "A3", "replica")],
    1: [(1, 2, "B2", "local"), (1, 3, "B3", "local"), (3, 3, "B3", "replica")],
    2: [(2, 2, "A2", "local"), (2, 3, "A3", "local")],
    3: [(3, 2, "B2", "local"), (3, 3, "B3", "local")],
}


def test_no_deletion_until_every_rank_reported():
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2)
    for r in (0, 1):
        assert not beat(coord, r, HOLDINGS[r]).deletions
    assert coord.state.newest_complete_step() == 3  # the premature picture
    for r in (2, 3):
        beat(coord, r, HOLDINGS[r])
    # Everyone reported: steps 2 and 3 are both complete and within keep_local=2; nothing to delete.
    assert coord.state.globally_complete_steps() == [2, 3]
    for r in range(4):
        assert not beat(coord, r, HOLDINGS[r]).deletions


def test_unknown_rank_and_wrong_job_are_rejected():
    coord = Coordinator(JobTopology(2, 1, 1), "t")
    with pytest.raises(grpc.RpcError, match="unknown rank 5"):
        beat(coord, 5, [])
    with pytest.raises(grpc.RpcError, match="FAILED_PRECONDITION"):
        coord.Heartbeat(pb.HeartbeatRequest(job="x", rank=0, incarnation=1), Ctx())
    assert coord.state.registered == {}
