"""Real `mtc replicator` daemons on a :class:`~tests.kits.faultnet.FaultNetwork`, a trainer that saves steps
into their RAM dirs, and coordinator probes recording every answer (the fault tests, issue #33).

Two slices of two hosts (ranks 0-1, 2-3); coordinator candidates are each slice's first host (0, then 2).
Every daemon listens on ``<its namespace's address>:7070`` and runs in its host's namespace; the RAM dirs and
the ``file://`` bucket are directories of the shared filesystem. The trainer saves each step with the
sidecar's own writer -- the same committed step directories a JAX save leaves, without JAX: with ``savers``
(issue #45), through one :mod:`tests.kits.fault_saver` process per host, started inside that host's namespace,
which saves the host's own rank with ``sidecar.writer.HostWriter`` (write, commit, notify the host's
replicator); without, from the test process (``write_step`` then ``notify_step_committed``). Every process
is started and stopped by its pid with bounded waits.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from mtc_rpc import control_pb2, control_pb2_grpc
from sidecar import checksums, commit, layout, writer
from sidecar.notify import notify_step_committed
from tests.kits.cgroup import MemoryCgroup
from tests.kits.faultnet import FaultNetwork

REPO = Path(__file__).resolve().parents[2]
PORT = 7070
NODES = 4
SLICES = 2
CANDIDATES = (0, 2)
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0
SAVE_ANSWER_TIMEOUT_SECONDS = 90.0  # a saver's answer to one save (its own bound is 60 s)
LOCAL_STATUS_TIMEOUT_SECONDS = 3.0


def step_bytes(rank: int, step: int, nbytes: int) -> np.ndarray:
    """Rank ``rank``'s data of ``step``: a pure function of both, so any copy can be checked bit for bit."""
    rng = np.random.default_rng(rank * 100_003 + step)
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def host_step(root: Path, rank: int, step: int, nbytes: int) -> writer.HostStep:
    """Rank ``rank``'s save of ``step`` under ``root`` (:func:`step_bytes`, one array of one shard)."""
    data = step_bytes(rank, step, nbytes)
    arrays = [writer.ArrayCopy("w", (nbytes,), "uint8", None, [writer.ShardCopy(((0, nbytes),), data)])]
    return writer.HostStep(root, "t", step, rank, NODES, arrays, [layout.ValueEntry("step", step)])


def save_rank(root: Path, rank: int, step: int, nbytes: int) -> bool:
    """Write and commit rank ``rank``'s data of ``step`` under ``root``; whether its daemon acknowledged."""
    writer.write_step(host_step(root, rank, step, nbytes))
    return notify_step_committed(root, step)


def local_status(root: Path) -> control_pb2.GetLocalStatusResponse:
    """The typed local status of the replicator serving ``root`` (over its control socket); raises
    ``grpc.RpcError`` when it does not answer within :data:`LOCAL_STATUS_TIMEOUT_SECONDS`."""
    with grpc.insecure_channel(f"unix:{layout.control_socket(root)}") as ch:
        return control_pb2_grpc.LocalControlStub(ch).GetLocalStatus(control_pb2.GetLocalStatusRequest(),
                                                                    timeout=LOCAL_STATUS_TIMEOUT_SECONDS)


def check_copy(step_dir: Path, rank: int, step: int) -> None:
    """``step_dir`` holds rank ``rank``'s data of ``step``, verified against its manifest and bit-exact."""
    m = checksums.verify_step_dir(step_dir)
    assert (m.rank, m.step) == (rank, step), f"{step_dir} holds rank {m.rank} step {m.step}"
    (a,) = m.arrays
    (shard,) = a.shards
    got = checksums.read_verified(layout.resolve_under(step_dir, shard.file), shard.length, shard.crc32c,
                                  shard.offset)
    assert bytes(got) == step_bytes(rank, step, shard.length).tobytes(), f"{step_dir} differs"


class Daemon:
    """One replicator process in its host's namespace."""

    def __init__(self, net: FaultNetwork, rank: int, args: list[str], log_path: Path) -> None:
        self.net, self.rank, self.args, self.log_path = net, rank, args, log_path
        self.proc: subprocess.Popen | None = None
        # A memory cgroup (tests/kits/cgroup.py) the daemon starts in, every (re)start: see in_cgroup.
        self.cgroup: MemoryCgroup | None = None
        self.env: dict[str, str] = {}  # more environment (e.g. STORAGE_EMULATOR_HOST for a gs:// bucket)

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.update(self.env)
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            argv = [sys.executable, "-m", "controller_client.cli", "-v", "replicator", *self.args]
            argv = self.net.command(self.net.host_ns[self.rank], argv)
            if self.cgroup is not None:  # the shell moves itself in, then execs: nothing is charged elsewhere
                argv = self.cgroup.wrap(argv)
            self.proc = subprocess.Popen(argv, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if b"LISTENING " in self.log_path.read_bytes()[start:]:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"replicator {self.rank} exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"replicator {self.rank} did not listen within {START_TIMEOUT_SECONDS}s")

    def stop(self) -> None:
        """SIGTERM, a bounded wait, then SIGKILL: by this process's pid only."""
        if self.proc is None:
            return
        _stop(self.proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, a bounded wait, then SIGKILL: by this process's pid only."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_SECONDS)


class Probe:
    """A ``tests.kits.fault_probe watch`` process in namespace ``ns`` appending answers to ``out``."""

    def __init__(self, net: FaultNetwork, ns: str, candidates: str, direct: str, out: Path) -> None:
        self.out = out
        argv = [sys.executable, "-m", "tests.kits.fault_probe", "watch", "--candidates", candidates,
                "--direct", direct, "--out", str(out)]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(net.command(ns, argv), env=env, cwd=str(REPO), stdout=subprocess.DEVNULL,
                                     stderr=open(str(out) + ".err", "ab"))  # noqa: SIM115 (closed by exit)

    def records(self) -> list[dict]:
        if not self.out.exists():
            return []
        return [json.loads(line) for line in self.out.read_text().splitlines() if line.endswith("}")]

    def stop(self) -> None:
        _stop(self.proc)


class Saver:
    """A :mod:`tests.kits.fault_saver` process in host ``rank``'s namespace saving that host's own rank."""

    def __init__(self, net: FaultNetwork, rank: int, root: Path, log_path: Path) -> None:
        self.rank = rank
        argv = [sys.executable, "-m", "tests.kits.fault_saver", "--root", str(root), "--rank", str(rank)]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(net.command(net.host_ns[rank], argv), env=env, cwd=str(REPO),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self._answers: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"saver-{rank}").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # ends when the saver exits
            if line.startswith("{"):
                self._answers.put(json.loads(line))

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        try:
            self._answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"saver {self.rank} not ready within {timeout}s") from None

    def save(self, step: int, nbytes: int, timeout: float = SAVE_ANSWER_TIMEOUT_SECONDS) -> dict:
        """One save; its answer (``ok``, ``error``, ``seconds``, ``notified``). Raises ``TimeoutError``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"step": step, "nbytes": nbytes}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                rec = self._answers.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"saver {self.rank} exited with {self.proc.returncode}") from None
                continue
            if rec.get("step") == step:
                return rec  # (a late answer to an earlier save that timed out is dropped)
        raise TimeoutError(f"saver {self.rank}: no answer to the save of step {step} within {timeout}s")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        _stop(self.proc)


@dataclass
class Trainer:
    """Saves step 1, 2, ... on every host every ``period`` seconds (in a thread) and records each outcome."""

    cluster: FaultCluster
    period: float = 1.0
    nbytes: int = 64 << 10
    saves: list[dict] = field(default_factory=list)
    step: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _paused: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    # Called with (rank, step) before each rank's data of a step is written (a fault mid-save).
    before_rank: Callable[[int, int], None] | None = None
    # One saver per host, in its namespace (the product path); empty: the test process writes every rank.
    savers: dict[int, Saver] = field(default_factory=dict)

    def save_next(self, nbytes: int | None = None) -> int:
        with self._lock:
            return self._save_next(nbytes)

    def _save_next(self, nbytes: int | None) -> int:
        self.step += 1
        t0 = time.monotonic()
        ok, error, notified = True, "", True
        for rank in range(NODES):
            if self.before_rank is not None:
                self.before_rank(rank, self.step)
            try:
                if self.savers:
                    rec = self.savers[rank].save(self.step, nbytes or self.nbytes)
                    notified &= bool(rec["notified"])
                    if not rec["ok"]:
                        ok, error = False, f"rank {rank}: {rec['error']}"
                else:
                    notified &= save_rank(self.cluster.ram(rank), rank, self.step, nbytes or self.nbytes)
            except Exception as e:  # recorded: the checker counts failed saves
                ok, error = False, f"rank {rank}: {type(e).__name__}: {e}"
        self.saves.append({"t": t0, "step": self.step, "ok": ok, "seconds": time.monotonic() - t0,
                           "error": error, "notified": notified})
        return self.step

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if not self._paused.is_set():
                    self._save_next(None)
            self._stop.wait(self.period)

    def start_savers(self) -> None:
        """One saver per host, started in its namespace (call before :meth:`start`)."""
        for rank in range(NODES):
            self.savers[rank] = Saver(self.cluster.net, rank, self.cluster.ram(rank),
                                      self.cluster.base / "logs" / f"saver-{rank}.log")
        for s in self.savers.values():
            s.wait_ready()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="trainer")
        self._thread.start()

    def pause(self) -> None:
        """No save starts after this returns."""
        self._paused.set()
        with self._lock:
            pass

    def resume(self) -> None:
        self._paused.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for s in self.savers.values():
            s.stop()


class FaultCluster:
    """Four daemons on ``net``, RAM dirs ``<base>/ram/<rank>``, the bucket ``<base>/bucket``."""

    def __init__(self, net: FaultNetwork, base: Path, heartbeat_seconds: float, lost_seconds: float,
                 extra: list[str] | None = None) -> None:
        self.net, self.base = net, Path(base)
        self.heartbeat_seconds, self.lost_seconds = heartbeat_seconds, lost_seconds
        self.addresses = {r: f"{net.ip(r)}:{PORT}" for r in range(NODES)}
        self.candidates = ",".join(self.addresses[r] for r in CANDIDATES)
        (self.base / "logs").mkdir(parents=True, exist_ok=True)
        (self.base / "bucket").mkdir(parents=True, exist_ok=True)
        peers = ",".join(f"{r}={a}" for r, a in self.addresses.items())
        cands = ",".join(f"{r}={self.addresses[r]}" for r in CANDIDATES)
        self.daemons = {
            r: Daemon(net, r, [
                "--local-dir", str(self.ram(r)), "--listen", self.addresses[r], "--job", "t", "--rank", str(r),
                "--nodes", str(NODES), "--data-parallelism", str(SLICES), "--peers", peers,
                "--coordinator-candidates", cands, "--heartbeat-seconds", str(heartbeat_seconds),
                "--host-lost-seconds", str(lost_seconds), "--rpc-timeout-seconds", "3",
                "--transfer-timeout-seconds", "120", "--backup-url", f"file://{self.base / 'bucket'}",
                "--backup-interval-steps", "5", "--preemption-grace-seconds", "0", "--insecure",
                *(extra or [])], self.base / "logs" / f"replicator-{r}.log")
            for r in range(NODES)}
        self.probes: list[Probe] = []

    def in_cgroup(self, rank: int, cgroup: MemoryCgroup) -> None:
        """Start (and restart) rank ``rank``'s daemon inside ``cgroup`` (call before :meth:`start`)."""
        self.daemons[rank].cgroup = cgroup

    def ram(self, rank: int) -> Path:
        return self.base / "ram" / str(rank)

    def start(self) -> None:
        for r in CANDIDATES:  # candidates first: the others' first heartbeats find one
            self.daemons[r].start()
        for r in range(NODES):
            if r not in CANDIDATES:
                self.daemons[r].start()

    def probe(self, ns: str, name: str, direct: str = "") -> Probe:
        p = Probe(self.net, ns, self.candidates, direct, self.base / f"probe-{name}.jsonl")
        self.probes.append(p)
        return p

    def restore(self, wait_seconds: float = 60.0, step: int | None = None) -> dict:
        """``prepare_restore`` of the newest step (or ``step``) through every candidate, from the controller's
        namespace."""
        argv = [sys.executable, "-m", "tests.kits.fault_probe", "restore", "--candidates", self.candidates,
                "--wait", str(wait_seconds), "--step", str(-1 if step is None else step)]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        res = subprocess.run(self.net.command(self.net.bridge_ns, argv), env=env, cwd=str(REPO),
                             capture_output=True, text=True, timeout=wait_seconds + 30, check=False)
        lines = res.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines else {"error": res.stderr[-300:]}

    def replace(self, *ranks: int) -> None:
        """Hosts ``ranks`` replaced together: every one's daemon stopped (by pid) and RAM dir deleted, then the
        daemons started again (none starts while another of them still holds its data)."""
        for rank in ranks:
            self.daemons[rank].stop()
        for rank in ranks:
            shutil.rmtree(self.ram(rank), ignore_errors=True)
        for rank in ranks:
            self.daemons[rank].start()

    def restore_started(self, wait_seconds: float = 60.0) -> subprocess.Popen:
        """:meth:`restore`'s probe started and not waited for (a fault while it runs); its one JSON line is
        on its stdout. The caller waits for it, bounded."""
        argv = [sys.executable, "-m", "tests.kits.fault_probe", "restore", "--candidates", self.candidates,
                "--wait", str(wait_seconds)]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return subprocess.Popen(self.net.command(self.net.bridge_ns, argv), env=env, cwd=str(REPO),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def committed(self, rank: int) -> list[int]:
        return commit.committed_steps(self.ram(rank) / layout.STEPS_DIR)

    def stop(self) -> None:
        for p in self.probes:
            p.stop()
        for d in self.daemons.values():
            d.stop()

    def logs(self) -> str:
        out = []
        for p in sorted((self.base / "logs").glob("*.log")):
            text = p.read_text(errors="replace")
            # Its warnings first (a failure's cause often precedes the tail by a minute), then its tail.
            warnings = [ln[:300] for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln][-15:]
            out.append(f"==== {p.name} (last warnings)\n" + "\n".join(warnings) if warnings else f"==== {p.name}")
            out.append(f"==== {p.name} (tail)\n{text[-3000:]}")
        return "\n".join(out)
