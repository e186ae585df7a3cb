"""A test network of the test's own: one network namespace per host, each joined by a veth pair to a bridge
that lives in a further namespace (where the controller-side probes run), never in the host's root namespace.

Faults are iptables DROP rules and ``tc tbf`` qdiscs inside the hosts' namespaces; :meth:`FaultNetwork.heal`
removes them all. :meth:`FaultNetwork.close` deletes every namespace this object created, by the names it
gave them (their veth pairs and bridge go with them); processes are the caller's to stop first, by pid.
A process gets into a host's namespace by being started in it (:meth:`FaultNetwork.command`) or, a Python
child already running, with :func:`enter`. Needs root, ``ip``, ``iptables`` and ``tc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterable, Sequence

from bench.children import pid_alive

COMMAND_TIMEOUT_SECONDS = 10.0
SUBNET = "10.213.0"  # private to these namespaces: the root namespace never sees it
IFACE = "eth0"  # a host's interface to the bridge, inside its namespace
_OURS = re.compile(r"^mtcf-(\d+)-[0-9a-f]{4}-(?:br|h\d+)$")  # the names FaultNetwork gives, with its pid
NETNS_DIR = "/var/run/netns"  # where ``ip netns add`` names its namespaces
CLONE_NEWNET = 0x40000000  # <sched.h>; Python 3.11 has no os.setns


def available() -> str:
    """"" when the test network can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [c for c in ("ip", "iptables", "tc") if shutil.which(c) is None]
    return f"missing {', '.join(missing)}" if missing else ""


def enter(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` (one :class:`FaultNetwork` made), with setns(2).

    Only the calling thread moves; threads it starts afterwards are born in ``ns``. So call it from the main
    thread before anything starts a thread that opens sockets (gRPC starts its threads with the first server
    or channel, not on import). Raises OSError when setns fails, RuntimeError when the thread is not in ``ns``
    afterwards."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {ns}: {os.strerror(err)}")
        if os.stat("/proc/thread-self/ns/net").st_ino != os.fstat(fd).st_ino:
            raise RuntimeError(f"setns returned 0 but this thread is not in network namespace {ns}")
    finally:
        os.close(fd)


def _run(argv: Sequence[str], check: bool = True) -> str:
    res = subprocess.run(list(argv), timeout=COMMAND_TIMEOUT_SECONDS, capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def reap_stale(ours: re.Pattern[str] = _OURS) -> list[str]:
    """Delete the namespaces an earlier run left behind when it was killed outright (SIGKILL: no teardown):
    those named as ``ours`` matches (group 1: the pid of the run that made them; default: as
    :class:`FaultNetwork` names them), by a process no longer alive. The processes still in them (that run's
    daemons) are SIGKILLed by pid first (``ip netns pids``). Returns the names deleted."""
    gone = []
    for line in _run(["ip", "netns", "list"], check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = ours.match(name)
        if not m or pid_alive(int(m.group(1))):
            continue
        for pid in _run(["ip", "netns", "pids", name], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _run(["ip", "netns", "delete", name], check=False)
        gone.append(name)
    return gone


class FaultNetwork:
    """``hosts`` namespaces at ``10.213.0.<rank+1>`` on a bridge in namespace :attr:`bridge_ns` (``.254``)."""

    def __init__(self, hosts: int) -> None:
        tag = f"mtcf-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.hosts = hosts
        self.bridge_ns = f"{tag}-br"
        self.host_ns = [f"{tag}-h{i}" for i in range(hosts)]
        self._made: list[str] = []

    def ip(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def controller_ip(self) -> str:
        return f"{SUBNET}.254"

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (for ``subprocess.Popen``; ``ip netns exec`` execs, so the
        child's pid is the command's)."""
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, argv: Sequence[str], check: bool = True) -> str:
        return _run(self.command(ns, argv), check)

    def __enter__(self) -> FaultNetwork:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        self.run(name, ["ip", "link", "set", "lo", "up"])

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        self.run(br, ["ip", "link", "add", "br0", "type", "bridge"])
        self.run(br, ["ip", "addr", "add", f"{self.controller_ip}/24", "dev", "br0"])
        self.run(br, ["ip", "link", "set", "br0", "up"])
        for rank, ns in enumerate(self.host_ns):
            self._add_ns(ns)
            # Both ends are made inside the bridge's namespace and one is moved: nothing in the root namespace.
            self.run(br, ["ip", "link", "add", f"v{rank}", "type", "veth", "peer", "name", IFACE, "netns", ns])
            self.run(br, ["ip", "link", "set", f"v{rank}", "master", "br0"])
            self.run(br, ["ip", "link", "set", f"v{rank}", "up"])
            self.run(ns, ["ip", "addr", "add", f"{self.ip(rank)}/24", "dev", IFACE])
            self.run(ns, ["ip", "link", "set", IFACE, "up"])

    # ------------------------------------------------------------------ faults

    def cut(self, rank: int) -> None:
        """Host ``rank`` reaches nobody and nobody reaches it: every packet on its link is dropped silently
        (its own loopback, and so its own coordinator, still answer it)."""
        ns = self.host_ns[rank]
        self.run(ns, ["iptables", "-A", "INPUT", "-i", IFACE, "-j", "DROP"])
        self.run(ns, ["iptables", "-A", "OUTPUT", "-o", IFACE, "-j", "DROP"])

    def cut_between(self, side_a: Iterable[int], side_b: Iterable[int]) -> None:
        """Hosts of ``side_a`` and hosts of ``side_b`` no longer reach each other (both still reach the
        controller's namespace)."""
        side_a, side_b = list(side_a), list(side_b)
        for mine, others in ((side_a, side_b), (side_b, side_a)):
            for rank in mine:
                for other in others:
                    self.run(self.host_ns[rank], ["iptables", "-A", "INPUT", "-s", self.ip(other), "-j", "DROP"])
                    self.run(self.host_ns[rank], ["iptables", "-A", "OUTPUT", "-d", self.ip(other), "-j", "DROP"])

    def throttle(self, rank: int, mbit: int) -> None:
        """Host ``rank``'s link sends at most ``mbit`` Mbit/s (a token bucket on both of its link's ends)."""
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"]
        self.run(self.host_ns[rank], ["tc", "qdisc", "replace", "dev", IFACE, "root", *tbf])
        self.run(self.bridge_ns, ["tc", "qdisc", "replace", "dev", f"v{rank}", "root", *tbf])

    def lossy(self, rank: int, share: float) -> None:
        """A random ``share`` of the packets on host ``rank``'s link is dropped, each direction on its
        receiving side (the kernel has no netem): what reaches ``rank``, and what ``rank`` sends, as it
        arrives at every other host and at the controller's namespace."""
        drop = ["-m", "statistic", "--mode", "random", "--probability", f"{share:.4f}", "-j", "DROP"]
        self.run(self.host_ns[rank], ["iptables", "-A", "INPUT", "-i", IFACE, *drop])
        for ns in [self.bridge_ns, *(n for r, n in enumerate(self.host_ns) if r != rank)]:
            self.run(ns, ["iptables", "-A", "INPUT", "-s", self.ip(rank), *drop])

    def lossy_everywhere(self, share: float) -> None:
        """A random ``share`` of the packets dropped as they arrive at every host and at the controller's
        namespace: each packet crosses one receiving side, so each is lost with probability ``share``."""
        drop = ["-m", "statistic", "--mode", "random", "--probability", f"{share:.4f}", "-j", "DROP"]
        self.run(self.bridge_ns, ["iptables", "-A", "INPUT", *drop])
        for ns in self.host_ns:
            self.run(ns, ["iptables", "-A", "INPUT", "-i", IFACE, *drop])

    def one_way(self, src: int, dst: int) -> None:
        """Host ``dst`` no longer hears host ``src`` (``src``'s packets dropped as they arrive at ``dst``);
        ``src`` still hears ``dst``. TCP needs both directions, so connections fail either way, but only
        ``dst``'s packets still arrive (``src`` sees SYNs and requests it cannot answer)."""
        self.run(self.host_ns[dst], ["iptables", "-A", "INPUT", "-s", self.ip(src), "-j", "DROP"])

    def heal(self) -> None:
        """Every rule and qdisc of the faults above removed."""
        self.run(self.bridge_ns, ["iptables", "-F", "INPUT"])
        for rank, ns in enumerate(self.host_ns):
            self.run(ns, ["iptables", "-F", "INPUT"])
            self.run(ns, ["iptables", "-F", "OUTPUT"])
            self.run(ns, ["tc", "qdisc", "del", "dev", IFACE, "root"], check=False)
            self.run(self.bridge_ns, ["tc", "qdisc", "del", "dev", f"v{rank}", "root"], check=False)

    def close(self) -> None:
        """Delete the namespaces this object made (by name); their links go with them."""
        for name in reversed(self._made):
            _run(["ip", "netns", "delete", name], check=False)
        self._made.clear()
