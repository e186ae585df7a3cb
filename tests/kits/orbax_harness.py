"""Launches a 2-process multi-controller Orbax job on loopback and stands in for the replicator daemon.

Each JAX process runs ``orbax_worker.py`` (unchanged Orbax MTC calls). The "daemon" is one thread per host
that answers Orbax's handshake with the helpers of ``replicator.orbax.contract`` only.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from replicator.orbax import contract as oc
from tests.kits.jax_procs import free_port, read_results, run_all, worker_env

WORKER = Path(__file__).with_name("orbax_worker.py")
PYTHON = sys.executable
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
# Orbax's ack wait and JAX's distributed-init timeout (the same argument). Answers come in < 0.1 s; this
# only bounds a broken test. Orbax polls once a second, so the value does not change the test's speed.
INIT_TIMEOUT_SECONDS = 30
PROCESS_TIMEOUT_SECONDS = 60

# What the daemon does when it sees replicator.yaml: (local_dir, rank, config) -> None.
Action = Callable[[Path, int, oc.ReplicatorConfig], None]


class Responder(threading.Thread):
    """Polls one host's local directory and answers each handshake with ``action``."""

    def __init__(self, local_dir: Path, rank: int, action: Action):
        super().__init__(daemon=True, name=f"responder-{rank}")
        self.local_dir = local_dir
        self.rank = rank
        self.action = action
        self.configs: list[oc.ReplicatorConfig] = []
        self.errors: list[BaseException] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                cfg = oc.read_config(self.local_dir)
                if cfg is not None:
                    self.configs.append(cfg)
                    self.action(self.local_dir, self.rank, cfg)
            except BaseException as e:  # noqa: BLE001 - surfaced to the test
                self.errors.append(e)
                return
            self._halt.wait(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def fresh_start(local_dir: Path, rank: int, cfg: oc.ReplicatorConfig) -> None:
    """Daemon answer when nothing is restorable: clean up, ack, step-0 marker (Google's order)."""
    oc.prepare_for_restore(local_dir, None)
    oc.acknowledge(local_dir, cfg)
    oc.write_no_restore_marker(local_dir, cfg.job_name, cfg.node_rank)


def restore_from(step: int, targets: dict[int, Path]) -> Action:
    """Daemon answer that restores ``step`` on every rank from ``targets[rank]`` (a staged step directory)."""

    def action(local_dir: Path, rank: int, cfg: oc.ReplicatorConfig) -> None:
        # Marker first, ack last: Orbax looks for markers only after the ack, so the planning time is
        # bounded by jax_initialization_timeout_seconds instead of the fixed 300 s marker wait.
        oc.prepare_for_restore(local_dir, step)
        oc.write_restore_marker(local_dir, cfg.job_name, step, cfg.node_rank, targets[cfg.node_rank])
        oc.acknowledge(local_dir, cfg)

    return action


@dataclass
class JobResult:
    returncodes: list[int]
    results: list[dict]
    logs: list[str]
    configs: list[list[oc.ReplicatorConfig]]
    seconds: float
    responder_errors: list[BaseException] = field(default_factory=list)


def run_job(
    root: Path,
    job: str,
    action: Action,
    *,
    save_steps: str = "",
    restore_step: int = -1,
    layout: str = "sharded",
    perturb_step: dict[int, int] | None = None,
    use_mtc_process_ids: bool = True,
    num_slices: int = 0,
) -> JobResult:
    """Run one incarnation of a 2-process job with local dirs ``root/local<rank>``; returns when both exit."""
    port = free_port()
    coordinator = f"127.0.0.1:{port}"
    responders: list[Responder] = []
    jobs = []
    t0 = time.monotonic()
    try:
        for rank in range(NUM_PROCESSES):
            local = root / f"local{rank}"
            local.mkdir(parents=True, exist_ok=True)
            (root / f"result{rank}.json").unlink(missing_ok=True)
            if use_mtc_process_ids:
                # What GKE's ranks service does; Orbax reads it and calls jax.distributed.initialize itself.
                oc.write_jax_init_info(local, rank, coordinator)
            else:
                (local / oc.JAX_INIT_INFO_FILE).unlink(missing_ok=True)
            cmd = [
                PYTHON,
                str(WORKER),
                "--local-dir", str(local),
                "--job", job,
                "--save-steps", save_steps,
                "--restore-step", str(restore_step),
                "--layout", layout,
                "--perturb-step", str((perturb_step or {}).get(rank, -1)),
                "--num-slices", str(num_slices),
                "--init-timeout", str(INIT_TIMEOUT_SECONDS),
                "--use-mtc-process-ids", "1" if use_mtc_process_ids else "0",
                "--result", str(root / f"result{rank}.json"),
            ]  # fmt: skip
            responder = Responder(local, rank, action)
            responder.start()
            responders.append(responder)
            jobs.append((cmd, worker_env(rank, NUM_PROCESSES, DEVICES_PER_PROCESS, coordinator),
                         root / f"worker{rank}.log"))
        rcs = run_all(jobs, PROCESS_TIMEOUT_SECONDS)
    finally:
        for r in responders:
            r.stop()
    seconds = time.monotonic() - t0
    results = read_results([root / f"result{rank}.json" for rank in range(NUM_PROCESSES)])
    logs = [(root / f"worker{rank}.log").read_text() for rank in range(NUM_PROCESSES)]
    return JobResult(
        returncodes=rcs,
        results=results,
        logs=logs,
        configs=[r.configs for r in responders],
        seconds=seconds,
        responder_errors=[e for r in responders for e in r.errors],
    )


def describe(res: JobResult) -> str:
    """Failure message: return codes, responder errors and the tail of each worker's log."""
    tails = "\n".join(
        f"--- worker {i}\n" + "\n".join(log.splitlines()[-25:]) for i, log in enumerate(res.logs)
    )
    return f"rc={res.returncodes} responder_errors={res.responder_errors!r} results={res.results}\n{tails}"
