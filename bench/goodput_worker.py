"""One JAX process of bench.goodput's training job: restore (or start), then train and checkpoint until killed.

``python -m bench.goodput_worker`` is started by bench/goodput_run.py, 4 at a time (one job incarnation), and
never by hand. Each process is one host of 2 slices x 2 hosts (``jax.distributed.initialize`` on 127.0.0.1,
gloo collectives) and holds bench.emergency's train state (:func:`bench.emergency_common.make_state`,
sharded within a slice, replicated across slices) plus a ``step`` leaf, the only one a train step changes:
the restored step is read from it, and every other leaf must come back bit for bit.

The first incarnation measures the system's save cost (``save(0)`` untimed, ``save(1)`` timed: how long it
blocks the loop, and until ``wait_until_finished``), takes the slowest host's, and derives the Young/Daly
interval from it (:func:`young_daly`); later incarnations read it from ``calibration.json``. A train step
sleeps ``--step-seconds`` (the accelerator's work; a sleep leaves the 2 cores of this box to checkpointing,
as an accelerator would leave the host's CPUs), increments ``step`` and asks, collectively, whether a
preemption notice came (ours: ``reached_preemption``; Orbax: the notice file the harness writes). On a notice
the job saves the step it is at, waits for it and exits 0.

Rank 0 appends the job's timeline to ``events.jsonl`` (CLOCK_MONOTONIC, one clock for every process of the
machine), every phase ending at a barrier of the 4 processes; any error is written to
``errors/<incarnation>-<rank>.txt`` and the process exits 1 (a restore the harness's check found other than
saved: :class:`WrongRestore`, which the harness tells from an error the system raised itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.emergency import OrbaxEmergency, OrbaxP2P, Ours, System
from bench.emergency_common import PROCESSES, SLICES, abstract_state, check_state, make_state

SYSTEMS = ("ours", "orbax_p2p", "orbax_emergency", "orbax_standard")
STEP_LEAF = "step"
STEP_LEAF_SIZE = 64
KEEP = 2  # checkpoints kept per tier by every system
JAX_INIT_TIMEOUT_SECONDS = 120


def young_daly(save_block_seconds: float, save_full_seconds: float, mtbf_seconds: float,
               step_seconds: float) -> tuple[float, int]:
    """(interval seconds, interval steps): Young/Daly's sqrt(2 * C * MTBF) with C the time a save blocks the
    loop, but never shorter than a whole save (a save cannot start before the previous one ended), and
    at least one step."""
    if min(save_block_seconds, save_full_seconds) < 0 or mtbf_seconds <= 0 or step_seconds <= 0:
        raise ValueError("save costs must be >= 0, the MTBF and the step > 0")
    seconds = max(math.sqrt(2 * save_block_seconds * mtbf_seconds), save_full_seconds)
    return seconds, max(1, round(seconds / step_seconds))


def bucket_interval_steps(bucket_seconds: float, step_seconds: float, interval_steps: int) -> int:
    """The persistent tier's interval in steps: ``bucket_seconds`` rounded to a multiple of the local one
    (Orbax's persistent saves happen only at steps the loop saves)."""
    return interval_steps * max(1, round(bucket_seconds / step_seconds / interval_steps))


class WrongRestore(ValueError):
    """The restore returned other bytes than were saved and the system did not notice (the harness's check
    found them); the harness tells it from an error the system raised by this name."""


# --------------------------------------------------------------------------- the systems

class GoodputOrbaxP2P(OrbaxP2P):
    def __init__(self, *a: Any, bucket_steps: int):
        super().__init__(*a)
        self.bucket_steps = bucket_steps

    def open(self) -> None:
        from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p
        from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options

        opts = p2p_options.CheckpointManagerOptions(
            local=p2p_options.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=KEEP),
            persistent=p2p_options.PersistentCheckpointOptions(save_interval_steps=self.bucket_steps,
                                                               max_to_keep=KEEP),
            replica_axis_index=0)
        self.mgr = p2p.CheckpointManager(self.mesh, self.abstract, self.local, self.persistent, options=opts)


class GoodputOrbaxEmergency(OrbaxEmergency):
    def __init__(self, *a: Any, bucket_steps: int):
        super().__init__(*a)
        self.bucket_steps = bucket_steps

    def open(self) -> None:
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

        opts = em.CheckpointManagerOptions(
            local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=KEEP),
            persistent=em.PersistentCheckpointOptions(save_interval_steps=self.bucket_steps, max_to_keep=KEEP),
            replica_axis_index=0)
        self.mgr = em.CheckpointManager(self.local, self.persistent, self.mesh, self.abstract, options=opts)


class OrbaxStandard(System):
    """Orbax's standard ``CheckpointManager``, every host writing its shards to one shared folder (the bucket)."""

    def open(self) -> None:
        import orbax.checkpoint as ocp

        self.mgr = ocp.CheckpointManager(self.persistent, options=ocp.CheckpointManagerOptions(
            save_interval_steps=1, max_to_keep=KEEP))

    def save(self, step: int, state: dict) -> None:
        import orbax.checkpoint as ocp

        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

    def restore(self) -> dict:
        import orbax.checkpoint as ocp

        restore_args = ocp.checkpoint_utils.construct_restore_args(self.abstract)
        out = self.mgr.restore(self.mgr.latest_step(), args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=self.abstract, restore_args=restore_args)))
        return out["state"]


class GoodputOurs(Ours):
    """Our front door; the harness, not this process, runs the host's replicator (the Pod's sidecar, started
    before the training container and restarted with the Pod)."""

    def __init__(self, rank: int, base: Path, mesh: Any, abstract: dict, ports: list[int]):
        System.__init__(self, rank, base, mesh, abstract)
        self.ports = ports
        self.proc = None
        self.coordinator = f"127.0.0.1:{ports[0]}"

    def shutdown(self) -> None:
        self.close()


def make_system(name: str, rank: int, base: Path, mesh: Any, abstract: dict, ports: list[int],
                bucket_steps: int) -> System:
    if name == "ours":
        return GoodputOurs(rank, base, mesh, abstract, ports)
    if name == "orbax_p2p":
        return GoodputOrbaxP2P(rank, base, mesh, abstract, bucket_steps=bucket_steps)
    if name == "orbax_emergency":
        return GoodputOrbaxEmergency(rank, base, mesh, abstract, bucket_steps=bucket_steps)
    if name == "orbax_standard":
        return OrbaxStandard(rank, base, mesh, abstract)
    raise ValueError(f"unknown system {name!r}")


# --------------------------------------------------------------------------- the job

class Timeline:
    """Rank 0's events, one JSON line each, flushed at once (the harness tails the file)."""

    def __init__(self, path: Path, rank: int, incarnation: int):
        self.rank, self.incarnation = rank, incarnation
        self.f = open(path, "a") if rank == 0 else None  # noqa: SIM115 - open for the process's life

    def emit(self, ev: str, **kw: Any) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"ev": ev, "t": time.monotonic(), "inc": self.incarnation, **kw}) + "\n")
            self.f.flush()


def _with_step_leaf(mesh: Any, state: dict, abstract: dict, step: int) -> tuple[dict, dict]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sh = NamedSharding(mesh, P("model"))
    state = dict(state, **{STEP_LEAF: jax.device_put(np.full((STEP_LEAF_SIZE,), step, np.int32), sh)})
    abstract = dict(abstract, **{STEP_LEAF: jax.ShapeDtypeStruct((STEP_LEAF_SIZE,), np.int32, sharding=sh)})
    return state, abstract


def _step_of(state: dict) -> int:
    import numpy as np

    values = {int(v) for s in state[STEP_LEAF].addressable_shards for v in np.asarray(s.data).ravel()}
    if len(values) != 1:
        raise ValueError(f"restored step leaf is not one step: {sorted(values)[:8]}")
    return values.pop()


def _calibrate(system: System, mesh: Any, abstract: dict, args: argparse.Namespace, barrier: Any,
               calibration: Path, bucket_guess: int) -> tuple[dict, int]:
    """The first incarnation: the save cost measured (the slowest host's), the intervals written to
    ``calibration``; the state at step 1 and the interval in steps."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    state, _ = make_state(mesh, args.mib)
    state, _ = _with_step_leaf(mesh, state, abstract, 0)
    jax.block_until_ready(state)
    barrier()
    system.save(0, state)  # untimed: a run's first save warms up (and Orbax's goes to the bucket too)
    system.wait()
    state, _ = _with_step_leaf(mesh, state, abstract, 1)
    barrier()
    t = time.monotonic()
    system.save(1, state)
    block = time.monotonic() - t
    system.wait()
    full = time.monotonic() - t
    costs = np.asarray(multihost_utils.process_allgather(np.array([block, full]))).reshape(-1, 2).max(axis=0)
    interval_seconds, interval_steps = young_daly(float(costs[0]), float(costs[1]), args.mtbf_seconds,
                                                  args.step_seconds)
    # Orbax saves to its persistent tier at steps % bucket_guess == 0 of the steps the loop saves.
    bucket_steps = bucket_interval_steps(args.bucket_seconds, args.step_seconds, interval_steps)
    if args.rank == 0:
        calibration.write_text(json.dumps({
            "save_block_seconds": float(costs[0]), "save_full_seconds": float(costs[1]),
            "interval_seconds": interval_seconds, "interval_steps": interval_steps,
            "bucket_interval_steps": bucket_steps}))
    if bucket_steps != bucket_guess:  # reopen with the interval the later incarnations use
        system.close()
        system.open()
    return state, interval_steps


def _recover(system: System, mesh: Any, abstract: dict, mib: int, tl: Timeline,
             barrier: Any) -> tuple[dict, int]:
    """A later incarnation's start: plan, restore (or start from nothing), the harness's check; the state
    and its step."""
    import jax

    step = system.mgr.latest_step()
    step = None if step is None else int(step)  # Orbax's emergency manager may answer a numpy int
    barrier()
    tl.emit("planned", step=step)
    if step is None:  # nothing survived: from the start
        state, _ = make_state(mesh, mib)
        state, _ = _with_step_leaf(mesh, state, abstract, 0)
    else:
        state = system.restore()
    jax.block_until_ready(state)
    barrier()
    step = _step_of(state)
    tl.emit("restored", step=step)
    # The harness's own check, outside every clock (the harness subtracts it): bit for bit as saved.
    t = time.monotonic()
    try:
        check_state({k: v for k, v in state.items() if k != STEP_LEAF},
                    {k: v for k, v in abstract.items() if k != STEP_LEAF})
    except ValueError as e:
        raise WrongRestore(f"step {step}: {e}") from None
    barrier()
    tl.emit("checked", seconds=time.monotonic() - t)
    return state, step


def run(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.jax_coordinator, num_processes=PROCESSES,
                               process_id=args.rank, initialization_timeout=JAX_INIT_TIMEOUT_SECONDS)
    import numpy as np
    from absl import flags
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from orbax.checkpoint._src.multihost import multihost as orbax_multihost

    flags.FLAGS(["bench"])
    orbax_multihost.initialize_runtime_to_distributed_ids()
    orbax_multihost.initialize_distributed_to_device_ids()
    base, rank = Path(args.base), args.rank
    tl = Timeline(base / "events.jsonl", rank, args.incarnation)
    n = [0]

    def barrier() -> None:
        n[0] += 1
        multihost_utils.sync_global_devices(f"goodput-{n[0]}")

    def any_host(flag: bool) -> bool:
        return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(SLICES, -1), ("replica", "model"))
    abstract = abstract_state(mesh, args.mib)
    _, abstract = _with_step_leaf(mesh, {}, abstract, 0)
    calibration = base / "calibration.json"
    calibrate = not calibration.exists()
    bucket_steps = 1
    if not calibrate:
        cal = json.loads(calibration.read_text())
        interval_steps, bucket_steps = cal["interval_steps"], cal["bucket_interval_steps"]
    ports = [int(p) for p in args.ports.split(",")] if args.ports else []
    # The interval of Orbax's persistent tier is an option of the manager: the first incarnation opens it
    # with the bucket interval in steps (it only needs to be a multiple of the local one: see below).
    bucket_guess = max(1, round(args.bucket_seconds / args.step_seconds))
    system = make_system(args.system, rank, base / "storage", mesh, abstract, ports,
                         bucket_guess if calibrate else bucket_steps)
    barrier()
    tl.emit("up")
    system.open()
    if calibrate:
        state, interval_steps = _calibrate(system, mesh, abstract, args, barrier, calibration, bucket_guess)
        step = 1
        barrier()
        tl.emit("start", step=step)
    else:
        state, step = _recover(system, mesh, abstract, args.mib, tl, barrier)
    increment = jax.jit(lambda x: x + 1)
    notice = base / "notice"
    while True:
        time.sleep(args.step_seconds)
        state[STEP_LEAF] = increment(state[STEP_LEAF])
        jax.block_until_ready(state[STEP_LEAF])
        step += 1
        preempted = (system.mgr.reached_preemption(step) if args.system == "ours"
                     else any_host(notice.exists()))
        tl.emit("step", step=step)
        if preempted:
            system.save(step, state)  # every system's local interval is 1: each save(step) call saves
            system.wait()
            if args.system == "ours":
                system.mgr.backup_now()
            barrier()
            tl.emit("preempt_saved", step=step)
            return
        if step % interval_steps == 0:
            system.save(step, state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one JAX process of bench.goodput's job (started by the harness)")
    p.add_argument("--system", required=True, choices=SYSTEMS)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--incarnation", type=int, required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--step-seconds", type=float, required=True)
    p.add_argument("--mtbf-seconds", type=float, required=True)
    p.add_argument("--bucket-seconds", type=float, required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--jax-coordinator", required=True)
    p.add_argument("--ports", default="", help="ours: the 4 replicators' ports (host 0's serves the coordinator)")
    args = p.parse_args(argv)
    code = 0
    try:
        run(args)
    except Exception as e:  # noqa: BLE001 - the harness records it as the failure's error, exact text
        errors = Path(args.base) / "errors"
        errors.mkdir(exist_ok=True)
        (errors / f"{args.incarnation}-{args.rank}.txt").write_text(
            f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip JAX's distributed shutdown barrier: the other processes may be gone.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
