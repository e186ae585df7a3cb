"""Test kit: a simulated Pathways job — this process is the controller, one worker process per host plays the
colocated-Python sidecar.

What it models (docs/pathways.md has the full list and what it does not model):

- Controller devices carry Pathways' attributes: ``slice_index``, ``virtual_task_index`` (the host's index
  in its slice), ``process_index`` 0 for all, a repr with ``logical_task=``, and a ``colocation_id``. Each
  device's colocated CPU device (``colocated_cpu_devices``, answered here) is another device of its host, so
  every save moves each shard to another device and every restore moves it back, as on Pathways. They are this process's real
  CPU devices (the attributes are added to JAX's device class while the simulation runs), so the product's
  meshes and arrays are ordinary JAX objects.
- A colocated-Python program runs the way Pathways runs it: JAX pickles the function and its specialization
  with its own colocated serialization (``serialization._serialize``); the bytes go to the worker process of
  every host the program's devices span; the worker unpickles them with JAX's ``_deserialize`` (its own
  device lookup, in the worker's namespace), receives only its own host's input shards, runs the function
  and returns its output shards, which become the controller's output arrays per the output specs.
- The workers are one multi-process JAX job among themselves (``jax.distributed`` on loopback): each sees
  every worker's CPU devices, only its own are addressable, and their ids are the workers' (``2048 * p +
  i``), not the controller's (host 0's ids coincide, the others' do not: Orbax's lookup needs the two
  namespaces not to collide on different devices); worker devices print like Pathways' sidecar devices, ``CpuDevice(id=2048)[PjRtIFRTDeviceId=2]``, where
  the PjRt-IFRT id is the controller-side id.
- Host functions keep state between calls in the worker (writer threads, JAX's result store), as a
  long-running sidecar does, and share nothing with the controller but the pickles.
- A worker's exception comes back as Pathways returns it: a ``JaxRuntimeError`` with status ``INTERNAL``
  and the exception's text, not its type; a dead worker makes the call raise ``DATA_LOSS``.
- Lost hosts (``lose_hosts``/``heal_hosts``): a program or call spanning one raises the ``DATA_LOSS``
  ``JaxRuntimeError`` of a slice-down without reaching any worker; the worker process itself stays (a
  replaced host keeps it: docs/pathways.md).

The hook is ``jax.experimental.colocated_python.func._compile_to_executable``, the one function whose CPU
fallback (``PjRtCompiler requires an HloProgram``) otherwise runs the unpickled function inline. Run as a
module (``python -m tests.kits.pathways_sim worker ...``) it is one worker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER_ID_STRIDE = 2048  # JAX numbers the CPU devices of process p from p * 2048 (jaxlib 0.10)
START_TIMEOUT_SECONDS = 90.0
CALL_TIMEOUT_SECONDS = 120.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SimHost:
    """One simulated worker host: its place in the allocation and its controller-side device ids."""

    host: int  # slice-major: slice * hosts_per_slice + index in slice
    slice_index: int
    task: int  # virtual_task_index: the host's index in its slice
    device_ids: tuple[int, ...]  # controller-side (PjRt-IFRT) ids of its devices
    worker: int  # the worker process (its jax.distributed process id) that plays it: the host's index


def plan_hosts(device_ids: Sequence[int], slices: int, hosts_per_slice: int) -> list[SimHost]:
    """Hosts slice-major over ``device_ids`` (ascending); worker process ``p`` plays host ``p``."""
    ids = sorted(device_ids)
    nodes = slices * hosts_per_slice
    if nodes <= 0 or len(ids) % nodes:
        raise ValueError(f"{len(ids)} devices cannot be split into {slices} x {hosts_per_slice} hosts")
    per = len(ids) // nodes
    return [SimHost(h, h // hosts_per_slice, h % hosts_per_slice, tuple(ids[h * per:(h + 1) * per]), h)
            for h in range(nodes)]


# --------------------------------------------------------------------------- device attributes

@contextlib.contextmanager
def _device_attributes(attrs: dict[str, Callable[[Any], Any]], repr_fn: Callable[[Any], str | None]) -> Iterator[None]:
    """Give JAX's device class the properties ``attrs`` (a getter raising AttributeError = absent) and a
    repr (``repr_fn`` None = JAX's own) while the block runs."""
    import jax

    cls = type(jax.devices()[0])
    saved = {name: cls.__dict__.get(name) for name in [*attrs, "__repr__"]}
    orig_repr = cls.__repr__
    for name, getter in attrs.items():
        setattr(cls, name, property(getter))
    cls.__repr__ = lambda self: repr_fn(self) or orig_repr(self)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(cls, name)
            else:
                setattr(cls, name, old)


def _lookup(table: dict[int, Any], name: str) -> Callable[[Any], Any]:
    def get(device: Any) -> Any:
        try:
            return table[device.id]
        except KeyError:
            raise AttributeError(name) from None
    return get


# --------------------------------------------------------------------------- controller side

class PathwaysSim:
    """The controller's view of a simulated Pathways job; a context manager (starts and stops the workers).

    ``devices`` (default ``jax.devices()``) are split slice-major into ``slices * hosts_per_slice`` hosts.
    """

    def __init__(self, slices: int = 2, hosts_per_slice: int = 2, devices: Sequence[Any] | None = None,
                 log_dir: Path | None = None, worker_setup: str | None = None,
                 worker_env: dict[str, str] | None = None,
                 worker_command: Callable[[list[str], dict[str, str]], list[str]] | None = None):
        import jax

        self.devices = list(devices if devices is not None else jax.devices())
        self.slices, self.hosts_per_slice = slices, hosts_per_slice
        self.hosts = plan_hosts([d.id for d in self.devices], slices, hosts_per_slice)
        self.host_of_id = {i: h for h in self.hosts for i in h.device_ids}
        self.log_dir = Path(log_dir) if log_dir is not None else None
        # "module:function" each worker calls before it serves (what a sidecar image could run at start).
        self.worker_setup = worker_setup
        # Extra environment of every worker (read by ``worker_setup``, e.g. where the host's own disk is).
        self.worker_env = dict(worker_env or {})
        # Wraps a worker's argv and the environment it needs (beyond the inherited one) into the command that
        # starts it, e.g. a `podman run` of the sidecar image (tests/deploy/test_image_work.py).
        self.worker_command = worker_command
        self._procs: list[subprocess.Popen] = []
        self._conns: dict[int, Any] = {}  # host -> connection to its worker
        self._lock = threading.Lock()
        self._programs = 0
        self._stack = contextlib.ExitStack()
        self.calls: list[tuple[str, tuple[int, ...]]] = []  # (program name, hosts it ran on), for tests
        self.lost: set[int] = set()  # hosts down (see lose_hosts)

    # ------------------------------------------------------------------ failures
    def hosts_of_slice(self, index: int) -> list[int]:
        return [h.host for h in self.hosts if h.slice_index == index]

    def lose_hosts(self, hosts: Sequence[int], delete_arrays: bool = False) -> None:
        """``hosts`` are down: a colocated program or call that spans one raises, without reaching any
        worker, ``jax.errors.JaxRuntimeError("DATA_LOSS: ...")`` (what pathwaysutils counts as a slice-down
        error). Their worker processes stay up, unused (they are one ``jax.distributed`` job).

        ``delete_arrays``: every live array with a shard on their devices is deleted too (reading one raises,
        as a lost slice's buffers are gone), between calls: a call in another thread (a save in the
        background) never reads a buffer while it is being deleted, which the real runtime would answer with
        an error, not a crash."""
        with self._lock:
            self.lost.update(hosts)
            if delete_arrays:
                import jax

                down = set(hosts)
                gone = {i for i, h in self.host_of_id.items() if h.host in down}
                for arr in jax.live_arrays():
                    if not arr.is_deleted() and {d.id for d in arr.sharding.device_set} & gone:
                        arr.delete()

    def heal_hosts(self, hosts: Sequence[int]) -> None:
        """``hosts`` are back (a replacement keeps the worker process and its state: docs/pathways.md)."""
        with self._lock:
            self.lost.difference_update(hosts)

    def _check_up(self, hosts: Sequence[int], name: str) -> None:
        down = sorted(set(hosts) & self.lost)
        if down:
            import jax

            raise jax.errors.JaxRuntimeError(
                f"DATA_LOSS: colocated program {name} spans hosts {down}, which are down (simulated Pathways)")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> PathwaysSim:
        try:
            self._start_workers()
            by_id = {h.host: h for h in self.hosts}
            slice_of = {i: by_id[h.host].slice_index for i, h in self.host_of_id.items()}
            task_of = {i: h.task for i, h in self.host_of_id.items()}
            # colocation_id: each controller device is its own colocated CPU device (1:1, as on Pathways),
            # so jax's colocated_cpu_devices maps a subset of the devices to itself, not (its CPU
            # fallback) to process 0's first CPU devices.
            colo_of = {i: i for i in self.host_of_id}
            self._stack.enter_context(_device_attributes(
                {"slice_index": _lookup(slice_of, "slice_index"), "virtual_task_index": _lookup(task_of, "virtual_task_index"),
                 "colocation_id": _lookup(colo_of, "colocation_id")},
                lambda d: (f"CpuDevice(id={d.id}, slice_index={slice_of[d.id]}, logical_task={task_of[d.id]})"
                           if d.id in slice_of else None)))
            self._stack.enter_context(self._colocated_cpu_devices())
            self._stack.enter_context(self._hook())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        for conn in self._conns.values():
            with contextlib.suppress(OSError, EOFError):
                conn.send(("stop",))
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # its own session, by its pid
                p.wait(timeout=10)
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._procs.clear()

    def _start_workers(self) -> None:

        from tests.kits.jax_procs import free_port

        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        coord = f"127.0.0.1:{free_port()}"
        n = len(self.hosts)
        per = len(self.hosts[0].device_ids)
        table = [dataclasses.asdict(h) for h in self.hosts]
        own = dict(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={per}",
                   MTC_SIM_AUTHKEY=authkey.hex(), MTC_SIM_HOSTS=repr(table), MTC_SIM_SETUP=self.worker_setup or "",
                   **self.worker_env)
        env = dict(os.environ, **own)
        for p in range(n):
            out = subprocess.DEVNULL
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"pathways-worker-{p}.log", "wb")  # noqa: SIM115 - the child owns it
            argv = [sys.executable, "-m", "tests.kits.pathways_sim", "worker", "--process", str(p),
                    "--processes", str(n), "--coordinator", coord,
                    "--controller", f"{listener.address[0]}:{listener.address[1]}"]
            if self.worker_command is not None:
                argv = self.worker_command(argv, dict(own))
            self._procs.append(subprocess.Popen(
                argv, env=env, cwd=str(REPO), stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        listener._listener._socket.settimeout(5.0)  # accept() bounded; checked against the deadline
        try:
            while len(self._conns) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{n - len(self._conns)} Pathways workers did not start")
                dead = [p.args for p in self._procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"a Pathways worker exited at start: {dead[0]}")
                try:
                    conn = listener.accept()
                except TimeoutError:
                    continue
                _, worker = conn.recv()
                host = next(h.host for h in self.hosts if h.worker == worker)
                self._conns[host] = conn
        finally:
            listener.close()

    # ------------------------------------------------------------------ accelerator -> colocated CPU devices
    def cpu_device_id(self, device_id: int) -> int:
        """The controller-side id of the colocated CPU device of accelerator device ``device_id``: the next
        device of the same host (cyclically), so that every save moves each shard to another device and every
        restore moves it back, as Pathways moves it between a TPU and its host's CPU; with one device per
        host, the device itself."""
        ids = self.host_of_id[device_id].device_ids
        return ids[(ids.index(device_id) + 1) % len(ids)]

    @contextlib.contextmanager
    def _colocated_cpu_devices(self) -> Iterator[None]:
        """JAX's ``colocated_cpu_devices`` answers as Pathways does: each device's own colocated CPU device
        (:meth:`cpu_device_id`), order kept, for devices and meshes (JAX's own lookup cannot tell the roles
        apart here: every simulated device is a CPU device)."""
        import jax
        import numpy as np
        from jax.experimental import colocated_python
        from jax.experimental.colocated_python import api

        by_id = {d.id: d for d in self.devices}

        def colocated(devices_or_mesh: Any) -> Any:
            if isinstance(devices_or_mesh, jax.sharding.Mesh):
                mesh = devices_or_mesh
                devs = np.vectorize(lambda d: by_id[self.cpu_device_id(d.id)], otypes=[object])(mesh.devices)
                return jax.sharding.Mesh(devs, mesh.axis_names)
            return [by_id[self.cpu_device_id(d.id)] for d in devices_or_mesh]

        saved = (colocated_python.colocated_cpu_devices, api.colocated_cpu_devices)
        colocated_python.colocated_cpu_devices = api.colocated_cpu_devices = colocated
        try:
            yield
        finally:
            colocated_python.colocated_cpu_devices, api.colocated_cpu_devices = saved

    # ------------------------------------------------------------------ the colocated-program hook
    @contextlib.contextmanager
    def _hook(self) -> Iterator[None]:
        from jax.experimental.colocated_python import func

        original = func._compile_to_executable
        func._compile_to_executable = self._compile
        try:
            yield
        finally:
            func._compile_to_executable = original

    def _compile(self, name, fun, in_specs_treedef, in_specs_leaves, out_specs_treedef, out_specs_leaves, devices):
        """JAX's ``_compile_to_executable`` up to the IFRT compile (PRNG keys to their physical form, the
        pickle), then the program is loaded on the hosts of ``devices`` instead of compiled."""
        from jax._src import tree_util
        from jax.experimental.colocated_python import func
        from jax.experimental.colocated_python.serialization import _serialize

        # The host function's name (JAX names a functools.partial "unknown"), for errors and ``calls``.
        name = getattr(getattr(fun, "func", fun), "__name__", name)
        prng_in = func._get_prng_key_info(in_specs_leaves)
        prng_out = func._get_prng_key_info(out_specs_leaves)
        in_specs_leaves = func._convert_inp_type_to_physical(in_specs_leaves, prng_in)
        out_specs_leaves = func._convert_inp_type_to_physical(out_specs_leaves, prng_out)
        if prng_in or prng_out:
            fun = func._make_prng_wrapped_fun(fun, prng_in, prng_out)
        pickled = _serialize((fun, in_specs_treedef, in_specs_leaves, out_specs_treedef, out_specs_leaves, devices))
        hosts = sorted({self._host(d.id) for d in devices})
        with self._lock:
            self._check_up(hosts, name)
            self._programs += 1
            program = self._programs
            self._broadcast(hosts, ("load", program, pickled))

        def call(*args, **kwargs):
            leaves = func._unwrap_prng_keys(tree_util.tree_leaves((args, kwargs)), prng_in)
            with self._lock:  # the inputs are read with the hosts known up (see lose_hosts)
                self._check_up(hosts, name)
                shards = {h: [] for h in hosts}
                for x in leaves:
                    per_host: dict[int, list] = {h: [] for h in hosts}
                    for s in x.addressable_shards:
                        per_host[self._host(s.device.id)].append((s.device.id, _to_numpy(s.data)))
                    for h in hosts:
                        shards[h].append(per_host[h])
                self.calls.append((name, tuple(hosts)))
                answers = self._exchange({h: ("run", program, shards[h]) for h in hosts})
            by_id: list[dict[int, Any]] = [{} for _ in out_specs_leaves]
            for h in hosts:
                for j, rows in enumerate(answers[h]):
                    by_id[j].update(rows)
            outs = [_assemble(spec, got) for spec, got in zip(out_specs_leaves, by_id, strict=True)]
            outs = func._wrap_prng_keys(outs, prng_out)
            return tree_util.tree_unflatten(out_specs_treedef, outs)

        return call

    def _host(self, device_id: int) -> int:
        try:
            return self.host_of_id[device_id].host
        except KeyError:
            raise ValueError(f"device id {device_id} is on no simulated Pathways host") from None

    def _broadcast(self, hosts: Sequence[int], msg: tuple) -> None:
        self._exchange({h: msg for h in hosts})

    def _exchange(self, msgs: dict[int, tuple]) -> dict[int, Any]:
        """Send each host its message, then gather every answer (the workers run concurrently)."""
        for h, msg in msgs.items():
            self._conns[h].send(msg)
        import jax

        answers, error = {}, None
        for h in msgs:
            conn = self._conns[h]
            try:
                if not conn.poll(CALL_TIMEOUT_SECONDS):
                    raise jax.errors.JaxRuntimeError(
                        f"DEADLINE_EXCEEDED: the Pathways worker of host {h} did not answer in {CALL_TIMEOUT_SECONDS}s "
                        "(simulated Pathways)")
                kind, payload = conn.recv()
            except (EOFError, OSError) as e:  # the worker process is gone: its host is lost
                self._worker_gone(h)
                raise jax.errors.JaxRuntimeError(
                    f"DATA_LOSS: the Pathways worker of host {h} is gone ({type(e).__name__}) (simulated Pathways)") from None
            if kind == "ok":
                answers[h] = payload
            elif error is None:
                error = _revive(h, payload)
        if error is not None:
            raise error
        return answers

    def _worker_gone(self, host: int) -> None:
        """The worker process of ``host`` went away during a call (here: nothing; its host stays up, unused)."""


def _to_numpy(x: Any) -> Any:
    import numpy as np

    return np.asarray(x)


def _assemble(spec: Any, got: dict[int, Any]) -> Any:
    """The controller's output array of ``spec`` from the workers' shards (keyed by controller device id)."""
    import jax

    bufs = []
    for d in spec.sharding.addressable_devices:
        if d.id not in got:
            raise RuntimeError(f"no worker returned the output shard for controller device {d.id}")
        bufs.append(jax.device_put(got[d.id], d))
    return jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, bufs)


def _revive(host: int, payload: tuple[bytes | None, str]) -> BaseException:
    """The worker's exception as Pathways surfaces it on the controller: a ``jax.errors.JaxRuntimeError``
    carrying a status and the exception's text, not its Python type (docs/pathways.md: what is known of the
    real format). The status is ``INTERNAL``, the worst case for a caller: pathwaysutils counts it as a
    slice-down. The worker's traceback is a note."""
    import jax

    blob, text = payload
    what = text.strip().splitlines()[-1] if text.strip() else "worker failed"
    err = jax.errors.JaxRuntimeError(f"INTERNAL: colocated Python function raised on host {host}: {what}")
    err.add_note(f"(raised on simulated Pathways host {host})\n{text}")
    return err


# --------------------------------------------------------------------------- worker side

class _Worker:
    """One worker process: a long-running colocated-Python sidecar for one host."""

    def __init__(self, process: int, hosts: list[SimHost]):
        import jax

        self.process = process
        self.me = next(h for h in hosts if h.worker == process)
        # Worker device -> controller-side (PjRt-IFRT) id, for every worker's devices.
        self.ifrt_of: dict[int, int] = {}
        for h in hosts:
            mine = sorted((d for d in jax.devices() if d.process_index == h.worker), key=lambda d: d.id)
            for d, cid in zip(mine, h.device_ids, strict=True):
                self.ifrt_of[d.id] = cid
        self.programs: dict[int, tuple] = {}

    def load(self, program: int, pickled: bytes) -> None:
        from jax.experimental.colocated_python.serialization import _deserialize

        self.programs[program] = _deserialize(pickled)

    def run(self, program: int, shards: list[list[tuple[int, Any]]]) -> list[list[tuple[int, Any]]]:
        import jax
        from jax._src import tree_util

        fun, in_treedef, in_leaves, _out_treedef, out_leaves, _devices = self.programs[program]
        args = []
        for spec, rows in zip(in_leaves, shards, strict=True):
            got = dict(rows)
            bufs = []
            for d in spec.sharding.addressable_devices:
                cid = self.ifrt_of.get(d.id)
                if cid not in got:
                    raise RuntimeError(f"input sharding names worker device {d!r}, whose shard this host "
                                       f"(controller ids {list(got)}) did not receive")
                bufs.append(jax.device_put(got[cid], d))
            args.append(jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, bufs))
        a, k = tree_util.tree_unflatten(in_treedef, args)
        result = fun(*a, **k)
        outs = tree_util.tree_leaves(result)
        if len(outs) != len(out_leaves):
            raise ValueError(f"colocated function returned {len(outs)} arrays, its output specs say {len(out_leaves)}")
        answer = []
        for x in outs:
            answer.append([(self.ifrt_of[s.device.id], _to_numpy(s.data)) for s in x.addressable_shards])
        return answer


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--process", type=int, required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--controller", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{args.process} %(name)s %(message)s")
    import ast

    import jax

    hosts = [SimHost(**{**h, "device_ids": tuple(h["device_ids"])}) for h in ast.literal_eval(os.environ["MTC_SIM_HOSTS"])]
    jax.distributed.initialize(args.coordinator, args.processes, args.process, initialization_timeout=60)
    worker = become_sidecar(args.process, hosts)
    host, port = args.controller.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["MTC_SIM_AUTHKEY"]))
    serve(conn, worker)
    logging.shutdown()
    os._exit(0)  # skip jax.distributed's shutdown barrier: the other workers stop on their own


def become_sidecar(process: int, hosts: list[SimHost]) -> _Worker:
    """This process (its ``jax.distributed`` job initialized) as the sidecar of worker ``process``: devices
    printed as Pathways' sidecar devices, ``MTC_SIM_SETUP`` run."""
    import jax

    worker = _Worker(process, hosts)
    ifrt_of = worker.ifrt_of
    cls = type(jax.devices()[0])
    orig_repr = cls.__repr__
    # Pathways' sidecar devices: the local id, and the controller-side id in the repr.
    cls.__repr__ = lambda self: f"{orig_repr(self)}[PjRtIFRTDeviceId={ifrt_of[self.id]}]" if self.id in ifrt_of \
        else orig_repr(self)
    if os.environ.get("MTC_SIM_SETUP"):
        import importlib

        mod, fn = os.environ["MTC_SIM_SETUP"].split(":")
        getattr(importlib.import_module(mod), fn)()
    return worker


def serve(conn: Any, worker: _Worker) -> None:
    """Say hello on ``conn`` and run the controller's programs until it says stop or goes away."""
    import jax

    conn.send(("hello", worker.process))
    log.info("worker %d plays host %d (slice %d, task %d), devices %s", worker.process, worker.me.host,
             worker.me.slice_index, worker.me.task, [repr(d) for d in jax.local_devices()])
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        try:
            if msg[0] == "load":
                worker.load(msg[1], msg[2])
                conn.send(("ok", None))
            else:
                conn.send(("ok", worker.run(msg[1], msg[2])))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the controller
            text = traceback.format_exc()
            log.warning("%s", text)
            try:
                blob = pickle.dumps(e)
            except Exception:  # noqa: BLE001
                blob = None
            conn.send(("err", (blob, text)))
    conn.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: python -m tests.kits.pathways_sim worker --process P --processes N --coordinator H:P "
             "--controller H:P")
