"""Orbax's in-memory Snapshotter with our checkpoints (controller_client.resilience): newest wins, a lost
slice's FSDP part falls back to the checkpoint, saving forward after a snapshot restore older than the
newest checkpoint step, an in-place scale-up, and the Pathways guide's loop with real pathwaysutils and
real replicators (elastic and pause-and-resume)."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.demo.elastic import SimulatedSlices, train_plain
from controller_client.demo.elastic_snapshot import SnapshotSchedule, lose_slice, train_with_snapshots
from controller_client.manager import CheckpointManagerOptions
from controller_client.resilience import ElasticCheckpointer
from controller_client.topology import HostTopology
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

Snapshotter = pytest.importorskip("orbax.checkpoint.experimental.v1.training.pathways").Snapshotter
pytest.importorskip("pathwaysutils")

SPECS = {"replicated": P(None, "model"), "fsdp": P("data", "model")}


def mesh_of(devices) -> Mesh:
    return Mesh(np.array(devices).reshape(len(devices) // 4, 4), ("data", "model"))


def state(step: int, devices, kind: str = "replicated") -> dict:
    w = np.random.default_rng(step).standard_normal((16, 8)).astype(np.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh_of(devices), SPECS[kind])), "step": step}


def target(devices, kind: str = "replicated") -> dict:
    return {"w": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh_of(devices), SPECS[kind])),
            "step": 0}


def checkpointer(tmp_path, devices, snapshotter=None, **kw) -> ElasticCheckpointer:
    topo = HostTopology.simulated(jax.devices(), 2, 2)  # the full allocation: ranks never change
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t", max_to_keep=4,
                                    save_interval_steps=kw.pop("save_interval_steps", 1))
    return ElasticCheckpointer(opts, topology=topo, devices=devices, snapshotter=snapshotter, **kw)


def same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))


def test_save_forward_after_a_snapshot_restore_older_than_the_newest_checkpoint_step(tmp_path):
    devs = jax.devices()
    ck = checkpointer(tmp_path, devs, Snapshotter(), snapshot_interval_steps=2)
    ck.save(8, state(8, devs))  # snapshot and checkpoint
    ck.save(9, state(9, devs))  # checkpoint only
    ck.wait_until_finished()
    # Slice 1 is lost with its RAM disks: steps 8 and 9 are incomplete, step 9 stays on ranks 0 and 1.
    lose_slice(SimulatedSlices(devs), 1)
    for rank in (2, 3):
        shutil.rmtree(tmp_path / str(rank))
    got = ck.restore(target(devs[:4]))
    assert (got.source, got.step) == ("snapshot", 8) and same(got.state, state(8, devs))
    # The job goes on from step 8: step 9 is saved again by slice 0 (today's error: FileExistsError).
    new9 = {"w": got.state["w"] + 1, "step": 9}
    assert ck.save(9, new9)
    ck.wait_until_finished()
    assert ck.manager.latest_step() == 9
    ck.close()
    fresh = checkpointer(tmp_path, devs[:4])  # a restarted process: no snapshot
    back = fresh.restore(target(devs[:4]))
    assert (back.source, back.step) == ("checkpoint", 9) and same(back.state, new9)
    fresh.close()


@pytest.mark.parametrize("kind, source, step", [("replicated", "snapshot", 7), ("fsdp", "checkpoint", 6)])
def test_restore_takes_the_newest_tier_that_can_rebuild_the_state(tmp_path, kind, source, step):
    devs = jax.devices()
    ck = checkpointer(tmp_path, devs, Snapshotter(), save_interval_steps=3)
    for s in (6, 7):
        ck.save(s, state(s, devs, kind))
    ck.wait_until_finished()
    assert ck.latest_step() == 7 and ck.manager.latest_step() == 6
    # Slice 1's buffers are gone: a replicated leaf has its other replica; an FSDP leaf lost half its rows
    # (the Snapshotter would return a (8, 8) array: detected, the checkpoint serves).
    lose_slice(SimulatedSlices(devs), 1)
    got = ck.restore(target(devs[:4], kind))
    assert (got.source, got.step) == (source, step)
    assert same(got.state, state(step, devs, kind))
    # The restored state was snapshotted again on slice 0: the next event finds it there.
    assert ck.snapshot_step() == step
    again = ck.restore(target(devs[:4], kind))
    assert (again.source, again.step) == ("snapshot", step) and same(again.state, got.state)
    ck.close()


def test_in_place_scale_up_keeps_the_checkpointer_working(tmp_path):
    devs = jax.devices()
    ck = checkpointer(tmp_path, devs[:4], Snapshotter())
    assert ck.restore(target(devs[:4])) is None  # nothing saved yet
    ck.save(3, state(3, devs[:4]))
    # The guide's scale-up: the same state device_put onto the bigger mesh, training goes on.
    grown = jax.device_put(state(3, devs[:4]), jax.tree.map(lambda t: getattr(t, "sharding", None), target(devs)))
    grown["step"] = 4
    assert ck.save(4, grown)  # (a CheckpointManager over slice 0 raises "All arguments must use the same device list")
    ck.wait_until_finished()
    assert ck.manager.active_ranks == [0, 1, 2, 3] and ck.manager.latest_step() == 4
    ck.close()
    fresh = checkpointer(tmp_path, devs)
    back = fresh.restore(target(devs))
    assert back.step == 4 and np.array_equal(np.asarray(back.state["w"]), np.asarray(grown["w"]))
    fresh.close()


def _assert_losses_equal(got: dict, kind: str, total: int) -> None:
    ref = train_plain(kind, total, jax.devices())
    assert sorted(got) == sorted(ref)
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicated", "fsdp"])
def test_guide_loop_lost_shrink_scale_up_in_place_restart_replaced(cluster_factory, kind):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    sched = SnapshotSchedule(total_steps=17, save_every=3, fail_at=8, return_at=11, restart_at=14)
    events: list[str] = []
    got = train_with_snapshots(cl, kind, sched, SimulatedSlices(jax.devices()), events)
    assert_guide_loop_story(events, kind)
    _assert_losses_equal(got, kind, sched.total_steps)


def assert_guide_loop_story(events: list[str], kind: str) -> None:
    """The guide loop's events for SnapshotSchedule(17, save_every=3, fail_at=8, return_at=11, restart_at=14)."""
    # The snapshot (step 7) serves replicated state; FSDP state lost slice 1's part: the checkpoint (6).
    first = "restored step 7 from the snapshot" if kind == "replicated" else "restored step 6 from the checkpoint"
    assert events[:4] == ["attempt on slices [0, 1]", "slice 1 lost before step 8", "attempt on slices [0]",
                          f"{first} onto 1 slice(s)"], events
    assert events[4:6] == ["slice 1 is back before step 11", "scale up in place at step 10: slices [0, 1]"], events
    # After the restart no snapshot exists: step 12 (saved on both slices after the scale-up) from the
    # checkpoint, slice 1's ranks from their peers.
    assert events[6].startswith("controller restarts after step 14; slice 1 replaced"), events
    assert events[7:] == ["attempt on slices [0, 1]", "restored step 12 from the checkpoint onto 2 slice(s)"], events


@pytest.mark.slow
def test_guide_loop_pause_and_resume(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    sched = SnapshotSchedule(total_steps=15, save_every=3, fail_at=8, return_at=11, restart_at=12)
    events: list[str] = []
    got = train_with_snapshots(cl, "replicated", sched, SimulatedSlices(jax.devices()), events,
                               minimum_slice_count=None)
    # The retry waits for both slices, then the surviving replica of the snapshot serves, on the same mesh.
    assert events[:4] == ["attempt on slices [0, 1]", "slice 1 lost before step 8", "attempt on slices [0, 1]",
                          "restored step 7 from the snapshot onto 2 slice(s)"], events
    assert not any("scale up" in e for e in events)
    assert events[-1] == "restored step 12 from the checkpoint onto 2 slice(s)", events
    _assert_losses_equal(got, "replicated", sched.total_steps)


def test_a_simulated_slice_failure_is_logged_as_one_line_a_real_error_with_its_traceback():
    import io
    import logging

    from controller_client.demo.elastic import quiet_simulated_failures

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    pw = logging.getLogger("pathwaysutils.elastic.manager")  # where elastic_retry logs what it retries
    pw.addHandler(handler)
    try:
        with quiet_simulated_failures():
            for text in ("DATA_LOSS: slice 1 is down (simulated)", "DATA_LOSS: slice 1 is down"):
                try:
                    raise jax.errors.JaxRuntimeError(text)
                except jax.errors.JaxRuntimeError:
                    pw.exception("Elastic event detected")
    finally:
        pw.removeHandler(handler)
    simulated, real = out.getvalue().split("Elastic event detected", 2)[1:]
    assert simulated == ": DATA_LOSS: slice 1 is down (simulated)\n"
    assert "Traceback" in real


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["replicated", "fsdp"])
def test_guide_loop_a_notice_to_one_slice_drops_it_a_notice_to_all_exits_75_durably(cluster_factory, kind):  # noqa: F811
    from tests.kits.cluster import status

    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-minutes", "60"]
    cl.start_all()
    sched = SnapshotSchedule(total_steps=10, save_every=3, fail_at=99, return_at=99, restart_at=10,
                             notices=((5, 1), (8, 0)))
    events: list[str] = []
    got = train_with_snapshots(cl, kind, sched, SimulatedSlices(jax.devices()), events)
    # Slice 1's notice drops slice 1 only (in place: no new attempt, no restore); slice 0 trains on; its own
    # notice then suspends the job: step 8 saved (forced: not an interval step), in the bucket, exit 75.
    assert events == ["attempt on slices [0, 1]", "slice 1 gets a preemption notice before step 5",
                      "preemption notice to slice(s) [1] after step 5: going on in place on slices [0]",
                      "slice 0 gets a preemption notice before step 8",
                      "preemption notice to every active slice after step 8: exit 75"], events
    assert 8 in status(cl).backed_up_steps  # read once: backup_now(wait=True) returned only then
    ref = train_plain(kind, 8, jax.devices())
    assert sorted(got) == sorted(ref)  # steps 6-8 on slice 0 alone: the same losses as on both slices
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=1e-5)
