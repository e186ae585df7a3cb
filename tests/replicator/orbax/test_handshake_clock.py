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


def test_only_the_phases_reached_are_described(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(hc.time, "monotonic", lambda: now[0])
    clock = hc.HandshakeClock(1)
    now[0] = 0.5
    clock.mark("stop")
    assert clock.describe() == "stop 0.500s"
    clock.done("failed", None)  # no daemon serves: the log line only
