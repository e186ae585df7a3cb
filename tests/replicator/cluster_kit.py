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

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.coordinator_client import CoordinatorClient
from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology

REPO = Path(__file__).resolve().parents[2]


class ReplicatorProc:
    def __init__(self, rank: int, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.rank = rank
        self.env = dict(env or {})
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout: float = 60.0) -> str:
        env = dict(os.environ, PYTHONPATH=str(REPO), **self.env)
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
        self.env: dict[str, str] = {}
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
        p = ReplicatorProc(rank, self._args(rank, listen), self.base / "logs" / f"replicator-{rank}.log", self.env)
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


# --------------------------------------------------------------------------- controller-side helpers

def manager(cluster, slices: int, hosts_per_slice: int) -> CheckpointManager:
    devs = jax.devices()
    topo = HostTopology.simulated(devs, slices, hosts_per_slice)
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    coordinator_address=cluster.coordinator, restore_wait_seconds=60,
                                    rpc_timeout_seconds=10)
    return CheckpointManager(opts, devices=devs, topology=topo)

def state(step: int, replicated_over_slices: bool = True) -> dict:
    """Params sharded over 'model' only are byte-identical on both slices (data-parallel replicas)."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    spec = P(None, "model") if replicated_over_slices else P("data", "model")
    rng = np.random.default_rng(step)
    return {
        "w": jax.device_put(rng.standard_normal((8, 64)).astype(np.float32), NamedSharding(mesh, spec)),
        "b": jax.device_put(jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16), NamedSharding(mesh, spec)),
        "rng": jax.device_put(jax.random.key(step), NamedSharding(mesh, P())),
        "step": step,
    }

def target(tree: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree)

def assert_equal(a: dict, b: dict) -> None:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, jax.Array):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y

def status(cluster) -> dict:
    c = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=5)
    try:
        return c.status()
    finally:
        c.close()

def redundant(cluster, step: int) -> bool:
    try:
        st = status(cluster)["steps"].get(str(step))
    except grpc.RpcError:
        return False
    return bool(st and st["complete"] and st["redundant"])

def save_steps(mgr, steps, **kw) -> dict:
    trees = {}
    for s in steps:
        trees[s] = state(s, **kw)
        assert mgr.save(s, trees[s])
        mgr.wait_until_finished()
    return trees

