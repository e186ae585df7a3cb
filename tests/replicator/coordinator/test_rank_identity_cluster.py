"""Per-rank certificates with real replicator processes on 127.0.0.1 (mutual TLS, docs/security.md).

Hosts with their own rank's certificate save, replicate and report end to end; the controller uses an
admin certificate; a client holding rank 1's certificate cannot report as rank 0 and changes nothing;
admin actions need the admin certificate; a replicator given another rank's certificate refuses to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import jax
import pytest

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from mtc_rpc import admin_pb2, admin_pb2_grpc
from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.client import CoordinatorClient
from replicator.net import rpc
from tests.kits.certs import CertAuthority, RankCertCluster
from tests.kits.cluster import REPO, save_steps, wait_for
from tests.kits.tls_coordinator import host_rows

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RankCertCluster]:
    base = Path(tempfile.mkdtemp(prefix="mtc-tls-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    c = RankCertCluster(base, 2, 1, CertAuthority(tmp_path / "ca"))
    try:
        yield c
    finally:
        c.stop_all(signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_per_rank_certificates_end_to_end_and_a_foreign_report_is_denied(cluster: RankCertCluster) -> None:
    ca = cluster.ca
    cluster.start_all()
    admin = ca.issue_admin("t")
    status = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=5, tls=admin.tls(ca.ca_file))
    devs = jax.devices()
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    coordinator_address=cluster.coordinator, tls_cert_file=str(admin.cert),
                                    tls_key_file=str(admin.key), tls_ca_file=str(ca.ca_file),
                                    restore_wait_seconds=60, rpc_timeout_seconds=10)
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 1, 2))
    try:
        save_steps(mgr, [1], replicated_over_slices=False)
        wait_for(lambda: mgr.latest_step() == 1, what="step 1 complete with per-rank certificates")
        # Each host fetched the other's data over mutual TLS, presenting its own rank's certificate.
        wait_for(lambda: (cluster.ram(1) / "peer" / "0" / "1").is_dir()
                 and (cluster.ram(0) / "peer" / "1" / "1").is_dir(), what="ring copies", timeout=60)
        wait_for(lambda: all(h[2] and h[3] == [1] and h[4] == 2 for h in host_rows(status).values()),
                 what="both hosts reported their step and copy")
        before = host_rows(status)
        assert set(before) == {0, 1} and before[0][0] and before[1][0]

        # A client holding rank 1's certificate claims rank 0: an empty full report with a new address and
        # incarnation would wipe rank 0's inventory and divert its peers.
        forger = cluster.certs[1]
        with rpc.make_channel(cluster.coordinator, tls=forger.tls(ca.ca_file)) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(pb.HeartbeatRequest(job="t", rank=0, incarnation=12345, address="127.0.0.1:1",
                                                   full_report=True, inventory_digest="x"), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "rank 0" in e.value.details() and "names rank 1" in e.value.details()
            # The same certificate still reads status (any certificate of the job's CA may).
            assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts_registered == 2
        assert host_rows(status) == before

        # A certificate of the job's CA that names no rank, and the admin certificate, cannot report.
        for pair in (ca.issue("no-identity"), admin):
            with rpc.make_channel(cluster.coordinator, tls=pair.tls(ca.ca_file)) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    pb_grpc.CoordinatorStub(ch).Heartbeat(
                        pb.HeartbeatRequest(job="t", rank=1, incarnation=1, full_report=True), timeout=10)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert host_rows(status) == before
        assert "report for rank 0 refused" in (cluster.base / "logs" / "replicator-0.log").read_text()

        # Admin actions need the admin certificate: a host's cannot pin (or report others' copies bad).
        with rpc.make_channel(cluster.coordinator, tls=cluster.certs[1].tls(ca.ca_file)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                admin_pb2_grpc.AdminStub(ch).Pin(admin_pb2.PinRequest(step=1), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert list(status.status().pinned_steps) == []
        with rpc.make_channel(cluster.coordinator, tls=admin.tls(ca.ca_file)) as ch:
            assert list(admin_pb2_grpc.AdminStub(ch).Pin(admin_pb2.PinRequest(step=1), timeout=10).pinned_steps) == [1]
    finally:
        mgr.close()
        status.close()


def test_a_replicator_with_another_ranks_certificate_refuses_to_start(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path / "ca")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "replicator.main", "--local-dir", str(tmp_path / "ram"),
                        "--rank", "1", "--nodes", "2", "--job", "t", "--listen", "127.0.0.1:0",
                        "--coordinator", "127.0.0.1:1", *ca.issue_rank("t", 0).args(ca.ca_file)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=str(REPO))
    assert r.returncode != 0
    assert "names mtc://t/rank/0 but this replicator is rank 1" in r.stderr, r.stderr
