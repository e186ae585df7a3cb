"""controller_client/jax_service.py: the address handed to ``jax.distributed.initialize`` answers now."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from controller_client import jax_service
from replicator.net import address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_process_0_connects_to_its_own_service_over_loopback() -> None:
    assert jax_service.reachable_address("job-workers-0-0.job:8476", 0) == "127.0.0.1:8476"


def test_waits_until_the_service_listens_and_returns_its_ip() -> None:
    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen = threading.Timer(0.5, lambda: (server.bind(("127.0.0.1", port)), server.listen()))
    t0 = time.monotonic()
    listen.start()
    try:
        assert jax_service.reachable_address(f"localhost:{port}", 1, timeout_seconds=10) == f"127.0.0.1:{port}"
        assert time.monotonic() - t0 >= 0.5
    finally:
        listen.join()
        server.close()


def test_the_name_is_resolved_again_on_every_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """The name first resolves to the old process 0's address (nothing answers there any more), then to the
    new one: the new one is returned (JAX's gRPC client would have spent 20 s on the old one)."""
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        port = live.getsockname()[1]
        answers = iter([["127.0.0.2"], ["127.0.0.2"], ["127.0.0.1"]])
        seen: list[str] = []

        def resolve(host, p, type=0):  # noqa: A002  (socket.getaddrinfo's own keyword)
            ips = next(answers)
            seen.append(ips[0])
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, p)) for ip in ips]

        monkeypatch.setattr(jax_service.socket, "getaddrinfo", resolve)
        assert jax_service.reachable_address(f"job-workers-0-0.job:{port}", 3, timeout_seconds=10) == f"127.0.0.1:{port}"
        assert seen == ["127.0.0.2", "127.0.0.2", "127.0.0.1"]


def test_nothing_answers_times_out_naming_the_address() -> None:
    port = _free_port()
    with pytest.raises(TimeoutError, match=f"localhost:{port} accepted no connection in 1 s"):
        jax_service.reachable_address(f"localhost:{port}", 1, timeout_seconds=1)


@pytest.mark.parametrize("bad", ["no-port", "host:", ":8476", "host:port", "host:65536"])
def test_a_malformed_address_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        jax_service.reachable_address(bad, 1)


def test_ipv6_addresses_keep_their_brackets() -> None:
    assert address.join_host_port("::1", 8476) == "[::1]:8476"
    assert address.split_host_port("[::1]:8476") == ("::1", 8476)
