"""One JAX process of an Orbax multi-tier checkpointing job run against real `mtc replicator` daemons.

The Orbax calls are the unchanged public ones (``initialize_multi_tier_checkpointing`` +
``ReplicatorCheckpointManager``); the test only chooses arguments. The mesh is ``(slices, devices per
slice)`` with axes ``("data", "model")`` and the state is sharded over ``"model"``: hosts holding the
same in-slice position in different slices are data-parallel replicas (byte-identical OCDBT values).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np


def expected_state(step: int, rows: int) -> dict[str, np.ndarray]:
    """The global pytree saved at ``step`` (deterministic, so a restore is checked bit for bit)."""
    rng = np.random.default_rng(7000 + step)
    return {
        "w": rng.standard_normal((rows, 6), dtype=np.float32),
        "b": np.arange(rows, dtype=np.int32) * (step + 1),
    }


def _patch_pathways_check() -> None:
    """CPU stand-in for Pathways: Orbax's colocated manager refuses to start unless this reports True."""
    from orbax.checkpoint._src.multihost import multihost
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import replicator_checkpoint_manager

    multihost.is_pathways_backend = lambda: True
    replicator_checkpoint_manager.multihost.is_pathways_backend = lambda: True


def _restore_elastic(local_dir: Path, step: int, restore_args):
    """Restore ``step`` from this process's own ``<local>/<step>`` with public Orbax APIs, each process alone."""
    import jax
    import orbax.checkpoint as ocp

    mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={jax.process_index()},
                                            barrier_sync_key_prefix="elastic")
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, multiprocessing_options=mp)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeRestore, handler)
    mngr = ocp.CheckpointManager(
        local_dir, options=ocp.CheckpointManagerOptions(multiprocessing_options=mp, create=False),
        handler_registry=registry,
    )
    try:
        return mngr.restore(step, args=restore_args)
    finally:
        mngr.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--slices", type=int, default=1)
    p.add_argument("--save-steps", default="")
    p.add_argument("--save-sleep", type=float, default=0.0, help="seconds between saves")
    p.add_argument("--restore-step", type=int, default=-1)
    p.add_argument("--backup-interval-steps", type=int, default=0)
    p.add_argument("--backup-interval-minutes", type=int, default=0)
    p.add_argument("--init-timeout", type=int, default=60)
    p.add_argument("--colocated", type=int, default=0)
    p.add_argument("--elastic", type=int, default=0, help="the process count changed since the save")
    p.add_argument("--keep-latest", type=int, default=0, help="Orbax preservation policy LatestN (0: none)")
    p.add_argument("--delete-restored", type=int, default=0, help="mgr.delete() the restored step")
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import jax
    import orbax.checkpoint as ocp
    from absl import flags
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization,
        replicator_checkpoint_manager,
    )

    flags.FLAGS(["worker", "--experimental_orbax_use_distributed_process_id=true"])
    if args.colocated:
        _patch_pathways_check()

    result: dict = {"events": []}
    t0 = time.monotonic()
    local_dir = Path(args.local_dir)
    try:
        initialization.initialize_multi_tier_checkpointing(
            local_dir,
            run_name=args.job,
            num_slices=args.slices,
            backup_interval_steps=args.backup_interval_steps or None,
            backup_interval_minutes=args.backup_interval_minutes or None,
            jax_initialization_timeout_seconds=args.init_timeout,
            jax_shutdown_timeout_seconds=5,
            use_colocated_python=bool(args.colocated),
        )
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on the type and text
        result["init_error"] = f"{type(e).__name__}: {e}"
        Path(args.result).write_text(json.dumps(result))
        logging.shutdown()
        os._exit(3)  # skip JAX's distributed shutdown barrier: the other processes may be gone
    result["init_seconds"] = time.monotonic() - t0

    devices = np.array(jax.devices()).reshape(args.slices, -1)
    mesh = Mesh(devices, ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("model"))
    rows = 2 * devices.shape[1]

    def to_global(tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in tree.items()
        }

    policy = ocp.checkpoint_managers.LatestN(args.keep_latest) if args.keep_latest else None
    options = replicator_checkpoint_manager.ReplicatorCheckpointManagerOptions(
        save_interval_steps=1, use_colocated_python=bool(args.colocated), preservation_policy=policy
    )
    mgr = replicator_checkpoint_manager.ReplicatorCheckpointManager(local_dir, options, global_mesh=mesh)
    result["latest_at_start"] = mgr.latest_step()
    if args.restore_step >= 0:
        want = expected_state(args.restore_step, rows)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in want.items()}
        restore_args = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
            )
        )
        try:
            restored = mgr.restore(None, args=restore_args)["state"]
        except ValueError as e:
            if not args.elastic:
                raise
            # Multi-controller Orbax refuses a changed process count (Pathways' colocated mode skips that
            # check): read this process's restored <local>/<N> with a per-process Orbax CheckpointManager.
            result["orbax_restore_error"] = str(e)
            restored = _restore_elastic(local_dir, mgr.latest_step(), restore_args)["state"]
        ok = True
        for k, v in want.items():
            for shard in restored[k].addressable_shards:
                got = np.asarray(shard.data)
                if got.dtype != v.dtype or got.tobytes() != v[shard.index].tobytes():
                    ok = False
        result["restore_bit_exact"] = ok
        if args.delete_restored:
            restored_step = mgr.latest_step()
            mgr.delete(restored_step)  # Orbax's own step deleter on the restored <local>/<N>
            result["events"].append(["delete", restored_step])
    for i, step in enumerate(int(s) for s in args.save_steps.split(",") if s):
        if i and args.save_sleep:
            time.sleep(args.save_sleep)
        saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(to_global(expected_state(step, rows)))))
        mgr.wait_until_finished()
        result["events"].append(["save", step, bool(saved)])
    mgr.close()
    result["total_seconds"] = time.monotonic() - t0
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
