"""A TCP port on 127.0.0.1 for a process started later (a coordinator candidate, a JAX or emulator service).

A port found by binding port 0 comes from the kernel's ephemeral range, and is free again once that socket
closes: any process binding port 0 or opening a connection meanwhile may be handed the same port, and the
process it was meant for then fails to bind (seen: a replicator's data port taking a coordinator's port).
Ports below the ephemeral range are never handed out that way, so one is picked there, checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000
TRIES = 64


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` free now, outside the ephemeral range when the machine leaves room below it."""
    high = _ephemeral_low() - 1
    rng = random.SystemRandom()
    if high - LOWEST >= TRIES:
        for _ in range(TRIES):
            port = rng.randint(LOWEST, high)
            if _bindable(port, host):
                return port
    with socket.socket() as s:  # no room below the range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]
