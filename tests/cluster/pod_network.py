"""The Pod network of the node agent: one network namespace per Pod on a bridge that lives in a further
namespace of the kit's own (never the host's root namespace), and a relay to the API server.

Pods get ``10.214.<n>.<m>/16`` on ``eth0``; the bridge namespace holds ``br0`` at :data:`BRIDGE_IP`, where
:class:`ApiRelay` listens on port 443 and forwards each connection to the API server on the root namespace's
loopback (the control plane's serving certificate names :data:`BRIDGE_IP` and ``kubernetes.default.svc``).
Every namespace is named ``mtck-<pid>-<tag>-...`` after the process that made it, so :func:`reap_stale`
finds what a killed run left and :meth:`PodNetwork.close` deletes exactly what this object made.
Needs root and ``ip``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Sequence

from tests.kits import faultnet

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_SECONDS = 10.0
BRIDGE_IP = "10.214.0.1"  # the bridge namespace's address: the API relay, the probes' source
PREFIX_LEN = 16
IFACE = "eth0"
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
_OURS = re.compile(r"^mtck-(\d+)-[0-9a-f]{4}-(?:br|p\d+)$")
RELAY_PORT = 443
RELAY_CONNECT_TIMEOUT_SECONDS = 5.0


def run(argv: Sequence[str], check: bool = True) -> str:
    res = subprocess.run(list(argv), timeout=COMMAND_TIMEOUT_SECONDS, capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def reap_stale() -> list[str]:
    """Delete the namespaces a killed run of the kit left (named after a pid that is gone), after SIGKILLing
    the processes still in them by pid. Returns the names deleted."""
    return faultnet.reap_stale(_OURS)


def listen_in(ns: str, host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` inside network namespace ``ns``.

    A socket belongs to the namespace of the thread that created it, so a short-lived thread moves itself
    into ``ns`` (setns(2) moves only the calling thread), opens the socket and ends; the rest of the process
    stays in its own namespace and can use the socket from any thread."""
    out: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(64)
            out.append(s)
        except BaseException as e:  # handed to the caller's thread
            out.append(e)

    t = threading.Thread(target=make, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join(COMMAND_TIMEOUT_SECONDS)
    if not out:
        raise TimeoutError(f"opening a socket in {ns} did not finish")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


class ApiRelay:
    """Forwards each connection accepted on ``listener`` to ``target`` (bytes both ways, one thread)."""

    def __init__(self, listener: socket.socket, target: tuple[str, int]) -> None:
        self.listener = listener
        self.target = target
        self._sel = selectors.DefaultSelector()
        self._peer: dict[socket.socket, socket.socket] = {}
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="api-relay", daemon=True)
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._stop_r, selectors.EVENT_READ)
        self._thread.start()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            up = socket.create_connection(self.target, timeout=RELAY_CONNECT_TIMEOUT_SECONDS)
        except OSError as e:
            log.warning("api relay: cannot reach %s:%s: %s", *self.target, e)
            conn.close()
            return
        for s in (conn, up):
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ)
        self._peer[conn], self._peer[up] = up, conn

    def _drop(self, s: socket.socket) -> None:
        other = self._peer.pop(s, None)
        for x in (s, other):
            if x is None:
                continue
            self._peer.pop(x, None)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(x)
            x.close()

    def _pump(self, s: socket.socket) -> None:
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(s)
            return
        other = self._peer[s]
        try:
            # Small TLS records: a blocking send with a timeout is simpler than buffering per socket.
            other.settimeout(RELAY_CONNECT_TIMEOUT_SECONDS)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            self._drop(s)

    def _loop(self) -> None:
        while True:
            for key, _ in self._sel.select(timeout=1.0):
                if key.fileobj == self._stop_r:
                    return
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj in self._peer:
                    self._pump(key.fileobj)  # type: ignore[arg-type]

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(COMMAND_TIMEOUT_SECONDS)
        for s in list(self._peer):
            self._drop(s)
        self._sel.close()
        self.listener.close()
        os.close(self._stop_r)
        os.close(self._stop_w)


class PodNetwork:
    """The bridge namespace and one namespace per Pod (:meth:`add_pod`), all deleted by :meth:`close`."""

    def __init__(self) -> None:
        self.tag = f"mtck-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.bridge_ns = f"{self.tag}-br"
        self._made: list[str] = []
        self._next = 0
        self._lock = threading.Lock()

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs: the child's pid is the command's)."""
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, argv: Sequence[str], check: bool = True) -> str:
        return run(self.command(ns, argv), check)

    def __enter__(self) -> PodNetwork:
        try:
            self._add_ns(self.bridge_ns)
            self.run(self.bridge_ns, ["ip", "link", "add", "br0", "type", "bridge"])
            self.run(self.bridge_ns, ["ip", "addr", "add", f"{BRIDGE_IP}/{PREFIX_LEN}", "dev", "br0"])
            self.run(self.bridge_ns, ["ip", "link", "set", "br0", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        run(["ip", "netns", "add", name])
        with self._lock:
            self._made.append(name)
        self.run(name, ["ip", "link", "set", "lo", "up"])

    def add_pod(self) -> tuple[str, str]:
        """A new Pod namespace joined to the bridge: ``(namespace name, pod IP)``."""
        with self._lock:
            n = self._next
            self._next += 1
        ip = f"10.214.{1 + n // 250}.{1 + n % 250}"
        ns = f"{self.tag}-p{n}"
        self._add_ns(ns)
        # Both ends made in the bridge's namespace and one moved into the Pod's: nothing in the root namespace.
        self.run(self.bridge_ns, ["ip", "link", "add", f"vp{n}", "type", "veth", "peer", "name", IFACE, "netns", ns])
        self.run(self.bridge_ns, ["ip", "link", "set", f"vp{n}", "master", "br0"])
        self.run(self.bridge_ns, ["ip", "link", "set", f"vp{n}", "up"])
        self.run(ns, ["ip", "addr", "add", f"{ip}/{PREFIX_LEN}", "dev", IFACE])
        self.run(ns, ["ip", "link", "set", IFACE, "up"])
        self.run(ns, ["ip", "route", "add", "default", "via", BRIDGE_IP])
        return ns, ip

    def pids(self, ns: str) -> list[int]:
        """The processes in namespace ``ns`` (``ip netns pids``)."""
        return [int(p) for p in run(["ip", "netns", "pids", ns], check=False).split() if p.isdigit()]

    def remove_pod(self, ns: str) -> None:
        """Delete a Pod's namespace (its veth pair goes with it); its processes are the caller's to stop."""
        run(["ip", "netns", "delete", ns], check=False)
        with self._lock:
            if ns in self._made:
                self._made.remove(ns)

    def close(self) -> None:
        """Delete every namespace this object made, by name, SIGKILLing by pid any process left in one."""
        with self._lock:
            made, self._made = list(reversed(self._made)), []
        for name in made:
            for pid in self.pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out = subprocess.run(["ip", "netns", "delete", name], timeout=COMMAND_TIMEOUT_SECONDS,
                                 capture_output=True, text=True, check=False)
            if out.returncode != 0 and os.path.exists(os.path.join(NETNS_DIR, name)):
                log.warning("cannot delete network namespace %s: %s", name, out.stderr.strip())
