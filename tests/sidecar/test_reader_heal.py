"""Reading a step with bad copies (no replicator): a bad copy is dropped and the next one used."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import layout


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_bad_copy_dropped_and_replica_used(tmp_path, damage):
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}  # replicated over slices
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    step_dir = tmp_path / "0" / "steps" / "1"
    victim = step_dir / layout.read_manifest(step_dir).files[0].name
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[3] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:7])
    else:
        victim.unlink()
    target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tree["w"].sharding)}
    out = mgr.restore(1, target)
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert not step_dir.exists()  # the bad copy is no longer listed anywhere


def test_no_good_copy_left_is_a_checksum_error_not_eof(tmp_path):
    devs = jax.devices()[:4]
    mesh = Mesh(np.array(devs).reshape(1, 4), ("data", "model"))
    x = np.arange(256, dtype=np.float32).reshape(8, 32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 1, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    step_dir = tmp_path / "0" / "steps" / "1"
    victim = step_dir / layout.read_manifest(step_dir).files[0].name
    victim.write_bytes(victim.read_bytes()[:5])
    with pytest.raises(layout.ChecksumError, match="EOFError|short|expected"):
        mgr.restore(1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tree["w"].sharding)})
