"""One JAX process of a multi-controller Orbax job, driven by the tests in this folder.

Runs Orbax's own ``initialize_multi_tier_checkpointing`` + ``ReplicatorCheckpointManager`` unchanged; only
the arguments (and the Slurm-style cluster variables set by the launcher) come from the test.
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


def expected_state(step: int, layout: str, num_devices: int) -> dict[str, np.ndarray]:
    """The global pytree saved at ``step`` (deterministic, so a restore can be checked bit for bit)."""
    rng = np.random.default_rng(1000 + step)
    rows = 2 * num_devices
    return {
        "w": rng.standard_normal((rows, 6), dtype=np.float32),
        "b": np.arange(rows, dtype=np.int32) * (step + 1),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-dir", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--save-steps", default="")
    parser.add_argument("--restore-step", type=int, default=-1)
    parser.add_argument("--layout", choices=("sharded", "replicated"), default="sharded")
    parser.add_argument(
        "--perturb-step", type=int, default=-1, help="this process saves a changed value at that step"
    )
    parser.add_argument("--num-slices", type=int, default=0, help="0: let Orbax count slices")
    parser.add_argument("--init-timeout", type=int, default=20)
    parser.add_argument("--use-mtc-process-ids", type=int, default=1)
    parser.add_argument("--backup-interval-steps", type=int, default=5)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import jax
    import orbax.checkpoint as ocp
    from absl import flags
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization,
        replicator_checkpoint_manager,
    )

    # Orbax uses absl flags; outside absl.app they must be parsed (after importing Orbax, which defines
    # them). MaxText sets this one for MTC: per-process names (ocdbt.process_<id>) then follow the
    # distributed process id from jax-init-info.txt rather than jax.process_index().
    flags.FLAGS(["orbax_worker", "--experimental_orbax_use_distributed_process_id=true"])

    result: dict = {"events": []}
    t0 = time.monotonic()
    local_dir = Path(args.local_dir)
    try:
        # Exactly what a MaxText/Orbax user calls; process ids come from jax-init-info.txt (use_mtc_process_ids)
        # or from the cluster environment (Slurm variables set by the test launcher).
        initialization.initialize_multi_tier_checkpointing(
            local_dir,
            run_name=args.job,
            num_slices=args.num_slices or None,
            backup_interval_steps=args.backup_interval_steps,
            jax_initialization_timeout_seconds=args.init_timeout,
            jax_shutdown_timeout_seconds=5,
            use_mtc_process_ids=bool(args.use_mtc_process_ids),
        )
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on the type
        result["init_error"] = f"{type(e).__name__}: {e}"
        Path(args.result).write_text(json.dumps(result))
        logging.shutdown()
        os._exit(3)  # skip JAX's distributed shutdown barrier: the other process may be gone
    result["init_seconds"] = time.monotonic() - t0
    result["process_index"] = jax.process_index()
    result["process_count"] = jax.process_count()

    devices = np.array(jax.devices()).reshape(jax.process_count(), -1)
    if args.layout == "sharded":
        mesh = Mesh(devices.reshape(-1), ("x",))
        spec = PartitionSpec("x")
    else:
        # Processes along "data": every process holds a full copy (a data-parallel replica).
        mesh = Mesh(devices, ("data", "model"))
        spec = PartitionSpec("model")
    sharding = NamedSharding(mesh, spec)
    n = jax.device_count()

    def to_global(tree: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {
            k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in tree.items()
        }

    options = replicator_checkpoint_manager.ReplicatorCheckpointManagerOptions(save_interval_steps=1)
    mgr = replicator_checkpoint_manager.ReplicatorCheckpointManager(local_dir, options, global_mesh=mesh)
    result["steps_at_start"] = list(mgr.all_steps())
    if args.restore_step >= 0:
        result["latest_before_restore"] = mgr.latest_step()
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for k, v in expected_state(args.restore_step, args.layout, n).items()
        }
        restored = mgr.restore(
            None,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
                )
            ),
        )
        state = restored["state"]
        want = expected_state(args.restore_step, args.layout, n)
        ok = True
        for k, v in want.items():
            arr = state[k]
            for shard in arr.addressable_shards:
                got = np.asarray(shard.data)
                if got.dtype != v.dtype or got.tobytes() != v[shard.index].tobytes():
                    ok = False
        result["restore_bit_exact"] = ok
    for step in [int(s) for s in args.save_steps.split(",") if s]:
        tree = expected_state(step, args.layout, n)
        if step == args.perturb_step:
            tree["w"][0, 0] += 1.0
        saved = mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(to_global(tree))))
        result["events"].append(["save", step, bool(saved)])
    mgr.wait_until_finished()
    result["steps_at_end"] = list(mgr.all_steps())
    mgr.close()
    result["total_seconds"] = time.monotonic() - t0
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
