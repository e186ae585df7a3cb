"""bench.goodput's Pods: the replicator sidecars (ours) and the 4 training processes of a job incarnation.

Every process is started in its own session and stopped by its pid. The replicators are what the rendered
JobSets run as a native sidecar of each worker Pod (deploy/multi-controller-native): they restart with their
Pod, and the Pod's training container starts beside its replicator (or, ``--trainer-start after-probe``, as
rendered before, only once its replicator answers the startup probe).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.children import bound_to_us, replicator_argv
from bench.emergency_common import DEVICES_PER_PROCESS, PROCESSES, REPO, SLICES
from controller_client.demo.ports import free_port

if TYPE_CHECKING:
    from bench.goodput_run import RunOptions

STOP_TIMEOUT_SECONDS = 30.0
SERVE_TIMEOUT_SECONDS = 120.0
STATUS_TIMEOUT_SECONDS = 5.0


def env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", GRPC_VERBOSITY="ERROR",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def stop(p: subprocess.Popen, sig: int, timeout: float) -> None:
    """``sig`` to ``p``'s own session (by its pid), SIGKILL after ``timeout``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def waited(p: subprocess.Popen, timeout: float) -> bool:
    try:
        p.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


class Replicators:
    """ours: one real ``mtc replicator`` per host (host 0's serves the coordinator), backing up to a folder."""

    def __init__(self, opts: RunOptions, storage: Path, logs: Path):
        self.opts, self.storage, self.logs = opts, storage, logs
        self.ports = [free_port() for _ in range(PROCESSES)]
        self.procs: dict[int, subprocess.Popen] = {}

    def local(self, host: int) -> Path:
        return self.storage / f"local{host}"

    def start(self, host: int) -> None:
        self.local(host).mkdir(parents=True, exist_ok=True)
        args = ["--local-dir", str(self.local(host)), "--listen", f"127.0.0.1:{self.ports[host]}", "--job", "bench",
                "--rank", str(host), "--nodes", str(PROCESSES), "--data-parallelism", str(SLICES),
                "--heartbeat-seconds", "0.1", "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "300",
                "--backup-url", f"file://{self.storage / 'persistent'}",
                "--backup-interval-minutes", f"{self.opts.bucket_seconds / 60:.4f}",
                "--preemption-grace-seconds", str(self.opts.grace_seconds)]
        if host:
            args += ["--coordinator", f"127.0.0.1:{self.ports[0]}"]
        with open(self.logs / f"replicator-{host}.log", "ab") as log:
            self.procs[host] = subprocess.Popen(
                bound_to_us(replicator_argv(*args)), stdout=log,
                stderr=subprocess.STDOUT, env=env(), cwd=str(REPO), start_new_session=True)

    def serving(self, host: int) -> bool:
        """The startup probe: ``host``'s replicator accepts on its gRPC port (RuntimeError if it exited)."""
        p = self.procs.get(host)
        if p is None or p.poll() is not None:
            raise RuntimeError(f"replicator {host} is not running (exit {None if p is None else p.returncode})")
        try:
            with socket.create_connection(("127.0.0.1", self.ports[host]), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self, hosts: list[int] | tuple[int, ...], sig: int = signal.SIGKILL,
             timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        procs = [p for p in (self.procs.pop(h, None) for h in hosts) if p is not None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + timeout
        for p in procs:
            stop(p, signal.SIGKILL, max(0.1, deadline - time.monotonic()))

    def record_restart(self, hosts: list[int]) -> None:
        """What the preStop hook (``mtc preempt --on-restart skip``) records when the Pod's Job is going away
        (a JobSet restart) and the RAM disk outlives the Pod: the replicator's SIGTERM then skips its flush."""
        from replicator import preemption

        for h in hosts:
            preemption.record_restart(self.local(h))

    def notice(self, hosts: tuple[int, ...], grace_seconds: float) -> None:
        """A preemption notice, as the Pods' preStop hook gives it (``mtc preempt``)."""
        hooks = [subprocess.Popen([sys.executable, "-m", "controller_client.cli", "preempt", "--local-dir",
                                   str(self.local(h)), "--save-window-seconds", f"{grace_seconds * 0.5:.2f}",
                                   "--flush-seconds", f"{grace_seconds * 0.4:.2f}"],
                                  env=env(), cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
                 for h in hosts]
        for hook in hooks:
            if not waited(hook, 30):
                stop(hook, signal.SIGKILL, 10)

    def restore_spans(self, since_monotonic: float) -> list[tuple[float, float]]:
        """(start, end) of each host's last restore (its replicator's, planned by the coordinator or asked
        for by the front door), on CLOCK_MONOTONIC, for those that ended after ``since_monotonic``."""
        import grpc

        from mtc_rpc import control_pb2, control_pb2_grpc
        from sidecar import layout

        offset = time.time() - time.monotonic()
        out = []
        for h in sorted(self.procs):
            try:
                with grpc.insecure_channel(f"unix:{layout.control_socket(self.local(h))}") as ch:
                    st = control_pb2_grpc.LocalControlStub(ch).GetLocalStatus(
                        control_pb2.GetLocalStatusRequest(), timeout=STATUS_TIMEOUT_SECONDS)
            except grpc.RpcError:
                continue
            if st.HasField("last_restore") and st.last_restore.finished_unix - offset >= since_monotonic:
                end = st.last_restore.finished_unix - offset
                out.append((end - st.last_restore.seconds, end))
        return out


class Job:
    """The 4 worker processes of the current incarnation."""

    def __init__(self, opts: RunOptions, base: Path, logs: Path, ports: list[int]):
        self.opts, self.base, self.logs, self.ports = opts, base, logs, ports
        self.incarnation = -1
        self.jax_port = 0
        self.procs: list[subprocess.Popen] = []

    def begin(self) -> None:
        """A new incarnation; its processes are started by :meth:`start_rank`."""
        self.incarnation += 1
        self.jax_port = free_port()
        self.procs = []

    def start_rank(self, rank: int) -> None:
        o = self.opts
        cmd = [sys.executable, "-m", "bench.goodput_worker", "--system", o.system, "--rank", str(rank),
               "--incarnation", str(self.incarnation), "--mib", str(o.mib), "--step-seconds", str(o.step_seconds),
               "--mtbf-seconds", str(o.mtbf_seconds), "--bucket-seconds", str(o.bucket_seconds),
               "--base", str(self.base), "--jax-coordinator", f"127.0.0.1:{self.jax_port}",
               "--ports", ",".join(map(str, self.ports))]
        with open(self.logs / f"worker-{self.incarnation}-{rank}.log", "wb") as log:
            self.procs.append(subprocess.Popen(bound_to_us(cmd), stdout=log, stderr=subprocess.STDOUT, env=env(),
                                               cwd=str(REPO), start_new_session=True))

    def start(self) -> None:
        self.begin()
        for rank in range(PROCESSES):
            self.start_rank(rank)

    def kill(self) -> None:
        for p in self.procs:
            stop(p, signal.SIGKILL, 10)

    def exited(self) -> list[int]:
        return [p.returncode for p in self.procs if p.poll() is not None]

    def error(self) -> str | None:
        """The first error a worker of this incarnation wrote, if any (a wrong restore before any other: the
        other hosts' collectives are cut when that host exits)."""
        texts = [p.read_text() for p in sorted((self.base / "errors").glob(f"{self.incarnation}-*.txt"))]
        errors = [t.splitlines()[0][:600] for t in texts if t.strip()]
        if errors:
            return next((e for e in errors if e.startswith("WrongRestore")), errors[0])
        codes = [c for c in self.exited() if c != 0]
        return f"a worker exited with {codes[0]} and no error" if codes else None
