"""A host whose daemon starts just before the coordinator's (a job restart, every daemon of an Orbax
handshake) reports within a fraction of the heartbeat interval, not after a full backoff."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from replicator.coordinator.client import CoordinatorClient
from replicator.daemon import Replicator
from replicator.options import ReplicatorOptions

INTERVAL = 5.0  # the backoff after a failed heartbeat never goes below it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _opts(root: Path, rank: int, listen: str, coordinator: str) -> ReplicatorOptions:
    return ReplicatorOptions(local_dir=root / str(rank), listen=listen, job="t", rank=rank, nodes=2,
                             coordinator=coordinator, heartbeat_seconds=INTERVAL, rpc_timeout_seconds=5,
                             transfer_timeout_seconds=10, bulk_priority="normal").validate()


def test_a_host_started_before_the_coordinator_registers_within_a_second(tmp_path: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"
    daemons: list[Replicator] = []
    client = None
    try:
        host = Replicator(_opts(tmp_path, 1, "127.0.0.1:0", address), rank=1, nodes=2, job="t")
        host.start()
        daemons.append(host)
        time.sleep(0.15)  # its first report finds nobody listening
        coordinator = Replicator(_opts(tmp_path, 0, address, ""), rank=0, nodes=2, job="t")
        coordinator.start()
        daemons.append(coordinator)
        t0 = time.monotonic()
        client = CoordinatorClient(address, rpc_timeout_seconds=5)
        registered = 0
        while time.monotonic() - t0 < 2 * INTERVAL:
            registered = client.status().hosts_registered
            if registered == 2:
                break
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert registered == 2, f"rank 1 not registered {took:.1f}s after the coordinator started"
        assert took < 1.5, f"rank 1 registered {took:.2f}s after the coordinator started (interval {INTERVAL}s)"
    finally:
        if client is not None:
            client.close()
        for d in reversed(daemons):
            d.stop(grace_seconds=0.0)
