"""Side by side with Orbax's own emergency managers: one JSON line of raw seconds and ratios (ours / best Orbax).

    python -m bench.emergency [--mib 1024] [--repeats 3] [--systems ours,orbax_p2p,orbax_emergency,ours_orbax]
        [--steady-steps 24] [--steady-every 8] [--steady-step-seconds 0.5]

Each round runs every system in turn (the order rotates per round, so that drift on a noisy machine hits
every system alike) as one job of 4 JAX processes on 127.0.0.1 (2 slices x 2 hosts, 2 CPU devices each,
``jax.distributed.initialize``, gloo collectives); ``ours_orbax`` runs as job incarnations of its own, after
that job in even rounds and before it in odd ones. Every system saves the same train state: ``--mib`` MiB
of mixed shapes and dtypes (float32, bfloat16, int32), sharded over the 4 devices of a slice and replicated
across the 2 slices, so each host (2 of the 4 devices) holds half of it and its counterpart in the other
slice an identical copy.

Systems:

- ``orbax_p2p``: ``orbax.checkpoint.experimental.emergency.p2p.CheckpointManager`` (local dir per host, peers
  over its own P2P service, persistent directory as the last resort);
- ``orbax_emergency``: ``orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager``
  (local dir per host; a slice with a complete local copy restores and broadcasts to the others; persistent
  directory as the last resort);
- ``ours``: ``controller_client.manager.CheckpointManager`` with ``dispatcher="in_process"`` (the
  multi-controller front door) in every process, and one real ``mtc replicator`` per host (rank 0 serves
  the coordinator), backing up to a local folder;
- ``ours_orbax``: our Orbax mode: Orbax's own public ``initialize_multi_tier_checkpointing`` +
  ``ReplicatorCheckpointManager``, unchanged, against one real ``mtc replicator`` per host in Orbax mode.
  Orbax's initialize calls ``jax.distributed.initialize`` and handshakes with the daemons itself, so it runs
  one job incarnation (4 new processes) for the saves and one per restore measure, every daemon restarted
  before each (a JobSet restart); its restore clock holds the daemons' restart, the handshake from the job's
  request until Orbax's initialize returned (its 1 s polls for the ack included) and the span after it.
  bench/emergency_orbax.py says exactly what is timed.

Every system first saves step 0 (untimed; a run's first step goes to the persistent tier too), then step 1
to the local tier only and step 2 to the local and the persistent tier (Orbax:
``persistent.save_interval_steps=2``; ours: ``--backup-interval-steps 2`` and ``backup_now()``). Measures (seconds, the
median over rounds of the slowest host, every phase started after a barrier):

- ``save_block``: how long ``save(1)`` blocks the training loop;
- ``safe_after``: from the ``save(1)`` call until step 1 survives the loss of any one host. Orbax's managers
  write no copy beyond each host's own local dir, so step 1 is safe once every host has committed it
  locally (``wait_until_finished`` on every process, then a barrier): the host's counterpart in the other
  slice holds the same bytes. Ours: once the coordinator reports step 1 ``complete`` and ``redundant``
  (every rank's data on at least two hosts), as the manager itself knows it;
- ``restore_local``: the job restarts with every local dir intact: a new manager, ``restore`` of the
  newest step (2), arrays ready. Ours: the restart of a JobSet, which restarts every Pod with its replicator
  sidecar: each host's replicator is stopped before the clock starts (a restart recorded first, as the
  preStop hook does where the node's RAM disk outlives the Pod) and started inside it, and the manager is
  opened once it serves (the training container waits for the sidecar's startup probe);
- ``restore_one_lost``: the same after the local dir of host 3 (slice 1) is wiped while its Pod is gone;
- ``restore_all_lost``: the same after every host's local dir is wiped: from the persistent tier.

Then the steady state (bench/emergency_steady.py): the step time of a loop of CPU-bound train steps with a
save every ``--steady-every`` steps against the same loop without checkpointing, the last save's work
(ours: its redundancy and the spare pool's refill) inside the window, so that no background work can land
between windows: ``steady`` per system and ``steady_step_time_vs_no_checkpoint`` for ours.

Every restore is checked bit for bit against the saved state (outside the clock). A system that fails on
CPU is reported with its exact error under ``errors`` and left out of the comparison. The ratios
``*_vs_best_orbax`` divide our time by the faster Orbax manager's (below 1: we are faster); those of
``ours_orbax`` are ``ours_orbax_*_vs_best_orbax``.

(One module: the three systems that share one job and the orchestration of every system are one scenario
read together; the state and constants it shares with the fourth system are bench/emergency_common.py, that
system's job incarnations bench/emergency_orbax.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import emergency_steady
from bench.children import bound_to_us, replicator_argv, scratch_dir
from bench.emergency_common import (
    DEVICES_PER_PROCESS,
    LOST_HOST,
    MEASURES,
    PROCESSES,
    REPO,
    RPC_TIMEOUT_SECONDS,
    SLICES,
    WAIT_SECONDS,
    check_state,
    make_state,
    wait_for,
)
from bench.emergency_steady import SteadyOptions
from controller_client.demo.ports import free_port as _free_port

SYSTEMS = ("ours", "orbax_p2p", "orbax_emergency", "ours_orbax")
# Run in one job per round (ours_orbax runs job incarnations of its own: bench/emergency_orbax.py).
JOB_SYSTEMS = ("ours", "orbax_p2p", "orbax_emergency")
ROUND_TIMEOUT_SECONDS = 1800.0


def _scratch_dir() -> Path:
    return scratch_dir("mtc-bench-emergency-")


# --------------------------------------------------------------------------- systems (in each worker)

class System:
    """One checkpointing system as the benchmark drives it in one JAX process (host ``rank``)."""

    def __init__(self, rank: int, base: Path, mesh: Any, abstract: dict):
        self.rank, self.base, self.mesh, self.abstract = rank, base, mesh, abstract
        self.local = base / f"local{rank}"
        self.persistent = base / "persistent"
        self.local.mkdir(parents=True, exist_ok=True)
        self.persistent.mkdir(parents=True, exist_ok=True)
        self.mgr: Any = None

    def open(self) -> None: ...
    def save(self, step: int, state: dict) -> None: ...
    def wait(self) -> None:
        self.mgr.wait_until_finished()
    def wait_safe(self, step: int) -> None:
        self.wait()
    def wait_persistent(self, step: int) -> None:
        self.wait()
    def settle(self, step: int) -> None:
        """Every piece of work the system does for ``step`` is over (before the timed steps begin)."""
        self.wait()
    def restore(self) -> dict: ...
    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None
    def wipe(self) -> None:
        """This host loses its local storage (called on a closed system)."""
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)
    def pod_down(self, replaced: bool) -> None:
        """The job's Pod on this host goes (a JobSet restart; called on a closed system, before the clock);
        ``replaced``: the host is replaced and its local storage lost."""
        if replaced:
            self.wipe()
    def pod_up(self) -> None:
        """The new Pod's start before the training process's (inside the restore clock)."""
    def wait_quiet(self, step: int) -> None:
        """Every piece of work the system does for ``step`` is over (the end of a steady-state window)."""
        self.wait()
    def shutdown(self) -> None:
        self.close()


class OrbaxP2P(System):
    def open(self) -> None:
        from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager as p2p
        from orbax.checkpoint.experimental.emergency.p2p import options as p2p_options

        opts = p2p_options.CheckpointManagerOptions(
            local=p2p_options.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=p2p_options.PersistentCheckpointOptions(save_interval_steps=2, max_to_keep=2),
            replica_axis_index=0)
        self.mgr = p2p.CheckpointManager(self.mesh, self.abstract, self.local, self.persistent, options=opts)

    def save(self, step: int, state: dict) -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args

        self.mgr.save(step, args=p2p_args.Composite(state=ocp.args.PyTreeSave(state)))

    def restore(self) -> dict:
        import orbax.checkpoint as ocp
        from orbax.checkpoint.experimental.emergency.p2p import args as p2p_args

        restore_args = ocp.checkpoint_utils.construct_restore_args(self.abstract)
        out = self.mgr.restore(None, args=p2p_args.Composite(
            state=ocp.args.PyTreeRestore(item=self.abstract, restore_args=restore_args)))
        return out["state"]


class OrbaxEmergency(System):
    def open(self) -> None:
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

        opts = em.CheckpointManagerOptions(
            local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=em.PersistentCheckpointOptions(save_interval_steps=2, max_to_keep=2),
            replica_axis_index=0)
        self.mgr = em.CheckpointManager(self.local, self.persistent, self.mesh, self.abstract, options=opts)

    def save(self, step: int, state: dict) -> None:
        import orbax.checkpoint as ocp

        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

    def restore(self) -> dict:
        out = self.mgr.restore(None)
        return out["state"] if "state" in out else out


class Ours(System):
    """Our multi-controller front door, plus this host's own replicator daemon (started here, by pid)."""

    def __init__(self, rank: int, base: Path, mesh: Any, abstract: dict, ports: list[int]):
        super().__init__(rank, base, mesh, abstract)
        self.ports = ports
        self.proc: subprocess.Popen | None = None
        self.coordinator = f"127.0.0.1:{ports[0]}"
        self.start_replicator()

    def start_replicator(self) -> None:
        args = ["--local-dir", str(self.local), "--listen", f"127.0.0.1:{self.ports[self.rank]}", "--job", "bench",
                "--rank", str(self.rank), "--nodes", str(PROCESSES), "--data-parallelism", str(SLICES),
                "--heartbeat-seconds", "0.1", "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "300",
                "--backup-url", f"file://{self.persistent}", "--backup-interval-steps", "2"]
        if self.rank:
            args += ["--coordinator", self.coordinator]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        log = open(self.base / f"replicator-{self.rank}.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(bound_to_us(replicator_argv(*args)),
                                     stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=str(REPO))
        # (In the worker's process group: the orchestrator's kill of a stuck round's group ends it too.)
        log.close()
        wait_for(self._serving, 60, f"replicator {self.rank} to serve")

    def _serving(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"replicator {self.rank} exited with {self.proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", self.ports[self.rank]), timeout=0.5):
                return True
        except OSError:
            return False

    def stop_replicator(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()  # by its pid
            p.wait(timeout=10)

    def open(self) -> None:
        from controller_client.manager import CheckpointManager, CheckpointManagerOptions
        from controller_client.topology import HostTopology

        devs = list(self.mesh.devices.flat)
        opts = CheckpointManagerOptions(local_directory=str(self.base / "local{host}"), job_name="bench",
                                        dispatcher="in_process", coordinator_address=self.coordinator,
                                        restore_wait_seconds=WAIT_SECONDS, rpc_timeout_seconds=RPC_TIMEOUT_SECONDS)
        self.mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, SLICES,
                                                                                         PROCESSES // SLICES))

    def save(self, step: int, state: dict) -> None:
        self.mgr.save(step, state)

    def _summary(self, step: int) -> Any:
        from replicator.coordinator.client import CoordinatorClient

        c = CoordinatorClient(self.coordinator, rpc_timeout_seconds=RPC_TIMEOUT_SECONDS)
        try:
            st = c.status()
        finally:
            c.close()
        return st, next((s for s in st.steps if s.step == step), None)

    def wait_safe(self, step: int) -> None:
        self.wait()
        if self.rank == 0:
            wait_for(lambda: (s := self._summary(step)[1]) is not None and s.complete and s.redundant,
                      WAIT_SECONDS, f"step {step} redundant")

    def wait_persistent(self, step: int) -> None:
        # The step interval counts from the first backup (step 0, taken as soon as it completed): ask for
        # step 2 explicitly, as Orbax's persistent.save_interval_steps=2 saves it.
        self.mgr.backup_now()
        if self.rank == 0:
            wait_for(lambda: step in self._summary(step)[0].backup.committed_steps, WAIT_SECONDS,
                      f"step {step} backed up")

    def settle(self, step: int) -> None:
        # Orbax's wait_until_finished ends all its work for a step (local and persistent); ours goes on in
        # the daemons: copies to peers and the backup. They end before the timed steps start. So does the
        # spare pool's fill after the save (docs/peer.md), which a training loop's next save, minutes later,
        # finds done: run 1 of a run used to time save(1) against the fill still under way (1.6-2.4 s, rounds 2
        # and 3 0.7-0.9 s).
        self.wait_safe(step)
        from sidecar.writer import writer_for

        if not writer_for(self.local).wait_pool_filled(WAIT_SECONDS):
            raise TimeoutError(f"the spare pool of {self.local} still filling after {WAIT_SECONDS}s")
        if self.rank == 0:
            wait_for(lambda: step in self._summary(step)[0].backup.committed_steps, WAIT_SECONDS,
                      f"step {step} backed up")

    def restore(self) -> dict:
        return self.mgr.restore(None, self.abstract)

    def wait_quiet(self, step: int) -> None:
        from sidecar.writer import writer_for

        self.wait_safe(step)
        if not writer_for(self.local).wait_pool_filled(WAIT_SECONDS):
            raise TimeoutError(f"the spare pool of {self.local} still filling after {WAIT_SECONDS}s")

    def pod_down(self, replaced: bool) -> None:
        # The replicator is the Pod's sidecar (deploy/multi-controller-native): it goes with the Pod. On a host
        # that stays, the preStop hook records a restart (the node's RAM disk outlives the Pod): no flush.
        if not replaced:
            from replicator import preemption

            preemption.record_restart(self.local)
        self.stop_replicator()
        super().pod_down(replaced)

    def pod_up(self) -> None:
        # The training container starts once its replicator serves (the sidecar's startup probe).
        self.start_replicator()

    def shutdown(self) -> None:
        self.close()
        self.stop_replicator()


def run_system(name: str, rank: int, base: Path, mesh: Any, state: dict, abstract: dict, ports: list[int],
               barrier: Any, inexact: dict[str, int], keep_logs: bool = False,
               steady: SteadyOptions | None = None) -> dict[str, float]:
    """One system's scenario on this host: every phase after a barrier, then the steady state (``steady``,
    bench/emergency_steady.py); returns this host's seconds. ``inexact``: filled with measure -> elements
    whose zero lost its sign in that restore."""
    import jax

    times: dict[str, float] = {}
    kinds = {"orbax_p2p": OrbaxP2P, "orbax_emergency": OrbaxEmergency}
    system = Ours(rank, base, mesh, abstract, ports) if name == "ours" else kinds[name](rank, base, mesh, abstract)
    try:
        barrier()
        system.open()
        # Step 0 first, untimed: Orbax's managers save the first step of a run to the persistent tier
        # whatever the interval, which would put a persistent save into step 1's timings.
        system.save(0, state)
        system.settle(0)
        barrier()
        t0 = time.monotonic()
        system.save(1, state)
        times["save_block"] = time.monotonic() - t0
        system.wait_safe(1)
        barrier()
        times["safe_after"] = time.monotonic() - t0
        system.save(2, state)
        system.wait_persistent(2)
        barrier()
        for measure, wiped in (("restore_local", []), ("restore_one_lost", [LOST_HOST]),
                               ("restore_all_lost", list(range(PROCESSES)))):
            system.close()
            barrier()
            system.pod_down(rank in wiped)
            barrier()
            t = time.monotonic()
            system.pod_up()
            system.open()
            got = system.restore()
            jax.block_until_ready(got)
            times[measure] = time.monotonic() - t
            barrier()
            try:
                sign_lost = check_state(got, abstract)
            except ValueError as e:
                raise ValueError(f"{measure}: {e}") from None
            if sign_lost:
                inexact[measure] = sign_lost
            del got
        if steady is not None and steady.steps:
            times.update(emergency_steady.measure(system, state, steady, barrier))
    finally:
        system.shutdown()
    barrier()
    if rank == 0:  # free the RAM disk before the next system runs (~3-5 copies of the state)
        if keep_logs:  # its daemons' logs stay (--keep), next to the workers'
            for f in base.glob("*.log"):
                (base.parent / f"{base.name}-{f.name}").write_bytes(f.read_bytes())
        shutil.rmtree(base, ignore_errors=True)
    return times


def worker(args: argparse.Namespace) -> None:
    """One host of a round: every system in turn, results to ``--result`` after each."""
    import jax

    if args.verbose:  # --keep: every process's log, timestamped, in the kept directory
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.jax_coordinator, num_processes=PROCESSES,
                               process_id=args.rank, initialization_timeout=120)
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost as orbax_multihost

    flags.FLAGS(["bench"])  # Orbax's emergency restore reads absl flags (their defaults here)
    # Orbax's emergency managers need these process/device maps (set up once per process, as their docs say).
    orbax_multihost.initialize_runtime_to_distributed_ids()
    orbax_multihost.initialize_distributed_to_device_ids()
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    rank, base = args.rank, Path(args.base)
    n = [0]

    def barrier() -> None:
        n[0] += 1
        multihost_utils.sync_global_devices(f"bench-{n[0]}")

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(SLICES, -1), ("replica", "model"))
    state, abstract = make_state(mesh, args.mib)
    jax.block_until_ready(state)
    ports = [int(p) for p in args.ports.split(",")]
    out: dict[str, Any] = {"rank": rank, "seconds": {}, "errors": {}, "inexact": {}}
    for i, name in enumerate(s for s in args.systems.split(",") if s):
        try:
            out["seconds"][name] = run_system(name, rank, base / name, mesh, state, abstract,
                                              ports[i * PROCESSES:(i + 1) * PROCESSES], barrier,
                                              out["inexact"].setdefault(name, {}), keep_logs=args.verbose,
                                              steady=SteadyOptions(args.steady_steps, args.steady_every,
                                                                   args.steady_step_seconds))
        except Exception as e:  # noqa: BLE001 - reported as this system's error, with its exact text
            out["errors"][name] = f"{type(e).__name__}: {e}"
            out.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
            Path(args.result).write_text(json.dumps(out))
            break  # the other processes may be stuck in this system's collectives: end the round
        Path(args.result).write_text(json.dumps(out))
    sys.stdout.flush()
    # Skip JAX's distributed shutdown barrier: after an error the other processes may be gone.
    os._exit(0)


# --------------------------------------------------------------------------- orchestration

# A collective cut because another host failed or left: a consequence, not the cause of a round's error.
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "Read timeout")


def _is_consequence(error: str) -> bool:
    return any(c in error for c in _CONSEQUENCES)


def run_round(systems: list[str], mib: int, scratch: Path, timeout: float,
              verbose: bool = False, steady: SteadyOptions | None = None) -> dict[str, dict[str, Any]]:
    """One round: 4 worker processes (each in its own session, stopped by pid) running ``systems`` in order.
    Returns per system the slowest host's seconds per measure (and steady-state key), or ``{"error": ...}``.
    ``verbose``: the workers log at INFO and keep the daemons' logs (``--keep``)."""
    steady = steady or SteadyOptions(steps=0)
    base = scratch / "round"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    jax_port = _free_port()
    ports = ",".join(str(_free_port()) for _ in range(PROCESSES * len(systems)))
    procs = []
    logs = []
    t0 = time.monotonic()
    try:
        for rank in range(PROCESSES):
            env = dict(os.environ, JAX_PLATFORMS="cpu", GRPC_VERBOSITY="ERROR",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            log = open(base / f"worker{rank}.log", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            cmd = [sys.executable, "-m", "bench.emergency", "--worker", "--systems", ",".join(systems),
                   "--rank", str(rank), "--mib", str(mib), "--base", str(base),
                   "--jax-coordinator", f"127.0.0.1:{jax_port}", "--ports", ports,
                   "--result", str(base / f"result{rank}.json"), "--steady-steps", str(steady.steps),
                   "--steady-every", str(steady.every), "--steady-step-seconds", str(steady.step_seconds)]
            cmd += ["--verbose"] if verbose else []
            procs.append(subprocess.Popen(bound_to_us(cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=str(REPO), start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for p in procs:
            # The worker's own session, by its pid: a stuck worker, or the replicators of one that died
            # (they are in its session, and would outlive it).
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # the worker and its replicators are gone
                pass
            p.wait(timeout=10)
        for f in logs:
            f.close()
    results = []
    for rank in range(PROCESSES):
        path = base / f"result{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    out: dict[str, dict[str, Any]] = {}
    for name in systems:
        if any("error" in v for v in out.values()):
            break  # not run: the round ended at an earlier system's error
        errors = {rank: r["errors"][name] for rank, r in enumerate(results) if name in r.get("errors", {})}
        if errors:
            # A host whose peer failed sees its collective cut ("Connection closed by peer"): the cause is
            # the first error in rank order that is not one of those. Every host's error and traceback stay
            # in the record (``by_rank``), so a failure seen once on CI can be read.
            causes = [e for e in errors.values() if not _is_consequence(e)] or list(errors.values())
            out[name] = {"error": causes[0], "by_rank": {
                rank: {"error": e, "traceback": results[rank].get("tracebacks", {}).get(name, "")[-1500:]}
                for rank, e in errors.items()}}
        elif all(name in r.get("seconds", {}) for r in results):
            out[name] = {m: max(r["seconds"][name][m] for r in results) for m in MEASURES}
            out[name].update({k: max(r["seconds"][name][k] for r in results) for k in emergency_steady.KEYS
                              if all(k in r["seconds"][name] for r in results)})
            inexact = {m: sum(r.get("inexact", {}).get(name, {}).get(m, 0) for r in results) for m in MEASURES}
            if any(inexact.values()):
                out[name]["inexact"] = {m: n for m, n in inexact.items() if n}
        else:
            tail = (base / "worker0.log").read_text()[-1500:]
            out[name] = {"error": f"no result within {timeout:.0f}s (round took {time.monotonic() - t0:.0f}s); "
                                  f"worker 0 log: {tail}"}
            break
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="size of the train state (MiB, default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every system once")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--timeout", type=float, default=ROUND_TIMEOUT_SECONDS, help="bound on one round (seconds)")
    p.add_argument("--steady-steps", type=int, default=SteadyOptions.steps,
                   help=f"train steps per steady-state window (default {SteadyOptions.steps}; 0: none)")
    p.add_argument("--steady-every", type=int, default=SteadyOptions.every,
                   help=f"a save every N of them (default {SteadyOptions.every})")
    p.add_argument("--steady-step-seconds", type=float, default=SteadyOptions.step_seconds,
                   help=f"CPU seconds of a steady-state train step (default {SteadyOptions.step_seconds:g})")
    p.add_argument("--keep", help="run in this directory and keep it (logs of every process) instead of a "
                   "temporary one on /dev/shm")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--jax-coordinator", help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    systems = [s for s in args.systems.split(",") if s]
    try:
        steady = SteadyOptions(args.steady_steps, args.steady_every, args.steady_step_seconds)
    except ValueError as e:
        p.error(str(e))
    if args.mib < 1 or args.repeats < 1 or not set(systems) <= set(SYSTEMS):
        p.error("--mib and --repeats must be >= 1, --systems a subset of " + ",".join(SYSTEMS))
    scratch = Path(args.keep) if args.keep else _scratch_dir()
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    errors: dict[str, str] = {}
    error_ranks: dict[str, dict[int, dict[str, str]]] = {}
    round_seconds: list[float] = []
    try:
        for r in range(args.repeats):
            live = [s for s in systems if s not in errors]
            if not live:
                break
            in_job = [s for s in live if s in JOB_SYSTEMS]
            order = in_job[r % len(in_job):] + in_job[:r % len(in_job)] if in_job else []
            # ours_orbax after the others' job in even rounds, before it in odd ones (drift hits it alike).
            parts = [order] if order else []
            if "ours_orbax" in live:
                parts.insert(len(parts) if r % 2 == 0 else 0, ["ours_orbax"])
            t0 = time.monotonic()
            for part in parts:
                if part == ["ours_orbax"]:
                    from bench import emergency_orbax

                    got_round = {"ours_orbax": emergency_orbax.run(args.mib, scratch, args.timeout)}
                else:
                    got_round = run_round(part, args.mib, scratch, args.timeout, verbose=bool(args.keep),
                                          steady=steady)
                for s, got in got_round.items():
                    if "error" in got:
                        errors[s] = got["error"]
                        if "by_rank" in got:
                            error_ranks[s] = got["by_rank"]
                    else:
                        runs[s].append(got)
            round_seconds.append(round(time.monotonic() - t0, 1))
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = {s: {m: round(statistics.median(x[m] for x in v), 4) for m in MEASURES}
               for s, v in runs.items() if v}
    result: dict[str, Any] = {"bench": "emergency", "mib": args.mib, "repeats": args.repeats,
                              "processes": PROCESSES, "slices": SLICES, "seconds": seconds, "round_seconds": round_seconds,
                              "runs": {s: [{m: round(x[m], 4) for m in MEASURES} for x in v] for s, v in runs.items()}}
    if errors:
        result["errors"] = errors
    if error_ranks:
        result["errors_by_rank"] = error_ranks
    # Restores that lost the sign of zeros (every other bit exact), per system and measure: the most elements
    # in any round, summed over the hosts. Their times count: the values are equal as numbers.
    sign_lost = {s: {m: max(x.get("inexact", {}).get(m, 0) for x in v) for m in MEASURES}
                 for s, v in runs.items() if v}
    sign_lost = {s: {m: n for m, n in d.items() if n} for s, d in sign_lost.items() if any(d.values())}
    if sign_lost:
        result["zero_sign_lost"] = sign_lost
    orbax = [s for s in ("orbax_p2p", "orbax_emergency") if s in seconds]
    if "ours" in seconds and orbax:
        for m in MEASURES:
            best = min(orbax, key=lambda s: seconds[s][m])
            result[f"{m}_vs_best_orbax"] = round(seconds["ours"][m] / seconds[best][m], 3)
            result.setdefault("best_orbax", {})[m] = best
    result.update(emergency_steady.result(runs))
    if "ours_orbax" in runs:
        from bench import emergency_orbax

        result.update(emergency_orbax.result_keys(seconds, runs["ours_orbax"], orbax))
    print(json.dumps(result))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
