"""The backup tier in the running daemons: scheduling, retention, skips, restore after losing every RAM disk."""

from __future__ import annotations

import pytest

from sidecar import checksums, layout
from tests.kits.cluster import assert_equal, manager, save_steps, status, target, wait_for

pytestmark = pytest.mark.slow



def backups(cluster) -> list[int]:
    try:
        return list(status(cluster).backup.committed_steps)
    except Exception:
        return []


def _lose_everything_and_restore(cl, trees, step, slices=2, hosts=2):
    cl.stop_all()
    for r in range(cl.nodes):
        cl.wipe(r)
    cl.start_all()
    mgr = manager(cl, slices, hosts)
    assert mgr.latest_step() == step
    assert_equal(trees[step], mgr.restore(None, target(trees[step])))
    def held(r: int) -> list:
        return [d for d in [cl.ram(r) / "steps" / str(step), *(cl.ram(r) / "peer").glob(f"*/{step}")]
                if (d / layout.MANIFEST_NAME).is_file()]

    for r in range(cl.nodes):
        # Every host holds its rank's data again (downloaded from the bucket, or copied from a host that
        # already had, a faster tier), verified, in a committed directory. The restore may have read it
        # while it landed: its replicator commits it moments later.
        for d in wait_for(lambda r=r: held(r), what=f"host {r} holds step {step} again", timeout=60):
            checksums.verify_step_dir(d)
    mgr.close()


def test_local_folder_backup_retention_and_restore_after_losing_all_ram(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=2)
    bucket = cl.base / "bucket"
    cl.extra = ["--backup-url", f"file://{bucket}", "--backup-interval-steps", "2", "--backup-keep", "2"]
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = {}
    for s in (2, 4, 6):
        trees.update(save_steps(mgr, [s]))
        wait_for(lambda s=s: s in backups(cl), what=f"backup of step {s}", timeout=60)
    assert backups(cl) == [4, 6]  # --backup-keep 2
    st = status(cl).backup
    assert st.failures == 0 and st.in_progress_step == -1
    # Data-parallel replicas share content: each distinct piece is stored once.
    data_dirs = list((bucket / "t" / "steps" / "6" / "data").iterdir())
    assert len(data_dirs) == 2, data_dirs
    mgr.close()
    _lose_everything_and_restore(cl, trees, 6)


def test_operator_forces_an_older_backup(cluster_factory):
    cl = cluster_factory(nodes=2, data_parallelism=1)
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-steps", "1"]
    cl.start_all()
    mgr = manager(cl, 1, 2)
    trees = {}
    for s in (1, 2):
        trees.update(save_steps(mgr, [s], replicated_over_slices=False))
        wait_for(lambda s=s: s in backups(cl), what=f"backup of step {s}", timeout=60)
    mgr.close()
    cl.stop_all()
    cl.extra += ["--restore-from-backup", "1"]
    cl.start_all()
    mgr = manager(cl, 1, 2)
    assert_equal(trees[1], mgr.restore(None, target(trees[1])))
    mgr.close()


def test_slow_backup_makes_the_next_one_a_recorded_skip(cluster_factory):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cl = cluster_factory(nodes=2, data_parallelism=1)
    # 16 MiB per host uploaded at 4 MB/s (after an 8 MiB burst): a backup takes a few seconds.
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-steps", "1",
                "--max-bytes-per-second", "4000000"]
    cl.start_all()
    mgr = manager(cl, 1, 2)
    s = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    for step in (1, 2, 3):
        mgr.save(step, {"w": jax.device_put(np.full((2048, 4096), step, np.float32), s)})
        mgr.wait_until_finished()
        wait_for(lambda step=step: mgr.latest_step() == step, what=f"step {step} complete")
    st = wait_for(lambda: status(cl).backup if status(cl).backup.skipped else None,
                  what="a recorded skip", timeout=60)
    assert st.skipped >= 1
    # The skipped work is not lost: once the slow backup ends, the newest step is backed up.
    wait_for(lambda: 3 in backups(cl), what="backup of step 3", timeout=120)
    mgr.close()


def test_gcs_backup_through_the_emulator(cluster_factory, tmp_path):
    from tests.kits.storage import BUCKET, Emulator

    emu = Emulator("fake-gcs", tmp_path)
    try:
        cl = cluster_factory(nodes=4, data_parallelism=2)
        cl.env = {"STORAGE_EMULATOR_HOST": emu.url}
        cl.extra = ["--backup-url", f"gs://{BUCKET}/mtc", "--backup-interval-steps", "1"]
        cl.start_all()
        mgr = manager(cl, 2, 2)
        trees = save_steps(mgr, [1])
        wait_for(lambda: 1 in backups(cl), what="backup of step 1 to the emulator", timeout=90)
        names = [b.name for b in emu.client().list_blobs(BUCKET, prefix="mtc/t/")]
        assert any(n.startswith("mtc/t/commits/1") for n in names), names
        mgr.close()
        _lose_everything_and_restore(cl, {1: trees[1]}, 1)
    finally:
        emu.stop()

