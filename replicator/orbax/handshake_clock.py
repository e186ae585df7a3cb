"""The phases of one Orbax-mode handshake, timed as they happen: one log line and a histogram per phase.

Where a restart's time goes between Orbax writing ``replicator.yaml`` and our acknowledgement:

- ``stop``: the previous incarnation's daemon stopped (in-flight RPCs get a short grace);
- ``layout``: what Orbax left on the RAM disk ingested into the store, re-labelled after an elastic event;
- ``start``: the new daemon built and serving (gRPC servers, the coordinator if this host is the first);
- ``hosts``: until every host has reported to the coordinator (a plan on fewer could miss data);
- ``plan``: the coordinator's PrepareRestore until this host holds its data of the step (fetches included);
- ``marker``: the restore marker written and ``replicator.yaml`` acknowledged.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger(__name__)

Phase = Literal["stop", "layout", "start", "hosts", "plan", "marker"]
PHASES: tuple[Phase, ...] = ("stop", "layout", "start", "hosts", "plan", "marker")
BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class HandshakeMetrics:
    """``mtc_orbax_handshake_phase_seconds{phase}`` and ``mtc_orbax_handshake_seconds``, on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.phase_seconds = Histogram(
            "mtc_orbax_handshake_phase_seconds", "Orbax mode: time of one phase of a handshake (stop, layout, "
            "start, hosts, plan, marker; docs/orbax.md)", ["phase"], buckets=BUCKETS, registry=registry)
        self.seconds = Histogram(
            "mtc_orbax_handshake_seconds", "Orbax mode: from replicator.yaml seen to its acknowledgement",
            buckets=BUCKETS, registry=registry)


class HandshakeClock:
    """Marks the end of each phase on a monotonic clock; :meth:`done` reports them."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.t0 = self._last = time.monotonic()
        self.phases: dict[Phase, float] = {}

    def mark(self, phase: Phase) -> None:
        """``phase`` ended now (it began when the previous one ended)."""
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + (now - self._last)
        self._last = now

    def seconds(self) -> float:
        return self._last - self.t0

    def describe(self) -> str:
        """``stop 0.001s, layout 0.004s, ...`` in the order the phases run."""
        return ", ".join(f"{p} {self.phases[p]:.3f}s" for p in PHASES if p in self.phases)

    def done(self, outcome: str, metrics: HandshakeMetrics | None) -> None:
        """One log line, and the histograms when a daemon (its registry) serves."""
        log.info("handshake %d done in %.2fs (%s): %s", self.number, self.seconds(), self.describe(), outcome)
        if metrics is None:
            return
        for phase, secs in self.phases.items():
            metrics.phase_seconds.labels(phase=phase).observe(secs)
        metrics.seconds.observe(self.seconds())
