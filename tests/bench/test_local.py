"""bench.local's plain-read baseline reads the saved steps' bytes, not the spare pool's (which a writer may
be filling while it reads)."""

from __future__ import annotations

from pathlib import Path

from bench import local
from sidecar import spares


def test_plain_read_reads_the_steps_and_not_the_spare_pool(tmp_path: Path) -> None:
    step = tmp_path / "0" / "steps" / "1"
    step.mkdir(parents=True)
    (step / "0.0.bin").write_bytes(b"x" * 1000)
    (step / "MANIFEST.json").write_bytes(b"{}")
    pool = spares.spare_dir(tmp_path / "0")
    pool.mkdir()
    (pool / f"{2 << 20}-abc").write_bytes(bytes(2 << 20))
    (pool / f"{spares.WARM_PREFIX}def").write_bytes(b"being filled")
    assert local.plain_read(tmp_path) == 1002


def test_plain_assembly_builds_each_target_shard_from_the_saved_ones() -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    tree = local.make_tree(2)
    other = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, x.sharding.spec))
                          if isinstance(x, jax.Array) else x, tree)
    built: list = []
    assert local.plain_assembly(tree, target, keep=built) == local.nbytes(tree)
    assert len(built) == 8 * (len(tree["layers"]) + len(tree["small"]))
    for x, idx, out in built:
        np.testing.assert_array_equal(out, np.asarray(x)[idx])
