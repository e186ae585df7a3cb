"""Run inside a test's network namespace: a gRPC server and a client of it on loopback (test_keepalive).

Protocol on stdin/stdout, one line each: prints ``PORT <n>`` once connected; on ``CALL <seconds>`` makes one
health check with that deadline and prints ``DONE <code> <elapsed>``; ``QUIT`` ends it.
"""

from __future__ import annotations

import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicator.net import rpc


def main() -> None:
    server, port = rpc.create_server("127.0.0.1:0", [])
    server.start()
    channel = rpc.make_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    print(f"PORT {port}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "QUIT":
            break
        t0 = time.monotonic()
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=float(cmd[1]))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        print(f"DONE {code} {time.monotonic() - t0:.2f}", flush=True)
    channel.close()
    server.stop(0)


if __name__ == "__main__":
    main()
