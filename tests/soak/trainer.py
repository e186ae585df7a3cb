"""The soak test's training process: 12 simulated hosts (2 slices x 6), a save every second.

At start it restores the newest globally complete step through the replicators (when there is one) and
checks it bit-exact against the deterministic state of that step, then saves the following steps, one per
``--interval`` seconds, until killed or ``--until-step``. Every event is one JSON line in ``--events``.
``--verify`` only restores and checks (the soak's final check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=12"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from controller_client.manager import CheckpointManager, CheckpointManagerOptions  # noqa: E402
from controller_client.topology import HostTopology  # noqa: E402

SLICES, HOSTS_PER_SLICE = 2, 6


def state(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(SLICES, HOSTS_PER_SLICE), ("data", "model"))
    rng = np.random.default_rng(step)
    return {
        "w": jax.device_put(rng.standard_normal((8, 6 * 512)).astype(np.float32), NamedSharding(mesh, P("data", "model"))),
        "r": jax.device_put(rng.integers(0, 1 << 30, (4, 6 * 64), dtype=np.int32), NamedSharding(mesh, P(None, "model"))),
        "key": jax.device_put(jax.random.key(step), NamedSharding(mesh, P())),
        "step": step,
    }


def target() -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        state(0))


def equal(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, jax.Array):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        elif x != y:
            return False
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--template", required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--verify", action="store_true")
    a = p.parse_args()
    events = open(a.events, "a", buffering=1)  # noqa: SIM115 - line-buffered: a SIGKILL loses at most one line

    def emit(**kw) -> None:
        events.write(json.dumps({"pid": os.getpid(), "t": time.time(), **kw}) + "\n")

    devs = jax.devices()
    opts = CheckpointManagerOptions(local_directory=a.template, job_name="t", coordinator_address=a.coordinator,
                                    dispatcher="in_process", restore_wait_seconds=60, rpc_timeout_seconds=10)
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, SLICES, HOSTS_PER_SLICE))
    step = 1
    for attempt in range(5):
        try:
            latest = mgr.latest_step()
            if latest is None:
                break
            got = mgr.restore(None, target())
            ok = equal(got, state(got["step"]))
            emit(event="restored", step=int(got["step"]), ok=ok)
            if not ok:
                return 4
            step = int(got["step"]) + 1
            break
        except Exception as e:  # a replicator being restarted right now: try again
            emit(event="restore_error", attempt=attempt, error=f"{type(e).__name__}: {e}"[:500])
            time.sleep(1.0)
    else:
        return 3
    if a.verify:
        return 0
    while True:
        t0 = time.monotonic()
        try:
            mgr.save(step, state(step), force=True)
            mgr.wait_until_finished()
            emit(event="saved", step=step)
        except Exception as e:
            emit(event="save_error", step=step, error=f"{type(e).__name__}: {e}"[:500])
        step += 1
        time.sleep(max(0.0, a.interval - (time.monotonic() - t0)))


if __name__ == "__main__":
    sys.exit(main())
