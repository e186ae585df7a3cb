"""A multi-controller trainer starts together with its replicator sidecar (no startup probe between them): its
CheckpointManager waits for its hosts' replicators before its first decision that needs the other tiers."""

from __future__ import annotations

import threading
import time

import jax
import pytest

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import layout
from tests.kits.cluster import assert_equal, redundant, save_steps, target, wait_for
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)


def _manager(local_directory: str, coordinator: str, **kw) -> CheckpointManager:
    devs = jax.devices()
    opts = CheckpointManagerOptions(
        local_directory=local_directory,
        job_name="t",
        dispatcher="in_process",
        coordinator_address=coordinator,
        restore_wait_seconds=60,
        **kw,
    )
    return CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 1))


def test_a_restarted_trainer_waits_for_replicators_that_start_after_it(cluster_factory):  # noqa: F811
    """A JobSet restart: every replicator goes, host 1 is replaced (its RAM disk empty), and the new trainer
    starts 4 s before the replicators do, longer than its coordinator client tries (3 x rpc_timeout_seconds).
    Deciding without them it found step 1 on no tier (host 0 holds only rank 0's data) and answered "no
    checkpoint": a start from step 0. Now latest_step() waits for them and the restore is bit-exact."""
    cl = cluster_factory(nodes=2, data_parallelism=2)
    cl.start_all()
    mgr = _manager(cl.local_template, cl.coordinator, rpc_timeout_seconds=10)
    trees = save_steps(mgr, [1])
    wait_for(lambda: redundant(cl, 1), what="step 1 redundant", timeout=60)
    mgr.close()
    cl.stop_all()
    cl.wipe(1)
    back = threading.Timer(4.0, cl.start_all)
    mgr = _manager(cl.local_template, cl.coordinator, rpc_timeout_seconds=1)
    t0 = time.monotonic()
    back.start()
    try:
        step = mgr.latest_step()
    finally:
        back.join()
    assert step == 1
    assert time.monotonic() - t0 >= 4.0  # it did wait for the replicators
    assert_equal(trees[1], mgr.restore(None, target(trees[1])))
    mgr.close()


def test_no_replicator_fails_naming_its_control_socket(tmp_path):
    """Where no replicator ever serves, the first decision fails after replicator_wait_seconds, naming the
    socket it asked, instead of deciding from the RAM disk alone (old: "no checkpoint", a start from step 0)."""
    mgr = _manager(
        str(tmp_path / "{host}"), "127.0.0.1:1", replicator_wait_seconds=0.3, rpc_timeout_seconds=0.2
    )
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=str(layout.control_socket(tmp_path / "0"))):
        mgr.latest_step()
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(TimeoutError):  # a save asks the steps first: nothing is written without a replicator
        mgr.save(1, {"x": jax.numpy.zeros(8)})
    assert not (tmp_path / "0" / "steps").exists() or not list((tmp_path / "0" / "steps").iterdir())
