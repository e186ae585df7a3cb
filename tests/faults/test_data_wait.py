"""A data-port client waiting for the server's status when the server's host is cut off: it fails within the
keepalive's ~11 s, not at the transfer's deadline (600 s by default). ``make test-faults``; needs root.

The server (host 0's namespace) reads the client's header and then, as a server whose transfer slots are all busy
does, sends nothing; the client (host 1's namespace) runs ``replicator.peer.client._receive_tcp``. Once the client
waits, host 0 is cut: nothing on the connection answers any more, and nothing but TCP keepalive can tell.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from replicator.peer import protocol
from tests.kits import faultnet
from tests.kits.fault_cluster import REPO

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(faultnet.available()), reason=faultnet.available() or "available")]

PORT = 7099
DEADLINE_SECONDS = 90.0
# Keepalive: the first probe after DATA_KEEPALIVE_IDLE_SECONDS, then DATA_KEEPALIVE_PROBES unanswered ones.
KEEPALIVE_SECONDS = (protocol.DATA_KEEPALIVE_IDLE_SECONDS
                     + protocol.DATA_KEEPALIVE_INTERVAL_SECONDS * protocol.DATA_KEEPALIVE_PROBES)

SERVER = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("LISTENING", flush=True)
conn, _ = srv.accept()
conn.recv(64)  # the magic and the ticket; then silence, as while every transfer slot is busy
time.sleep(float(sys.argv[3]))
"""

CLIENT = """
import json, sys, time
from pathlib import Path
from replicator.net.throttle import RateLimiter
from replicator.peer import client
from replicator.peer.sinks import FileSink
from sidecar.layout import FileEntry
sink = FileSink(Path(sys.argv[3]), [FileEntry("0.bin", 1 << 20, 0)])
t0 = time.monotonic()
try:
    client._receive_tcp(sys.argv[1], int(sys.argv[2]), b"t" * 32, sink, t0 + float(sys.argv[4]), RateLimiter(None))
    out = {"error": None}
except Exception as e:
    out = {"error": type(e).__name__ + ": " + str(e)}
sink.abort()
out["seconds"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_a_client_waiting_for_a_cut_off_servers_status_fails_within_the_keepalive(tmp_path) -> None:
    with faultnet.FaultNetwork(2) as net:
        server = subprocess.Popen(net.command(net.host_ns[0], [sys.executable, "-c", SERVER, net.ip(0), str(PORT),
                                                               str(DEADLINE_SECONDS + 30)]),
                                  stdout=subprocess.PIPE, text=True)
        client = None
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "LISTENING"
            client = subprocess.Popen(net.command(net.host_ns[1], [sys.executable, "-c", CLIENT, net.ip(0), str(PORT),
                                                                   str(tmp_path), str(DEADLINE_SECONDS)]),
                                      stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                                      env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
            time.sleep(2.0)  # connected, header sent and acknowledged: the client waits for the status
            assert client.poll() is None, "the client stopped before the cut"
            t_cut = time.monotonic()
            net.cut(0)
            out, _ = client.communicate(timeout=DEADLINE_SECONDS + 30)
            waited = time.monotonic() - t_cut
        finally:
            for p in (client, server):
                if p is not None:
                    _stop(p)
        got = json.loads(out.strip().splitlines()[-1])
        assert got["error"], got  # the transfer failed, and nothing was written (sink aborted)
        assert not list(tmp_path.iterdir())
        # Probing starts DATA_KEEPALIVE_IDLE_SECONDS after the last packet (the header's ack, 2 s before the cut).
        assert waited <= KEEPALIVE_SECONDS + 5, (waited, got)
