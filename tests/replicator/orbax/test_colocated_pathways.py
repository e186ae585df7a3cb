"""Unchanged Orbax 0.12.8 in colocated mode (``use_colocated_python=True``) on the simulated Pathways job:
this process is the single controller, 2 slices x 2 hosts are separate worker processes (their own device
ids, only their own shards), and every host has a real `mtc replicator` daemon in Orbax mode.

The seed's elastic loop: ``initialize_multi_tier_checkpointing(..., devices=<active devices>)`` at start and
whenever the active slice count changes, a new ``ReplicatorCheckpointManager`` on the active mesh.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sidecar import layout
from tests.kits.orbax_colocated import HOST_CWD_ENV, LOCAL_NAME, ColocatedCluster, worker_setup  # noqa: F401
from tests.kits.orbax_replicator import wait_for
from tests.kits.orbax_replicator_worker import expected_state
from tests.kits.pathways_sim import PathwaysSim

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

JOB = "colo"


@pytest.fixture
def base() -> Iterator[tuple[Path, list[ColocatedCluster]]]:
    d = Path(tempfile.mkdtemp(prefix="mtc-orbax-coloc-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    clusters: list[ColocatedCluster] = []
    yield d, clusters
    for c in clusters:
        c.stop_all(signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pathways_orbax(monkeypatch):
    """Orbax's colocated manager refuses plain CPU JAX: only its Pathways check is patched, on the controller."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import replicator_checkpoint_manager

    monkeypatch.setattr(multihost, "is_pathways_backend", lambda: True)
    monkeypatch.setattr(replicator_checkpoint_manager.multihost, "is_pathways_backend", lambda: True)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["pytest"])


def _init(devices, slices: int) -> None:
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization

    initialization.initialize_multi_tier_checkpointing(
        LOCAL_NAME, run_name=JOB, num_slices=slices, backup_interval_minutes=30,
        jax_initialization_timeout_seconds=90, use_colocated_python=True, devices=devices)


def _manager(mesh: Mesh):
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import replicator_checkpoint_manager as rcm

    return rcm.ReplicatorCheckpointManager(
        LOCAL_NAME, rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=1, use_colocated_python=True),
        global_mesh=mesh)


def _mesh(devices, slices: int) -> Mesh:
    return Mesh(np.array(devices).reshape(slices, -1), ("data", "model"))


def _state(step: int, mesh: Mesh) -> dict[str, jax.Array]:
    sharding = NamedSharding(mesh, PartitionSpec("model"))
    rows = 2 * mesh.devices.shape[1]
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in expected_state(step, rows).items()}


def _save(mgr, steps, mesh: Mesh) -> None:
    import orbax.checkpoint as ocp

    for step in steps:
        assert mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(step, mesh))))
        mgr.wait_until_finished()


def _restore_bit_exact(mgr, step: int, mesh: Mesh) -> None:
    import orbax.checkpoint as ocp

    sharding = NamedSharding(mesh, PartitionSpec("model"))
    want = expected_state(step, 2 * mesh.devices.shape[1])
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in want.items()}
    got = mgr.restore(None, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))["state"]
    for k, v in want.items():
        assert got[k].sharding == sharding, k
        assert np.asarray(got[k]).dtype == v.dtype and np.asarray(got[k]).tobytes() == v.tobytes(), k


def _ingested(cl: ColocatedCluster, hosts, step: int) -> None:
    wait_for(lambda: all((cl.local(h) / "steps" / str(step) / layout.MANIFEST_NAME).is_file() for h in hosts),
             what=f"step {step} ingested on hosts {hosts}")


def test_colocated_orbax_on_four_simulated_workers(base, pathways_orbax) -> None:
    root, clusters = base
    cl = ColocatedCluster(root / "c", 4)
    clusters.append(cl)
    cl.start_all()
    with PathwaysSim(2, 2, log_dir=root / "c" / "logs", worker_setup="tests.kits.orbax_colocated:worker_setup",
                     worker_env={HOST_CWD_ENV: cl.host_cwd_template}) as sim:
        devs = jax.devices()
        mesh = _mesh(devs, 2)
        _init(devs, 2)
        mgr = _manager(mesh)
        assert mgr.latest_step() is None
        _save(mgr, [1, 2], mesh)
        _ingested(cl, range(4), 2)
        # A restart of the job (same devices): every host's daemon answers the new handshake with step 2.
        _init(devs, 2)
        mgr = _manager(mesh)
        assert mgr.latest_step() == 2
        _restore_bit_exact(mgr, 2, mesh)
        assert {hosts for _, hosts in sim.calls} >= {(0, 1, 2, 3)}
