"""Every RAM disk lost, the step in the bucket: one host per group of byte-identical data-parallel replicas
downloads it, the others copy it from that host (issue #48, ``restore_all_lost``): half the bucket reads with two
replicas, the data bit-exact."""

from __future__ import annotations

import pytest

from sidecar import checksums
from tests.kits.admin import mtc
from tests.kits.cluster import assert_equal, manager, save_steps, status, target, wait_for

pytestmark = pytest.mark.slow

STEP = 3


def _last_restore(cl, r: int) -> dict | None:
    local = mtc("status", "--local-dir", str(cl.ram(r)), "-o", "json")
    return local.json().get("last_restore") if local.code == 0 else None


def test_every_host_wiped_reads_each_replica_groups_content_once_from_the_bucket(cluster_factory) -> None:
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-steps", "1"]
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [STEP])  # replicated over slices: ranks 0 and 2 (1 and 3) hold identical data
    wait_for(lambda: STEP in status(cl).backup.committed_steps, what=f"backup of step {STEP}", timeout=60)
    mgr.close()
    hashes = {}
    for r in range(4):
        m = checksums.verify_step_dir(cl.ram(r) / "steps" / str(STEP))
        hashes[r] = m.content_hash
    assert hashes[0] == hashes[2] and hashes[1] == hashes[3] and hashes[0] != hashes[1]
    cl.stop_all()
    for r in range(4):
        cl.wipe(r)
    cl.start_all()
    r = mtc("restore", str(STEP), "--wait-seconds", "60", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0 and r.json()["ready"], r
    restores = {h: wait_for(lambda h=h: _last_restore(cl, h), what=f"host {h}'s restore") for h in range(4)}
    by_tier = {h: (x["tier"], x["owner_rank"], x["bytes"]) for h, x in restores.items()}
    bucket = [h for h, x in restores.items() if x["tier"] == "bucket"]
    # One bucket read per replica group (the smaller rank's host), the other host copied it from there.
    assert sorted(bucket) == [0, 1], by_tier
    assert by_tier[2][0] == "peer" and by_tier[3][0] == "peer", by_tier
    bucket_bytes = sum(x["bytes"] for x in restores.values() if x["tier"] == "bucket")
    total = sum(x["bytes"] for x in restores.values())
    assert 0 < bucket_bytes and 2 * bucket_bytes == total, by_tier
    for h in range(4):
        # Each host holds data of its rank's content (its own or its replica's directory), verified.
        dirs = [d for d in [cl.ram(h) / "steps" / str(STEP), *(cl.ram(h) / "peer").glob(f"*/{STEP}")]
                if (d / "MANIFEST.json").is_file()]
        assert any(checksums.verify_step_dir(d).content_hash == hashes[h] for d in dirs), (h, dirs)
    mgr = manager(cl, 2, 2)
    assert mgr.latest_step() == STEP
    assert_equal(trees[STEP], mgr.restore(None, target(trees[STEP])))
    mgr.close()
    # The job's restore read what the hosts hold: still one bucket read per replica group.
    assert sorted(h for h in range(4) if _last_restore(cl, h)["tier"] == "bucket") == [0, 1]
