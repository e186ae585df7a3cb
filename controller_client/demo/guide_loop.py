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
    import pathwaysutils

    from controller_client.manager import CheckpointManagerOptions

    pathwaysutils.initialize()
    events = events if events is not None else []
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    save_interval_steps=schedule.save_every, coordinator_address=cluster.coordinator,
                                    restore_wait_seconds=60, preemption_scope="slices")
    losses: dict[int, float] = {}

    def controller_process(stop_after: int) -> None:
        _ControllerProcess(opts, schedule, sim, events, losses).run(stop_after)

    run_with_restart(cluster, sim, schedule, controller_process, events)
    return losses


class _ControllerProcess:
    """One lifetime of the guide's controller process: its ``manager.Manager``, its ``Snapshotter``, the
    attempt's ``CheckpointManager`` and the slices dropped for their notice."""

    def __init__(self, opts: Any, schedule: GuideSchedule, sim: SimulatedSlices, events: list[str],
                 losses: dict[int, float]) -> None:
        from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter
        from pathwaysutils.elastic import manager

        from controller_client.resilience import LeavingSlices

        self.opts, self.schedule, self.sim, self.events, self.losses = opts, schedule, sim, events, losses
        self.topology = allocation_topology(sim.devices)
        self.model = _model("replicated")
        self.elastic_manager = manager.Manager(sim.devices)
        self.snapshotter = Snapshotter(replica_axis_index=0)
        self.mgr: Any = None  # the attempt's CheckpointManager
        self.leaving = LeavingSlices(schedule.notice_hold_seconds)  # slices dropped for their preemption notice

    def run(self, stop_after: int) -> None:
        from pathwaysutils.elastic import manager

        @self.elastic_manager.elastic_retry(
            minimum_slice_count=1, poll_interval=0.2, timeout=120,
            retry_policy=manager.ElasticRetryLimit(max_attempts=self.schedule.max_attempts),
            on_elastic_event_callback=self.close_lost_attempt)
        def run_training_loop() -> None:
            self.attempt(stop_after)

        try:
            run_training_loop()
        finally:
            self.snapshotter.join()
            last, self.mgr = self.mgr, None
            if last is not None:
                last.close()

    # ------------------------------------------------------------------ the attempt's parts
    def close_lost_attempt(self, *_: Any) -> None:
        """on_elastic_event_callback: the lost attempt's manager reaches lost hosts; close it quietly."""
        from controller_client.resilience import close_after_failure

        mgr, self.mgr = self.mgr, None
        if mgr is not None:
            close_after_failure(mgr, "after an elastic event")

    def flush(self) -> None:
        """Before a simulated loss: the attempt's pending saves and snapshot are done."""
        self.mgr.wait_until_finished()
        self.snapshotter.join()

    def on_active(self) -> None:
        """The mesh, the input shards' home and a new manager for the active slices."""
        from controller_client.manager import CheckpointManager

        self.active = active_devices(self.elastic_manager)
        self.mesh = create_mesh(self.active)
        old, self.mgr = self.mgr, None
        if old is not None:
            old.close()
        self.mgr = CheckpointManager(self.opts, devices=self.active, topology=self.topology)

    def restore(self, slices: list[int]) -> None:
        """The guide: the latest in-memory snapshot first; in a new process, the multi-tier checkpoint."""
        _, target, _, _ = self.model
        if self.snapshotter.latest is not None:
            self.snapshotter.join()
            restored = self.snapshotter.load({**target(self.mesh), "data": self.data.get_state()})
            self.params, self.step = restored["params"], int(restored["step"])
            self.data.set_state(restored["data"])
            self.events.append(f"restored step {self.step} from the snapshot onto {len(slices)} slice(s)")
        elif (latest := self.mgr.latest_step()) is not None:
            restored = self.mgr.restore(latest, {**target(self.mesh), "data": self.data.get_state()})
            self.params, self.step = restored["params"], restored["step"]
            self.data.set_state(restored["data"])
            self.events.append(f"restored step {self.step} from the checkpoint onto {len(slices)} slice(s)")

    def remesh(self, slices: frozenset[int]) -> None:
        """The guide's in-place resize onto ``slices``: mesh, input shards, state, manager."""
        import jax

        from controller_client.demo.elastic_data import ElasticBatches

        _, target, dataset, _ = self.model
        self.elastic_manager.active_slice_indices = slices
        self.on_active()
        position = self.data.get_state()
        self.data.close()
        self.data = ElasticBatches(dataset(), self.mesh)
        self.data.set_state(position)
        self.params = jax.device_put(self.params, jax.tree.map(lambda t: t.sharding, target(self.mesh)["params"]))

    def attempt(self, stop_after: int) -> None:
        from controller_client.demo.elastic_data import ElasticBatches

        init, _, dataset, train_step = self.model
        self.leaving.keep_out(self.elastic_manager)
        self.on_active()
        slices = sorted(self.elastic_manager.active_slice_indices)
        self.events.append(f"attempt on slices {slices}")
        self.data = ElasticBatches(dataset(), self.mesh)
        self.params, self.step = init(self.mesh)["params"], 0
        try:
            self.restore(slices)
            while self.step < stop_after:
                if new := self.leaving.returnable(self.elastic_manager.available_inactive_slices):
                    self.remesh(self.elastic_manager.active_slice_indices | new)  # the guide's in-place scale-up
                    self.events.append(f"scale up in place at step {self.step}: slices "
                                       f"{sorted(self.elastic_manager.active_slice_indices)}")
                    continue
                if scheduled_slice_event(self.sim, self.schedule, self.step, self.elastic_manager, self.events,
                                         self.flush):
                    continue
                b = next(self.data)
                self.params, loss = train_step(self.params, b["x"], b["y"])
                self.step += 1
                self.losses[self.step] = float(loss)
                if self.checkpoint_and_notice():
                    return
        finally:
            self.data.close()

    def checkpoint_and_notice(self) -> bool:
        """Snapshot and save on their schedules, then act on a notice: True when the process exits 75."""
        from controller_client import preemption_exit
        from sidecar.failures import StepAlreadyExistsError

        step, mgr = self.step, self.mgr
        state = {"params": self.params, "step": step, "data": self.data.get_state()}
        if step % self.schedule.snapshot_every == 0:
            self.snapshotter.save(step, state)
        saved = False
        if step % self.schedule.save_every == 0:
            saved = mgr.save(step, state)
            self.events.append(f"save({step}) -> {saved}")
        noticed = mgr.noticed_slices()
        if noticed and noticed >= mgr.active_slices:  # every active slice: the job suspends
            if not saved:
                with contextlib.suppress(StepAlreadyExistsError):
                    mgr.save(step, state, force=True)
            code = preemption_exit.finish_preempted(mgr, self.schedule.durable_wait_seconds)
            self.events.append(f"preemption notice to every active slice after step {step}: exit {code}")
            return True
        if noticed:  # some slices: dropped in place, the others go on
            self.leaving.drop(noticed)
            self.remesh(self.elastic_manager.active_slice_indices - noticed)
            self.events.append(f"preemption notice to slice(s) {sorted(noticed)} after step {step}: "
                               f"going on in place on slices {sorted(self.elastic_manager.active_slice_indices)}")
        return False
