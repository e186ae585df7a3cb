"""Per-Pod certificates with real replicator processes on 127.0.0.1 (mutual TLS, ``--tls-rank-identity require``).

Four replicators (2 slices x 2 hosts) each present the certificate cert-manager's csi-driver would issue to
its JobSet Pod (URI SAN ``mtc://t/pod/t-workers-<s>-<h>-<suffix>``): they register, save, replicate and
report as the rank their Pod names derive; the controller uses the admin certificate. A Pod's certificate
claiming another rank is refused and changes nothing; a replicator whose Pod certificate derives another
rank refuses to start.
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
from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.client import CoordinatorClient
from replicator.net import rpc
from tests.kits.certs import CertAuthority, PodCertCluster, jobset_pod_name
from tests.kits.cluster import REPO, save_steps, wait_for
from tests.kits.tls_coordinator import host_rows

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[PodCertCluster]:
    base = Path(tempfile.mkdtemp(prefix="mtc-pod-tls-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    c = PodCertCluster(base, 4, 2, CertAuthority(tmp_path / "ca"))
    try:
        yield c
    finally:
        c.stop_all(signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_pod_certificates_end_to_end_and_a_foreign_report_is_denied(cluster: PodCertCluster) -> None:
    ca = cluster.ca
    cluster.start_all()
    admin = ca.issue_admin("t")
    status = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=5, tls=admin.tls(ca.ca_file))
    devs = jax.devices()
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    coordinator_address=cluster.coordinator, tls_cert_file=str(admin.cert),
                                    tls_key_file=str(admin.key), tls_ca_file=str(ca.ca_file),
                                    restore_wait_seconds=60, rpc_timeout_seconds=10)
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    try:
        save_steps(mgr, [1], replicated_over_slices=False)
        wait_for(lambda: mgr.latest_step() == 1, what="step 1 complete with per-Pod certificates", timeout=60)
        wait_for(lambda: set(host_rows(status)) == {0, 1, 2, 3}
                 and all(h[2] and h[3] == [1] and h[4] >= 2 for h in host_rows(status).values()),
                 what="every host reported its step and a copy", timeout=60)
        before = host_rows(status)

        # Slice 1's host 0 (rank 2) claims rank 3: an empty full report would wipe rank 3's inventory.
        with rpc.make_channel(cluster.coordinator, tls=cluster.certs[2].tls(ca.ca_file)) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(pb.HeartbeatRequest(job="t", rank=3, incarnation=12345, address="127.0.0.1:1",
                                                   full_report=True, inventory_digest="x"), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert e.value.details() == (
                f"report for rank 3 refused: the certificate mtc://t/pod/{cluster.pods[2]} is host 0 of slice 1, "
                "i.e. rank 2 (1 x 2 hosts per slice + 0); it may report only for rank 2")
            assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts_registered == 4
        # Another job's Pod, and a Pod of another replicated job of this JobSet, cannot report either.
        for uri in ("mtc://u/pod/" + jobset_pod_name("u", 1, 1), "mtc://t/pod/" + jobset_pod_name("t", 0, 0, "head")):
            with rpc.make_channel(cluster.coordinator, tls=ca.issue("stray", [uri]).tls(ca.ca_file)) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    pb_grpc.CoordinatorStub(ch).Heartbeat(
                        pb.HeartbeatRequest(job="t", rank=0, incarnation=1, full_report=True), timeout=10)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "report for rank 0 refused" in e.value.details()
        assert host_rows(status) == before
        assert "report for rank 3 refused" in (cluster.base / "logs" / "replicator-0.log").read_text()
    finally:
        mgr.close()
        status.close()


def test_a_replicator_whose_pod_certificate_derives_another_rank_refuses_to_start(tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path / "ca")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    pod = jobset_pod_name("t", 1, 0)  # rank 2 with 2 hosts per slice
    r = subprocess.run([sys.executable, "-m", "replicator.main", "--local-dir", str(tmp_path / "ram"),
                        "--rank", "1", "--nodes", "4", "--data-parallelism", "2", "--job", "t",
                        "--listen", "127.0.0.1:0", "--coordinator", "127.0.0.1:1", "--tls-rank-identity", "require",
                        *ca.issue_pod("t", pod).args(ca.ca_file)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=str(REPO))
    assert r.returncode != 0
    assert (f"names mtc://t/pod/{pod}, host 0 of slice 1, i.e. rank 2 (1 x 2 hosts per slice + 0), but this "
            "replicator is rank 1") in r.stderr, r.stderr
