"""`mtc` admin commands as subprocesses against real replicators on loopback with a file:// bucket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from controller_client.demo.cluster import REPO, LocalCluster
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from sidecar import layout
from tests.kits.admin import mtc
from tests.kits.cluster import assert_equal, manager, redundant, save_steps, target, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job():
    """4 hosts in 2 slices, steps 1-3 saved; a long backup interval: only the first step is backed up."""
    base = Path(tempfile.mkdtemp(prefix="mtc-admin-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    bucket = base / "bucket"
    cl = LocalCluster(base / "c", 4, 2, extra=["--backup-url", f"file://{bucket}",
                                               "--backup-interval-minutes", "600"])
    try:
        cl.start_all()
        mgr = manager(cl, 2, 2)
        trees = save_steps(mgr, [1, 2])
        backups = BackupStore(open_store(f"file://{bucket}"), "t")
        # The first complete step is backed up at once; the next one is due only in 600 minutes.
        wait_for(lambda: backups.committed_steps(), what="a first backup", timeout=60)
        trees.update(save_steps(mgr, [3]))
        wait_for(lambda: redundant(cl, 3), what="step 3 redundant", timeout=60)
        yield cl, mgr, trees, f"file://{bucket}"
        mgr.close()
    finally:
        cl.stop_all(signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def test_steps_and_status_table_and_json(job) -> None:
    cl, _, _, url = job
    r = mtc("steps", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    doc = r.json()
    assert doc["newest_complete_step"] == 3 and doc["nodes"] == 4 and doc["degraded"] is False
    s3 = next(s for s in doc["steps"] if s["step"] == 3)
    assert s3["complete"] and s3["redundant"] and s3["local_ranks"] == [0, 1, 2, 3] and s3["missing_ranks"] == []
    assert s3["bytes"] > 0 and s3["first_seen_unix"] > 0 and s3["complete_unix"] >= s3["first_seen_unix"] - 1
    r = mtc("steps", "--coordinator", cl.coordinator)
    assert r.code == 0 and "redundant" in r.out and "0-3" in r.out, r
    r = mtc("status", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    st = r.json()
    assert st["newest_complete_step"] == 3 and st["newest_redundant"] and st["lost_ranks"] == []
    assert st["backup"]["url"] == url and st["backup"]["interval_seconds"] == 600 * 60
    assert [s["redundant"] for s in st["steps"] if s["step"] == 3] == [True]
    r = mtc("status", "--coordinator", cl.coordinator)
    assert r.code == 0 and "newest complete step" in r.out and "health" in r.out and "ok" in r.out, r
    r = mtc("status", "--hosts", "--ranks", "1-2", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    hosts = r.json()["hosts"]
    assert [h["rank"] for h in hosts] == [1, 2] and all(h["address"] and not h["lost"] for h in hosts)
    assert all(3 in h["steps"] and h["bytes"] > 0 and h["seconds_since_report"] < 10 for h in hosts)
    r = mtc("status", "--hosts", "--coordinator", cl.coordinator)
    assert r.code == 0 and "last report" in r.out, r
    assert mtc("status", "--hosts", "--ranks", "x-", "--coordinator", cl.coordinator).code == 2
    r = mtc("status", "--local-dir", str(cl.ram(2)))
    assert r.code == 0 and "replicator rank 2" in r.out, r


def test_commands_fail_over_to_the_next_coordinator_candidate(job) -> None:
    """A dead first candidate (refused connection) is skipped, as hosts and the CheckpointManager do."""
    import socket

    cl, _, _, _ = job
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    r = mtc("steps", "-o", "json", "--coordinator", f"{dead},{cl.coordinator}")
    assert r.code == 0 and r.json()["newest_complete_step"] == 3, r
    r = mtc("steps", "-o", "json", "--coordinator", dead)
    assert r.code == 1, r


def test_inspect_from_the_cluster(job) -> None:
    cl, _, trees, _ = job
    r = mtc("inspect", "3", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    doc = r.json()
    leaves = {x["path"]: x for x in doc["leaves"]}
    assert leaves["['w']"]["shape"] == [8, 64] and leaves["['w']"]["dtype"] == "float32"
    assert leaves["['w']"]["sharding"] == "1x4 shards" and leaves["['w']"]["bytes"] == 8 * 64 * 4
    assert leaves["['b']"]["dtype"] == "bfloat16" and leaves["['rng']"]["key_impl"]
    assert leaves["['step']"]["value"] == 3
    assert [x["rank"] for x in doc["ranks"]] == [0, 1, 2, 3]
    assert all(f["crc32c"] for x in doc["ranks"] for f in x["file_checksums"])
    r = mtc("inspect", "3", "--files", "--coordinator", cl.coordinator)
    assert r.code == 0 and "['w']" in r.out and "(8, 64)" in r.out and "crc32c" in r.out, r
    r = mtc("inspect", "99", "--coordinator", cl.coordinator)
    assert r.code == 1 and "NOT_FOUND" in r.err, r


def test_pin_unpin_and_gc_dry_run(job) -> None:
    cl, _, _, _ = job
    r = mtc("pin", "2", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0 and 2 in r.json()["pinned_steps"], r
    r = mtc("gc", "--dry-run", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    gc = r.json()
    assert 2 in gc["protected_steps"] and 3 in gc["protected_steps"]
    assert all(x["step"] != 2 and x["reason"] for x in gc["would_delete"])
    r = mtc("steps", "-o", "json", "--coordinator", cl.coordinator)
    assert next(s for s in r.json()["steps"] if s["step"] == 2)["pinned"]
    r = mtc("unpin", "2", "--coordinator", cl.coordinator)
    assert r.code == 0 and "unpinned step 2" in r.out, r
    r = mtc("gc", "--dry-run", "--coordinator", cl.coordinator)
    assert r.code == 0 and "protected steps" in r.out, r
    assert mtc("gc", "--coordinator", cl.coordinator).code == 2
    assert mtc("pin", "77", "--coordinator", cl.coordinator).code == 1


def test_backup_now_commits_the_newest_step(job) -> None:
    cl, _, _, url = job
    r = mtc("backups", "list", "-o", "json", "--backup-url", url)
    assert r.code == 0 and 3 not in [b["step"] for b in r.json()["backups"]], r
    r = mtc("backup", "now", "-o", "json", "--wait-seconds", "120", "--coordinator", cl.coordinator)
    assert r.code == 0 and r.json() == {"step": 3, "state": "backed-up"}, r
    r = mtc("backup", "now", "--coordinator", cl.coordinator)
    assert r.code == 0 and "already-backed-up" in r.out, r
    r = mtc("steps", "-o", "json", "--coordinator", cl.coordinator)
    s3 = next(s for s in r.json()["steps"] if s["step"] == 3)
    assert s3["backed_up"] and s3["bucket_ranks"] == [0, 1, 2, 3] and s3["backup_unix"] > 0
    r = mtc("backup", "now", "2", "--coordinator", cl.coordinator)
    assert r.code == 1 and "newest complete step" in r.err, r


def test_verify_catches_a_flipped_byte_and_the_copy_is_healed(job) -> None:
    cl, _, _, _ = job
    r = mtc("verify", "3", "--tier", "local", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0 and r.json()["ok"] and len(r.json()["copies"]) == 4, r
    step_dir = cl.ram(1) / "steps" / "3"
    victim = next(p for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != layout.MANIFEST_NAME)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    name = str(victim.relative_to(step_dir))
    r = mtc("verify", "3", "--tier", "local", "--coordinator", cl.coordinator)
    assert r.code == 1, r
    assert f"bad file {name} (rank 1 on host 1, local tier)" in r.err and "BAD" in r.out, r
    # The coordinator stopped using the copy: host 1 deleted it and refetched rank 1's data (from its
    # byte-identical replica), so every copy of step 3 verifies again.
    wait_for(lambda: not (cl.ram(1) / "steps" / "3").exists(), what="bad copy deleted", timeout=30)
    wait_for(lambda: mtc("verify", "3", "--coordinator", cl.coordinator).code == 0, what="healed", timeout=60,
             interval=1.0)
    r = mtc("steps", "-o", "json", "--coordinator", cl.coordinator)
    assert next(s for s in r.json()["steps"] if s["step"] == 3)["complete"]


def test_restore_pins_an_older_step_for_the_next_restore(job) -> None:
    cl, mgr, trees, _ = job
    r = mtc("restore", "2", "-o", "json", "--wait-seconds", "60", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    doc = r.json()
    assert doc["step"] == 2 and doc["ready"] and doc["ready_ranks"] == [0, 1, 2, 3]
    r = mtc("steps", "-o", "json", "--coordinator", cl.coordinator)
    assert next(s for s in r.json()["steps"] if s["step"] == 2)["restore_target"]
    assert_equal(trees[2], mgr.restore(None, target(trees[2])))
    r = mtc("restore", "2", "--wait-seconds", "30", "--coordinator", cl.coordinator)
    assert r.code == 0 and "every host holds step 2" in r.out, r
    assert mtc("unpin", "2", "--coordinator", cl.coordinator).code == 0
    r = mtc("status", "-o", "json", "--coordinator", cl.coordinator)
    assert r.json()["restore_target"] == 3, r


def test_plan_from_a_saved_step_and_from_flags(job) -> None:
    cl, _, _, _ = job
    r = mtc("plan", "--step", "3", "--slices", "2", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0, r
    p = r.json()
    r = mtc("plan", "--slices", "2", "-o", "json", "--coordinator", cl.coordinator)  # the newest complete step
    assert r.code == 0 and r.json() == p, r
    # Both slices hold byte-identical data: the replica is the copy, no byte copies are kept.
    assert p["byte_copies_per_rank"] == 0 and p["ram_disk_bytes_per_host"] >= 3 * p["own_bytes_per_step"]
    # ec:2+1 over the same step: one code group of the 4 hosts, slice-inner; each holds one parity shard of
    # half the longest stream (MANIFEST.json + files), so a little more than half its own bytes.
    r = mtc("plan", "--step", "3", "--slices", "2", "--redundancy", "ec:2+1", "-o", "json", "--coordinator",
            cl.coordinator)
    assert r.code == 0, r
    e = r.json()
    assert e["mode"] == "ec" and e["code_groups"]["groups"][0]["members"] == [0, 2, 1, 3]
    own, parity = e["own_bytes_per_step"], e["parity_bytes_per_host"]
    assert own == p["own_bytes_per_step"] and own / 2 < parity < own / 2 + 64 * 1024
    assert e["ram_disk_bytes_per_host"] == -(-3 * (own + parity) * 11 // 10)
    r = mtc("plan", "--state-bytes", "8e9", "--hosts", "4", "--slices", "1", "--replicas", "1", "--keep", "2",
            "-o", "json")
    assert r.code == 0, r
    p = r.json()
    assert p["own_bytes_per_step"] == 2 * 10**9 and p["byte_copies_per_rank"] == 1
    assert p["ram_disk_bytes_per_host"] == int(3 * 2 * 2e9 * 1.1) and "rule" in p
    r = mtc("plan", "--state-bytes", "8e9", "--hosts", "4", "--slices", "1")
    assert r.code == 0 and "RAM disk per host" in r.out and "rule" in r.out, r
    assert mtc("plan").code == 2


def test_degraded_and_error_exit_codes(tmp_path) -> None:
    cl = LocalCluster(tmp_path / "c", 2, 1)
    try:
        cl.start_all()
        wait_for(lambda: mtc("status", "-o", "json", "--coordinator", cl.coordinator).json()["hosts_registered"]
                 == 2, what="both hosts registered", timeout=30, interval=0.5)
        r = mtc("status", "-o", "json", "--coordinator", cl.coordinator)
        assert r.code == 3 and r.json()["degraded"] and "no globally complete step" in r.json()["problems"], r
        r = mtc("steps", "--coordinator", cl.coordinator)
        assert r.code == 3 and "DEGRADED" in r.out, r
        cl.procs[1].stop()
        wait_for(lambda: mtc("status", "-o", "json", "--coordinator", cl.coordinator).json()["lost_ranks"] == [1],
                 what="rank 1 lost", timeout=30, interval=1.0)
        r = mtc("status", "--coordinator", cl.coordinator)
        assert r.code == 3 and "hosts lost" in r.out, r
        # The exec probe of TLS deployments: 0 while the host's replicator answers, 1 once it is gone.
        assert mtc("status", "--local-dir", str(cl.ram(0)), "--timeout-seconds", "3").code == 0
        r = mtc("status", "--local-dir", str(cl.ram(1)), "--timeout-seconds", "3")
        assert r.code == 1 and "no replicator answers" in r.err, r
        r = mtc("backup", "now", "--coordinator", cl.coordinator)
        assert r.code == 1 and "no backup tier" in r.err, r
    finally:
        cl.stop_all(signal.SIGKILL)
    assert mtc("steps").code == 2  # no coordinator given
    r = mtc("steps", "--coordinator", cl.coordinator, "--timeout-seconds", "2")
    assert r.code == 1 and ("UNAVAILABLE" in r.err or "DEADLINE" in r.err), r


def test_admin_service_needs_the_token(tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cl = LocalCluster(tmp_path / "c", 2, 1, extra=["--token-file", str(token)])
    try:
        cl.start_all()
        r = mtc("steps", "--coordinator", cl.coordinator)
        assert r.code == 1 and "UNAUTHENTICATED" in r.err, r
        r = mtc("steps", "-o", "json", "--coordinator", cl.coordinator, "--token-file", str(token))
        assert r.code in (0, 3) and r.json()["nodes"] == 2, r
        r = mtc("pin", "1", "--coordinator", cl.coordinator)
        assert r.code == 1 and "UNAUTHENTICATED" in r.err, r
    finally:
        cl.stop_all(signal.SIGKILL)


def test_restore_waits_for_a_restarted_coordinator_to_rebuild_its_view(tmp_path) -> None:
    """Right after a restart the coordinator answers UNAVAILABLE ("rebuilding its view") until every host
    reported: `mtc restore --wait-seconds` waits that out instead of failing at once."""
    cl = LocalCluster(tmp_path / "c", 2, 1)
    try:
        cl.start_all()
        mgr = manager(cl, 1, 2)
        save_steps(mgr, [1])
        wait_for(lambda: redundant(cl, 1), what="step 1 redundant", timeout=60)
        mgr.close()
        cl.stop_all()
        cl.start(0)  # the coordinator's host is back; rank 1 is not yet: the view is not whole
        r = mtc("steps", "--coordinator", cl.coordinator, "--timeout-seconds", "2")
        assert r.code == 1 and "UNAVAILABLE" in r.err, r  # what a command without a wait gets now
        proc = subprocess.Popen([sys.executable, "-m", "controller_client.cli", "restore", "1", "-o", "json",
                                 "--wait-seconds", "60", "--coordinator", cl.coordinator],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        try:
            time.sleep(3.0)  # the command is waiting, not failed
            assert proc.poll() is None, proc.communicate()
            cl.start(1)
            out, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        assert proc.returncode == 0, (out, err)
        doc = json.loads(out)
        assert doc["step"] == 1 and doc["ready"] and doc["ready_ranks"] == [0, 1], doc
    finally:
        cl.stop_all(signal.SIGKILL)
