"""The daemon numbers its heartbeat reports (``HeartbeatRequest.report_seq``), so that a coordinator can
refuse an older report the network delivers late or twice (simulation seeds 22603, 34231)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.daemon import Replicator
from replicator.net import rpc
from replicator.options import ReplicatorOptions


class _Recording(Coordinator):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.seen: list[tuple[int, int]] = []  # (incarnation, report_seq) of rank 1's reports
        self.seen_lock = threading.Lock()

    def Heartbeat(self, request, context):  # noqa: N802 (gRPC method name)
        if request.rank == 1:
            with self.seen_lock:
                self.seen.append((request.incarnation, request.report_seq))
        return super().Heartbeat(request, context)


def test_a_replicator_numbers_its_reports_one_two_three(tmp_path: Path) -> None:
    coord = _Recording(JobTopology(2, 1, 1), "t", heartbeat_seconds=0.1)
    server, port = rpc.create_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, coord)])
    server.start()
    opts = ReplicatorOptions(local_dir=tmp_path / "1", listen="127.0.0.1:0", job="t", rank=1, nodes=2,
                             coordinator=f"127.0.0.1:{port}", heartbeat_seconds=0.1, rpc_timeout_seconds=5,
                             transfer_timeout_seconds=10, bulk_priority="normal").validate()
    host = Replicator(opts, rank=1, nodes=2, job="t")
    try:
        host.start()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with coord.seen_lock:
                if len(coord.seen) >= 4:
                    break
            time.sleep(0.02)
    finally:
        host.stop(grace_seconds=0.0)
        server.stop(0)
    seen = coord.seen[:4]
    assert len(seen) == 4, seen
    assert len({inc for inc, _ in seen}) == 1
    assert [seq for _, seq in seen] == [1, 2, 3, 4]
