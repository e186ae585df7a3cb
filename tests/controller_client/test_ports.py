"""Ports reserved for processes started later come from below the kernel's ephemeral range (where binding
port 0 and outgoing connections never land), are free, and differ."""

from __future__ import annotations

import itertools
import socket

from controller_client.demo import ports


def test_reserved_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = ports._ephemeral_low()
    got = {ports.free_port() for _ in range(20)}
    assert len(got) >= 19
    for p in got:
        assert ports.LOWEST <= p < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_handed_out(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # The taken port twice, then other ports (one of them may be in use too: the machine is shared).
        picks = itertools.chain([taken, taken], (p for p in range(ports.LOWEST, 65536) if p != taken))
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65535)
        monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, a, b: next(picks))
        assert ports.free_port() != taken
