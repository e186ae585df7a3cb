"""The Orbax-mode handshake's phase clock: the phases in order, the log line, the histograms."""

from __future__ import annotations

import logging

import pytest

from replicator.metrics import ReplicatorMetrics
from replicator.orbax import handshake_clock as hc


def test_phases_add_up_to_the_handshake_and_reach_the_histograms(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    monkeypatch.setattr(hc.time, "monotonic", lambda: now[0])
    clock = hc.HandshakeClock(3)
    for phase, secs in (("stop", 0.25), ("layout", 0.5), ("start", 0.125), ("hosts", 1.0), ("plan", 2.0),
                        ("marker", 0.0625)):
        now[0] += secs
        clock.mark(phase)
    metrics = ReplicatorMetrics()
    registry = metrics.registry
    with caplog.at_level(logging.INFO, logger=hc.__name__):
        clock.done("restore step 8 from /x", metrics)
    assert clock.seconds() == pytest.approx(3.9375)
    assert ("handshake 3 done in 3.94s (stop 0.250s, layout 0.500s, start 0.125s, hosts 1.000s, plan 2.000s, "
            "marker 0.062s): restore step 8 from /x") in caplog.text
    for phase, secs in (("hosts", 1.0), ("plan", 2.0)):
        assert registry.get_sample_value("mtc_orbax_handshake_phase_seconds_sum", {"phase": phase}) == secs
    assert registry.get_sample_value("mtc_orbax_handshake_seconds_sum") == pytest.approx(3.9375)
    assert registry.get_sample_value("mtc_orbax_handshake_seconds_count") == 1
    # The host's last handshake, typed for the heartbeat and `mtc status`.
    wire = metrics.last_handshake.to_wire()
    assert (wire.number, wire.outcome) == (3, "restore step 8 from /x")
    assert wire.seconds == pytest.approx(3.9375) and wire.finished_unix > 0
    assert [(p.phase, p.seconds) for p in wire.phases] == [
        ("stop", 0.25), ("layout", 0.5), ("start", 0.125), ("hosts", 1.0), ("plan", 2.0), ("marker", 0.0625)]


def test_status_renders_the_handshake() -> None:
    from controller_client.admin.restores import handshake_doc, handshake_text

    rec = hc.HandshakeRecord(2, (("stop", 0.001), ("hosts", 0.25), ("plan", 0.125)), 0.376, 0.0, "nothing to restore")
    assert handshake_text(rec.to_wire(), short=True) == "0.376s: stop 0.001s, hosts 0.250s, plan 0.125s"
    assert handshake_doc(rec.to_wire()) == {
        "number": 2, "seconds": 0.376, "finished_unix": None, "outcome": "nothing to restore",
        "phases": [{"phase": "stop", "seconds": 0.001}, {"phase": "hosts", "seconds": 0.25},
                   {"phase": "plan", "seconds": 0.125}]}


def test_only_the_phases_reached_are_described(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(hc.time, "monotonic", lambda: now[0])
    clock = hc.HandshakeClock(1)
    now[0] = 0.5
    clock.mark("stop")
    assert clock.describe() == "stop 0.500s"
    clock.done("failed", None)  # no daemon serves: the log line only
