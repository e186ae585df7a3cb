"""The cluster tests' training program: ``/app/train.py`` of the rendered multi-controller native worker Pods.

One JAX process per worker Pod (``jax.distributed.initialize`` from the Pod's ``JAX_*`` variables, gloo
collectives across the Pod network), our ``CheckpointManager`` in multi-controller mode on the Pod's
``MTC_*`` variables, exactly as docs/deploy.md tells a user to write it. The train state of step ``s`` is a
function of ``s`` alone, so a restore is checked bit for bit against it without a saved copy.

It restores the newest step (or starts at 0), trains ``MTC_TEST_STEPS`` steps of ``MTC_TEST_STEP_SECONDS``,
saves every ``MTC_TEST_SAVE_EVERY`` steps, and on a preemption notice saves the step it is at, waits until
that step is in the bucket (``backup_now(wait=True)``) and exits 75 (controller_client/preemption_exit.py).
Every event goes to ``$MTC_TEST_RESULTS/events.jsonl`` as one JSON line with CLOCK_MONOTONIC (one clock for
every process of the machine, the test's included).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = (64, 256)


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise SystemExit(f"train.py: {name} is not set")
    return value


class Events:
    def __init__(self, rank: int) -> None:
        self.path = Path(_env("MTC_TEST_RESULTS", "/results")) / "events.jsonl"
        self.rank = rank
        self.pod = os.environ.get("HOSTNAME", "")

    def emit(self, ev: str, **kw: Any) -> None:
        line = json.dumps({"t": time.monotonic(), "ev": ev, "rank": self.rank, "pod": self.pod, **kw})
        with open(self.path, "a") as f:
            f.write(line + "\n")


def make_state(step: int, sharding: Any) -> dict[str, Any]:
    import jax
    import numpy as np

    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal(SHAPE).astype(np.float32), sharding),
            "b": jax.device_put(rng.integers(0, 1 << 30, SHAPE[1], dtype=np.int32), sharding.__class__(
                sharding.mesh, jax.sharding.PartitionSpec(None)))}


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    import numpy as np
    from jax.experimental import multihost_utils

    bad = []
    for k, w in want.items():
        g = got[k]
        local_w = [np.asarray(s.data).tobytes() for s in w.addressable_shards]
        local_g = [np.asarray(s.data).tobytes() for s in g.addressable_shards]
        same = np.int32(local_w == local_g and w.dtype == g.dtype and w.shape == g.shape)
        if not bool(np.asarray(multihost_utils.process_allgather(same)).all()):
            bad.append(k)
    return bad


def main() -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    rank = int(_env("JAX_PROCESS_ID"))
    events = Events(rank)
    events.emit("start")
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from controller_client.jax_service import reachable_address
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.preemption_exit import exit_code
    from controller_client.topology import HostTopology

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Not the name itself: after a restart it may still resolve to the old process 0's Pod (jax_service.py).
    jax.distributed.initialize(coordinator_address=reachable_address(_env("JAX_COORDINATOR_ADDRESS"), rank, 120),
                               num_processes=int(_env("JAX_NUM_PROCESSES")), process_id=rank,
                               initialization_timeout=120,
                               # The Pod sets KUBERNETES_SERVICE_HOST but mounts no service-account token
                               # (automountServiceAccountToken: false): JAX's Kubernetes auto-detection, run
                               # even when every argument is given, would raise reading the token.
                               cluster_detection_method="deactivate")
    hosts_per_slice = int(_env("HOSTS_PER_SLICE"))
    processes = int(_env("JAX_NUM_PROCESSES"))
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(processes // hosts_per_slice, -1), ("replica", "model"))
    sharding = NamedSharding(mesh, P(None, "model"))
    opts = CheckpointManagerOptions(local_directory=_env("MTC_LOCAL_DIRECTORY"), job_name=_env("JOBSET_NAME"),
                                    dispatcher="in_process", coordinator_address=_env("MTC_COORDINATOR"),
                                    token_file=os.environ.get("MTC_TOKEN_FILE") or None,
                                    restore_wait_seconds=120, rpc_timeout_seconds=10)
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(
        devs, processes // hosts_per_slice, hosts_per_slice))
    steps = int(_env("MTC_TEST_STEPS", "1000000"))
    every = int(_env("MTC_TEST_SAVE_EVERY", "5"))
    step_seconds = float(_env("MTC_TEST_STEP_SECONDS", "0.2"))

    def any_host(flag: bool) -> bool:
        return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())

    latest = mgr.latest_step()
    step = 0
    if latest is not None:
        want = make_state(latest, sharding)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in want.items()}
        got = mgr.restore(latest, abstract)
        bad = differences(want, got)
        events.emit("restored", step=latest, differences=bad)
        if bad:
            raise SystemExit(f"step {latest} restored with different {bad}")
        step = latest
    else:
        events.emit("fresh")
    first = True
    preempted = False
    while step < steps:
        time.sleep(step_seconds)
        step += 1
        if first:
            events.emit("first_step", step=step)
            first = False
        if step % every == 0:
            mgr.save(step, make_state(step, sharding))
            mgr.wait_until_finished()
            events.emit("saved", step=step)
        if any_host(mgr.reached_preemption(step)):
            preempted = True
            if step % every:
                mgr.save(step, make_state(step, sharding), force=True)
                mgr.wait_until_finished()
                events.emit("saved", step=step)
            events.emit("notice", step=step)
            mgr.backup_now(wait=True, timeout_seconds=20)
            events.emit("backed_up", step=step)
            break
    mgr.close()
    code = exit_code(preempted=preempted, steps_left=step < steps)
    events.emit("exit", step=step, code=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
