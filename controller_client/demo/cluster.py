"""Run a job's replicators as local processes on loopback (the demo's embedded default, and the tests').

Rank 0's replicator also serves the coordinator; the others find it by address. Every process is started
and stopped by its pid; nothing is killed by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from controller_client.demo.ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 60.0


class ReplicatorProcess:
    """One `mtc replicator` child process; ``start()`` returns the address it prints."""

    def __init__(self, rank: int, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.rank = rank
        self.args = args
        self.log_path = log_path
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout_seconds: float = START_TIMEOUT_SECONDS) -> str:
        env = dict(os.environ, **self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controller_client.cli", "-v", "replicator", *self.args],
                stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(REPO))
        found: list[str] = []

        def read_stdout() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("LISTENING ") and not found:
                    found.append(line.split()[1])

        threading.Thread(target=read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout_seconds
        while not found and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replicator {self.rank} exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        if not found:
            self.stop(signal.SIGKILL)
            raise TimeoutError(f"replicator {self.rank} did not start within {timeout_seconds}s")
        self.address = found[0]
        return self.address

    def stop(self, sig: int = signal.SIGTERM, timeout_seconds: float = 30.0) -> None:
        self.signal(sig)
        self.wait(timeout_seconds)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_seconds: float = 30.0) -> None:
        """Wait for the process to exit after a signal; SIGKILL it when it does not within the timeout."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """``nodes`` replicators on 127.0.0.1 with RAM dirs ``<base>/ram/<rank>``; rank 0 is the coordinator."""

    def __init__(self, base: Path, nodes: int, data_parallelism: int, replicas: int = 1,
                 extra: list[str] | None = None, heartbeat_seconds: float = 0.2):
        self.base = Path(base)
        self.nodes = nodes
        self.data_parallelism = data_parallelism
        self.replicas = replicas
        self.extra = list(extra or [])
        self.heartbeat_seconds = heartbeat_seconds
        self.env: dict[str, str] = {}
        self.procs: dict[int, ReplicatorProcess] = {}
        self.coordinator = ""
        (self.base / "logs").mkdir(parents=True, exist_ok=True)

    def ram(self, rank: int) -> Path:
        return self.base / "ram" / str(rank)

    @property
    def local_template(self) -> str:
        """``local_directory`` for CheckpointManager: each simulated host's RAM dir."""
        return str(self.base / "ram" / "{host}")

    def _args(self, rank: int, listen: str) -> list[str]:
        args = ["--local-dir", str(self.ram(rank)), "--listen", listen, "--job", "t", "--rank", str(rank),
                "--nodes", str(self.nodes), "--data-parallelism", str(self.data_parallelism),
                "--replicas", str(self.replicas), "--heartbeat-seconds", str(self.heartbeat_seconds),
                "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "60", *self.extra]
        if rank != 0:
            args += ["--coordinator", self.coordinator]
        return args

    def start(self, rank: int) -> str:
        # The coordinator keeps its address across restarts: the others know it by address. Its port is
        # picked below the ephemeral range: a port the kernel handed out may be another process's connection
        # by the time the coordinator restarts (seen: "Address already in use" on a restart).
        listen = (self.coordinator or f"127.0.0.1:{free_port()}") if rank == 0 else "127.0.0.1:0"
        p = ReplicatorProcess(rank, self._args(rank, listen), self.base / "logs" / f"replicator-{rank}.log",
                              self.env)
        self.procs[rank] = p
        addr = p.start()
        if rank == 0:
            self.coordinator = addr
        return addr

    def start_all(self) -> None:
        """Rank 0 first (the others need its address), then the others together."""
        self.start(0)
        self.start_many(range(1, self.nodes))

    def start_many(self, ranks: Iterable[int]) -> None:
        """Start these ranks' replicators concurrently (each start waits for its process to listen)."""
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                self.start(rank)
            except BaseException as e:  # re-raised below, in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        """Signal every replicator at once, then wait for each (as Kubernetes stops a job's Pods: on SIGTERM
        they flush the newest complete step to the bucket together, the coordinator among them)."""
        for p in self.procs.values():
            p.signal(sig)
        for p in self.procs.values():
            p.wait()

    def notice(self, rank: int, flush_seconds: float = 20.0, timeout_seconds: float = 5.0) -> None:
        """Give rank ``rank``'s replicator a preemption notice as its Pod's preStop hook does (``mtc preempt``:
        ``LocalControl.Preempt`` over its control socket); the replicator keeps serving."""
        # Imported here: grpc and the stubs only for the tests and demos that give notices.
        import grpc

        from mtc_rpc import control_pb2, control_pb2_grpc
        from sidecar import layout

        with grpc.insecure_channel(f"unix:{layout.control_socket(self.ram(rank))}") as ch:
            control_pb2_grpc.LocalControlStub(ch).Preempt(
                control_pb2.PreemptRequest(save_window_seconds=0.0, flush_seconds=flush_seconds),
                timeout=timeout_seconds)

    def wipe(self, rank: int) -> None:
        shutil.rmtree(self.ram(rank), ignore_errors=True)

    def logs(self) -> str:
        out = []
        for p in sorted((self.base / "logs").glob("*.log")):
            out.append(f"==== {p.name}\n{p.read_text()[-3000:]}")
        return "\n".join(out)
