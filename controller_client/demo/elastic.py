"""`mtc demo --elastic`: the Pathways elastic training loop on 8 CPU devices as 2 simulated slices.

The loop is the one a Pathways user writes: one ``pathwaysutils.elastic.manager.Manager``, a training
function under ``@manager.elastic_retry(minimum_slice_count=1)`` that builds its mesh from the active
devices, restores the newest complete step at the start of each attempt, saves every few steps and asks to
scale up when ``available_inactive_slices`` is non-empty. ``CheckpointManager`` is the state tier, with the
full topology (ranks never change) and ``devices=`` the active devices.

What is simulated (CPU devices have no ``slice_index``, and nothing fails by itself): pathwaysutils' slice
grouping and health check are patched (:class:`SimulatedSlices`); slice 1 "fails" by raising the error a
Pathways slice-down raises (``jax.errors.JaxRuntimeError("DATA_LOSS: ...")``) and comes back later, as it
was or (``Schedule.replaced``) replaced by hosts with empty RAM disks. Replicators are real processes on
loopback. On devices with Pathways attributes (the simulated Pathways of tests/kits/pathways_sim.py) the
topology comes from them and pathwaysutils groups the slices itself; only the health check is patched.

The data is a grain pipeline read through grain's ``ElasticIterator`` (:mod:`.elastic_data`), one shard per
active slice. Its state (the global index of the next record) is saved with the train state, as a string
leaf of the checkpointed tree, and restored from the checkpoint at the start of each attempt onto however
many slices are active: step ``s`` trains on the same records on one slice or two, so the loss trajectory
equals an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controller_client.demo.cluster import LocalCluster
from controller_client.demo.run import _setup_jax
from controller_client.preemption_exit import DURABLE_WAIT_SECONDS
from controller_client.topology import HostTopology
from sidecar.failures import StepAlreadyExistsError

log = logging.getLogger(__name__)

SLICES = 2
HOSTS_PER_SLICE = 2
# elastic_retry's retry_policy (pathwaysutils.elastic.manager.ElasticRetryLimit): attempts per controller process.
RETRY_ATTEMPTS = 10
DEVICES_PER_SLICE = 4


@dataclasses.dataclass
class Schedule:
    """When slice ``lost_slice`` (1) fails and returns, in training steps."""

    total_steps: int = 24
    save_every: int = 3
    fail_at: int = 8  # the slice goes down before this step runs
    return_at: int = 14  # the slice is healthy again before this step runs
    replaced: bool = False  # the slice comes back replaced (empty RAM disks), not as it was
    lost_slice: int = 1
    notice_hold_seconds: float = 70.0  # LeavingSlices: terminationGracePeriodSeconds 60 + the monitor's 10 s
    durable_wait_seconds: float = DURABLE_WAIT_SECONDS  # backup_now(wait=True) before exit 75


class SimulatedSlices:
    """Stand-in for pathwaysutils' slice discovery on CPU: devices are grouped into slices by id (by their
    ``slice_index`` when they carry one, as on Pathways and the simulated Pathways), and a slice is healthy
    unless marked down."""

    def __init__(self, devices: list[Any], per_slice: int = DEVICES_PER_SLICE):
        self.devices = sorted(devices, key=lambda d: d.id)
        self.per_slice = per_slice
        # Pathways devices name their slice: pathwaysutils' own grouping (by slice_index) is used.
        self.pathways = all(getattr(d, "slice_index", None) is not None for d in self.devices)
        self.down: set[int] = set()
        self.history: list[str] = []  # what the loop has simulated already (so each event happens once)
        self._lock = threading.Lock()

    def slice_of(self, device: Any) -> int:
        if self.pathways:
            return int(device.slice_index)
        return self.devices.index(device) // self.per_slice

    def slice_to_devices(self, devices: Any = None) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for d in devices if devices is not None else self.devices:
            out.setdefault(self.slice_of(d), []).append(d)
        return out

    def active(self, slice_to_devices: Any = None, checker: Any = None) -> frozenset[int]:
        with self._lock:
            return frozenset(s for s in (slice_to_devices or self.slice_to_devices()) if s not in self.down)

    def fail(self, index: int) -> None:
        with self._lock:
            self.down.add(index)

    def heal(self, index: int) -> None:
        with self._lock:
            self.down.discard(index)

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Patch pathwaysutils' health check (the module the Manager calls), and its slice grouping unless
        the devices carry ``slice_index``."""
        # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
        from pathwaysutils.elastic import elastic

        saved = elastic.get_slice_to_devices, elastic.get_active_slice_indices
        if not self.pathways:
            elastic.get_slice_to_devices = self.slice_to_devices
        elastic.get_active_slice_indices = self.active
        try:
            yield
        finally:
            elastic.get_slice_to_devices, elastic.get_active_slice_indices = saved


def allocation_topology(devices: list[Any]) -> HostTopology:
    """The full allocation (ranks are its places and never change): from the devices' Pathways attributes
    when they carry them (``HostTopology.from_devices``, the manager's default), else the devices split by
    id into ``SLICES x HOSTS_PER_SLICE`` simulated hosts (CPU devices name no slice or host)."""
    if all(getattr(d, "slice_index", None) is not None for d in devices):
        return HostTopology.from_devices(devices)
    return HostTopology.simulated(devices, SLICES, HOSTS_PER_SLICE)


def replace_slice(cluster: Any, index: int) -> None:
    """Slice ``index`` comes back *replaced*: its hosts' replicators die (SIGKILL: a SIGTERM would be a
    preemption notice, which suspends the whole job), their RAM disks are emptied, new replicators start
    (ranks keep their places; what those hosts held is refilled from peers)."""
    for rank in range(index * HOSTS_PER_SLICE, (index + 1) * HOSTS_PER_SLICE):
        cluster.procs[rank].kill()
        cluster.wipe(rank)
        cluster.start(rank)


class _OneLineSimulatedFailure(logging.Filter):
    """pathwaysutils logs every slice-down error it retries with ``_logger.exception`` (a full traceback);
    for a failure the demo simulated that reads as a crash. Keep it to one line; real errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and SIMULATED in str(exc):
            message = record.getMessage()
            record.msg, record.args = "%s: %s", (message, str(exc).splitlines()[0])
            record.levelno, record.levelname = logging.WARNING, "WARNING"  # expected: not an error
            record.exc_info = None
            record.exc_text = None
        return True


SIMULATED = "(simulated)"


@contextlib.contextmanager
def quiet_simulated_failures() -> Iterator[None]:
    """While the demo runs, the retried simulated slice failures are logged as one line each."""
    target = logging.getLogger("pathwaysutils.elastic.manager")
    f = _OneLineSimulatedFailure()
    target.addFilter(f)
    try:
        yield
    finally:
        target.removeFilter(f)


def _model(kind: str):
    """A small linear model with momentum SGD; ``kind`` "fsdp" shards parameters over both mesh axes
    (across slices), "replicated" only over "model" (every slice holds a full replica)."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = P("data", "model") if kind == "fsdp" else P(None, "model")
    w_true = np.random.default_rng(123).standard_normal((32, 16)).astype(np.float32)

    def shardings(mesh):
        return {"w": NamedSharding(mesh, spec), "m": NamedSharding(mesh, spec)}

    def init(mesh):
        w = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32) * 0.1
        sh = shardings(mesh)
        return {"params": {"w": jax.device_put(w, sh["w"]), "m": jax.device_put(np.zeros_like(w), sh["m"])},
                "step": 0}

    def target(mesh):
        sh = shardings(mesh)
        return {"params": {k: jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=sh[k]) for k in ("w", "m")},
                "step": 0}

    def dataset():
        # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
        from controller_client.demo.elastic_data import make_dataset

        return make_dataset(w_true)

    @jax.jit
    def train_step(params, x, y):
        def loss_fn(w):
            return jnp.mean((x @ w - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params["w"])
        m = 0.9 * params["m"] + g
        return {"w": params["w"] - 0.01 * m, "m": m}, loss

    return init, target, dataset, train_step


def train_elastic(cluster: Any, kind: str, schedule: Schedule, sim: SimulatedSlices,
                  events: list[str] | None = None) -> dict[int, float]:
    """The elastic loop; returns the loss of every step (the last computation of a step that ran twice)."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from pathwaysutils.elastic import manager as elastic_manager

    from controller_client import preemption_exit
    from controller_client.demo.elastic_data import ElasticBatches
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.resilience import LeavingSlices, close_after_failure

    events = events if events is not None else []
    init, target, dataset, train_step = _model(kind)
    devices = sim.devices
    # The full allocation: ranks are (slice, host) places and never change.
    topology = allocation_topology(devices)
    losses: dict[int, float] = {}
    leaving = LeavingSlices(schedule.notice_hold_seconds)  # slices dropped for their preemption notice
    with sim.patched(), quiet_simulated_failures():
        elastic = elastic_manager.Manager(devices)

        # A bounded retry (without a policy elastic_retry retries slice-down errors forever).
        @elastic.elastic_retry(minimum_slice_count=1, poll_interval=0.2, timeout=120,
                               retry_policy=elastic_manager.ElasticRetryLimit(max_attempts=RETRY_ATTEMPTS))
        def run() -> None:
            leaving.keep_out(elastic)  # elastic_retry took every healthy slice, a noticed one too
            slices = sorted(elastic.active_slice_indices)
            active = [d for s in slices for d in elastic.slice_to_devices[s]]
            events.append(f"attempt on slices {slices}")
            mesh = Mesh(np.array(active).reshape(len(slices), DEVICES_PER_SLICE), ("data", "model"))
            opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                            save_interval_steps=schedule.save_every,
                                            coordinator_address=cluster.coordinator, restore_wait_seconds=60,
                                            preemption_scope="slices")
            ckpt = CheckpointManager(opts, devices=active, topology=topology)
            # One data shard per active slice; its position comes from the checkpoint, never from `step`.
            data = ElasticBatches(dataset(), mesh)
            try:
                if ckpt.latest_step() is None:
                    state = init(mesh)
                else:
                    # The iterator state is a str leaf: the target's (a fresh iterator's) only gives its type.
                    state = ckpt.restore(None, {**target(mesh), "data": data.get_state()})
                    data.set_state(state["data"])
                    events.append(f"restored step {state['step']} onto {len(slices)} slice(s), "
                                  f"data iterator state {state['data']}")
                params, step = state["params"], state["step"]

                def checkpoint() -> dict[str, Any]:
                    return {"params": params, "step": step, "data": data.get_state()}

                while step < schedule.total_steps:
                    if new := leaving.returnable(elastic.available_inactive_slices):
                        with contextlib.suppress(StepAlreadyExistsError):  # saved at its interval already
                            ckpt.save(step, checkpoint(), force=True)
                        ckpt.wait_until_finished()
                        events.append(f"scale up at step {step}: slices {sorted(new)}")
                        raise elastic_manager.ScaleUpSignalError()
                    lost = schedule.lost_slice
                    if step + 1 == schedule.fail_at and lost in slices:
                        sim.fail(lost)
                        events.append(f"slice {lost} fails before step {step + 1}")
                        raise jax.errors.JaxRuntimeError(f"DATA_LOSS: slice {lost} is down {SIMULATED}")
                    if step + 1 == schedule.return_at and lost not in slices:
                        if schedule.replaced:
                            replace_slice(cluster, lost)
                        sim.heal(lost)
                        events.append(f"slice {lost} is back before step {step + 1}"
                                      + (" (replaced: empty RAM disks)" if schedule.replaced else ""))
                        _wait(lambda: elastic.available_inactive_slices, 30, f"the monitor to see slice {lost}")
                        continue
                    b = next(data)
                    params, loss = train_step(params, b["x"], b["y"])
                    step += 1
                    losses[step] = float(loss)
                    saved = ckpt.save(step, checkpoint())
                    if saved:
                        ckpt.wait_until_finished()
                    noticed = ckpt.noticed_slices()  # preemption_scope="slices"
                    if noticed and noticed >= ckpt.active_slices:  # every active slice: the job suspends
                        if not saved:
                            with contextlib.suppress(StepAlreadyExistsError):
                                ckpt.save(step, checkpoint(), force=True)
                        code = preemption_exit.finish_preempted(ckpt, schedule.durable_wait_seconds)
                        events.append(f"preemption notice to every active slice after step {step}: exit {code}")
                        break
                    if noticed:  # some slices: dropped in place (their shards still answer), the others go on
                        leaving.drop(noticed)
                        slices = [s for s in slices if s not in noticed]
                        elastic.active_slice_indices = frozenset(slices)
                        active = [d for s in slices for d in elastic.slice_to_devices[s]]
                        mesh = Mesh(np.array(active).reshape(len(slices), DEVICES_PER_SLICE), ("data", "model"))
                        params = jax.device_put(params, jax.tree.map(lambda t: t.sharding, target(mesh)["params"]))
                        position = data.get_state()
                        data.close()
                        data = ElasticBatches(dataset(), mesh)
                        data.set_state(position)
                        ckpt.close()
                        ckpt = CheckpointManager(opts, devices=active, topology=topology)
                        events.append(f"preemption notice to slice(s) {sorted(noticed)} after step {step}: "
                                      f"going on in place on slices {slices}")
            except BaseException as e:
                if isinstance(e, jax.errors.JaxRuntimeError):
                    # A slice-down error: closing the manager reaches the lost slice's hosts and fails as
                    # well; elastic_retry must see the error that ended the attempt, not the close's.
                    close_after_failure(ckpt, "at the end of an attempt")
                else:
                    ckpt.close()  # a scale-up (every host healthy) or a real error
                raise
            else:
                ckpt.close()
            finally:
                data.close()

        run()
    return losses


def train_plain(kind: str, total_steps: int, devices: list[Any]) -> dict[int, float]:
    """The same training without interruptions or checkpoints, on both slices."""
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import numpy as np
    from jax.sharding import Mesh

    from controller_client.demo.elastic_data import ElasticBatches

    init, _, dataset, train_step = _model(kind)
    mesh = Mesh(np.array(devices).reshape(SLICES, DEVICES_PER_SLICE), ("data", "model"))
    params = init(mesh)["params"]
    losses = {}
    data = ElasticBatches(dataset(), mesh)
    try:
        for step in range(1, total_steps + 1):
            b = next(data)
            params, loss = train_step(params, b["x"], b["y"])
            losses[step] = float(loss)
    finally:
        data.close()
    return losses


def _wait(pred: Any, timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_seconds}s waiting for {what}")


def run_elastic_demo(workdir: str | None = None, keep: bool = False, kinds: tuple[str, ...] = ("replicated", "fsdp"),
                     schedule: Schedule | None = None) -> int:
    """Run the elastic loop for each kind of state; 0 when every loss trajectory matches."""
    _setup_jax()
    # Imported here, not at the top: JAX loads only after _setup_jax() has set XLA_FLAGS (module docstring).
    import jax
    import numpy as np


    schedule = schedule or Schedule()
    devices = jax.devices()[: SLICES * DEVICES_PER_SLICE]
    if len(devices) < SLICES * DEVICES_PER_SLICE:
        raise SystemExit("mtc demo --elastic needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    base = Path(workdir or tempfile.mkdtemp(prefix="mtc-elastic-",
                                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    ok = True
    try:
        for kind in kinds:
            cluster = LocalCluster(base / kind, nodes=SLICES * HOSTS_PER_SLICE, data_parallelism=SLICES)
            try:
                cluster.start_all()
                events: list[str] = []
                got = train_elastic(cluster, kind, schedule, SimulatedSlices(devices), events)
            finally:
                cluster.stop_all()
            ref = train_plain(kind, schedule.total_steps, devices)
            same = sorted(got) == sorted(ref) and all(np.isclose(got[s], ref[s], rtol=1e-5, atol=1e-6) for s in ref)
            ok = ok and same
            print(f"-- {kind} state:")
            for e in events:
                print(f"   {e}")
            print(f"{'OK  ' if same else 'FAIL'} {kind}: losses of steps 1..{schedule.total_steps} equal the "
                  f"uninterrupted run's (max relative difference "
                  f"{max(abs(got.get(s, np.inf) - ref[s]) / max(abs(ref[s]), 1e-12) for s in ref):.2e})")
    finally:
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1
