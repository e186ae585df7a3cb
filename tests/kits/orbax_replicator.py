"""Test kit: real `mtc replicator` processes in Orbax mode plus multi-process Orbax jobs, on loopback.

Each host ``r`` has a local directory ``<base>/local<r>``, one replicator daemon (``mtc replicator
--local-dir ...`` without ``--rank/--nodes``) on a fixed loopback port, and, per job incarnation, one JAX
process running ``orbax_replicator_worker.py``. The daemon writes ``jax-init-info.txt`` itself
(``--jax-coordinator``/``--jax-process-id``), so Orbax runs with its default ``use_mtc_process_ids=True``.
Every process is started in its own session and stopped by its pid, with timeouts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.kits.jax_procs import REPO, free_port, read_results, run_all, worker_env

WORKER = Path(__file__).with_name("orbax_replicator_worker.py")
DEVICES_PER_PROCESS = 2
# Orbax's ack wait and JAX's init timeout. The replicator answers in ~1 s; this only bounds a broken run.
INIT_TIMEOUT_SECONDS = 60


class Daemon:
    """One `mtc replicator` process in Orbax mode."""

    def __init__(self, args: list[str], log_path: Path):
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controller_client.cli", "-v", "replicator", *self.args],
                stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(REPO), start_new_session=True,
            )  # fmt: skip
        self.lines = []

        def reader(proc: subprocess.Popen, lines: list[str]) -> None:
            for raw in proc.stdout:
                lines.append(raw.decode(errors="replace").strip())

        threading.Thread(target=reader, args=(self.proc, self.lines), daemon=True).start()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # its own session, by its pid
                p.wait(timeout=10)
        return p.returncode


@dataclass
class JobResult:
    returncodes: list[int]
    results: list[dict]
    logs: list[str]
    seconds: float


class OrbaxCluster:
    """``nodes`` hosts, each with a replicator daemon in Orbax mode; ``run_job`` runs one job incarnation.

    ``members`` (default: every host) are the hosts of the current job in rank order: rank ``r`` is host
    ``members[r]`` (its directory, daemon and address); :meth:`set_members` changes them (an elastic event).
    """

    def __init__(self, base: Path, nodes: int, extra: list[str] = (), members: list[int] | None = None):
        self.base = base
        self.nodes = nodes
        self.extra = list(extra)
        self.members = list(range(nodes)) if members is None else list(members)
        self.ports = [free_port() for _ in range(nodes)]
        self.jax_port = free_port()
        self.daemons: dict[int, Daemon] = {}
        (base / "logs").mkdir(parents=True, exist_ok=True)

    def local(self, rank: int) -> Path:
        return self.base / f"local{rank}"

    def address(self, rank: int) -> str:
        return f"127.0.0.1:{self.ports[rank]}"

    def set_members(self, hosts: list[int]) -> None:
        self.members = list(hosts)

    def daemon_args(self, host: int) -> list[str]:
        """Host ``host``'s daemon: ``--peers`` is the whole allocation (keyed by host index, which Orbax's
        ranks equal until an elastic event renumbers the hosts); its JAX process id follows :attr:`members`."""
        peers = ",".join(f"{h}={self.address(h)}" for h in range(self.nodes))
        return [
            "--local-dir", str(self.local(host)), "--listen", self.address(host), "--peers", peers,
            "--jax-coordinator", f"127.0.0.1:{self.jax_port}", "--jax-process-id", str(self.members.index(host)),
            "--heartbeat-seconds", "0.2", "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "30",
            "--handshake-timeout-seconds", "40", *self.extra,
        ]  # fmt: skip

    def start(self, rank: int) -> None:
        d = Daemon(self.daemon_args(rank), self.base / "logs" / f"replicator-{rank}.log")
        self.daemons[rank] = d
        d.start()

    def start_all(self) -> None:
        for h in self.members:
            self.start(h)

    def stop(self, rank: int) -> int | None:
        return self.daemons[rank].stop()

    def stop_all(self, sig: int = signal.SIGTERM) -> list[int | None]:
        return [d.stop(sig) for d in self.daemons.values()]

    def wipe(self, rank: int) -> None:
        shutil.rmtree(self.local(rank), ignore_errors=True)

    def run_job(self, job: str, *, slices: int, save_steps: str = "", restore_step: int = -1,
                save_sleep: float = 0.0, backup_interval_steps: int = 0, backup_interval_minutes: int = 0,
                processes: int | None = None, colocated: bool = False, elastic: bool = False,
                keep_latest: int = 0, delete_restored: bool = False, timeout: float = 120.0) -> JobResult:
        """One incarnation of the job: one JAX process per host, unchanged Orbax calls; waits for all."""
        n = len(self.members) if processes is None else processes
        t0 = time.monotonic()
        jobs = []
        for rank in range(n):
            result = self.base / f"result{rank}.json"
            result.unlink(missing_ok=True)
            cmd = [
                sys.executable, str(WORKER), "--local-dir", str(self.local(self.members[rank])), "--job", job,
                "--slices", str(slices), "--save-steps", save_steps, "--save-sleep", str(save_sleep),
                "--restore-step", str(restore_step), "--backup-interval-steps", str(backup_interval_steps),
                "--backup-interval-minutes", str(backup_interval_minutes),
                "--init-timeout", str(INIT_TIMEOUT_SECONDS), "--colocated", "1" if colocated else "0",
                "--elastic", "1" if elastic else "0", "--keep-latest", str(keep_latest),
                "--delete-restored", "1" if delete_restored else "0",
                "--result", str(result),
            ]  # fmt: skip
            env = worker_env(rank, n, 8 if colocated else DEVICES_PER_PROCESS, f"127.0.0.1:{self.jax_port}")
            jobs.append((cmd, env, self.base / "logs" / f"worker{rank}.log"))
        rcs = run_all(jobs, timeout, cwd=self.base)
        results = read_results([self.base / f"result{rank}.json" for rank in range(n)])
        texts = [(self.base / "logs" / f"worker{r}.log").read_text() for r in range(n)]
        return JobResult(rcs, results, texts, time.monotonic() - t0)

    def describe(self, res: JobResult | None = None) -> str:
        out = []
        if res is not None:
            out.append(f"rc={res.returncodes} results={res.results}")
            out += [f"--- worker {i}\n" + "\n".join(t.splitlines()[-25:]) for i, t in enumerate(res.logs)]
        for p in sorted((self.base / "logs").glob("replicator-*.log")):
            out.append(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-30:]))
        return "\n".join(out)


def restored_from(restored: Path, copy: Path) -> bool:
    """Whether Orbax's restored ``<local>/<N>`` is the marker we made of ``copy`` (its hard links)."""
    try:
        return os.path.samefile(Path(restored) / "commit_success.txt", Path(copy) / "commit_success.txt")
    except FileNotFoundError:
        return False


def wait_for(pred, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
