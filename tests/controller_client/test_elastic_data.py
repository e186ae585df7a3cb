"""The elastic demo's grain pipeline: the same records per step on any number of slices, and an iterator
state that is checkpointed with the train state and restored onto fewer or more slices."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.demo.elastic_data import GLOBAL_BATCH, ElasticBatches, make_dataset
from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology

W_TRUE = np.random.default_rng(123).standard_normal((32, 16)).astype(np.float32)


def mesh_of(devices, shape) -> Mesh:
    return Mesh(np.array(devices).reshape(shape), ("data", "model"))


def rows(batch: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A global batch as {record id: (x row, y row)} (the order inside the batch depends on the shards)."""
    ids = np.asarray(batch["id"]).tolist()
    xs, ys = np.asarray(batch["x"]), np.asarray(batch["y"])
    assert len(set(ids)) == len(ids) == GLOBAL_BATCH
    return {i: (xs[k], ys[k]) for k, i in enumerate(ids)}


def assert_same_records(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for i in want:
        np.testing.assert_array_equal(got[i][0], want[i][0])
        np.testing.assert_array_equal(got[i][1], want[i][1])


def take(data: ElasticBatches, steps: int) -> list[dict]:
    return [rows(next(data)) for _ in range(steps)]


def reference(steps: int) -> list[dict]:
    """An uninterrupted run on both slices."""
    data = ElasticBatches(make_dataset(W_TRUE), mesh_of(jax.devices(), (2, 4)))
    try:
        return take(data, steps)
    finally:
        data.close()


def test_each_step_reads_the_same_records_on_any_slice_count():
    devs = jax.devices()
    ds = make_dataset(W_TRUE)
    ref = reference(4)
    # Step s reads the records at positions (s-1)*B .. s*B-1 of the shuffled dataset.
    for s, got in enumerate(ref):
        assert sorted(got) == sorted(int(ds[k]["id"]) for k in range(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH))
    for devices, shape in ((devs[:4], (1, 4)), (devs[4:], (1, 4)), (devs, (4, 2))):
        data = ElasticBatches(make_dataset(W_TRUE), mesh_of(devices, shape))
        try:
            for got, want in zip(take(data, 4), ref, strict=True):
                assert_same_records(got, want)
        finally:
            data.close()


def test_each_shard_lands_on_its_slice():
    devs = jax.devices()
    mesh = mesh_of(devs, (2, 4))
    data = ElasticBatches(make_dataset(W_TRUE), mesh)
    try:
        b = next(data)
    finally:
        data.close()
    assert b["x"].sharding == NamedSharding(mesh, P("data"))
    half = GLOBAL_BATCH // 2
    for shard in b["x"].addressable_shards:
        row = devs.index(shard.device) // 4  # the slice (mesh row) of the device
        assert shard.index[0] == slice(row * half, (row + 1) * half)


def test_state_does_not_depend_on_the_shard_count():
    devs = jax.devices()
    states = set()
    for devices, shape in ((devs[:4], (1, 4)), (devs, (2, 4)), (devs, (4, 2))):
        data = ElasticBatches(make_dataset(W_TRUE), mesh_of(devices, shape))
        fresh = data.get_state()
        take(data, 3)
        states.add(data.get_state())
        assert data.get_state() != fresh
        data.close()
    assert len(states) == 1, states


def test_bad_state_and_bad_batch_are_refused():
    devs = jax.devices()
    with pytest.raises(ValueError, match="not divisible by 4"):
        ElasticBatches(make_dataset(W_TRUE), mesh_of(devs, (4, 2)), global_batch=66)
    data = ElasticBatches(make_dataset(W_TRUE), mesh_of(devs, (2, 4)))
    with pytest.raises(ValueError, match="not a data iterator state"):
        data.set_state("[1, 2]")
    next(data._iterators[0])  # one shard advances alone
    with pytest.raises(RuntimeError, match="out of step"):
        data.get_state()
    data.close()


def test_iterator_state_restored_from_the_checkpoint_onto_fewer_then_more_slices(tmp_path):
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)  # the full allocation: ranks never change
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    both, one = (CheckpointManager(opts, devices=d, topology=topo) for d in (devs, devs[:4]))
    ref = reference(10)

    def tree(step: int, data: ElasticBatches, mesh: Mesh) -> dict:
        w = jax.device_put(np.full((8, 4), step, np.float32), NamedSharding(mesh, P("data", "model")))
        return {"w": w, "step": step, "data": data.get_state()}

    def target(mesh: Mesh, data: ElasticBatches) -> dict:
        return {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("data", "model"))),
                "step": 0, "data": data.get_state()}

    # Steps 1..5 on both slices; save step 5 with the iterator state.
    mesh2 = mesh_of(devs, (2, 4))
    data = ElasticBatches(make_dataset(W_TRUE), mesh2)
    for want in ref[:5]:
        assert_same_records(rows(next(data)), want)
    both.save(5, tree(5, data, mesh2), force=True)
    both.wait_until_finished()
    data.close()

    # Slice 1 is gone: a fresh pipeline on slice 0 continues at step 6 from the state read back.
    mesh1 = mesh_of(devs[:4], (1, 4))
    data = ElasticBatches(make_dataset(W_TRUE), mesh1)
    state = one.restore(None, target(mesh1, data))
    assert state["step"] == 5
    # Without the restored state the pipeline would start over at step 1's records.
    unrestored = ElasticBatches(make_dataset(W_TRUE), mesh1)
    assert sorted(rows(next(unrestored))) == sorted(ref[0])
    unrestored.close()
    assert sorted(ref[0]) != sorted(ref[5])
    data.set_state(state["data"])
    for want in ref[5:8]:  # steps 6, 7, 8 on one slice
        assert_same_records(rows(next(data)), want)
    one.save(8, tree(8, data, mesh1), force=True)
    one.wait_until_finished()
    data.close()

    # Slice 1 is back: both slices continue at step 9 from the state slice 0 saved.
    data = ElasticBatches(make_dataset(W_TRUE), mesh2)
    state = both.restore(None, target(mesh2, data))
    assert state["step"] == 8
    data.set_state(state["data"])
    for want in ref[8:10]:
        assert_same_records(rows(next(data)), want)
    data.close()
    both.close()
    one.close()
