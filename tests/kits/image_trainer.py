"""Test kit: a training process's checkpoint calls, run in a container of the sidecar image against replicator
containers (tests/deploy/test_image_work.py), and the trees the image tests save and compare.

``python -m tests.kits.image_trainer save|restore ...``: 8 CPU devices as 2 slices x 2 simulated hosts, host
``h``'s RAM disk at ``<ram>/<h>`` (the replicator containers' ``/local``); prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def state(step: int, devices: Any, shape: tuple[int, int] = (2, 4)) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices).reshape(shape), ("data", "model"))
    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal((16, 64)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "v": jax.device_put(rng.standard_normal((8, 32)).astype(np.float32), NamedSharding(mesh, P(None, "model"))),
            "rng": jax.device_put(jax.random.key(step), NamedSharding(mesh, P())),
            "host": np.arange(5, dtype=np.int64) * step,
            "step": step}


def target_on(tree: dict, devices: Any, shape: tuple[int, int]) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices).reshape(shape), ("data", "model"))
    specs = {"w": P("data", "model"), "v": P(None, "model"), "rng": P()}
    out = {k: jax.ShapeDtypeStruct(tree[k].shape, tree[k].dtype, sharding=NamedSharding(mesh, s))
           for k, s in specs.items()}
    return {**out, "host": np.zeros(5, np.int64), "step": tree["step"]}


def differences(a: dict, b: dict) -> list[str]:
    """The keys whose values differ (dtype or bytes); PRNG keys compared by their key data."""
    import jax
    import numpy as np

    bad = []
    for k, x in a.items():
        y = b[k]
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray)):
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["save", "restore"])
    p.add_argument("--ram", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--steps", type=int, nargs="*", default=[])
    p.add_argument("--shape", default="2x4", help="the restore's mesh")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.topology import HostTopology

    devs = jax.devices()
    opts = CheckpointManagerOptions(local_directory=os.path.join(args.ram, "{host}"), job_name="t",
                                    coordinator_address=args.coordinator, restore_wait_seconds=60,
                                    rpc_timeout_seconds=10)
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, slices=2, hosts_per_slice=2))
    out: dict[str, Any] = {}
    if args.action == "save":
        for step in args.steps:
            if not mgr.save(step, state(step, devs)):
                raise SystemExit(f"save({step}) declined")
            mgr.wait_until_finished()
        out["saved"] = list(args.steps)
    else:
        step = args.steps[0] if args.steps else mgr.latest_step()
        shape = tuple(int(n) for n in args.shape.split("x"))
        want = state(step, devs)
        got = mgr.restore(step, target_on(want, devs, shape))
        out.update(step=step, differences=differences(want, got))
    mgr.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
