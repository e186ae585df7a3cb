"""`mtc demo`: train a small model on 8 CPU devices as 4 simulated hosts, crash, restore, compare losses."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from controller_client.demo.cluster import LocalCluster
from controller_client.topology import HostTopology
from replicator.coordinator.client import CoordinatorClient

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
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
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
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax

    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        state,
    )


def _equal(a: Any, b: Any) -> bool:
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True


def _wait(pred, timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError(f"mtc demo: timed out waiting for {what}")


def run_demo(workdir: str | None = None, keep: bool = False) -> int:
    """Run the demo; returns 0 when every restore is bit-exact and the resumed run matches."""
    _setup_jax()
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import numpy as np

    from controller_client.manager import CheckpointManager, CheckpointManagerOptions

    devices, init, train_step = _model()
    base = Path(workdir or tempfile.mkdtemp(prefix="mtc-demo-",
                                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    bucket = base / "bucket"
    cluster = LocalCluster(base, nodes=4, data_parallelism=2,
                           extra=["--backup-url", f"file://{bucket}", "--backup-interval-steps", str(SAVE_EVERY),
                                  "--metrics-port", "0"])
    topo = HostTopology.simulated(devices, slices=2, hosts_per_slice=2)
    rows: list[Row] = []
    checks: list[tuple[str, bool]] = []

    def manager() -> CheckpointManager:
        opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                        save_interval_steps=SAVE_EVERY, coordinator_address=cluster.coordinator,
                                        restore_wait_seconds=120)
        return CheckpointManager(opts, devices=devices, topology=topo)

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
                    rows.append(Row(f"save (blocked {blocked * 1000:.1f} ms)", step, _nbytes(params),
                                    time.monotonic() - t0))
        return {"params": params, "rng": rng, "step": stop}, losses

    def restore(what: str) -> Any:
        mgr = manager()
        t0 = time.monotonic()
        restored = mgr.restore(None, _abstract(init()))
        rows.append(Row(what, restored["step"], _nbytes(restored["params"]), time.monotonic() - t0))
        return mgr, restored

    left_running = False
    print(f"mtc demo: 8 CPU devices as 2 slices x 2 hosts; replicators on 127.0.0.1; RAM dirs and bucket "
          f"under {base}")
    try:
        cluster.start_all()
        final_ref, reference = train(init(), 0, TOTAL_STEPS)

        mgr = manager()
        _, first = train(init(), 0, CRASH_AFTER, mgr)
        mgr.close()
        print(f"-- the training process crashes after step {CRASH_AFTER}; RAM disks and replicators survive")
        mgr, restored = restore("restore: own RAM disk")
        latest = restored["step"]
        final, resumed = train(restored, latest, TOTAL_STEPS, mgr)
        checks.append((f"resumed losses of steps {latest + 1}..{TOTAL_STEPS} equal the uninterrupted run",
                       all(np.float32(resumed[s]) == np.float32(reference[s]) for s in resumed)
                       and all(first[s] == reference[s] for s in first)))
        mgr.close()

        client = CoordinatorClient(cluster.coordinator)
        _wait(lambda: TOTAL_STEPS in client.status().backup.committed_steps, 120,
              f"the backup of step {TOTAL_STEPS}")
        _wait(lambda: any(s.step == TOTAL_STEPS and s.redundant for s in client.status().steps), 60,
              "peer redundancy")
        client.close()

        print("-- host 3 is lost: its RAM disk is wiped and its replicator restarts empty")
        cluster.procs[3].stop()
        cluster.wipe(3)
        cluster.start(3)
        mgr, restored = restore("restore: host 3 from its peer")
        checks.append(("host 3 restored bit-exact from its data-parallel peer", _equal(restored, final)))
        mgr.close()

        print("-- every host is lost: all RAM disks wiped, all replicators restart")
        cluster.stop_all()
        for r in range(cluster.nodes):
            cluster.wipe(r)
        cluster.start_all()
        mgr, restored = restore("restore: all hosts from bucket")
        checks.append(("all hosts restored bit-exact from the local-folder bucket", _equal(restored, final)))
        mgr.close()
        checks.append(("final state equals the uninterrupted run's", _equal(final, final_ref)))
        left_running = keep  # --keep: leave the job's replicators up for the operator's commands
    finally:
        if not left_running:
            cluster.stop_all()
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)

    print(f"{'what':<34} {'step':>5} {'bytes':>10} {'ms':>9}")
    for r in rows:
        print(f"{r.what:<34} {r.step:>5} {r.nbytes:>10} {r.seconds * 1000:>9.1f}")
    for what, ok in checks:
        print(f"{'OK  ' if ok else 'FAIL'} {what}")
    if left_running:
        pids = " ".join(str(p.proc.pid) for p in cluster.procs.values() if p.proc is not None)
        print(f"-- the replicators keep running (--keep); try the operator's commands (README: Operating it):\n"
              f"   mtc status --coordinator {cluster.coordinator}\n"
              f"   mtc steps --coordinator {cluster.coordinator}\n"
              f"   mtc backups list --backup-url file://{bucket}\n"
              f"   mtc status --local-dir {cluster.ram(0)}   (shows its metrics address)\n"
              f"   stop them with: kill {pids}")
    return 0 if all(ok for _, ok in checks) else 1


def _nbytes(params: dict) -> int:
    return sum(x.nbytes for x in params.values())
