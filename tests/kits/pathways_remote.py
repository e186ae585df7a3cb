"""Test kit: the simulated Pathways of ``pathways_sim.py`` across machines (the cluster tests' Pods).

``pathways_sim.PathwaysSim`` starts its worker processes itself; here something else starts them (the worker
Pods of ``tests/cluster``, whose ``pathways-worker`` container runs :func:`dial_main`) and they dial the
controller: ``RemotePathwaysSim`` listens, tells each worker which host it plays (its place in the
allocation: slice and index in the slice, which the Pod knows) and counts the host up once the worker is
ready. The workers are one ``jax.distributed`` job among themselves, as in ``pathways_sim``, but its
coordination service runs apart (:func:`serve_coordination`: the head's resource manager) and is
*recoverable*: a worker may go away and a new one take its place (a slice's Pods replaced) while the others
keep running.

What differs from ``PathwaysSim``: a host is down while no worker plays it (its worker went away: a call
spanning it raises ``DATA_LOSS``, :meth:`RemotePathwaysSim.active_slices` leaves its slice out, as
pathwaysutils' health check counts a slice whose workers are gone); a new worker for the host brings it back
(programs loaded before are loaded on it at its first call). Messages: the worker sends ``("join", slice,
task)``, the controller answers ``("plan", process, processes, hosts)``, the worker initializes JAX and serves
as a ``pathways_sim`` worker (``("hello", process)``, then ``load``/``run``/``stop``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from tests.kits.pathways_sim import PathwaysSim, SimHost, become_sidecar, serve

log = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 180.0  # a joining worker's JAX start (import, jax.distributed, devices) on a busy machine
HEARTBEAT_SECONDS = 10  # the coordination service's: a worker gone this long is dead to it
DIAL_RETRY_SECONDS = 0.5


class RemotePathwaysSim(PathwaysSim):
    """The controller of a simulated Pathways job whose workers dial in (see the module docstring).

    ``listen``: (address, port) to accept workers on; ``authkey``: the workers' shared key;
    ``start_timeout_seconds``: how long :meth:`__enter__` waits for every host's first worker.
    """

    def __init__(self, slices: int, hosts_per_slice: int, listen: tuple[str, int], authkey: bytes,
                 devices: Sequence[Any] | None = None, start_timeout_seconds: float = 300.0):
        super().__init__(slices, hosts_per_slice, devices=devices)
        self.listen, self.authkey = listen, authkey
        self.start_timeout_seconds = start_timeout_seconds
        self.joins: list[tuple[float, int]] = []  # (monotonic time, host) of every worker that came up
        self._pickles: dict[int, bytes] = {}
        self._loaded: dict[int, set[int]] = {}  # host -> programs its current worker has loaded
        self._up = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._listener: Listener | None = None
        self._acceptor: threading.Thread | None = None

    # ------------------------------------------------------------------ workers joining
    def _start_workers(self) -> None:
        self._listener = Listener(self.listen, authkey=self.authkey)
        self._listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]  # accept() bounded
        self._acceptor = threading.Thread(target=self._accept_loop, name="pathways-accept", daemon=True)
        self._acceptor.start()
        deadline = time.monotonic() + self.start_timeout_seconds
        with self._up:
            while len(self._conns) < len(self.hosts):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(h.host for h in self.hosts if h.host not in self._conns)
                    raise TimeoutError(f"no worker for hosts {missing} within {self.start_timeout_seconds:.0f}s")
                self._up.wait(min(left, 1.0))

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:  # a dialer that failed authentication, the listener closed
                if self._closing.is_set():
                    return
                log.warning("pathways: a worker could not join: %s", e)
                continue
            threading.Thread(target=self._join, args=(conn,), name="pathways-join", daemon=True).start()

    def _join(self, conn: Connection) -> None:
        """One worker's handshake: where it plays, then its JAX start; then its host is up."""
        try:
            if not conn.poll(HANDSHAKE_SECONDS):
                raise TimeoutError("no join message")
            kind, slice_index, task = conn.recv()
            host = next((h for h in self.hosts if (h.slice_index, h.task) == (slice_index, task)), None)
            if kind != "join" or host is None:
                raise ValueError(f"unexpected {kind} for slice {slice_index} task {task}")
            conn.send(("plan", host.worker, len(self.hosts), [dataclasses.asdict(h) for h in self.hosts]))
            if not conn.poll(HANDSHAKE_SECONDS):
                raise TimeoutError(f"the worker of host {host.host} did not start")
            hello = conn.recv()
            if hello != ("hello", host.worker):
                raise ValueError(f"unexpected {hello!r}")
        except (OSError, EOFError, ValueError, TimeoutError) as e:
            log.warning("pathways: a worker could not join: %s", e)
            conn.close()
            return
        with self._up:
            old = self._conns.get(host.host)
            if old is not None:
                old.close()
            self._conns[host.host] = conn
            self._loaded[host.host] = set()
            self.lost.discard(host.host)
            self.joins.append((time.monotonic(), host.host))
            self._up.notify_all()
        log.info("pathways: host %d (slice %d, task %d) is up", host.host, host.slice_index, host.task)

    def close(self) -> None:
        self._closing.set()
        if self._acceptor is not None:
            self._acceptor.join(5)
        if self._listener is not None:
            self._listener.close()
        super().close()

    # ------------------------------------------------------------------ hosts going away
    def _worker_gone(self, host: int) -> None:
        self.lost.add(host)
        conn = self._conns.pop(host, None)
        if conn is not None:
            conn.close()

    def _reap(self) -> None:
        """Hosts whose worker went away while no call was running (the lock is held: nothing is in flight, so
        a readable connection is at its end)."""
        for h, conn in list(self._conns.items()):
            try:
                gone = conn.poll(0)
            except (OSError, EOFError):
                gone = True
            if gone:
                log.info("pathways: the worker of host %d went away", h)
                self._worker_gone(h)

    def active_slices(self, slice_to_devices: Mapping[int, Sequence[Any]] | None = None,
                      checker: Any = None) -> frozenset[int]:
        """pathwaysutils' ``elastic.get_active_slice_indices``: the slices (of ``slice_to_devices``, default all)
        every host of which has a worker."""
        with self._lock:
            self._reap()
            slices = set(slice_to_devices) if slice_to_devices is not None else {h.slice_index for h in self.hosts}
            return frozenset(s for s in slices if all(
                h.host in self._conns and h.host not in self.lost for h in self.hosts if h.slice_index == s))

    # ------------------------------------------------------------------ programs on a new worker
    def _broadcast(self, hosts: Sequence[int], msg: tuple) -> None:
        if msg[0] == "load":
            self._pickles[msg[1]] = msg[2]
        super()._broadcast(hosts, msg)
        if msg[0] == "load":
            for h in hosts:
                self._loaded[h].add(msg[1])

    def _exchange(self, msgs: dict[int, tuple]) -> dict[int, Any]:
        missing = {h: ("load", m[1], self._pickles[m[1]]) for h, m in msgs.items()
                   if m[0] == "run" and m[1] not in self._loaded.get(h, set())}
        if missing:
            super()._exchange(missing)
            for h, m in missing.items():
                self._loaded[h].add(m[1])
        return super()._exchange(msgs)


# --------------------------------------------------------------------------- the resource manager's part

def serve_coordination(port: int, processes: int, stop: threading.Event) -> None:
    """The workers' ``jax.distributed`` coordination service on ``port`` (every address), recoverable (a
    worker may leave and a new one take its process id), until ``stop`` is set."""
    from jax._src.lib import _jax

    service = _jax.get_distributed_runtime_service(f"[::]:{port}", processes, heartbeat_timeout=HEARTBEAT_SECONDS,
                                                   shutdown_timeout=30, recoverable=True)
    log.info("pathways: coordination service for %d workers on port %d", processes, port)
    try:
        stop.wait()
    finally:
        service.shutdown()


# --------------------------------------------------------------------------- the worker's part

def _dial(address: str, authkey: bytes, deadline: float) -> Connection:
    host, port = address.rsplit(":", 1)
    while True:
        try:
            return Client((socket.gethostbyname(host), int(port)), authkey=authkey)
        except OSError as e:  # the controller not listening yet, its name not yet resolvable
            if time.monotonic() > deadline:
                raise TimeoutError(f"controller {address} not reachable: {e}") from None
            time.sleep(DIAL_RETRY_SECONDS)


def _connect_jax(coordination: str, process: int, processes: int) -> None:
    """``jax.distributed.initialize`` without starting a service (it runs in the resource manager), with
    recoverability on (this process may be a replacement for an earlier one of the same id)."""
    import jax
    from jax._src import distributed
    from jax._src.lib import _jax

    jax.config.update("jax_enable_recoverability", True)
    host, port = coordination.rsplit(":", 1)
    address = f"{socket.gethostbyname(host)}:{port}"
    state = distributed.global_state
    state.coordinator_address, state.process_id, state.num_processes = address, process, processes
    state.client = _jax.get_distributed_runtime_client(address, process, init_timeout=int(HANDSHAKE_SECONDS),
                                                        use_compression=True, heartbeat_timeout=HEARTBEAT_SECONDS)
    state.client.connect()


def _answer_port(port: int, stop: threading.Event) -> None:
    """Accept (and close) connections on ``port``: the worker's server port, which ``mtc preempt
    --hold-while-port`` watches to tell the worker is up."""
    with socket.create_server(("0.0.0.0", port), backlog=16) as srv:
        srv.settimeout(1.0)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                c, _ = srv.accept()
                c.close()


def dial_main(controller: str, coordination: str, slice_index: int, task: int, authkey: bytes,
              server_port: int = 0, timeout_seconds: float = HANDSHAKE_SECONDS) -> int:
    """One worker: dial ``controller``, play the host it assigns to (``slice_index``, ``task``), serve its
    programs until it stops or goes away. Ends on SIGTERM (the Pod's) at once."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker s{slice_index}t{task} %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    stop = threading.Event()
    if server_port:
        threading.Thread(target=_answer_port, args=(server_port, stop), daemon=True).start()
    conn = _dial(controller, authkey, time.monotonic() + timeout_seconds)
    conn.send(("join", slice_index, task))
    if not conn.poll(timeout_seconds):
        raise TimeoutError(f"controller {controller} sent no plan")
    _, process, processes, table = conn.recv()
    hosts = [SimHost(**{**h, "device_ids": tuple(h["device_ids"])}) for h in table]
    per = len(hosts[0].device_ids)
    os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={per}")
    _connect_jax(coordination, process, processes)
    worker = become_sidecar(process, hosts)
    serve(conn, worker)
    stop.set()
    logging.shutdown()
    os._exit(0)  # skip jax.distributed's shutdown: the others keep running
