"""The address a multi-controller process gives ``jax.distributed.initialize``: one that answers now.

``JAX_COORDINATOR_ADDRESS`` names process 0's Pod (``<jobset>-workers-0-0.<jobset>:<port>``). After a JobSet
restart a new process may start while the name still resolves to the old process 0's Pod, which is being torn
down: JAX's gRPC client then spends a whole connection attempt (20 s, gRPC's minimum connect timeout) on an
address that no longer answers before it resolves the name again. Seen on the real control plane
(tests/cluster/test_in_place_restart.py, a trainer crash with ``recreate``): the first step after the crash
came 42 s later instead of 11 s in one run of three, both new processes inside ``jax.distributed.initialize``.

:func:`reachable_address` resolves the name afresh and tries each address for a second at a time until one
accepts a connection, and returns that IP address, so that JAX's client connects to the live process 0 at once.
Process 0 runs the service itself (bound to every interface): it connects over loopback.
"""

from __future__ import annotations

import logging
import socket
import time

from replicator.net.address import join_host_port, split_host_port

log = logging.getLogger(__name__)

ATTEMPT_SECONDS = 1.0  # one connection attempt to one resolved address
RETRY_SECONDS = 0.1  # between rounds, while process 0's service is not up yet


def reachable_address(address: str, process_id: int, timeout_seconds: float = 300.0) -> str:
    """``address`` (``host:port`` of JAX's coordination service, process 0) as an address that accepts a
    connection now: ``127.0.0.1:port`` for process 0 itself, else the first of the name's current IP addresses
    to accept one. Waits up to ``timeout_seconds`` (JAX's own ``initialization_timeout`` is 300 s by default),
    then raises TimeoutError naming the address and the last error."""
    host, port = split_host_port(address)
    if process_id == 0:
        return f"127.0.0.1:{port}"  # its service binds every interface ([::], IPv4 too)
    deadline = time.monotonic() + timeout_seconds
    t0 = time.monotonic()
    last = "not tried"
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            infos, last = [], f"{host} does not resolve: {e}"
        for family, kind, proto, _, sockaddr in infos:
            try:
                with socket.socket(family, kind, proto) as s:
                    s.settimeout(min(ATTEMPT_SECONDS, max(0.01, deadline - time.monotonic())))
                    s.connect(sockaddr)
            except OSError as e:
                last = f"{sockaddr[0]}: {e}"
                continue
            waited = time.monotonic() - t0
            if waited >= 1.0:
                log.info("JAX's coordination service %s answered at %s after %.1f s", address, sockaddr[0], waited)
            return join_host_port(sockaddr[0], port)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"JAX's coordination service {address} accepted no connection in "
                               f"{timeout_seconds:.0f} s (last: {last})")
        time.sleep(RETRY_SECONDS)
