"""The Pathways guide's elastic loop exactly as the guide writes it, with our ``CheckpointManager`` directly
underneath (no ``ElasticCheckpointer``, no ``mark_restored``).

The guide's loop (``../shared/pathways-guide.txt``, "Elastic training"): one ``manager.Manager`` and one
Orbax ``Snapshotter(replica_axis_index=0)`` per controller process; ``@elastic_manager.elastic_retry(
minimum_slice_count=1, ..., retry_policy=manager.ElasticRetryLimit(...))`` around the training function;
each attempt builds its mesh from the active devices, restores the latest snapshot when there is one, trains,
snapshots every few steps, and scales up in place when ``available_inactive_slices`` is non-empty. What we
add is what a user adds: a ``CheckpointManager`` over the attempt's active devices that saves every
``save_every`` steps and, in a new process (no snapshot), restores the newest complete step; and an
``on_elastic_event_callback`` that closes the lost attempt's manager.

After an elastic event the snapshot is usually *older* than the newest checkpoint (snapshots every 2 steps,
checkpoints every 3): the attempt trains forward and calls ``save`` on steps already saved. As Orbax's
``CheckpointManager`` does, those saves are skipped (``save`` returns False), never an error that
``elastic_retry`` would re-raise. State is replicated along the replica axis, as the guide requires.

Suspend-resume per slice (``preemption_scope="slices"``): after each step the loop asks ``noticed_slices()``;
a notice to some active slices drops them in place (their shards still answer within the grace period) and
keeps them out of scale-ups for a while (:class:`~controller_client.resilience.LeavingSlices`); a notice to
every active slice saves the step, waits until it is durable and exits 75 (``preemption_exit.finish_preempted``).
tests/controller_client/test_guide_loop.py runs it on the simulated Pathways.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from controller_client.demo.elastic import SimulatedSlices, _model, allocation_topology
from controller_client.demo.elastic_snapshot import (
    active_devices,
    create_mesh,
    run_with_restart,
    scheduled_slice_event,
)
from controller_client.preemption_exit import DURABLE_WAIT_SECONDS


@dataclasses.dataclass
class GuideSchedule:
    """When things happen, in completed training steps."""

    total_steps: int = 17
    snapshot_every: int = 2
    save_every: int = 3
    fail_at: int = 10  # slice 1 is lost before this step runs (after step 9's checkpoint, snapshot 8)
    return_at: int = 12  # slice 1 is healthy again before this step runs: in-place scale-up
    restart_at: int = 14  # the controller process restarts after this step; slice 1 comes back replaced
    max_attempts: int = 4  # manager.ElasticRetryLimit per controller process
    notice_hold_seconds: float = 70.0  # LeavingSlices: terminationGracePeriodSeconds 60 + the monitor's 10 s
    durable_wait_seconds: float = DURABLE_WAIT_SECONDS  # backup_now(wait=True) before exit 75


def train_guide_loop(cluster: Any, schedule: GuideSchedule, sim: SimulatedSlices,
                     events: list[str] | None = None) -> dict[int, float]:
    """Run the story of :class:`GuideSchedule`; returns each step's loss (the last computation of a step)."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS.
    import jax
    import pathwaysutils
    from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter
    from pathwaysutils.elastic import manager

    from controller_client import preemption_exit
    from controller_client.demo.elastic_data import ElasticBatches
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.resilience import LeavingSlices, close_after_failure
    from sidecar.failures import StepAlreadyExistsError

    pathwaysutils.initialize()
    events = events if events is not None else []
    init, target, dataset, train_step = _model("replicated")
    devices = sim.devices
    topology = allocation_topology(devices)
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    save_interval_steps=schedule.save_every, coordinator_address=cluster.coordinator,
                                    restore_wait_seconds=60, preemption_scope="slices")
    losses: dict[int, float] = {}

    def controller_process(stop_after: int) -> None:
        elastic_manager = manager.Manager(devices)
        snapshotter = Snapshotter(replica_axis_index=0)
        current: dict[str, CheckpointManager] = {}
        leaving = LeavingSlices(schedule.notice_hold_seconds)  # slices dropped for their preemption notice

        def close_lost_attempt(*_: Any) -> None:
            """on_elastic_event_callback: the lost attempt's manager reaches lost hosts; close it quietly."""
            mgr = current.pop("mgr", None)
            if mgr is not None:
                close_after_failure(mgr, "after an elastic event")

        def flush() -> None:
            """Before a simulated loss: the attempt's pending saves and snapshot are done."""
            current["mgr"].wait_until_finished()
            snapshotter.join()

        def manager_on(active: list[Any]) -> CheckpointManager:
            old = current.pop("mgr", None)
            if old is not None:
                old.close()
            current["mgr"] = CheckpointManager(opts, devices=active, topology=topology)
            return current["mgr"]

        @elastic_manager.elastic_retry(minimum_slice_count=1, poll_interval=0.2, timeout=120,
                                       retry_policy=manager.ElasticRetryLimit(max_attempts=schedule.max_attempts),
                                       on_elastic_event_callback=close_lost_attempt)
        def run_training_loop() -> None:
            leaving.keep_out(elastic_manager)
            active = active_devices(elastic_manager)
            mesh = create_mesh(active)
            mgr = manager_on(active)
            slices = sorted(elastic_manager.active_slice_indices)
            events.append(f"attempt on slices {slices}")
            data = ElasticBatches(dataset(), mesh)
            params, step = init(mesh)["params"], 0
            try:
                if snapshotter.latest is not None:  # the guide: the latest in-memory snapshot first
                    snapshotter.join()
                    restored = snapshotter.load({**target(mesh), "data": data.get_state()})
                    params, step = restored["params"], int(restored["step"])
                    data.set_state(restored["data"])
                    events.append(f"restored step {step} from the snapshot onto {len(slices)} slice(s)")
                elif (latest := mgr.latest_step()) is not None:  # a new process: the multi-tier checkpoint
                    restored = mgr.restore(latest, {**target(mesh), "data": data.get_state()})
                    params, step = restored["params"], restored["step"]
                    data.set_state(restored["data"])
                    events.append(f"restored step {step} from the checkpoint onto {len(slices)} slice(s)")
                def remesh(slices: frozenset[int]) -> None:
                    """The guide's in-place resize onto ``slices``: mesh, input shards, state, manager."""
                    nonlocal active, mesh, data, params, mgr
                    elastic_manager.active_slice_indices = slices
                    active = active_devices(elastic_manager)
                    mesh = create_mesh(active)
                    position = data.get_state()
                    data.close()
                    data = ElasticBatches(dataset(), mesh)
                    data.set_state(position)
                    params = jax.device_put(params, jax.tree.map(lambda t: t.sharding, target(mesh)["params"]))
                    mgr = manager_on(active)

                while step < stop_after:
                    if new := leaving.returnable(elastic_manager.available_inactive_slices):
                        remesh(elastic_manager.active_slice_indices | new)  # the guide's in-place scale-up
                        events.append(f"scale up in place at step {step}: slices "
                                      f"{sorted(elastic_manager.active_slice_indices)}")
                        continue
                    if scheduled_slice_event(sim, schedule, step, elastic_manager, events, flush):
                        continue
                    b = next(data)
                    params, loss = train_step(params, b["x"], b["y"])
                    step += 1
                    losses[step] = float(loss)
                    state = {"params": params, "step": step, "data": data.get_state()}
                    if step % schedule.snapshot_every == 0:
                        snapshotter.save(step, state)
                    saved = False
                    if step % schedule.save_every == 0:
                        saved = mgr.save(step, state)
                        events.append(f"save({step}) -> {saved}")
                    noticed = mgr.noticed_slices()
                    if noticed and noticed >= mgr.active_slices:  # every active slice: the job suspends
                        if not saved:
                            with contextlib.suppress(StepAlreadyExistsError):
                                mgr.save(step, state, force=True)
                        code = preemption_exit.finish_preempted(mgr, schedule.durable_wait_seconds)
                        events.append(f"preemption notice to every active slice after step {step}: exit {code}")
                        return
                    if noticed:  # some slices: dropped in place, the others go on
                        leaving.drop(noticed)
                        remesh(elastic_manager.active_slice_indices - noticed)
                        events.append(f"preemption notice to slice(s) {sorted(noticed)} after step {step}: "
                                      f"going on in place on slices {sorted(elastic_manager.active_slice_indices)}")
            finally:
                data.close()

        try:
            run_training_loop()
        finally:
            snapshotter.join()
            last = current.pop("mgr", None)
            if last is not None:
                last.close()

    run_with_restart(cluster, sim, schedule, controller_process, events)
    return losses
