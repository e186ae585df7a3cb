"""Multi-process scenarios: real `mtc replicator` processes on 127.0.0.1, the controller in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import coordinator_pb2_grpc as cpb_grpc
from mtc_rpc import tier_pb2
from sidecar import checksums, commit, layout
from tests.kits.cluster import REPO, assert_equal, manager, redundant, save_steps, status, target, wait_for

pytestmark = pytest.mark.slow


def test_restart_everything_restores_newest_complete_step(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [1, 2, 3])
    wait_for(lambda: mgr.latest_step() == 3, what="step 3 globally complete")
    assert mgr.all_steps()[-1] == 3
    wait_for(lambda: redundant(cl, 3), what="step 3 redundant", timeout=60)
    mgr.close()
    cl.stop_all()
    cl.start_all()
    mgr = manager(cl, 2, 2)
    assert mgr.latest_step() == 3
    assert_equal(trees[3], mgr.restore(None, target(trees[3])))
    # keep_local=2: the older steps were collected on every host
    for r in range(4):
        assert commit.committed_steps(cl.ram(r) / "steps") == [2, 3]
    mgr.close()


def test_wiped_host_restored_from_its_data_parallel_replica(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [5, 10])
    wait_for(lambda: redundant(cl, 10), what="step 10 redundant", timeout=60)
    # Identical replicas are verified by hash: no byte copy was made on any host.
    for r in range(4):
        assert not list((cl.ram(r) / "peer").glob("*/10")), f"host {r} holds a byte copy"
    cl.procs[3].stop()
    cl.wipe(3)
    cl.start(3)
    out = mgr.restore(None, target(trees[10]))
    assert_equal(trees[10], out)
    # Host 3 got its data from its replica (rank 1, same in-slice index in the other slice): as rank 1's copy
    # read by the restore (peer/1/10), or as its own step when the coordinator's restore task, which a
    # replaced host's first heartbeat may already carry, landed first (steps/10). Either way verified.
    # (A restore task in flight when the restore read its bytes from the peer commits a moment later.)
    landed = wait_for(lambda: [d / "10" for d in (cl.ram(3) / "peer" / "1", cl.ram(3) / "steps")
                               if 10 in commit.committed_steps(d)], what="host 3's copy of step 10", timeout=30)
    for d in landed:
        checksums.verify_step_dir(d)
    wait_for(lambda: redundant(cl, 10), what="step 10 redundant again", timeout=60)
    mgr.close()


def test_a_restore_in_flight_waits_for_a_replaced_hosts_replicator(cluster_factory):
    """Issue #19 (restore x host): host 3 is replaced (replicator down, RAM disk empty) while a restore
    runs; the restore gave up at once ("no replicator serves ...") although restore_wait_seconds allowed
    more. Now host 3's reader waits for its replicator and the restore completes, bit-exact."""
    import threading
    import time

    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [1])
    wait_for(lambda: redundant(cl, 1), what="step 1 redundant", timeout=60)
    cl.procs[3].stop()
    cl.wipe(3)
    back = threading.Timer(3.0, lambda: cl.start(3))  # the replacement host's replicator starts a bit later
    back.start()
    t0 = time.monotonic()
    try:
        out = mgr.restore(1, target(trees[1]))
    finally:
        back.join()
    assert time.monotonic() - t0 >= 3.0  # it did wait for the replicator
    assert_equal(trees[1], out)
    mgr.close()


def test_single_slice_ring_copy_restores_a_wiped_host(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=1)
    cl.start_all()
    mgr = manager(cl, 1, 4)
    trees = save_steps(mgr, [1, 2], replicated_over_slices=False)
    wait_for(lambda: redundant(cl, 2), what="step 2 redundant", timeout=60)
    holders = [r for r in range(4) if (cl.ram(r) / "peer" / "2" / "2").is_dir()]
    assert holders, "no ring copy of rank 2's step"
    cl.procs[2].stop()
    cl.wipe(2)
    cl.start(2)
    assert_equal(trees[2], mgr.restore(None, target(trees[2])))
    # The restore reads the copy while it lands; the replicator commits it on the RAM disk just after.
    wait_for(lambda: commit.committed_steps(cl.ram(2) / "steps") == [2], what="rank 2's step 2 committed again",
             timeout=30)
    mgr.close()


def test_sigkill_during_replication_leaves_no_partial_copy(cluster_factory):
    # 16 MiB per host at 2 MB/s after the limiter's 8 MiB burst: each copy takes ~4 s.
    cl = cluster_factory(nodes=4, data_parallelism=1, extra=["--max-bytes-per-second", "2000000"])
    cl.start_all()
    mgr = manager(cl, 1, 4)
    big = {"w": jax.device_put(np.ones((4096, 4096), np.float32),
                               NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x")))}
    mgr.save(1, big)
    mgr.wait_until_finished()

    def copying() -> list:
        return [p for r in range(4) for p in (cl.ram(r) / "peer").glob("*/.tmp-*")]

    tmp = wait_for(copying, what="a copy in flight", timeout=60, interval=0.02)
    victim = int(tmp[0].relative_to(cl.base / "ram").parts[0])
    cl.procs[victim].kill()
    # Nothing half-visible: the victim's peer area has no committed step 1 of another rank.
    for owner_dir in (cl.ram(victim) / "peer").glob("*"):
        for d in owner_dir.iterdir():
            if layout.parse_step_name(d.name) is not None:
                checksums.verify_step_dir(d)
    leftovers = list((cl.ram(victim) / "peer").glob("*/.tmp-*"))
    assert leftovers, "the killed replicator's partial copy should still be on disk"
    cl.start(victim)
    # The restarted replicator removed the killed one's temporary directories at start.
    assert not [p for p in leftovers if p.exists()]
    mgr.save(2, big)
    mgr.wait_until_finished()
    wait_for(lambda: mgr.latest_step() == 2, what="step 2 globally complete after the restart", timeout=60)
    wait_for(lambda: redundant(cl, 2), what="step 2 redundant after restart", timeout=90)
    for r in range(4):
        for owner_dir in (cl.ram(r) / "peer").glob("*"):
            for d in owner_dir.iterdir():
                if layout.parse_step_name(d.name) is not None:
                    checksums.verify_step_dir(d)
    mgr.close()


def test_coordinator_restart_loses_nothing(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [1])
    wait_for(lambda: redundant(cl, 1), what="step 1 redundant")
    cl.procs[0].kill()
    cl.start(0)  # same address; state rebuilt from heartbeats
    trees.update(save_steps(mgr, [2]))
    wait_for(lambda: redundant(cl, 2), what="step 2 redundant after coordinator restart", timeout=60)
    assert mgr.all_steps()[-1] == 2
    assert_equal(trees[2], mgr.restore(None, target(trees[2])))
    mgr.close()
    # The admin view: the coordinator's global status and one host's local status, as JSON.
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "controller_client.cli", "steps", "-o", "json", "--coordinator",
                          cl.coordinator], capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    st = json.loads(out)
    step2 = next(s for s in st["steps"] if s["step"] == 2)
    assert st["newest_complete_step"] == 2 and step2["redundant"] and step2["local_ranks"] == [0, 1, 2, 3]
    # The typed status the coordinator serves (what Orbax mode and the tests read), with per-host detail.
    typed = status(cl, hosts=True)
    assert typed.newest_complete_step == 2 and [h.rank for h in typed.hosts if h.address] == [0, 1, 2, 3]
    out = subprocess.run([sys.executable, "-m", "controller_client.cli", "status", "-o", "json", "--local-dir",
                          str(cl.ram(3))], capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    local = json.loads(out)
    assert local["rank"] == 3 and 2 in local["own_steps"]


def test_bad_requests_are_rejected_and_change_nothing(cluster_factory, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cl = cluster_factory(nodes=2, data_parallelism=1, extra=["--token-file", str(token)])
    cl.start_all()
    before = sorted(str(p) for p in cl.base.rglob("*") if "logs" not in p.parts)
    with grpc.insecure_channel(cl.coordinator) as ch:
        stub = cpb_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetSteps(cpb.GetStepsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = (("authorization", "Bearer s3cret"),)
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(cpb.HeartbeatRequest(job="t", rank=7, incarnation=1), timeout=5, metadata=md)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "unknown rank 7" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(cpb.HeartbeatRequest(job="other", rank=0, incarnation=1), timeout=5, metadata=md)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        bad = cpb.HeartbeatRequest(job="t", rank=1, incarnation=1,
                                   holdings=[cpb.Holding(owner_rank=1, step=-3, content_hash="x", tier=tier_pb2.TIER_LOCAL)])
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(bad, timeout=5, metadata=md)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        huge = cpb.HeartbeatRequest(job="t" * (64 << 20), rank=0, incarnation=1)
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(huge, timeout=10, metadata=md)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    after = sorted(str(p) for p in cl.base.rglob("*") if "logs" not in p.parts)
    assert before == after


def test_a_forged_registration_cannot_lock_a_host_out(cluster_factory):
    """Incarnations are nonces: a report under a host's rank with another incarnation (forged, or a brief
    double start) supersedes it, and the real host takes a new incarnation and reports everything again."""
    from replicator.coordinator.client import CoordinatorClient

    cl = cluster_factory(nodes=2, data_parallelism=1)
    cl.start_all()
    mgr = manager(cl, 1, 2)
    save_steps(mgr, [1], replicated_over_slices=False)
    wait_for(lambda: redundant(cl, 1), what="step 1 redundant", timeout=60)
    client = CoordinatorClient(cl.coordinator, rpc_timeout_seconds=5)

    def host1():
        return next(h for h in client.status(hosts=True).hosts if h.rank == 1)

    real = host1().incarnation
    with grpc.insecure_channel(cl.coordinator) as ch:
        # 2**63 - 1: with clock-ordered incarnations this would have outranked every later restart.
        # Under the serving epoch (any answer tells it): a report of another epoch counts for nothing.
        forged = cpb.HeartbeatRequest(job="t", rank=1, incarnation=2**63 - 1, full_report=True,
                                      known_epoch=client.status().epoch)
        cpb_grpc.CoordinatorStub(ch).Heartbeat(forged, timeout=5)
    assert host1().incarnation == 2**63 - 1 and host1().pieces == 0
    wait_for(lambda: host1().incarnation not in (real, 2**63 - 1) and host1().pieces > 0,
             what="host 1 registered again with its inventory", timeout=30)
    wait_for(lambda: redundant(cl, 1), what="step 1 redundant again", timeout=30)
    client.close()
    mgr.close()


def test_bad_configuration_exits_with_one_line(tmp_path):
    import subprocess
    import sys

    from tests.kits.cluster import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args, msg in [
        (["--local-dir", str(tmp_path), "--rank", "4", "--nodes", "4"], "--rank 4 is outside"),
        (["--local-dir", str(tmp_path), "--rank", "0"], "--rank and --nodes go together"),
        (["--local-dir", str(tmp_path), "--rank", "1", "--nodes", "3", "--data-parallelism", "2"], "multiple"),
        (["--local-dir", str(tmp_path), "--rank", "0", "--nodes", "2", "--token-file", "/nonexistent"], "token"),
        (["--rank", "0", "--nodes", "2"], "--local-dir is required"),
        (["--local-dir", str(tmp_path), "--rank", "0", "--nodes", "2", "--listen", "nope"], "HOST:PORT"),
    ]:
        r = subprocess.run([sys.executable, "-m", "controller_client.cli", "replicator", *args],
                           capture_output=True, text=True, env=env, timeout=60, cwd=str(REPO))
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], (args, r.stderr)



def test_unusable_bucket_is_reported_at_start(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "controller_client.cli", "replicator", "--local-dir",
                        str(tmp_path / "ram"), "--rank", "0", "--nodes", "1", "--listen", "127.0.0.1:0",
                        "--backup-url", f"file://{not_a_dir}/bucket"],
                       capture_output=True, text=True, env=env, timeout=60, cwd=str(REPO))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtc replicator: cannot start:"), r.stderr


def test_mutual_tls_and_token_end_to_end(cluster_factory, tmp_path):
    from tests.kits.cluster import write_tls_files

    tls = write_tls_files(tmp_path)
    token = tmp_path / "token"
    token.write_text("t0ken")
    cl = cluster_factory(nodes=2, data_parallelism=1,
                         extra=["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"],
                                "--token-file", str(token)])
    cl.start_all()
    devs = jax.devices()
    opts = CheckpointManagerOptions(local_directory=cl.local_template, job_name="t",
                                    coordinator_address=cl.coordinator, token_file=str(token),
                                    tls_cert_file=tls["cert"], tls_key_file=tls["key"], tls_ca_file=tls["ca"],
                                    restore_wait_seconds=60, rpc_timeout_seconds=10)
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 1, 2))
    trees = save_steps(mgr, [1], replicated_over_slices=False)
    wait_for(lambda: mgr.latest_step() == 1, what="step 1 complete over TLS")
    # Replication under TLS goes over the encrypted gRPC stream (no plaintext data port).
    wait_for(lambda: (cl.ram(1) / "peer" / "0" / "1").is_dir() and (cl.ram(0) / "peer" / "1" / "1").is_dir(),
             what="ring copies over TLS", timeout=60)
    cl.procs[1].stop()
    cl.wipe(1)
    cl.start(1)
    assert_equal(trees[1], mgr.restore(None, target(trees[1])))
    mgr.close()
    # A plaintext client gets nowhere.
    with grpc.insecure_channel(cl.coordinator) as ch:
        with pytest.raises(grpc.RpcError):
            cpb_grpc.CoordinatorStub(ch).GetSteps(cpb.GetStepsRequest(), timeout=5)
