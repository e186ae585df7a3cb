"""The elastic loop on the simulated Pathways (tests/kits/pathways_sim.py): the controller here, one worker
process per host running the pickled colocated programs in its own device-id namespace, real replicators,
real pathwaysutils (its slice grouping by ``slice_index``; only the health check is simulated) and, for the
guide's loop, Orbax's real ``Snapshotter``.

2 slices x 2 hosts x 2 devices. A lost slice is lost on the simulation too: every colocated call that spans
one of its hosts raises the ``DATA_LOSS`` error a slice-down raises (``PathwaysSim.lose_hosts``).
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np
import pytest

from controller_client.demo.elastic import Schedule, SimulatedSlices, train_elastic, train_plain
from controller_client.demo.elastic_snapshot import wait_redundant
from tests.controller_client.test_elastic_snapshot import assert_guide_loop_story
from tests.controller_client.test_pathways_sim import mgr_for, sim  # noqa: F401  (fixture)
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


class PathwaysSlices(SimulatedSlices):
    """A slice is lost as on Pathways: pathwaysutils' health check counts it down, every colocated call
    spanning its hosts raises ``DATA_LOSS``, and its replicators die with their RAM disks. It comes back
    empty (new replicators on empty RAM disks), unless the loop replaced it already."""

    def __init__(self, sim, cluster):  # noqa: F811
        super().__init__(jax.devices())
        self.sim, self.cluster = sim, cluster

    def _ranks(self, index: int) -> list[int]:
        return self.sim.hosts_of_slice(index)  # rank = host: both are slice-major places in the allocation

    def fail(self, index: int) -> None:
        # The newest step has its peer copies (a job's slices fail long after its saves, as a rule): the
        # restore onto the survivors is then of that step, whatever the timing here.
        wait_redundant(self.cluster)
        self.sim.lose_hosts(self.sim.hosts_of_slice(index), delete_arrays=True)  # reading a buffer there raises
        super().fail(index)
        for rank in self._ranks(index):
            self.cluster.procs[rank].kill()
            self.cluster.wipe(rank)

    def heal(self, index: int) -> None:
        for rank in self._ranks(index):
            if not self.cluster.procs[rank].alive:
                self.cluster.wipe(rank)
                self.cluster.start(rank)
        super().heal(index)
        self.sim.heal_hosts(self.sim.hosts_of_slice(index))


@pytest.fixture
def slices(sim, cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    s = PathwaysSlices(sim, cl)
    yield s
    sim.heal_hosts(range(len(sim.hosts)))


@pytest.fixture
def failover_slices(sim, tmp_path):  # noqa: F811
    """As ``slices``, with a coordinator candidate on each slice (ranks 0 and 2): slice 0 can be lost."""
    import signal

    from tests.replicator.test_failover import FailoverCluster

    cl = FailoverCluster(tmp_path / "c", 4, 2)
    try:
        cl.start_all()
        yield PathwaysSlices(sim, cl)
    finally:
        sim.heal_hosts(range(len(sim.hosts)))
        cl.stop_all(signal.SIGKILL)


def assert_losses_equal(got: dict, kind: str, total: int) -> None:
    ref = train_plain(kind, total, jax.devices())
    assert sorted(got) == sorted(ref)
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=1e-5)


def test_elastic_loop_lost_shrink_replaced_scale_up(sim, slices, caplog):  # noqa: F811
    """Slice 1 is lost, training shrinks onto slice 0 (restored there), slice 1 comes back replaced (empty
    RAM disks), the loop scales back up to both slices; losses equal an uninterrupted run's."""
    caplog.set_level(logging.INFO)
    cl = slices.cluster
    sched = Schedule(total_steps=15, save_every=3, fail_at=8, return_at=11, replaced=True)
    events: list[str] = []
    first = len(sim.calls)
    got = train_elastic(cl, "fsdp", sched, slices, events)
    assert events[:4] == ["attempt on slices [0, 1]", "slice 1 fails before step 8", "attempt on slices [0]",
                          'restored step 6 onto 1 slice(s), data iterator state {"global_next_index": 384}'], events
    assert "slice 1 is back before step 11 (replaced: empty RAM disks)" in events
    assert events[-2:] == ["attempt on slices [0, 1]",
                           'restored step 10 onto 2 slice(s), data iterator state {"global_next_index": 640}'], events
    assert_losses_equal(got, "fsdp", sched.total_steps)
    # The host functions ran in the worker processes: on slice 0's hosts alone while slice 1 was down.
    assert {hosts for _, hosts in sim.calls[first:]} >= {(0, 1, 2, 3), (0, 1)}
    # The retry decided on the loop's slice-down error (one line), not on the failed attempt's manager
    # failing to close on the lost hosts (that was chained onto it: a traceback, and on Pathways whatever
    # error the runtime raises for a lost host, which need not count as slice-down).
    retried = [r for r in caplog.records if r.name == "pathwaysutils.elastic.manager" and "Elastic event" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in retried] == [
        (logging.WARNING, "Elastic event detected: DATA_LOSS: slice 1 is down (simulated)")], retried
    assert any("at the end of an attempt" in r.getMessage() and "hosts [2, 3], which are down" in r.getMessage()
               for r in caplog.records if r.name == "controller_client.resilience")


@pytest.mark.parametrize("kind", ["replicated", "fsdp"])
def test_guide_loop_with_snapshotter(sim, slices, kind):  # noqa: F811
    """The guide's loop (real Snapshotter): slice lost -> shrink -> in-place scale-up -> controller restart
    (new manager, no snapshot) -> slice 1 replaced empty; losses equal an uninterrupted run's."""
    pytest.importorskip("orbax.checkpoint.experimental.v1.training.pathways")
    from controller_client.demo.elastic_snapshot import SnapshotSchedule, train_with_snapshots

    cl = slices.cluster
    sched = SnapshotSchedule(total_steps=17, save_every=3, fail_at=8, return_at=11, restart_at=14)
    events: list[str] = []
    calls_before = len(sim.calls)
    got = train_with_snapshots(cl, kind, sched, slices, events)
    assert_guide_loop_story(events, kind)
    assert_losses_equal(got, kind, sched.total_steps)
    assert {hosts for _, hosts in sim.calls[calls_before:]} >= {(0, 1, 2, 3), (0, 1)}


def test_elastic_loop_loses_slice_0_survivors_in_other_id_namespace(sim, failover_slices):  # noqa: F811
    """Slice 0 is lost (the serving coordinator with it: rank 2's candidate takes over): the survivors are
    the hosts whose worker device ids differ from the controller's (2048 * p + i); training goes on on
    slice 1 from slice 0's data on its peers, slice 0 comes back replaced and empty."""
    sched = Schedule(total_steps=12, save_every=3, fail_at=8, return_at=10, replaced=True, lost_slice=0)
    events: list[str] = []
    first = len(sim.calls)
    got = train_elastic(failover_slices.cluster, "fsdp", sched, failover_slices, events)
    assert events[:4] == ["attempt on slices [0, 1]", "slice 0 fails before step 8", "attempt on slices [1]",
                          'restored step 6 onto 1 slice(s), data iterator state {"global_next_index": 384}'], events
    assert "slice 0 is back before step 10 (replaced: empty RAM disks)" in events
    assert events[-1] == 'restored step 9 onto 2 slice(s), data iterator state {"global_next_index": 576}', events
    assert_losses_equal(got, "fsdp", sched.total_steps)
    assert (2, 3) in {hosts for _, hosts in sim.calls[first:]}


def test_close_on_a_lost_slice_raises_and_drops_the_coordinator_connection(sim, slices, monkeypatch):  # noqa: F811
    """A manager whose hosts include a lost slice cannot wait for its saves there: close() raises the
    slice-down error and still closes its coordinator connection (before: one leaked per slice loss)."""
    from replicator.coordinator.client import CoordinatorClient

    closed = []
    orig = CoordinatorClient.close
    monkeypatch.setattr(CoordinatorClient, "close", lambda self: (closed.append(self), orig(self))[1])
    mgr = mgr_for(slices.cluster)
    assert mgr.active_ranks == [0, 1, 2, 3]
    sim.lose_hosts(sim.hosts_of_slice(1))
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        mgr.close()
    assert closed == [mgr._coordinator]


def test_a_save_failing_on_a_lost_host_is_not_the_next_managers_failure(sim, slices):  # noqa: F811
    """A background save fails on a host whose slice is then lost (its RAM disk wiped under the writer, as
    bench.goodput --pathways met it), the attempt's manager is closed after the failure, the slice comes back
    with the same worker process (its writer and the failure it kept): the next manager, over every slice,
    saves and restores. Before, its first call raised the dead manager's SaveError and ended the elastic loop
    (not a slice-down error). The failing manager itself still gets its failure."""
    import shutil

    from controller_client.resilience import close_after_failure
    from sidecar import layout
    from sidecar.writer import SaveError
    from tests.controller_client.test_pathways_sim import assert_equal, state, target_on

    devices = jax.devices()
    old = mgr_for(slices.cluster)
    old.save(1, state(1, devices))
    old.wait_until_finished()
    # Rank 3's next writes fail in the background (its steps directory is not a directory), deterministically.
    steps = layout.steps_dir(slices.cluster.ram(3))
    shutil.rmtree(steps)
    steps.write_text("")
    old.save(2, state(2, devices))
    with pytest.raises(SaveError, match="background save"):
        old.wait_until_finished()  # its owner sees it (once)
    old.save(3, state(3, devices))  # fails on rank 3 again, in the background: nobody asks before the loss
    worker_log = sim.log_dir / "pathways-worker-3.log"
    deadline = time.monotonic() + 30
    while f"save of step 3 to {slices.cluster.ram(3)} failed" not in worker_log.read_text():
        assert time.monotonic() < deadline, worker_log.read_text()[-2000:]
        time.sleep(0.05)
    # Slice 1 lost as PathwaysSlices.fail loses it, without waiting for step 3's peer copies (it never
    # completes): calls there raise DATA_LOSS, its replicators die, its RAM disks are wiped (the file too).
    sim.lose_hosts(sim.hosts_of_slice(1), delete_arrays=True)
    SimulatedSlices.fail(slices, 1)
    for rank in slices._ranks(1):
        slices.cluster.procs[rank].kill()
        slices.cluster.wipe(rank)
    close_after_failure(old, "in the test")
    slices.heal(1)
    new = mgr_for(slices.cluster)
    new.save(4, state(4, devices))
    new.wait_until_finished()
    restored = new.restore(4, target_on(state(4, devices), devices, (2, 4)))
    assert_equal(restored, state(4, devices))
    new.close()


def test_guide_loop_pause_and_resume(sim, slices):  # noqa: F811
    """minimum_slice_count=None: the retry waits until slice 1 is back (empty: its replicators and RAM disks
    died with it), the snapshot's surviving replica serves on the same mesh and manager."""
    pytest.importorskip("orbax.checkpoint.experimental.v1.training.pathways")
    from controller_client.demo.elastic_snapshot import SnapshotSchedule, train_with_snapshots

    sched = SnapshotSchedule(total_steps=15, save_every=3, fail_at=8, return_at=11, restart_at=12)
    events: list[str] = []
    got = train_with_snapshots(slices.cluster, "replicated", sched, slices, events, minimum_slice_count=None)
    assert events[:4] == ["attempt on slices [0, 1]", "slice 1 lost before step 8", "attempt on slices [0, 1]",
                          "restored step 7 from the snapshot onto 2 slice(s)"], events
    assert not any("scale up" in e for e in events)
    assert events[-1] == "restored step 12 from the checkpoint onto 2 slice(s)", events
    assert_losses_equal(got, "replicated", sched.total_steps)


# --------------------------------------------------------------------------- what the simulation does not model

def _worker_pid(x, *, _ids=None):
    """Runs on the workers: each device's element is the process id of the worker that holds it."""
    import os

    bufs = [jax.device_put(np.full((1,), os.getpid(), np.int32), s.device) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, bufs)


def worker_pids(devices) -> list[int]:
    """Through colocated Python as the dispatcher calls it (its ``_PathwaysIds`` first: the worker then
    resolves the controller's device ids)."""
    import functools

    from jax.experimental import colocated_python
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from controller_client.dispatch import _PathwaysIds

    x = jax.device_put(np.zeros(len(devices), np.int32), NamedSharding(Mesh(np.array(devices), ("d",)), P("d")))
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return np.asarray(colocated_python.colocated_python(functools.partial(_worker_pid, _ids=_PathwaysIds())).specialize(out_specs_fn=lambda _: spec)(x)).tolist()


def test_limit_a_replaced_host_keeps_its_worker_process(sim):  # noqa: F811
    """Pinned limit (docs/pathways.md): a host lost and back, replaced or not, is played by the same worker
    process, with the sidecar state it had (writer threads, JAX's result store): the workers are one
    jax.distributed job, which a killed member would take down. On Pathways a replacement host starts a
    fresh sidecar."""
    import os

    devs = jax.devices()
    before = worker_pids(devs)
    assert len(set(before)) == 4 and os.getpid() not in before  # one process per host, none of them this one
    sim.lose_hosts(sim.hosts_of_slice(1))
    try:
        with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
            worker_pids(devs)
        assert worker_pids(devs[:4]) == before[:4]
    finally:
        sim.heal_hosts(sim.hosts_of_slice(1))
    assert worker_pids(devs) == before


def test_limit_the_health_check_does_not_see_a_lost_slice(sim):  # noqa: F811
    """Pinned limit (docs/pathways.md): pathwaysutils' own health check runs a pmap on each slice's
    devices, which here are this process's CPU devices and never fail, so a slice lost on the simulation
    is still reported active; the tests simulate the check (SimulatedSlices)."""
    from pathwaysutils.elastic import elastic

    sim.lose_hosts(sim.hosts_of_slice(1))
    try:
        assert set(elastic.get_active_slice_indices(elastic.get_slice_to_devices(jax.devices()))) == {0, 1}
    finally:
        sim.heal_hosts(sim.hosts_of_slice(1))
