"""The sidecar's client of its replicator's local control socket (real gRPC on a Unix socket)."""

import concurrent.futures

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc
from sidecar import layout
from sidecar.remote import ReplicatorFetcher


class BigManifest(control_pb2_grpc.LocalControlServicer):
    def __init__(self, data: bytes):
        self.data = data

    def FetchStep(self, request, context):
        return control_pb2.FetchStepResponse(manifest_json=self.data)


def test_manifest_larger_than_grpc_default_limit_is_received(tmp_path):
    # A step with many block crc32cs: > 4 MiB of manifest (gRPC's default receive limit).
    entry = layout.ShardEntry(((0, 6 << 30),), "0.0.bin", 0, 6 << 30, 0, 1 << 20, (4294967295,) * 6144)
    shards = tuple(entry for _ in range(100))
    m = layout.StepManifest(job="t", step=1, rank=0, nodes=1, files=(layout.FileEntry("0.0.bin", 6 << 30, 0),),
                            arrays=(layout.ArrayEntry("w", (6 << 30,), "uint8", shards),))
    data = m.to_json()
    assert len(data) > 4 << 20
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    control_pb2_grpc.add_LocalControlServicer_to_server(BigManifest(data), server)
    server.add_insecure_port(f"unix:{layout.control_socket(tmp_path)}")
    server.start()
    try:
        got = ReplicatorFetcher(tmp_path, timeout_seconds=30).manifest(0, 1)
    finally:
        server.stop(None)
    assert got == m
