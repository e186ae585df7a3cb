"""A multi-controller trainer that is ending waits for no lost peer (controller_client/exit_guard.py).

Two real JAX processes joined by ``jax.distributed`` (gloo on loopback), each building the multi-controller
``CheckpointManager`` as a trainer does. Process 0 (which also runs JAX's coordination service) is frozen with
SIGSTOP: a host whose packets go nowhere. Without the guard, process 1 then waited at JAX's shutdown barrier
(300 s by default) whether it failed or exited normally, and JAX's preemption notifier swallowed SIGTERM: the
Pod's deletion ended it only at its SIGKILL (tests/cluster/test_in_place_restart.py: 52-57 s from a host lost
to the next step instead of 9 s, in half the runs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller_client import exit_guard

ROOT = Path(__file__).resolve().parents[2]

PROCESS = """
import os, sys, time
import jax
import numpy as np
from jax.experimental import multihost_utils

rank, port, end, local = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                           initialization_timeout=60, cluster_detection_method="deactivate")
from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mgr = CheckpointManager(CheckpointManagerOptions(local_directory=local, job_name="t", dispatcher="in_process"),
                        devices=devs, topology=HostTopology.simulated(devs, 2, 1))
assert list(np.asarray(multihost_utils.process_allgather(np.int32(rank)))) == [0, 1]
mgr.close()  # a collective too: both processes close before either ends its own way
print("ready", flush=True)
if end == "wait":
    time.sleep(600)
time.sleep(float(os.environ.get("MTC_TEST_END_AFTER", "0")))
if end == "raise":
    raise RuntimeError("Gloo AllGather failed: Connection closed by peer (as a lost host's collective fails)")
sys.exit(0)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pair:
    """Process 0 and 1; ``ends``: what each does once both are ready (wait / raise / exit). Their output goes
    to files (gloo prints to stdout too)."""

    def __init__(self, tmp_path: Path, ends: tuple[str, str], end_after: float = 0.0):
        script = tmp_path / "proc.py"
        script.write_text(PROCESS)
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MTC_TEST_END_AFTER=str(end_after),
                   XLA_FLAGS="--xla_force_host_platform_device_count=1")
        port = str(_port())
        self.procs: list[subprocess.Popen[bytes]] = []
        self.out: list[Path] = []
        self.err: list[Path] = []
        for rank, end in enumerate(ends):
            local = tmp_path / f"local{rank}"
            local.mkdir()
            self.out.append(tmp_path / f"out{rank}")
            self.err.append(tmp_path / f"err{rank}")
            with open(self.out[-1], "wb") as out, open(self.err[-1], "wb") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(script), str(rank), port, end, str(local)], env=env, stdout=out,
                    stderr=err))

    def wait_ready(self, seconds: float = 120.0) -> None:
        deadline = time.monotonic() + seconds
        for rank, p in enumerate(self.procs):
            while "ready" not in self.out[rank].read_text().split("\n"):
                if p.poll() is not None:
                    pytest.fail(f"process {rank} ended before it was ready: {self.stderr(rank)[-2000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"process {rank} not ready in {seconds:.0f} s: {self.stderr(rank)[-2000:]}")
                time.sleep(0.1)

    def stderr(self, rank: int) -> str:
        return self.err[rank].read_text(errors="replace")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _exit_within(p: subprocess.Popen[bytes], seconds: float) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        rc = p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"process {p.pid} still running {seconds:.0f} s later")
    return rc, time.monotonic() - t0


@pytest.fixture
def pair(tmp_path: Path):
    made: list[_Pair] = []

    def make(ends: tuple[str, str], end_after: float = 0.0) -> _Pair:
        made.append(_Pair(tmp_path, ends, end_after))
        made[-1].wait_ready()
        return made[-1]

    yield make
    for p in made:
        p.stop()


def test_a_failing_process_does_not_wait_for_a_lost_peer(pair) -> None:
    """Process 1's collective fails while process 0 is frozen: it exits 1 after the guard's bound, not after
    JAX's 300 s shutdown barrier (it waited out the test's bound without the guard)."""
    job = pair(("wait", "raise"), end_after=2.0)
    os.kill(job.procs[0].pid, signal.SIGSTOP)
    rc, took = _exit_within(job.procs[1], exit_guard.FAILED_SHUTDOWN_SECONDS + 20)
    err = job.stderr(1)
    assert rc == 1
    assert "Gloo AllGather failed" in err and "exiting 1 without it" in err
    assert took >= exit_guard.FAILED_SHUTDOWN_SECONDS - 1  # it gave the barrier its chance (2 s after ready)


def test_sigterm_ends_a_process_waiting_at_the_shutdown_barrier(pair) -> None:
    """Process 1 exits normally while process 0 is frozen: it waits at JAX's barrier (as it should: a peer
    may still be saving), but the kubelet's SIGTERM ends it at once (JAX's notifier swallowed it before)."""
    job = pair(("wait", "exit"))
    os.kill(job.procs[0].pid, signal.SIGSTOP)
    time.sleep(2.0)
    assert job.procs[1].poll() is None  # at the barrier
    os.kill(job.procs[1].pid, signal.SIGTERM)
    rc, _ = _exit_within(job.procs[1], 10)
    assert rc == -signal.SIGTERM


def test_healthy_peers_keep_jax_shutdown(pair) -> None:
    """Both alive: one fails, the other exits 0; both pass JAX's own shutdown barrier (no early exit)."""
    job = pair(("exit", "raise"))
    rcs = [_exit_within(p, 60)[0] for p in job.procs]
    assert rcs == [0, 1]
    assert "without it" not in job.stderr(1)
