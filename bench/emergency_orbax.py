"""bench.emergency's ``ours_orbax`` system: unchanged Orbax multi-tier checkpointing against our replicator.

Orbax 0.12.8's public ``initialize_multi_tier_checkpointing`` + ``ReplicatorCheckpointManager`` run unchanged
in 4 JAX processes (2 slices x 2 hosts, 2 CPU devices each, on 127.0.0.1), against one real ``mtc
replicator`` daemon per host in Orbax mode (``--local-dir`` without ``--rank/--nodes``, docs/orbax.md),
backing up to a local folder (``--backup-url file://...``; ``backup_interval_steps=2`` in the handshake).
``initialize_multi_tier_checkpointing`` calls ``jax.distributed.initialize`` itself and handshakes with the
daemons through ``replicator.yaml``, so this system cannot share bench.emergency's job: it runs as job
incarnations of its own (4 worker processes each, every one in its own session and stopped by its pid). The
daemons are the worker Pods' sidecars: every restore incarnation is a JobSet restart, which restarts every
daemon (:meth:`Daemons.restart_pods`), and each incarnation is a new handshake:

1. the save job: step 0 (untimed; then it waits until step 0 is complete, redundant and backed up, as
   ``ours`` does), step 1 (``save_block``, ``safe_after``), step 2 (saved, then waited for until the
   coordinator reports it backed up: the interval of 2 steps counts from step 0's backup);
2. ``restore_local``: every daemon restarted, every local dir intact, a new incarnation;
3. ``restore_one_lost``: the same, host 3's local dir wiped while its daemon was down;
4. ``restore_all_lost``: the same, every local dir wiped (from the bucket).

What is timed (the slowest host's seconds, each span started after a barrier of the 4 processes):

- ``save_block``: ``ReplicatorCheckpointManager.save(1)`` returning;
- ``safe_after``: from that call until ``wait_until_finished`` returned on every host and our coordinator
  (host 0's daemon) reports step 1 ``complete`` and ``redundant`` (every rank's data on two hosts: the
  daemons ingest Orbax's ``<local>/1`` and attest data-parallel replicas by content hash), then a barrier
  -- the same condition as ``ours``. Reported split in two (``ours_orbax_safe_after_split``, medians):
  ``orbax_save_seconds``, Orbax's own save (until the last host's ``wait_until_finished`` returned), and
  ``our_share_seconds``, from then until our coordinator reported the step complete and redundant;
- a restore measure, three parts: ``daemon_start_seconds``, from the daemons' restart until every one is
  up (in Orbax mode a daemon serves only after a handshake gave it its rank; it is up once it wrote
  ``jax-init-info.txt``, which the training process's JAX start needs); ``ack_wait_seconds``, from the
  moment the last host's Orbax wrote ``replicator.yaml`` (the job is up everywhere) until the last host's
  ``initialize_multi_tier_checkpointing`` returned: the daemons plan the restore, fetch what their host
  lacks (from a peer, or the bucket), write the markers and delete the yaml (their ack), and Orbax, polling
  every second, sees the ack and the marker; then the slowest host's span from after ``initialize``
  returned and a barrier, until a new ``ReplicatorCheckpointManager`` was built, ``restore`` of its
  ``latest_step()`` returned and the arrays are ready (``after_init_seconds``: the span of the other
  systems' ``open()`` + ``restore()``).

Not in a restore's clock: JAX's distributed start inside ``initialize`` (no other system's clock holds it).
Reported per restore measure under ``ours_orbax_restore_parts``: the three parts, ``handshake_seconds``
(the daemons' part of ``ack_wait_seconds`` alone: until the last yaml was deleted, as a thread of each worker
polling its local dir every 5 ms sees it), ``open_seconds`` (inside ``after_init_seconds``: constructing
``ReplicatorCheckpointManager``) and ``init_seconds`` (the whole ``initialize`` call, the slowest host). The
medians of ``handshake_seconds`` are also keys of their own, ``ours_orbax_handshake_<local|one_lost|all_lost>_seconds``
(issue 48's targets: 0.3 / 0.5 / 1.0 s).

Every restore is checked bit for bit against the saved state (``check_state``, outside the clock) and must
be of step 2. ``python -m bench.emergency_orbax`` is only the worker; ``python -m bench.emergency`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from bench.children import bound_to_us, replicator_argv
from bench.emergency_common import (
    DEVICES_PER_PROCESS,
    LOST_HOST,
    MEASURES,
    PROCESSES,
    REPO,
    RPC_TIMEOUT_SECONDS,
    SLICES,
    WAIT_SECONDS,
    abstract_state,
    check_state,
    make_state,
    wait_for,
)
from controller_client.demo.ports import free_port as _free_port
from replicator.orbax.contract import JAX_INIT_INFO_FILE as JAX_INIT_INFO

NAME = "ours_orbax"
JOB = "bench"
# The parts of a restore measure (and the whole initialize call beside them), per measure.
PARTS = ("daemon_start_seconds", "handshake_seconds", "ack_wait_seconds", "after_init_seconds", "open_seconds",
         "init_seconds")
SAVE_SPLIT = ("orbax_save_seconds", "our_share_seconds")
RESTORES = (("restore_local", []), ("restore_one_lost", [LOST_HOST]), ("restore_all_lost", list(range(PROCESSES))))
# ``ours_orbax_handshake_<case>_seconds``: the median ``handshake_seconds`` of each restore measure (issue 48).
HANDSHAKE_KEYS = {"restore_local": "local", "restore_one_lost": "one_lost", "restore_all_lost": "all_lost"}
# Bounds Orbax's ack wait and JAX's start-up (it only ends a broken run; the daemons answer in ~1 s and
# fetch before they ack, so a restore from the bucket at 1 GiB must fit in it too).
INIT_TIMEOUT_SECONDS = 300
STOP_TIMEOUT_SECONDS = 30.0
# After one worker of an incarnation failed, the others get this long to write their own result.
GRACE_SECONDS = 10.0
YAML_POLL_SECONDS = 0.005


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", GRPC_VERBOSITY="ERROR",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


# --------------------------------------------------------------------------- the daemons (orchestrator)

class Daemons:
    """One ``mtc replicator`` per host in Orbax mode, each in its own session, stopped by its pid."""

    def __init__(self, base: Path, logs: Path):
        self.base, self.logs = base, logs
        self.ports = [_free_port() for _ in range(PROCESSES)]
        self.jax_port = _free_port()
        self.procs: dict[int, subprocess.Popen] = {}

    def local(self, host: int) -> Path:
        return self.base / f"local{host}"

    @property
    def coordinator(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"  # host 0, slice 0's first host: the coordinator candidate that serves

    def args(self, host: int) -> list[str]:
        peers = ",".join(f"{h}=127.0.0.1:{p}" for h, p in enumerate(self.ports))
        return ["--local-dir", str(self.local(host)), "--listen", f"127.0.0.1:{self.ports[host]}", "--peers", peers,
                "--jax-coordinator", f"127.0.0.1:{self.jax_port}", "--jax-process-id", str(host),
                "--heartbeat-seconds", "0.1", "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "300",
                "--handshake-timeout-seconds", str(INIT_TIMEOUT_SECONDS - 30),
                "--backup-url", f"file://{self.base / 'persistent'}"]

    def start(self, host: int) -> None:
        self.local(host).mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"replicator-{host}.log", "ab") as log:
            self.procs[host] = subprocess.Popen(
                bound_to_us(replicator_argv(*self.args(host))),
                stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=str(REPO), start_new_session=True)

    def stop(self, hosts: list[int]) -> None:
        """SIGTERM to every one of ``hosts`` at once (each then flushes as on a preemption notice, and would
        wait for a coordinator stopped before it), then wait for each."""
        procs = [p for p in (self.procs.pop(h, None) for h in hosts) if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # its own session, by its pid
                p.wait(timeout=10)

    def check_alive(self) -> None:
        for host, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"replicator {host} exited with {p.returncode}")

    def ready(self, host: int) -> bool:
        """``host``'s daemon is up: in Orbax mode it serves only once a handshake gave it its rank, and the
        first thing it does is write ``jax-init-info.txt`` (the training process's JAX needs it to start)."""
        self.check_alive()
        return (self.local(host) / JAX_INIT_INFO).exists()

    def restart_pods(self, replaced: list[int]) -> float:
        """A JobSet restart: every daemon goes with its Pod (on a host that stays the preStop hook records a
        restart, the node's RAM disk outliving the Pod), ``replaced`` hosts lose their local dirs, then every
        daemon starts. Returns the seconds from the start until every daemon is up (:meth:`ready`)."""
        from replicator import preemption

        for host in range(PROCESSES):
            if host not in replaced:
                preemption.record_restart(self.local(host))
        self.stop(list(self.procs))
        for host in range(PROCESSES):
            if host in replaced:
                shutil.rmtree(self.local(host), ignore_errors=True)
            else:
                (self.local(host) / JAX_INIT_INFO).unlink(missing_ok=True)  # the old Pod's
        t0 = time.monotonic()
        for host in range(PROCESSES):
            self.start(host)
        for host in range(PROCESSES):
            wait_for(lambda h=host: self.ready(h), WAIT_SECONDS, f"replicator {host} to start")
        return time.monotonic() - t0


# --------------------------------------------------------------------------- orchestration

def _incarnation(phase: str, mib: int, daemons: Daemons, logs: Path, deadline: float) -> list[dict[str, Any]]:
    """One job incarnation: 4 worker processes running ``phase``; returns their results (rank order)."""
    procs, files = [], []
    results = [logs / f"{phase}-result{rank}.json" for rank in range(PROCESSES)]
    try:
        for rank in range(PROCESSES):
            results[rank].unlink(missing_ok=True)
            coord = f"127.0.0.1:{daemons.jax_port}"
            env = dict(_env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                       # JAX reads the process count from a cluster environment when Orbax initializes it
                       # with the process id and coordinator of jax-init-info.txt only.
                       SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS=str(PROCESSES),
                       SLURM_PROCID=str(rank), SLURM_LOCALID="0",
                       JAX_COORDINATOR_ADDRESS=coord, JAX_COORDINATOR_BIND_ADDRESS=coord)
            log = open(logs / f"{phase}-worker{rank}.log", "w")  # noqa: SIM115 - closed in finally
            files.append(log)
            cmd = [sys.executable, "-m", "bench.emergency_orbax", "--phase", phase, "--rank", str(rank),
                   "--mib", str(mib), "--local-dir", str(daemons.local(rank)),
                   "--coordinator", daemons.coordinator, "--result", str(results[rank])]
            procs.append(subprocess.Popen(bound_to_us(cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=str(REPO), start_new_session=True))
        failed_at, exited = None, []
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            exited += [rank for rank, p in enumerate(procs) if p.poll() is not None and rank not in exited]
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + GRACE_SECONDS:
                break
            daemons.check_alive()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own session, by its pid
                p.wait(timeout=10)
        for f in files:
            f.close()
    out = [json.loads(r.read_text()) if r.exists() else {} for r in results]
    # The first worker to exit holds the cause; the others' errors follow from it (a collective that lost
    # a peer); then rank order.
    order = exited + [rank for rank in range(PROCESSES) if rank not in exited]
    errors = [out[rank]["error"] for rank in order if "error" in out[rank]]
    if errors:
        raise RuntimeError(f"{phase}: {errors[0]}")
    if not all("seconds" in r for r in out):
        rank = next(i for i, r in enumerate(out) if "seconds" not in r)
        tail = (logs / f"{phase}-worker{rank}.log").read_text()[-1500:]
        why = "the round's --timeout passed" if time.monotonic() >= deadline else f"exit {procs[rank].returncode}"
        raise RuntimeError(f"{phase}: worker {rank} gave no result ({why}); its log: {tail}")
    return out


def run(mib: int, scratch: Path, timeout: float) -> dict[str, Any]:
    """One round of ``ours_orbax``: the slowest host's seconds per measure (plus ``parts``: the parts of
    each restore measure, and ``inexact`` if zeros lost their sign), or ``{"error": ...}``."""
    base, logs = scratch / NAME, scratch / f"{NAME}-logs"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    daemons = Daemons(base, logs)
    out: dict[str, Any] = {}
    parts: dict[str, dict[str, float]] = {k: {} for k in PARTS}
    inexact: dict[str, int] = {}
    try:
        for host in range(PROCESSES):
            daemons.start(host)
        saved = _incarnation("save", mib, daemons, logs, deadline)
        for m in ("save_block", "safe_after"):
            out[m] = max(r["seconds"][m] for r in saved)
        # safe_after split: Orbax's own save (until the last host's wait_until_finished returned) and our
        # share (from then until our coordinator reported the step complete and redundant).
        orbax_done = max(r["orbax_saved"] for r in saved)
        out["save_split"] = {"orbax_save_seconds": orbax_done - min(r["save_started"] for r in saved),
                             "our_share_seconds": max(0.0, saved[0]["safe_at"] - orbax_done)}
        for measure, wiped in RESTORES:
            got_parts = {"daemon_start_seconds": daemons.restart_pods(wiped)}
            got = _incarnation(measure, mib, daemons, logs, deadline)
            # From the moment the last host's Orbax asked (the job is up everywhere; a host that asked earlier
            # waits for the others): the daemons' part (until the last ack), and until the last host's
            # initialize returned (Orbax's 1 s polls for the ack and the restore marker in it).
            asked = max(r["yaml_seen"] for r in got)
            got_parts["handshake_seconds"] = max(r["yaml_acked"] for r in got) - asked
            got_parts["ack_wait_seconds"] = max(r["init_returned"] for r in got) - asked
            for key in ("after_init_seconds", "open_seconds", "init_seconds"):
                got_parts[key] = max(r[key] for r in got)
            out[measure] = (got_parts["daemon_start_seconds"] + got_parts["ack_wait_seconds"]
                            + max(r["seconds"][measure] for r in got))
            for key in parts:
                parts[key][measure] = got_parts[key]
            if sum(r.get("sign_lost", 0) for r in got):
                inexact[measure] = sum(r.get("sign_lost", 0) for r in got)
    except Exception as e:  # noqa: BLE001 - reported as this system's error, with its exact text
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        daemons.stop(list(daemons.procs))
        shutil.rmtree(base, ignore_errors=True)  # the RAM disk, before the next system runs
    out["parts"] = parts
    if inexact:
        out["inexact"] = inexact
    return out


def result_keys(seconds: dict[str, dict[str, float]], runs: list[dict[str, Any]], orbax: list[str]) -> dict:
    """bench.emergency's keys for this system: ``ours_orbax_<measure>_vs_best_orbax`` (its median seconds /
    the faster Orbax manager's, of ``orbax``), ``best_orbax``, ``ours_orbax_restore_parts``: the medians
    over rounds of the parts of each restore measure (see the module docstring), and
    ``ours_orbax_handshake_<case>_seconds``: those of ``handshake_seconds``, per restore case."""
    out: dict[str, Any] = {}
    if NAME in seconds and orbax:
        for m in MEASURES:
            best = min(orbax, key=lambda s: seconds[s][m])
            out[f"{NAME}_{m}_vs_best_orbax"] = round(seconds[NAME][m] / seconds[best][m], 3)
            out.setdefault("best_orbax", {})[m] = best
    if runs:
        out[f"{NAME}_safe_after_split"] = {k: round(statistics.median(x["save_split"][k] for x in runs), 4)
                                           for k in SAVE_SPLIT}
        out[f"{NAME}_restore_parts"] = {k: {m: round(statistics.median(x["parts"][k][m] for x in runs), 4)
                                            for m, _ in RESTORES} for k in PARTS}
        for m, case in HANDSHAKE_KEYS.items():
            out[f"{NAME}_handshake_{case}_seconds"] = out[f"{NAME}_restore_parts"]["handshake_seconds"][m]
    return out


# --------------------------------------------------------------------------- one worker of an incarnation

class _AckWatch:
    """Times, from the outside, our daemon's part of Orbax's handshake: ``replicator.yaml`` written by Orbax
    until deleted by the daemon (its ack, after it placed this host's data and the marker)."""

    def __init__(self, local: Path):
        self.yaml = local / "replicator.yaml"
        self.seen: float | None = None
        self.acked: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            # Look once more after the stop: Orbax's own poll can see the ack within our poll's sleep, and its
            # initialize returns (and stops us) before we looked again.
            stopping = self._stop.is_set()
            there = self.yaml.exists()
            if there and self.seen is None:
                self.seen = time.monotonic()
            elif not there and self.seen is not None:
                self.acked = time.monotonic()
                return
            if stopping:
                return
            self._stop.wait(YAML_POLL_SECONDS)

    def seconds(self) -> float:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.seen is None:
            raise RuntimeError(f"did not see {self.yaml} written (polled every {YAML_POLL_SECONDS} s)")
        if self.acked is None:
            raise RuntimeError(f"saw {self.yaml} written but not deleted before Orbax's initialize returned")
        return self.acked - self.seen


def _worker(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import numpy as np
    import orbax.checkpoint as ocp
    from absl import flags
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        replicator_checkpoint_manager as rcm,
    )

    # As MaxText runs MTC: per-process names follow the distributed process id (docs/orbax.md).
    flags.FLAGS(["bench", "--experimental_orbax_use_distributed_process_id=true"])
    local = Path(args.local_dir)
    watch = _AckWatch(local)
    t0 = time.monotonic()
    initialization.initialize_multi_tier_checkpointing(
        local, run_name=JOB, num_slices=SLICES, backup_interval_steps=2,
        jax_initialization_timeout_seconds=INIT_TIMEOUT_SECONDS, jax_shutdown_timeout_seconds=5)
    out["init_returned"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for all hosts
    out["init_seconds"] = out["init_returned"] - t0
    watch.seconds()
    out["yaml_seen"], out["yaml_acked"] = watch.seen, watch.acked  # CLOCK_MONOTONIC: one clock for all hosts
    n = [0]

    def barrier() -> None:
        n[0] += 1
        multihost_utils.sync_global_devices(f"bench-orbax-{n[0]}")

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs).reshape(SLICES, -1), ("replica", "model"))
    options = rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=1)
    seconds: dict[str, float] = {}
    if args.phase == "save":
        state, _ = make_state(mesh, args.mib)
        jax.block_until_ready(state)
        mgr = rcm.ReplicatorCheckpointManager(local, options, global_mesh=mesh)

        def save(step: int) -> None:
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

        barrier()
        save(0)
        mgr.wait_until_finished()
        if args.rank == 0:
            _wait_safe(args.coordinator, 0)
            _wait_backed_up(args.coordinator, 0)
        barrier()
        t = time.monotonic()
        save(1)
        seconds["save_block"] = time.monotonic() - t
        mgr.wait_until_finished()
        # Orbax's own save ends here on this host (its local step committed); the rest until the step is safe
        # is our share: the daemons ingest it, attest the replicas, the coordinator counts it redundant.
        out["save_started"], out["orbax_saved"] = t, time.monotonic()  # CLOCK_MONOTONIC: one clock for all
        if args.rank == 0:
            _wait_safe(args.coordinator, 1)
            out["safe_at"] = time.monotonic()
        barrier()
        seconds["safe_after"] = time.monotonic() - t
        save(2)
        mgr.wait_until_finished()
        if args.rank == 0:
            _wait_backed_up(args.coordinator, 2)
        barrier()
        mgr.close()
    else:
        _restore_phase(args, mesh, local, options, barrier, out, seconds)
    barrier()
    out["seconds"] = seconds


def _restore_phase(args: argparse.Namespace, mesh: Any, local: Path, options: Any, barrier: Any,
                   out: dict[str, Any], seconds: dict[str, float]) -> None:
    """A restore incarnation after ``initialize``: a new manager, ``restore`` of its latest step (timed), the
    check (step 2, bit for bit; untimed)."""
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        replicator_checkpoint_manager as rcm,
    )

    abstract = abstract_state(mesh, args.mib)
    restore_args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
    barrier()
    t = time.monotonic()
    mgr = rcm.ReplicatorCheckpointManager(local, options, global_mesh=mesh)
    out["open_seconds"] = time.monotonic() - t
    step = mgr.latest_step()
    got = mgr.restore(step, args=restore_args)["state"]
    jax.block_until_ready(got)
    seconds[args.phase] = out["after_init_seconds"] = time.monotonic() - t
    barrier()
    if step != 2:
        raise ValueError(f"{args.phase}: restored step {step}, saved 2")
    try:
        out["sign_lost"] = check_state(got, abstract)
    except ValueError as e:
        raise ValueError(f"{args.phase}: {e}") from None
    del got
    mgr.close()


def _status(coordinator: str) -> Any:
    from replicator.coordinator.client import CoordinatorClient

    c = CoordinatorClient(coordinator, rpc_timeout_seconds=RPC_TIMEOUT_SECONDS)
    try:
        return c.status()
    finally:
        c.close()


def _wait_safe(coordinator: str, step: int) -> None:
    def redundant() -> bool:
        s = next((s for s in _status(coordinator).steps if s.step == step), None)
        return s is not None and s.complete and s.redundant

    wait_for(redundant, WAIT_SECONDS, f"step {step} redundant")


def _wait_backed_up(coordinator: str, step: int) -> None:
    wait_for(lambda: step in _status(coordinator).backup.committed_steps, WAIT_SECONDS, f"step {step} backed up")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one JAX process of bench.emergency's ours_orbax job incarnations")
    p.add_argument("--phase", required=True, choices=["save", *(m for m, _ in RESTORES)])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--local-dir", required=True)
    p.add_argument("--coordinator", required=True, help="our coordinator (host 0's daemon)")
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    out: dict[str, Any] = {"rank": args.rank, "phase": args.phase}
    try:
        _worker(args, out)
    except Exception as e:  # noqa: BLE001 - reported as this system's error, with its exact text
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-4000:]
    Path(args.result).write_text(json.dumps(out))
    sys.stdout.flush()
    # Skip JAX's distributed shutdown barrier: after an error the other processes may be gone.
    os._exit(0 if "error" not in out else 1)


if __name__ == "__main__":
    sys.exit(main())
