"""A small sharded JAX state and an in-process CheckpointManager over 4 simulated hosts (2 slices x 2)."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from controller_client.manager import CheckpointManager, CheckpointManagerOptions  # noqa: E402
from controller_client.topology import HostTopology  # noqa: E402


def manager(template: str) -> CheckpointManager:
    devs = jax.devices()
    opts = CheckpointManagerOptions(local_directory=template, job_name="t", dispatcher="in_process",
                                    max_to_keep=2)
    return CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))


def state(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal((8, 64)).astype(np.float32), NamedSharding(mesh, P("data", "model"))),
            "step": step}


def target() -> dict:
    s = state(0)
    return {"w": jax.ShapeDtypeStruct(s["w"].shape, s["w"].dtype, sharding=s["w"].sharding), "step": 0}
