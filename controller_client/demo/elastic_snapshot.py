"""`mtc demo --elastic --snapshotter`: the Pathways guide's elastic loop, with Orbax's in-memory
``Snapshotter`` for elastic events and multi-tier checkpoints for the rest (:mod:`controller_client.resilience`).

The loop is written as the guide writes it: ``pathwaysutils.initialize()``, one elastic ``Manager`` and one
``Snapshotter`` per controller process, ``@elastic_retry`` around the training function, a mesh from the
active devices (``active_devices``: a shim for pathwaysutils releases whose ``Manager`` lacks the property),
a restore at the start of each attempt, a snapshot every step and a checkpoint every few, and an *in-place*
scale-up when ``available_inactive_slices`` is non-empty (add the slices to ``active_slice_indices``,
rebuild the mesh, ``device_put`` the state, keep training: no restore, no new attempt).

The story, on 8 CPU devices as 2 simulated slices with real replicators on loopback:

1. slice 1 is lost before ``fail_at``: its buffers are deleted (the Snapshotter's replica there included)
   and the slice-down error is raised; the retry shrinks to slice 0 (``minimum_slice_count=1``) or, in
   pause-and-resume mode (``minimum_slice_count=None``), waits until slice 1 is back on the same mesh;
2. slice 1 returns before ``return_at``: in-place scale-up (elastic mode);
3. after ``restart_at`` the controller process "restarts" (a new Manager, Snapshotter and checkpointer: no
   snapshot survives) and slice 1 comes back *replaced*: its hosts' RAM disks are empty and their
   replicators restarted, so ranks 2 and 3 refill from their peers.

Replicated state restores from the snapshot after the loss (the surviving replica); FSDP state, whose
part on slice 1 is gone with it, from the checkpoint; after the restart, from the checkpoint. Losses equal
an uninterrupted run's. What is simulated: the slice grouping and health check (:class:`SimulatedSlices`;
on Pathways devices the grouping is pathwaysutils' own), the loss (buffers deleted, ``DATA_LOSS`` raised)
and the restart (in one OS process). tests/controller_client/test_pathways_sim_elastic.py runs this loop on
the simulated Pathways (docs/pathways.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from controller_client.demo.cluster import LocalCluster
from controller_client.demo.elastic import (
    DEVICES_PER_SLICE,
    HOSTS_PER_SLICE,
    RETRY_ATTEMPTS,
    SLICES,
    SimulatedSlices,
    _model,
    _wait,
    allocation_topology,
    quiet_simulated_failures,
    replace_slice,
)
from controller_client.demo.run import _setup_jax
from controller_client.preemption_exit import DURABLE_WAIT_SECONDS
from replicator.coordinator.client import CoordinatorClient


@dataclasses.dataclass
class SnapshotSchedule:
    """When things happen, in training steps; snapshots every step, checkpoints every ``save_every``."""

    total_steps: int = 20
    save_every: int = 3
    fail_at: int = 8  # slice 1 is lost before this step runs
    return_at: int = 11  # slice 1 is healthy again before this step runs (elastic mode: in-place scale-up)
    restart_at: int = 14  # the controller process restarts after this step; slice 1 comes back replaced
    # (step, slice): the slice's hosts get a preemption notice before this step runs (their preStop hooks). A
    # notice to some active slices drops them in place; to every active slice, the job saves and exits 75.
    notices: tuple[tuple[int, int], ...] = ()
    notice_hold_seconds: float = 70.0  # LeavingSlices: terminationGracePeriodSeconds 60 + the monitor's 10 s
    durable_wait_seconds: float = DURABLE_WAIT_SECONDS  # backup_now(wait=True) before exit 75


def active_devices(elastic_manager: Any) -> list[Any]:
    """``elastic_manager.active_devices`` where pathwaysutils has it; else (0.1.13) the devices of
    ``active_slice_indices`` in slice order, which is what the property returns."""
    devices = getattr(elastic_manager, "active_devices", None)
    if devices is not None:
        return list(devices)
    return [d for s in sorted(elastic_manager.active_slice_indices) for d in elastic_manager.slice_to_devices[s]]


def create_mesh(devices: Sequence[Any]) -> Any:
    """One mesh row per slice (``"data"``: the replica axis, ``Snapshotter(replica_axis_index=0)``)."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(devices).reshape(len(devices) // DEVICES_PER_SLICE, DEVICES_PER_SLICE), ("data", "model"))


def lose_slice(sim: SimulatedSlices, index: int) -> None:
    """Slice ``index`` fails: mark it down and delete every buffer with a shard on it, as its loss would
    (a snapshot replica there included); reading them now raises, as on Pathways."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax

    gone = {d.id for d in sim.slice_to_devices()[index]}
    sim.fail(index)
    for arr in jax.live_arrays():
        if not arr.is_deleted() and {d.id for d in arr.sharding.device_set} & gone:
            arr.delete()


def train_with_snapshots(cluster: Any, kind: str, schedule: SnapshotSchedule, sim: SimulatedSlices,
                         events: list[str] | None = None, minimum_slice_count: int | None = 1) -> dict[int, float]:
    """Run the story above; returns the loss of every step (the last computation of a step run twice)."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax
    import pathwaysutils
    from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter  # ocp.v1.training.pathways
    from pathwaysutils.elastic import manager

    from controller_client import preemption_exit
    from controller_client.demo.elastic_data import ElasticBatches
    from controller_client.manager import CheckpointManagerOptions
    from controller_client.resilience import ElasticCheckpointer, LeavingSlices
    from sidecar.failures import StepAlreadyExistsError

    pathwaysutils.initialize()  # on Pathways: the proxy backend, profiling and persistence hooks; CPU: no-op
    events = events if events is not None else []
    init, target, dataset, train_step = _model(kind)
    devices = sim.devices
    topology = allocation_topology(devices)  # the full allocation
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    save_interval_steps=schedule.save_every, coordinator_address=cluster.coordinator,
                                    restore_wait_seconds=60, preemption_scope="slices")
    losses: dict[int, float] = {}

    def params_shardings(mesh: Any) -> Any:
        return jax.tree.map(lambda t: t.sharding, target(mesh)["params"])

    def reshard(data: Any, mesh: Any) -> Any:
        """The input pipeline onto the mesh's slices, at the same position (one shard per active slice)."""
        position = data.get_state()
        data.close()
        out = ElasticBatches(dataset(), mesh)
        out.set_state(position)
        return out

    def controller_process(stop_after: int) -> None:
        """One lifetime of the controller: what it builds does not survive a restart."""
        elastic_manager = manager.Manager(devices)
        snapshotter = Snapshotter(replica_axis_index=0)
        ckpt = ElasticCheckpointer(opts, topology=topology, devices=active_devices(elastic_manager),
                                   snapshotter=snapshotter)
        leaving = LeavingSlices(schedule.notice_hold_seconds)  # slices dropped for their preemption notice

        # A bounded retry (without a policy elastic_retry retries slice-down errors forever).
        @elastic_manager.elastic_retry(minimum_slice_count=minimum_slice_count, poll_interval=0.2, timeout=120,
                                       retry_policy=manager.ElasticRetryLimit(max_attempts=RETRY_ATTEMPTS))
        def train_loop() -> None:
            leaving.keep_out(elastic_manager)  # elastic_retry took every healthy slice, a noticed one too
            mesh = create_mesh(active_devices(elastic_manager))
            slices = sorted(elastic_manager.active_slice_indices)
            events.append(f"attempt on slices {slices}")
            data = ElasticBatches(dataset(), mesh)
            try:
                restored = ckpt.restore({**target(mesh), "data": data.get_state()})
                if restored is None:
                    params, step = init(mesh)["params"], 0
                else:
                    params, step = restored.state["params"], restored.state["step"]
                    data.set_state(restored.state["data"])
                    events.append(f"restored step {step} from the {restored.source} onto {len(slices)} slice(s)")
                while step < stop_after:
                    if new := leaving.returnable(elastic_manager.available_inactive_slices):
                        # In-place scale-up: the same attempt, the same checkpointer, a bigger mesh.
                        elastic_manager.active_slice_indices = elastic_manager.active_slice_indices | new
                        mesh = create_mesh(active_devices(elastic_manager))
                        params = jax.device_put(params, params_shardings(mesh))
                        data = reshard(data, mesh)
                        events.append(f"scale up in place at step {step}: slices "
                                      f"{sorted(elastic_manager.active_slice_indices)}")
                        continue
                    if scheduled_slice_event(sim, schedule, step, elastic_manager, events, ckpt.wait_until_finished,
                                             pause_resume=minimum_slice_count is None):
                        continue
                    scheduled_notices(cluster, sim, schedule, step, events)
                    b = next(data)
                    params, loss = train_step(params, b["x"], b["y"])
                    step += 1
                    losses[step] = float(loss)
                    checkpointed = {"params": params, "step": step, "data": data.get_state()}
                    saved = ckpt.save(step, checkpointed)
                    if saved:
                        ckpt.wait_until_finished()
                    noticed = ckpt.noticed_slices()  # suspend-resume, per slice (preemption_scope="slices")
                    if noticed and noticed >= ckpt.manager.active_slices:  # every active slice: the job
                        if not saved:
                            with contextlib.suppress(StepAlreadyExistsError):  # saved at its interval already
                                ckpt.save(step, checkpointed, force=True)
                        # The step durable (the bucket), then exit 75: the JobSet restarts, never Completed.
                        code = preemption_exit.finish_preempted(ckpt, schedule.durable_wait_seconds)
                        events.append(f"preemption notice to every active slice after step {step}: exit {code}")
                        return
                    if noticed:  # some slices: they go away within their grace period; the others go on
                        leaving.drop(noticed)
                        elastic_manager.active_slice_indices = elastic_manager.active_slice_indices - noticed
                        mesh = create_mesh(active_devices(elastic_manager))
                        params = jax.device_put(params, params_shardings(mesh))  # their shards still answer
                        data = reshard(data, mesh)
                        events.append(f"preemption notice to slice(s) {sorted(noticed)} after step {step}: "
                                      f"going on in place on slices {sorted(elastic_manager.active_slice_indices)}")
            finally:
                data.close()

        try:
            train_loop()
        finally:
            ckpt.close()

    run_with_restart(cluster, sim, schedule, controller_process, events)
    return losses


def scheduled_notices(cluster: Any, sim: SimulatedSlices, schedule: Any, step: int, events: list[str]) -> None:
    """The story's preemption notices before step ``step + 1`` (``schedule.notices``): every host of the slice
    gets one (its preStop hook), once."""
    for at, index in getattr(schedule, "notices", ()):
        if step + 1 == at and f"notice {index}" not in sim.history:
            sim.history.append(f"notice {index}")
            for rank in range(index * HOSTS_PER_SLICE, (index + 1) * HOSTS_PER_SLICE):
                cluster.notice(rank)
            events.append(f"slice {index} gets a preemption notice before step {step + 1}")


def scheduled_slice_event(sim: SimulatedSlices, schedule: Any, step: int, elastic_manager: Any, events: list[str],
                          flush: Callable[[], None], pause_resume: bool = False) -> bool:
    """The story's slice events before step ``step + 1``: slice 1 is lost at ``schedule.fail_at`` once
    (``flush`` first: the failure strikes between steps; raises the slice-down error; ``pause_resume``: it
    comes back a second later), and is back at ``schedule.return_at``. True when it came back (the loop
    looks at ``available_inactive_slices`` again)."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax

    if step + 1 == schedule.fail_at and 1 in elastic_manager.active_slice_indices and "lost" not in sim.history:
        flush()
        sim.history.append("lost")
        lose_slice(sim, 1)
        events.append(f"slice 1 lost before step {step + 1}")
        if pause_resume:  # it comes back while the retry waits
            threading.Timer(1.0, sim.heal, (1,)).start()
        raise jax.errors.JaxRuntimeError("DATA_LOSS: slice 1 is down (simulated)")
    if step + 1 == schedule.return_at and 1 in sim.down:
        sim.heal(1)
        events.append(f"slice 1 is back before step {step + 1}")
        _wait(lambda: elastic_manager.available_inactive_slices, 30, "the monitor to see slice 1")
        return True
    return False


def run_with_restart(cluster: Any, sim: SimulatedSlices, schedule: Any, controller_process: Callable[[int], None],
                     events: list[str]) -> None:
    """Two lifetimes of the controller: up to ``schedule.restart_at``, then (slice 1 replaced by empty hosts
    once the newest step has its peer copies) up to ``schedule.total_steps``; one when ``restart_at`` is not
    before ``total_steps``."""
    with sim.patched(), quiet_simulated_failures():
        controller_process(schedule.restart_at)
        if schedule.restart_at >= schedule.total_steps:
            return
        newest = wait_redundant(cluster)
        events.append(f"controller restarts after step {schedule.restart_at}; slice 1 replaced (empty RAM disks; "
                      f"step {newest} has its copies on peers)")
        replace_slice(cluster, 1)
        sim.heal(1)
        controller_process(schedule.total_steps)


def wait_redundant(cluster: Any, timeout_seconds: float = 60) -> int:
    """Wait until the newest complete step has a copy of every rank on a second host (a slice replaced
    before that would take its only copies along: the restart would restore an older step, correctly)."""
    client = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=5)
    try:
        def newest_redundant() -> int | None:
            st = client.status()
            return next((s.step for s in st.steps if s.step == st.newest_complete_step and s.redundant), None)

        _wait(lambda: newest_redundant() is not None, timeout_seconds, "the newest step's peer copies")
        return newest_redundant()
    finally:
        client.close()


def run_snapshot_demo(workdir: str | None = None, keep: bool = False,
                      kinds: tuple[str, ...] = ("replicated", "fsdp"), schedule: SnapshotSchedule | None = None,
                      pause_resume: bool = False) -> int:
    """Run the loop for each kind of state, print the events and whether the losses match; 0 if all do.
    ``pause_resume``: ``minimum_slice_count=None`` (wait for every slice) instead of shrinking."""
    _setup_jax()

    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax
    import numpy as np

    from controller_client.demo.elastic import train_plain

    schedule = schedule or SnapshotSchedule()
    devices = jax.devices()[: SLICES * DEVICES_PER_SLICE]
    if len(devices) < SLICES * DEVICES_PER_SLICE:
        raise SystemExit("mtc demo --elastic needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    base = Path(workdir or tempfile.mkdtemp(prefix="mtc-elastic-",
                                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    ok = True
    try:
        for kind in kinds:
            cluster = LocalCluster(base / kind, nodes=SLICES * HOSTS_PER_SLICE, data_parallelism=SLICES)
            events: list[str] = []
            try:
                cluster.start_all()
                got = train_with_snapshots(cluster, kind, schedule, SimulatedSlices(devices), events,
                                           None if pause_resume else 1)
            finally:
                cluster.stop_all()
            ref = train_plain(kind, schedule.total_steps, devices)
            same = sorted(got) == sorted(ref) and all(np.isclose(got[s], ref[s], rtol=1e-5, atol=1e-6) for s in ref)
            ok = ok and same
            print(f"-- {kind} state (snapshots + checkpoints):")
            for e in events:
                print(f"   {e}")
            print(f"{'OK  ' if same else 'FAIL'} {kind}: losses of steps 1..{schedule.total_steps} equal the "
                  f"uninterrupted run's (max relative difference "
                  f"{max(abs(got.get(s, np.inf) - ref[s]) / max(abs(ref[s]), 1e-12) for s in ref):.2e})")
    finally:
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1
