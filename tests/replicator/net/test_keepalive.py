"""gRPC keepalive on every channel and server: a partition ends a waiting call within seconds, not at its
deadline (or after minutes of TCP retransmission), and the first call after the heal connects afresh.

A real partition: client and server in a network namespace of the test's own, packets to the server's port
dropped silently by iptables there (no RST, no FIN).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replicator.net import rpc
from tests.kits import netns

REPO = Path(__file__).resolve().parents[3]
CALL_DEADLINE_SECONDS = 30.0

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")


def _ask(child: subprocess.Popen, deadline: float) -> tuple[str, float]:
    child.stdin.write(f"CALL {deadline}\n")
    child.stdin.flush()
    line = child.stdout.readline().split()
    assert line and line[0] == "DONE", line
    return line[1], float(line[2])


def test_a_partition_ends_a_waiting_call_within_the_keepalive_bound_and_the_heal_reconnects() -> None:
    bound = (rpc.KEEPALIVE_TIME_MS + rpc.KEEPALIVE_TIMEOUT_MS) / 1000
    with netns.NetNamespace() as ns:
        child = subprocess.Popen(ns.command([sys.executable, "-m", "tests.kits.keepalive_child"]), cwd=REPO,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            first = child.stdout.readline().split()
            assert first and first[0] == "PORT", first
            port = int(first[1])
            assert _ask(child, 5)[0] == "OK"
            ns.drop_port(port)
            code, seconds = _ask(child, CALL_DEADLINE_SECONDS)
            # Without keepalive the call waits for its deadline (DEADLINE_EXCEEDED after 30 s).
            assert code == "UNAVAILABLE" and seconds <= bound + 3, (code, seconds)
            ns.heal()
            code, seconds = _ask(child, CALL_DEADLINE_SECONDS)
            assert code == "OK" and seconds <= 6, (code, seconds)  # within the longest reconnect backoff
            child.stdin.write("QUIT\n")
            child.stdin.flush()
            assert child.wait(timeout=10) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)
