"""Test kit shared by the Orbax harnesses: multi-process JAX on CPU over loopback, started and stopped by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from controller_client.demo.ports import free_port as free_port  # the kits' callers import it from here

REPO = Path(__file__).resolve().parents[2]


def worker_env(rank: int, processes: int, devices: int, coordinator: str) -> dict[str, str]:
    """Environment of JAX process ``rank``: CPU devices, and the Slurm variables JAX reads when Orbax calls
    ``jax.distributed.initialize`` without ``num_processes`` (and the process id when Orbax does not pass it)."""
    return dict(
        os.environ,
        PYTHONPATH=str(REPO),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="127.0.0.1",
        SLURM_NTASKS=str(processes),
        SLURM_PROCID=str(rank),
        SLURM_LOCALID="0",
        JAX_COORDINATOR_ADDRESS=coordinator,
        JAX_COORDINATOR_BIND_ADDRESS=coordinator,  # loopback only (JAX binds [::] by default)
    )


def run_all(jobs: Sequence[tuple[list[str], dict[str, str], Path]], timeout: float,
            cwd: Path | None = None) -> list[int]:
    """Start every ``(cmd, env, log_path)`` in its own session, wait for all within ``timeout``; returns the
    exit codes (-999 for one still running, which is then killed by its pid)."""
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for cmd, env, log_path in jobs:
            log_f = open(log_path, "w")  # noqa: SIM115 - closed in finally
            logs.append(log_f)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=None if cwd is None else str(cwd)))
        deadline = time.monotonic() + timeout
        rcs = []
        for p in procs:
            try:
                rcs.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                rcs.append(-999)
        return rcs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own session, by its pid
                p.wait(timeout=10)
        for f in logs:
            f.close()


def read_results(paths: Sequence[Path]) -> list[dict]:
    return [json.loads(p.read_text()) if p.exists() else {} for p in paths]
