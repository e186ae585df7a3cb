"""Test kit: a cluster of real `mtc replicator` processes on 127.0.0.1 for multi-process scenarios."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ReplicatorProc:
    def __init__(self, rank: int, args: list[str], log_path: Path):
        self.rank = rank
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout: float = 60.0) -> str:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "controller_client.cli", "-v", "replicator", *self.args],
                                     stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(REPO))
        log.close()
        found: list[str] = []

        def reader() -> None:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("LISTENING ") and not found:
                    found.append(line.split()[1])

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replicator {self.rank} exited {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        if not found:
            raise TimeoutError(f"replicator {self.rank} did not start: {self.log_path.read_text()[-2000:]}")
        self.address = found[0]
        return self.address

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Cluster:
    """N replicators (rank 0 also the coordinator), per-host RAM dirs ``<base>/ram/<rank>``."""

    def __init__(self, base: Path, nodes: int, data_parallelism: int, replicas: int = 1, extra: list[str] = ()):
        self.base = base
        self.nodes = nodes
        self.data_parallelism = data_parallelism
        self.replicas = replicas
        self.extra = list(extra)
        self.procs: dict[int, ReplicatorProc] = {}
        self.coordinator = ""
        (base / "logs").mkdir(parents=True, exist_ok=True)

    def ram(self, rank: int) -> Path:
        return self.base / "ram" / str(rank)

    @property
    def local_template(self) -> str:
        return str(self.base / "ram" / "{host}")

    def _args(self, rank: int, listen: str) -> list[str]:
        args = ["--local-dir", str(self.ram(rank)), "--listen", listen, "--job", "t", "--rank", str(rank),
                "--nodes", str(self.nodes), "--data-parallelism", str(self.data_parallelism),
                "--replicas", str(self.replicas), "--heartbeat-seconds", "0.2", "--rpc-timeout-seconds", "5",
                "--transfer-timeout-seconds", "60", *self.extra]
        if rank != 0:
            args += ["--coordinator", self.coordinator]
        return args

    def start(self, rank: int) -> str:
        if rank == 0:
            listen = self.coordinator or "127.0.0.1:0"
        else:
            listen = "127.0.0.1:0"
        p = ReplicatorProc(rank, self._args(rank, listen), self.base / "logs" / f"replicator-{rank}.log")
        self.procs[rank] = p
        addr = p.start()
        if rank == 0:
            self.coordinator = addr
        return addr

    def start_all(self) -> None:
        self.start(0)
        for r in range(1, self.nodes):
            self.start(r)

    def stop_all(self, sig: int = signal.SIGTERM) -> None:
        for p in self.procs.values():
            p.stop(sig)

    def wipe(self, rank: int) -> None:
        shutil.rmtree(self.ram(rank), ignore_errors=True)

    def logs(self) -> str:
        out = []
        for p in sorted((self.base / "logs").glob("*.log")):
            out.append(f"==== {p.name}\n{p.read_text()[-3000:]}")
        return "\n".join(out)



def wait_for(pred, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
