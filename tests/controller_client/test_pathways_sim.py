"""The native path on a simulated Pathways job (tests/kits/pathways_sim.py): the controller here, one worker
process per host running the pickled colocated programs in its own device-id namespace, real replicators.

2 slices x 2 hosts x 2 devices; the product's defaults (``HostTopology.from_devices``, ``ColocatedDispatcher``)
are what runs, as on Pathways.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology, worker_key
from sidecar import layout
from tests.kits.cluster import wait_for
from tests.kits.pathways_sim import PathwaysSim
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with PathwaysSim(2, 2, log_dir=tmp_path_factory.mktemp("pathways")) as s:
        yield s


def opts_for(cl, **kw) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(local_directory=cl.local_template, job_name="t",
                                    coordinator_address=cl.coordinator, restore_wait_seconds=60,
                                    rpc_timeout_seconds=10, **kw)


def mgr_for(cl, devices=None, **kw) -> CheckpointManager:
    # No topology given: the manager's default (from the devices' Pathways attributes) is under test.
    return CheckpointManager(opts_for(cl, **kw), devices=devices if devices is not None else jax.devices())


def state(step: int, devices, shape=(2, 4)) -> dict:
    mesh = Mesh(np.array(devices).reshape(shape), ("data", "model"))
    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal((16, 64)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "v": jax.device_put(rng.standard_normal((8, 32)).astype(np.float32),
                                NamedSharding(mesh, P(None, "model"))),
            "rng": jax.device_put(jax.random.key(step), NamedSharding(mesh, P())),
            "host": np.arange(5, dtype=np.int64) * step,
            "step": step}


def target_on(tree: dict, devices, shape) -> dict:
    mesh = Mesh(np.array(devices).reshape(shape), ("data", "model"))
    specs = {"w": P("data", "model"), "v": P(None, "model"), "rng": P()}
    out = {k: jax.ShapeDtypeStruct(tree[k].shape, tree[k].dtype, sharding=NamedSharding(mesh, s))
           for k, s in specs.items()}
    return {**out, "host": np.zeros(5, np.int64), "step": tree["step"]}


def assert_equal(a: dict, b: dict) -> None:
    for k, x in a.items():
        y = b[k]
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray)):
            assert np.asarray(x).dtype == np.asarray(y).dtype, k
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=k)
        else:
            assert x == y, k


def pathways_device(id: int, slice_index: int | None, task: int | None = None, repr_text: str | None = None):
    d = SimpleNamespace(id=id, process_index=0, slice_index=slice_index, virtual_task_index=task)
    text = repr_text or f"Device(id={id})"
    return type("PwDevice", (SimpleNamespace,), {"__repr__": lambda self: text})(**vars(d))


# --------------------------------------------------------------------------- worker identity

def test_worker_key_follows_orbax_rule():
    """virtual_task_index first, then logical_task= / task_id / vtask= in the order Orbax 0.12.8 uses."""
    from orbax.checkpoint._src.multihost import pathways

    devs = [pathways_device(0, 1, 3), pathways_device(1, 0, None, "TpuDevice(id=1, logical_task=2)"),
            pathways_device(2, 1, None, "X(vtask=5)")]
    for d in devs:
        assert worker_key(d) == tuple(reversed(pathways._get_device_worker_key(d)))
    plain = SimpleNamespace(id=0, process_index=3)  # multi-controller: the process is the host
    assert worker_key(plain) == (0, 3)


def test_from_devices_finds_every_pathways_worker():
    """process_index is 0 on every Pathways device: the hosts are the (slice, task) pairs (today: 2 of 4)."""
    devs = [pathways_device(i, i // 4, (i // 2) % 2) for i in range(8)]
    topo = HostTopology.from_devices(devs)
    assert (topo.slices, topo.hosts_per_slice) == (2, 2)
    assert [topo.rank_of(d) for d in devs] == [0, 0, 1, 1, 2, 2, 3, 3]
    # Only slice 1 active (elastic): ranks stay places in the full allocation.
    assert HostTopology.from_devices(devs[4:], slices=2).ranks_of(devs[4:]) == [2, 3]


def test_sim_devices_carry_pathways_attributes(sim):
    devs = jax.devices()
    assert {d.process_index for d in devs} == {0}
    assert [(d.slice_index, d.virtual_task_index) for d in devs[::2]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "logical_task=1" in repr(devs[2])
    assert HostTopology.from_devices(devs).nodes == 4


def test_sim_colocated_cpu_devices_are_other_devices_of_the_same_host(sim):
    """One colocated CPU device per device, order kept, for any subset and for meshes: another device of the
    same host (so that the accelerator -> CPU transfer of a save, and back after a restore, happens), never
    JAX's CPU fallback (process 0's first CPU devices: slice 1's devices would map to slice 0's)."""
    from jax.experimental import colocated_python

    devs = jax.devices()
    assert list(colocated_python.colocated_cpu_devices(tuple(devs[4:]))) == [devs[5], devs[4], devs[7], devs[6]]
    cpu = list(colocated_python.colocated_cpu_devices(tuple(devs[::2])))
    assert cpu == devs[1::2]
    assert [sim.host_of_id[c.id].host for c in cpu] == [sim.host_of_id[d.id].host for d in devs[::2]]
    mesh = jax.sharding.Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    cpu_mesh = colocated_python.colocated_cpu_devices(mesh)
    assert cpu_mesh.axis_names == ("a", "b") and [d.id for d in cpu_mesh.devices.flat] == [1, 0, 3, 2, 5, 4, 7, 6]


# --------------------------------------------------------------------------- the native path

def test_native_path_on_simulated_pathways(sim, cluster_factory):  # noqa: F811
    """save, latest_step, restore onto the same and another mesh, from one slice, preemption and backup_now."""
    cl = cluster_factory(nodes=4, data_parallelism=2)
    bucket = cl.base / "bucket"
    cl.extra = ["--backup-url", f"file://{bucket}", "--backup-interval-minutes", "30",
                "--preemption-grace-seconds", "20"]
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    assert mgr.topology.nodes == 4 and mgr.active_ranks == [0, 1, 2, 3]
    trees = {}
    for step in (1, 2):
        trees[step] = state(step, devs)
        assert mgr.save(step, trees[step])
        mgr.wait_until_finished()
    # Every host wrote its own shards (in its worker process), and the coordinator counts the step complete.
    for r in range(4):
        assert (layout.steps_dir(cl.ram(r)) / "2" / layout.MANIFEST_NAME).is_file(), r
    assert mgr.all_steps() == [1, 2]
    assert mgr.latest_step() == 2
    assert_equal(trees[2], mgr.restore(None, target_on(trees[2], devs, (2, 4))))
    assert_equal(trees[1], mgr.restore(1, target_on(trees[1], devs, (4, 2))))  # another mesh
    assert not mgr.reached_preemption(2)
    mgr.backup_now()
    wait_for(lambda: any(bucket.rglob("*")), what="a backup in the bucket", timeout=30)
    mgr.close()
    # Only slice 1 active: a manager on its devices restores onto a 1 x 4 mesh (slice 0's shards from peers).
    one = mgr_for(cl, devices=devs[4:])
    assert one.active_ranks == [2, 3]
    assert_equal(trees[2], one.restore(2, target_on(trees[2], devs[4:], (1, 4))))
    one.close()
    cl.procs[3].proc.send_signal(signal.SIGTERM)
    mgr = mgr_for(cl)
    wait_for(lambda: mgr.reached_preemption(2), what="preemption noticed", timeout=90)
    mgr.close()
    # The host functions ran in the worker processes, on the hosts of the programs' devices.
    assert {hosts for _, hosts in sim.calls} >= {(0, 1, 2, 3), (2, 3)}


def test_a_colocated_save_returns_before_the_hosts_copy_and_the_next_call_waits(sim, cluster_factory):  # noqa: F811
    """The save blocks only while its leaves go to the CPU devices: with every worker held busy (the
    simulation's call lock taken here), ``save`` still returns; the hosts' copies then run in the background,
    the train step may donate the saved arrays meanwhile, and ``wait_until_finished`` waits for them."""
    import threading

    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    mgr.save(1, state(1, devs))  # the first save asks the hosts for their steps (a query, not in the background)
    mgr.wait_until_finished()
    tree = state(2, devs)
    expected = {k: np.asarray(jax.random.key_data(v) if k == "rng" else v) for k, v in tree.items()
                if isinstance(v, jax.Array)}
    returned = threading.Event()
    with sim._lock:  # no colocated program can run until it is released
        t = threading.Thread(target=lambda: (mgr.save(2, tree), returned.set()), daemon=True)
        t.start()
        assert returned.wait(30), "save waited for the hosts"
        # A program that ends here without close() still gets the save: the interpreter joins the thread.
        assert not mgr.dispatcher._pending._thread.daemon
        donate = jax.jit(lambda x: x * 2, donate_argnums=0)
        tree["w"] = donate(tree["w"])  # the training step reuses the saved array's buffers
    mgr.wait_until_finished()
    restored = mgr.restore(2, target_on(tree, devs, (2, 4)))
    for k, v in expected.items():
        got = restored[k]
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got) if k == "rng" else got), v, err_msg=k)
    mgr.close()


def test_for_devices_carries_the_saved_steps_so_the_first_save_on_the_new_devices_asks_nothing(sim, cluster_factory):  # noqa: F811
    """An in-place scale-up: a manager over slice 1 saved step 1; ``for_devices(every device)`` waits for it
    and returns a manager whose first save (step 2, on the new mesh) is the save alone: no ``STEPS`` fan-out
    and no coordinator call (a fresh manager asks both, and the coordinator may be busy taking a returned
    slice's hosts in). Both steps restore onto both slices."""
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    one = CheckpointManager(opts_for(cl), devices=devs[4:], topology=HostTopology.from_devices(devs))
    trees = {1: state(1, devs[4:], (1, 4))}
    assert one.save(1, trees[1])
    both = one.for_devices(devs)
    assert both.active_ranks == [0, 1, 2, 3]
    asked: list[str] = []
    real_steps = both._coordinator.steps
    both._coordinator.steps = lambda *a, **k: asked.append("GetSteps") or real_steps(*a, **k)
    before = len(sim.calls)
    trees[2] = state(2, devs)
    assert both.save(2, trees[2])
    both.dispatcher.finish_save()
    assert [name for name, _ in sim.calls[before:]] == ["_coloc_save"] and not asked
    both.wait_until_finished()
    for step, tree in trees.items():
        assert_equal(tree, both.restore(step, target_on(tree, devs, (2, 4))))
    fresh = mgr_for(cl)
    before = len(sim.calls)
    assert fresh.save(3, state(3, devs))
    assert any(name == "_coloc_query" for name, _ in sim.calls[before:])  # a fresh manager asks first
    fresh.close()
    both.close()
