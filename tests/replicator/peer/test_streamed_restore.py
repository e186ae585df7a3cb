"""A host that lost its RAM disk reads its data while the peer copy lands (issue #21, item 2).

Real replicator processes on 127.0.0.1. Replication is throttled (``--max-bytes-per-second``) so that a
copy takes seconds: the restore reads a file's verified blocks while later files are still on the wire,
a bad block is rejected (never returned), a peer lost mid-stream falls back to the bucket, and the copy is
committed on the RAM disk for next time.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sidecar import checksums, commit, host, layout
from tests.kits.cluster import assert_equal, manager, target, wait_for

pytestmark = pytest.mark.slow

RATE = "8000000"  # bytes/s after the throttle's 8 MiB burst


def _state(rows: int) -> dict:
    """One float32 array replicated over the slices (data-parallel replicas), sharded over 'model'."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    w = np.random.default_rng(rows).standard_normal((rows, 4096), dtype=np.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh, P(None, "model")))}


def _save(cl, mgr, tree: dict, step: int = 1) -> None:
    assert mgr.save(step, tree)
    mgr.wait_until_finished()
    wait_for(lambda: mgr.latest_step() == step, what=f"step {step} complete", timeout=60)


def _replace_host(cl, rank: int) -> None:
    cl.procs[rank].stop()
    cl.wipe(rank)
    cl.start(rank)


def _column(tree: dict, c: int) -> np.ndarray:
    return np.asarray(tree["w"])[:, c * 1024 : (c + 1) * 1024]


def _index(tree: dict, c: int) -> tuple[tuple[int, int], ...]:
    return ((0, tree["w"].shape[0]), (c * 1024, (c + 1) * 1024))


def test_wiped_host_reads_its_data_while_it_lands_and_keeps_the_copy(cluster_factory):
    cl = cluster_factory(nodes=2, data_parallelism=2, extra=["--max-bytes-per-second", RATE])
    cl.start_all()
    mgr = manager(cl, 2, 1)
    tree = _state(2048)  # 32 MiB per host: 4 files of 8 MiB, 1 MiB blocks
    _save(cl, mgr, tree)
    _replace_host(cl, 1)

    src = host.open_step(mgr.config, 1, 1)
    try:
        assert len(src.landings) == 1, "the wiped host did not read its data as it lands"
        landing = src.landings[0]
        assert not landing.committed
        (path,) = src.arrays
        first = src.assemble(path, _index(tree, 0))
        # The first file is read (and verified) while the rest of the copy is still arriving.
        assert not landing.committed, "the read waited for the whole copy"
        np.testing.assert_array_equal(first, _column(tree, 0))
        for c in range(1, 4):
            np.testing.assert_array_equal(src.assemble(path, _index(tree, c)), _column(tree, c))
    finally:
        src.close()
    # The copy is committed on the RAM disk for next time, complete and verified, and nothing else is left.
    copy = cl.ram(1) / layout.PEER_DIR / "0"
    wait_for(lambda: 1 in commit.committed_steps(copy), what="the copy committed", timeout=60)
    checksums.verify_step_dir(copy / "1")
    assert not list(copy.glob(".tmp-*"))
    t0 = time.monotonic()
    assert_equal(tree, mgr.restore(1, target(tree)))  # from the committed copy now: no transfer
    assert time.monotonic() - t0 < 30
    mgr.close()


def test_a_bad_block_from_the_peer_is_rejected_while_landing(cluster_factory):
    cl = cluster_factory(nodes=2, data_parallelism=2, extra=["--max-bytes-per-second", RATE])
    cl.start_all()
    mgr = manager(cl, 2, 1)
    tree = _state(2048)
    _save(cl, mgr, tree)
    # Bit rot on the only other holder: one byte in the third block of its second file.
    src_dir = layout.steps_dir(cl.ram(0)) / "1"
    m = layout.read_manifest(src_dir)
    f = layout.resolve_under(src_dir, m.files[1].name)
    with open(f, "r+b") as fh:
        fh.seek(2 * layout.BLOCK_BYTES + 17)
        b = fh.read(1)
        fh.seek(2 * layout.BLOCK_BYTES + 17)
        fh.write(bytes([b[0] ^ 0xFF]))
    _replace_host(cl, 1)

    src = host.open_step(mgr.config, 1, 1)
    try:
        assert len(src.landings) == 1
        (path,) = src.arrays
        by_file = {s.file: s.index for a in m.arrays for s in a.shards}
        np.testing.assert_array_equal(src.assemble(path, by_file[m.files[0].name]), _column(tree, 0))
        with pytest.raises(OSError):  # ChecksumError / CorruptStepError: no other tier has good bytes
            src.assemble(path, by_file[m.files[1].name])
        assert any("landing, block 2" in why for why in src.bad.values()), src.bad
    finally:
        src.close()
    # The replicator rejects the copy as well: nothing is committed from the bad bytes.
    time.sleep(1.0)
    assert 1 not in commit.committed_steps(cl.ram(1) / layout.PEER_DIR / "0")
    assert 1 not in commit.committed_steps(layout.steps_dir(cl.ram(1)))
    mgr.close()


def test_a_peer_lost_mid_stream_falls_back_to_the_bucket(cluster_factory, tmp_path):
    bucket = tmp_path / "bucket"
    cl = cluster_factory(nodes=4, data_parallelism=2,
                         extra=["--max-bytes-per-second", RATE, "--backup-url", f"file://{bucket}",
                                "--backup-interval-steps", "100"])
    cl.start_all()
    mgr = manager(cl, 2, 2)
    tree = _state(4096)  # 32 MiB per host: 2 files of 16 MiB (rank 3's data is rank 1's)
    _save(cl, mgr, tree)
    from tests.kits.cluster import status
    wait_for(lambda: 1 in status(cl).backup.committed_steps, what="backup of step 1", timeout=120)
    _replace_host(cl, 3)

    src = host.open_step(mgr.config, 3, 1)
    try:
        assert len(src.landings) == 1
        landing = src.landings[0]
        (path,) = src.arrays
        np.testing.assert_array_equal(src.assemble(path, _index(tree, 2)), _column(tree, 2))
        assert not landing.committed
        cl.procs[1].kill()  # the only peer holding rank 3's data, mid-stream
        # The rest comes from the bucket (the replicator's ladder), verified, bit-exact.
        np.testing.assert_array_equal(src.assemble(path, _index(tree, 3)), _column(tree, 3))
        assert landing.failed
    finally:
        src.close()
    wait_for(lambda: 1 in commit.committed_steps(layout.steps_dir(cl.ram(3))), what="rank 3 refilled", timeout=60)
    checksums.verify_step_dir(layout.steps_dir(cl.ram(3)) / "1")
    mgr.close()
