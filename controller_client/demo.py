"""`mtc demo`: train a small model on 8 CPU devices as 4 simulated hosts, crash, restore, compare losses."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

TOTAL_STEPS = 20
SAVE_EVERY = 5
CRASH_AFTER = 13


@dataclasses.dataclass
class Row:
    what: str
    step: int
    nbytes: int
    seconds: float


def _setup_jax() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _model():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit(f"mtc demo needs 8 devices, JAX sees {len(devices)}; set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))
    rep = NamedSharding(mesh, P())

    def init():
        k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
        params = {
            "w1": jax.device_put(jax.random.normal(k1, (64, 256)) * 0.1, NamedSharding(mesh, P(None, "model"))),
            "w2": jax.device_put(jax.random.normal(k2, (256, 8)) * 0.1, NamedSharding(mesh, P("model", None))),
            "scale": jax.device_put(jnp.ones((8,), jnp.bfloat16), rep),
        }
        return {"params": params, "rng": jax.device_put(k3, rep), "step": 0}

    @jax.jit
    def train_step(params, rng):
        rng, kx = jax.random.split(rng)
        x = jax.random.normal(kx, (32, 64))
        y = jnp.sin(x[:, :8])

        def loss_fn(p):
            h = jax.nn.relu(x @ p["w1"])
            out = (h @ p["w2"]) * p["scale"].astype(jnp.float32)
            return jnp.mean((out - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        new = {
            "w1": params["w1"] - 0.05 * grads["w1"],
            "w2": params["w2"] - 0.05 * grads["w2"],
            "scale": (params["scale"].astype(jnp.float32) - 0.05 * grads["scale"]).astype(jnp.bfloat16),
        }
        return new, rng, loss

    return devices[:8], init, train_step


def _abstract(state: Any) -> Any:
    import jax

    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        state,
    )


def run_demo(workdir: str | None = None, keep: bool = False) -> int:
    """Run the demo; returns 0 when the resumed run matches the uninterrupted one exactly."""
    _setup_jax()
    import numpy as np

    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.topology import HostTopology

    devices, init, train_step = _model()
    base = workdir or tempfile.mkdtemp(prefix="mtc-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ram = Path(base) / "ram" / "{host}"
    topo = HostTopology.simulated(devices, slices=2, hosts_per_slice=2)
    opts = CheckpointManagerOptions(local_directory=str(ram), job_name="demo", save_interval_steps=SAVE_EVERY)
    rows: list[Row] = []

    def train(state, start, stop, mgr=None):
        losses = {}
        params, rng = state["params"], state["rng"]
        for step in range(start + 1, stop + 1):
            params, rng, loss = train_step(params, rng)
            losses[step] = float(loss)
            if mgr is not None:
                st = {"params": params, "rng": rng, "step": step}
                t0 = time.monotonic()
                if mgr.save(step, st):
                    blocked = time.monotonic() - t0
                    mgr.wait_until_finished()
                    nbytes = sum(x.nbytes for x in (params["w1"], params["w2"], params["scale"]))
                    rows.append(Row(f"save (blocked {blocked * 1000:.1f} ms)", step, nbytes,
                                    time.monotonic() - t0))
        return {"params": params, "rng": rng, "step": stop}, losses

    print(f"mtc demo: 8 CPU devices as 2 slices x 2 hosts; RAM directories under {Path(base) / 'ram'}")
    _, reference = train(init(), 0, TOTAL_STEPS)

    mgr = CheckpointManager(opts, devices=devices, topology=topo)
    _, first = train(init(), 0, CRASH_AFTER, mgr)
    mgr.close()
    print(f"-- crash after step {CRASH_AFTER}: the training process is gone, the RAM disks survive")

    mgr = CheckpointManager(opts, devices=devices, topology=topo)
    latest = mgr.latest_step()
    t0 = time.monotonic()
    restored = mgr.restore(latest, _abstract(init()))
    dt = time.monotonic() - t0
    rows.append(Row("restore", latest, sum(x.nbytes for x in restored["params"].values()), dt))
    _, resumed = train(restored, restored["step"], TOTAL_STEPS, mgr)
    mgr.close()

    print(f"{'what':<28} {'step':>5} {'bytes':>10} {'ms':>9}")
    for r in rows:
        print(f"{r.what:<28} {r.step:>5} {r.nbytes:>10} {r.seconds * 1000:>9.1f}")
    ok = all(np.float32(resumed[s]) == np.float32(reference[s]) for s in resumed) and all(
        first[s] == reference[s] for s in first
    )
    print(f"resumed from step {latest}; losses of steps {latest + 1}..{TOTAL_STEPS} "
          f"{'EQUAL' if ok else 'DIFFER from'} the uninterrupted run "
          f"(last loss {resumed[TOTAL_STEPS]:.6f} vs {reference[TOTAL_STEPS]:.6f})")
    if not keep and workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1
