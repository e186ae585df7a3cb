"""One system's run of ``bench.goodput --pathways``: the Pathways elastic loop on the simulated Pathways.

``python -m bench.goodput_pathways_loop`` is started by bench/goodput_pathways.py, once per system, and never
by hand: a fresh controller process per system, so neither inherits the other's compiled programs. This
process is the single controller (8 CPU devices, 2 slices x 2 hosts x 2 devices); tests/kits/pathways_sim.py
starts one worker process per host (the colocated-Python sidecar). The train state is bench.emergency's
(``--mib``, sharded within a slice, replicated across slices) plus a ``step`` scalar; a train step changes the
``step`` and one small leaf, then sleeps ``--step-seconds`` (the accelerator's work).

A slice loss, at its scheduled time (checked at each step boundary), is what tests/controller_client/
test_pathways_sim_elastic.py's ``PathwaysSlices`` makes of it: the simulation's hosts lost (every colocated
call spanning them raises ``DATA_LOSS``), pathwaysutils' health check counts the slice down, every live array
with a shard there is deleted (the Snapshotter's replica there included), our replicators there are killed
and their RAM disks wiped; the next step raises the slice-down ``JaxRuntimeError`` Pathways raises. After
``--replace-seconds`` a background thread brings the slice back (empty RAM disks, new replicators), and the
elastic Manager's monitor finds it healthy; each loop rejoins it its own way.

- ``ours``: :func:`controller_client.demo.elastic.train_elastic`'s loop: our ``CheckpointManager`` (a new
  one per attempt over the active devices) saving every Young/Daly interval from its measured save cost,
  real replicators (coordinator candidates on each slice's first host, the rendered default) backing up to
  a folder; a loss ends the attempt and the next one restores the newest complete step onto the survivors;
  a returning slice: in place, as docs/elastic.md's loop (mesh, ``device_put``, ``for_devices``: a manager
  over the active devices that knows the saved steps, once the old one's pending save is done; no save, no
  restore).
- ``orbax``: the guide's loop: Orbax's ``Snapshotter`` (every Young/Daly interval from its measured cost)
  and Orbax's ``CheckpointManager`` to a persistent folder (every ``--bucket-seconds``, as bench.goodput's
  bucket tier); a loss: the next attempt loads the latest snapshot onto the survivors (the checkpoint only
  when there is no snapshot); a returning slice: in place (mesh, ``device_put``, no restore).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.goodput_pathways_rig import DEVICES_PER_SLICE, SLICES, Rig, start_rig  # noqa: E402

SYSTEMS = ("ours", "orbax")
MAX_ATTEMPTS = 1000
SLICE_WAIT_SECONDS = 300.0


def _elastic_retry(elastic: Any, rig: Any) -> Any:
    """The same ``elastic_retry`` for both loops: one slice at least, the rig's poll, its attempt limits."""
    from pathwaysutils.elastic import manager as elastic_manager

    return elastic.elastic_retry(
        minimum_slice_count=1,
        poll_interval=rig.opts.poll_seconds,
        timeout=SLICE_WAIT_SECONDS,
        retry_policy=elastic_manager.ElasticRetryLimit(max_attempts=MAX_ATTEMPTS),
    )


def mesh_of(devices: list[Any]) -> Any:
    """One mesh row per slice: ``replica`` (the Snapshotter's replica axis 0) x ``model``."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(
        np.array(devices).reshape(len(devices) // DEVICES_PER_SLICE, DEVICES_PER_SLICE), ("replica", "model")
    )


def active_devices(elastic: Any) -> list[Any]:
    return [d for s in sorted(elastic.active_slice_indices) for d in elastic.slice_to_devices[s]]


def calibrate(rig: Rig, save: Any, wait: Any, state: dict) -> tuple[dict, float, float]:
    """Before the clock starts: steps 1 (compiles) and 2, a warm-up save of step 1 and a timed one of step 2;
    the state at step 2 and the save's (blocking, full) seconds."""
    state = rig.train(state, SLICES)
    save(1, state)
    wait()
    state = rig.train(state, SLICES)
    t = time.monotonic()
    save(2, state)
    block = time.monotonic() - t
    wait()
    return state, block, time.monotonic() - t


# --------------------------------------------------------------------------- ours


def run_ours(rig: Rig) -> dict[str, Any]:
    """train_elastic's loop with our CheckpointManager; returns the system's own figures."""
    import jax
    from pathwaysutils.elastic import manager as elastic_manager

    from controller_client.demo.elastic import allocation_topology
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.resilience import close_after_failure

    devices = rig.slices.devices
    topology = allocation_topology(devices)
    opts = CheckpointManagerOptions(
        local_directory=rig.cluster.local_template,
        job_name="t",
        save_interval_steps=1,
        coordinator_address=rig.cluster.coordinator,
        restore_wait_seconds=120,
    )
    own: dict[str, Any] = {}
    elastic = elastic_manager.Manager(devices)

    @_elastic_retry(elastic, rig)
    def attempt() -> None:
        slices = sorted(elastic.active_slice_indices)
        rig.attempt(slices)
        mesh = mesh_of(active_devices(elastic))
        ckpt = CheckpointManager(opts, devices=active_devices(elastic), topology=topology)
        try:
            if "interval_steps" not in own:
                state, block, full = calibrate(rig, ckpt.save, ckpt.wait_until_finished, rig.initial(mesh))
                own.update(save_block_seconds=round(block, 4), save_full_seconds=round(full, 4))
                own["interval_steps"] = rig.young_daly(block, full)
                rig.start_clock(state)
            else:
                latest = ckpt.latest_step()
                state = rig.initial(mesh) if latest is None else ckpt.restore(latest, rig.abstract(mesh))
                rig.restored(state, "checkpoint" if latest is not None else "scratch")
            while not rig.done():
                rig.before_step(slices)
                state = rig.train(state, len(slices))
                step = rig.step_of(state)
                if step % own["interval_steps"] == 0:
                    ckpt.save(step, state)
                if new := elastic.available_inactive_slices:  # the in-place scale-up (docs/elastic.md)
                    rig.noticed(sorted(new))
                    elastic.active_slice_indices = elastic.active_slice_indices | new
                    slices = sorted(elastic.active_slice_indices)
                    mesh = mesh_of(active_devices(elastic))
                    state = jax.device_put(state, jax.tree.map(lambda a: a.sharding, rig.abstract(mesh)))
                    # A manager serves the devices it was built with: the next one knows the saved steps.
                    ckpt = ckpt.for_devices(active_devices(elastic))
                    rig.attempt(slices)
                    rig.restored(state, "in place")
        except jax.errors.JaxRuntimeError:
            rig.detected()
            close_after_failure(ckpt, "at the end of an attempt")
            raise
        except BaseException:
            ckpt.close()
            raise
        ckpt.close()

    attempt()
    return own


# --------------------------------------------------------------------------- the guide's Orbax path


def _orbax_restore(rig: Rig, snapshotter: Any, persistent: Any, mesh: Any) -> dict:
    """The guide: the latest in-memory snapshot; without one, the persistent checkpoint; else a new state."""
    import orbax.checkpoint as ocp

    abstract = rig.abstract(mesh)
    if snapshotter.latest is not None:
        snapshotter.join()
        state = snapshotter.load(abstract)
        rig.restored(state, "snapshot")
    elif (latest := persistent.latest_step()) is not None:
        state = persistent.restore(latest, args=ocp.args.StandardRestore(abstract))
        rig.restored(state, "persistent checkpoint")
    else:
        state = rig.initial(mesh)
        rig.restored(state, "scratch")
    return state


def run_orbax(rig: Rig) -> dict[str, Any]:
    """The guide's loop: Snapshotter + Orbax's CheckpointManager; returns the system's own figures."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter
    from pathwaysutils.elastic import manager as elastic_manager

    from bench.goodput_worker import bucket_interval_steps

    devices = rig.slices.devices
    own: dict[str, Any] = {}
    elastic = elastic_manager.Manager(devices)
    snapshotter = Snapshotter(replica_axis_index=0)
    folder = rig.scratch / "persistent"

    def persistent_manager(interval: int) -> Any:
        return ocp.CheckpointManager(
            folder,
            options=ocp.CheckpointManagerOptions(
                save_interval_steps=interval, max_to_keep=2, enable_async_checkpointing=True
            ),
        )

    persistent = persistent_manager(1)

    @_elastic_retry(elastic, rig)
    def attempt() -> None:
        nonlocal persistent
        slices = sorted(elastic.active_slice_indices)
        rig.attempt(slices)
        mesh = mesh_of(active_devices(elastic))
        try:
            if "interval_steps" not in own:
                state = own_calibration(rig, own, snapshotter, persistent, mesh)
                persistent.close()
                own["persistent_interval_steps"] = bucket_interval_steps(
                    rig.opts.bucket_seconds, rig.opts.step_seconds, own["interval_steps"]
                )
                persistent = persistent_manager(own["persistent_interval_steps"])
                rig.start_clock(state)
            else:
                state = _orbax_restore(rig, snapshotter, persistent, mesh)
            while not rig.done():
                rig.before_step(slices)
                state = rig.train(state, len(slices))
                step = rig.step_of(state)
                if step % own["interval_steps"] == 0:
                    snapshotter.save(step, state)
                persistent.save(step, args=ocp.args.StandardSave(state))
                if new := elastic.available_inactive_slices:  # the guide's in-place scale-up
                    rig.noticed(sorted(new))
                    elastic.active_slice_indices = elastic.active_slice_indices | new
                    slices = sorted(elastic.active_slice_indices)
                    mesh = mesh_of(active_devices(elastic))
                    state = jax.device_put(state, jax.tree.map(lambda a: a.sharding, rig.abstract(mesh)))
                    rig.attempt(slices)
                    rig.restored(state, "in place")
        except jax.errors.JaxRuntimeError:
            rig.detected()
            raise

    try:
        attempt()
    finally:
        snapshotter.join()
        persistent.wait_until_finished()
        persistent.close()
    return own


def own_calibration(rig: Rig, own: dict, snapshotter: Any, persistent: Any, mesh: Any) -> dict:
    """The snapshot's cost (its interval from it) and the persistent checkpoint's, as ours is measured."""
    import orbax.checkpoint as ocp

    state, block, full = calibrate(rig, snapshotter.save, snapshotter.join, rig.initial(mesh))
    own.update(save_block_seconds=round(block, 4), save_full_seconds=round(full, 4))
    own["interval_steps"] = rig.young_daly(block, full)
    t = time.monotonic()
    persistent.save(2, args=ocp.args.StandardSave(state))
    own["persistent_save_block_seconds"] = round(time.monotonic() - t, 4)
    persistent.wait_until_finished()
    own["persistent_save_full_seconds"] = round(time.monotonic() - t, 4)
    return state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--options", required=True, help="JSON of bench.goodput_pathways_rig.PathwaysOptions")
    p.add_argument("--scratch", required=True)
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with start_rig(args.system, json.loads(args.options), Path(args.scratch)) as rig:
        own = (run_ours if args.system == "ours" else run_orbax)(rig)
        result = {**own, **rig.result()}
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
