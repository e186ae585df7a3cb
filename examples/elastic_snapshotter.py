"""The Pathways guide's elastic loop: Orbax's in-memory Snapshotter for elastic events, multi-tier
checkpoints for restarts, lost replicas, FSDP state and preemption; on 8 CPU devices as 2 slices.

    python examples/elastic_snapshotter.py [--state fsdp|replicated|both] [--pause-resume]

Same as ``mtc demo --elastic --snapshotter``. The loop is
``controller_client.demo.elastic_snapshot.train_with_snapshots``, written as the guide writes it::

    pathwaysutils.initialize()
    elastic_manager = manager.Manager()
    snapshotter = ocp.v1.training.pathways.Snapshotter()        # orbax-checkpoint >= 0.12.6
    options = CheckpointManagerOptions(..., preemption_scope="slices")  # a notice stops its slices only
    ckpt = ElasticCheckpointer(options, topology=HostTopology.from_devices(jax.devices()),
                               devices=active_devices(elastic_manager), snapshotter=snapshotter)
    leaving = LeavingSlices(hold_seconds=70)                  # grace period + the monitor's poll interval

    @elastic_manager.elastic_retry(minimum_slice_count=1,     # None: pause and resume
                                   retry_policy=manager.ElasticRetryLimit(max_attempts=10))
    def train_loop():
        leaving.keep_out(elastic_manager)                     # a slice dropped for its notice stays out
        mesh = create_mesh(active_devices(elastic_manager))   # shim: pathwaysutils 0.1.13 lacks the property
        restored = ckpt.restore(abstract_state(mesh))         # the snapshot or the checkpoint: the newer
        ...
        while step < total_steps:
            if new := leaving.returnable(elastic_manager.available_inactive_slices):  # in-place scale-up
                elastic_manager.active_slice_indices |= new
                mesh = create_mesh(active_devices(elastic_manager))
                state = jax.device_put(state, shardings(mesh))
            state = train_step(state, next(data))
            saved = ckpt.save(step, state)                    # snapshot every step, checkpoint every N
            noticed = ckpt.noticed_slices()                   # suspend-resume (docs/elastic.md)
            if noticed and noticed >= ckpt.manager.active_slices:   # every active slice: the job suspends
                if not saved:
                    ckpt.save(step, state, force=True)
                # backup_now(wait=True): the step in the bucket before the JobSet restart deletes the Pods
                sys.exit(preemption_exit.finish_preempted(ckpt))    # 75: the JobSet resumes, never Completed
            if noticed:                                       # some slices: drop them in place, go on
                leaving.drop(noticed)
                elastic_manager.active_slice_indices -= noticed
                mesh = create_mesh(active_devices(elastic_manager))
                state = jax.device_put(state, shardings(mesh))  # their shards still answer in the grace period

Slice 1 is lost (its buffers deleted, a ``DATA_LOSS`` error raised), training shrinks to slice 0 from the
snapshot (replicated state) or the checkpoint (FSDP state, whose part on slice 1 is gone), slice 1 returns
and joins in place, the controller restarts (no snapshot survives) with slice 1 replaced by empty hosts that
refill from their peers. The losses equal an uninterrupted run's. Needs the ``[jax,elastic]`` extras.
"""

from __future__ import annotations

import argparse
import sys

from controller_client.demo.elastic_snapshot import run_snapshot_demo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", choices=["fsdp", "replicated", "both"], default="both")
    p.add_argument("--pause-resume", action="store_true", help="minimum_slice_count=None: wait for every slice")
    p.add_argument("--workdir", help="directory for the simulated hosts' RAM dirs (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    args = p.parse_args(argv)
    kinds = ("replicated", "fsdp") if args.state == "both" else (args.state,)
    return run_snapshot_demo(args.workdir, keep=args.keep, kinds=kinds, pause_resume=args.pause_resume)


if __name__ == "__main__":
    sys.exit(main())
