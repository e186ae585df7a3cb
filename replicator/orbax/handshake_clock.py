"""The phases of one Orbax-mode handshake, timed as they happen: one log line and the daemon's histograms.

Where a restart's time goes between Orbax writing ``replicator.yaml`` and our acknowledgement:

- ``stop``: the previous incarnation's daemon stopped (in-flight RPCs get a short grace);
- ``layout``: what Orbax left on the RAM disk ingested into the store, re-labelled after an elastic event;
- ``start``: the new daemon built and serving (gRPC servers, the coordinator if this host is the first);
- ``hosts``: until every host has reported to the coordinator (a plan on fewer could miss data);
- ``plan``: the coordinator's PrepareRestore until this host holds its data of the step (fetches included);
- ``marker``: the restore marker written and ``replicator.yaml`` acknowledged.

:meth:`HandshakeClock.done` turns the clock into a :class:`HandshakeRecord`: the log line, the histograms and
the host's last handshake, which the heartbeat carries to the coordinator and ``mtc status`` shows (typed:
``mtc.v1.HandshakeBreakdown``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal, Protocol

from mtc_rpc import tier_pb2

log = logging.getLogger(__name__)

Phase = Literal["stop", "layout", "start", "hosts", "plan", "marker"]
PHASES: tuple[Phase, ...] = ("stop", "layout", "start", "hosts", "plan", "marker")


@dataclasses.dataclass(frozen=True)
class HandshakeRecord:
    """One finished handshake: its phases' seconds in the order they ran."""

    number: int
    phases: tuple[tuple[Phase, float], ...]
    seconds: float
    finished_unix: float
    outcome: str

    def to_wire(self) -> tier_pb2.HandshakeBreakdown:
        out = tier_pb2.HandshakeBreakdown(
            number=self.number, seconds=self.seconds, finished_unix=self.finished_unix, outcome=self.outcome
        )
        for phase, secs in self.phases:
            out.phases.add(phase=phase, seconds=secs)
        return out


class HandshakeObserver(Protocol):
    """Where a finished handshake goes (the daemon's :class:`replicator.metrics.ReplicatorMetrics`)."""

    def observe_handshake(self, record: HandshakeRecord) -> None: ...


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

    def record(self, outcome: str) -> HandshakeRecord:
        return HandshakeRecord(
            self.number,
            tuple((p, self.phases[p]) for p in PHASES if p in self.phases),
            self.seconds(),
            time.time(),
            outcome,
        )

    def done(self, outcome: str, metrics: HandshakeObserver | None) -> HandshakeRecord:
        """One log line, and on the serving daemon's ``metrics`` the histograms
        (``mtc_orbax_handshake_phase_seconds`` / ``mtc_orbax_handshake_seconds``) and its last handshake."""
        log.info("handshake %d done in %.2fs (%s): %s", self.number, self.seconds(), self.describe(), outcome)
        rec = self.record(outcome)
        if metrics is not None:
            metrics.observe_handshake(rec)
        return rec
