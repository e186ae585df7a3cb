"""The cluster tests' elastic Pathways controller: the rendered head Pod's ``controller`` container.

The simulated Pathways (``tests/kits/pathways_remote.py``): this process is the Pathways client (its devices
carry the slice and host attributes), the worker Pods' ``pathways-worker`` processes dial it on the proxy's
port and run the colocated Python of our ``CheckpointManager``; pathwaysutils' health check counts a slice
healthy while its workers are there. The loop is the shipped elastic loop (``mtc demo --elastic``,
``controller_client/demo/elastic.py``; docs/elastic.md): one ``pathwaysutils`` ``Manager``, the training
function under ``elastic_retry(minimum_slice_count=1)``, a ``CheckpointManager`` over the active devices with
the full topology and ``preemption_scope="slices"``; after every step ``noticed_slices()``: a notice to some
slices drops them in place (kept out of scale-ups by ``LeavingSlices``), a notice to every slice saves, waits
until the step is durable and exits 75; a returning slice scales up (the step saved, ``ScaleUpSignalError``,
the next attempt restores it onto every slice). The state of step ``s`` is a function of ``s`` alone, so each
restore is checked bit for bit. Every event is one JSON line in ``$MTC_TEST_RESULTS/events.jsonl``
(CLOCK_MONOTONIC), with the slices it ran on.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = (64, 256)
PROXY_PORT = 29000  # tests/cluster/pathways_images.py: where the workers dial the controller


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise SystemExit(f"train_elastic.py: {name} is not set")
    return value


def emit(ev: str, **kw: Any) -> None:
    line = json.dumps({"t": time.monotonic(), "ev": ev, "rank": -1, **kw})
    with open(Path(_env("MTC_TEST_RESULTS", "/results")) / "events.jsonl", "a") as f:
        f.write(line + "\n")


def make_state(step: int, mesh: Any) -> dict[str, Any]:
    """Step ``step``'s state: ``w`` split over "model" (each slice holds all of it), ``b`` replicated."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal(SHAPE).astype(np.float32), NamedSharding(mesh, P(None, "model"))),
            "b": jax.device_put(rng.integers(0, 1 << 30, SHAPE[1], dtype=np.int32), NamedSharding(mesh, P()))}


def differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The leaves of ``got`` whose shards differ from ``want``'s in a single bit (or in shape, dtype)."""
    import numpy as np

    bad = []
    for k, w in want.items():
        g = got[k]
        same = w.dtype == g.dtype and w.shape == g.shape and w.sharding == g.sharding
        by_dev = {s.device.id: np.asarray(s.data).tobytes() for s in g.addressable_shards}
        if not same or any(by_dev.get(s.device.id) != np.asarray(s.data).tobytes() for s in w.addressable_shards):
            bad.append(k)
    return bad


class Loop:
    """The shipped elastic loop over the simulated Pathways (see the module docstring)."""

    def __init__(self, sim: Any) -> None:
        from pathwaysutils.elastic import manager

        from controller_client.manager import CheckpointManagerOptions
        from controller_client.resilience import LeavingSlices
        from controller_client.topology import HostTopology

        self.sim = sim
        self.topology = HostTopology.from_devices(sim.devices)  # the full allocation: ranks never change
        self.elastic = manager.Manager(sim.devices)
        self.leaving = LeavingSlices(float(_env("MTC_TEST_NOTICE_HOLD_SECONDS", "70")))
        self.opts = CheckpointManagerOptions(
            local_directory=_env("MTC_LOCAL_DIRECTORY"), job_name=_env("JOBSET_NAME"),
            save_interval_steps=int(_env("MTC_TEST_SAVE_EVERY", "4")), coordinator_address=_env("MTC_COORDINATOR"),
            token_file=os.environ.get("MTC_TOKEN_FILE") or None, restore_wait_seconds=120, rpc_timeout_seconds=10,
            preemption_scope="slices")
        self.step_seconds = float(_env("MTC_TEST_STEP_SECONDS", "0.25"))
        self.steps = int(_env("MTC_TEST_STEPS", "1000000"))
        self.per_slice = len(sim.devices) // sim.slices
        self.mgr: Any = None
        self.exit_code = 0

    def on(self, slices: list[int]) -> tuple[list[Any], Any]:
        """The active devices and mesh of ``slices``, with a new manager over them."""
        import numpy as np
        from jax.sharding import Mesh

        from controller_client.manager import CheckpointManager

        active = [d for s in slices for d in self.elastic.slice_to_devices[s]]
        mesh = Mesh(np.array(active).reshape(len(slices), self.per_slice), ("replica", "model"))
        old, self.mgr = self.mgr, None
        if old is not None:
            old.close()
        self.mgr = CheckpointManager(self.opts, devices=active, topology=self.topology)
        return active, mesh

    def run(self) -> int:
        from pathwaysutils.elastic import manager

        from controller_client.resilience import close_after_failure

        def lost_attempt(*_: Any) -> None:
            mgr, self.mgr = self.mgr, None
            if mgr is not None:
                close_after_failure(mgr, "after an elastic event")

        @self.elastic.elastic_retry(minimum_slice_count=1, poll_interval=1, timeout=300,
                                    retry_policy=manager.ElasticRetryLimit(max_attempts=10),
                                    on_elastic_event_callback=lost_attempt)
        def attempt() -> None:
            self.attempt()

        try:
            attempt()
        finally:
            if self.mgr is not None:
                self.mgr.close()
        return self.exit_code

    def attempt(self) -> None:
        import jax
        from pathwaysutils.elastic import manager

        from controller_client import preemption_exit
        from sidecar.failures import StepAlreadyExistsError

        self.leaving.keep_out(self.elastic)  # elastic_retry took every healthy slice, a leaving one too
        slices = sorted(self.elastic.active_slice_indices)
        emit("attempt", slices=slices)
        _, mesh = self.on(slices)
        step = self.mgr.latest_step()
        if step is None:
            step = 0
            emit("fresh", slices=slices)
        else:
            want = make_state(step, mesh)
            got = self.mgr.restore(step, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                                          for k, v in want.items()})
            emit("restored", step=step, slices=slices, differences=differences(want, got))
        state = make_state(step, mesh)
        first = True
        while step < self.steps:
            if new := self.leaving.returnable(self.elastic.available_inactive_slices):
                with contextlib.suppress(StepAlreadyExistsError):  # saved at its interval already
                    self.mgr.save(step, state, force=True)
                self.mgr.wait_until_finished()
                emit("scale_up", step=step, slices=slices, new=sorted(new))
                raise manager.ScaleUpSignalError()
            time.sleep(self.step_seconds)
            step += 1
            state = make_state(step, mesh)
            emit("first_step" if first else "step", step=step, slices=slices)
            first = False
            saved = self.mgr.save(step, state)
            if saved:
                self.mgr.wait_until_finished()
                emit("saved", step=step, slices=slices)
            noticed = self.mgr.noticed_slices()
            if noticed and noticed >= self.mgr.active_slices:  # every active slice: the job suspends
                if not saved:
                    with contextlib.suppress(StepAlreadyExistsError):
                        self.mgr.save(step, state, force=True)
                self.exit_code = preemption_exit.finish_preempted(self.mgr)
                emit("exit", step=step, slices=slices, code=self.exit_code)
                return
            if noticed:  # some slices: dropped in place, the others go on
                emit("notice", step=step, slices=slices, noticed=sorted(noticed))
                self.leaving.drop(noticed)
                slices = [s for s in slices if s not in noticed]
                self.elastic.active_slice_indices = frozenset(slices)
                _, mesh = self.on(slices)
                state = jax.device_put(state, {k: v.sharding for k, v in make_state(step, mesh).items()})
                emit("dropped", step=step, slices=slices)
        emit("exit", step=step, slices=slices, code=0)


def main() -> int:
    slices, hosts = int(_env("MTC_TEST_SLICES")), int(_env("MTC_TEST_HOSTS_PER_SLICE"))
    per_host = int(_env("MTC_TEST_DEVICES_PER_HOST", "2"))
    # The manifests point JAX at the IFRT proxy; the simulated Pathways client is this process's CPU devices.
    os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={slices * hosts * per_host}")
    emit("start")
    from pathwaysutils.elastic import elastic

    from tests.kits.pathways_remote import RemotePathwaysSim

    with RemotePathwaysSim(slices, hosts, ("0.0.0.0", PROXY_PORT), bytes.fromhex(_env("MTC_SIM_AUTHKEY"))) as sim:
        elastic.get_active_slice_indices = sim.active_slices  # a slice is healthy while its workers are there
        emit("pathways_up", hosts=len(sim.hosts))
        return Loop(sim).run()


if __name__ == "__main__":
    sys.exit(main())
