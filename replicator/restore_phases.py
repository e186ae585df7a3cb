"""The phases of one restore of a host's data: timed as they happen, then one log line, metrics and status.

Users ask where a restore's time went. Every restore path of the replicator — the coordinator's restore task
(:meth:`replicator.fetch.Fetcher.restore`) and a sidecar's fetch of a whole step or of some files
(:mod:`replicator.sidecar_fetch`) — times its phases on one :class:`RestoreClock`:

- ``plan``: asking the coordinator where the data is (the heartbeat that carried the restore task, or the
  ``LocateStep`` calls of a sidecar's fetch);
- ``fetch`` per tier (``local``, ``peer``, ``bucket``): bringing the bytes, including the time lost on a tier
  that failed before the next one served;
- ``verify`` per tier: the crc32c checks of the bytes that arrived. A peer copy checks each chunk as it lands,
  so ``verify`` overlaps ``fetch`` (it is the share of the fetch spent checking, not time after it). A bucket
  download is checked by the storage backend while it streams: counted in ``fetch``, not separately;
- ``load`` (the reader handing the bytes to the caller) happens in the sidecar, not here: not timed by the
  replicator.

:func:`report` turns a finished clock into a :class:`RestoreRecord`: one ``%``-style log line, the
``mtc_restore_phase_seconds{phase,tier}`` histograms and the host's last restore (heartbeat, local status).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Literal, Protocol

from mtc_rpc import tier_pb2
from replicator.tier_wire import to_wire
from replicator.tiers import Tier

log = logging.getLogger(__name__)

Phase = Literal["plan", "fetch", "verify"]
Trigger = Literal["task", "sidecar", "files"]
PHASE_ORDER: tuple[Phase, ...] = ("plan", "fetch", "verify")
_PHASE_WIRE = {"plan": tier_pb2.RESTORE_PHASE_PLAN, "fetch": tier_pb2.RESTORE_PHASE_FETCH,
               "verify": tier_pb2.RESTORE_PHASE_VERIFY}


@dataclasses.dataclass(frozen=True)
class RestoreRecord:
    """One finished restore: its phases' seconds keyed by (phase, tier name; "" for plan)."""

    step: int
    owner_rank: int
    trigger: Trigger
    tier: Tier
    nbytes: int
    phases: tuple[tuple[Phase, str, float], ...]
    seconds: float
    finished_unix: float

    def repeats(self, prev: RestoreRecord | None) -> bool:
        """This restore found the data on this host already (no bytes moved) and ``prev`` brought the same
        (step, owner): a repeated task (sent again while ``prev`` landed), not the restore to show as the last."""
        return (prev is not None and self.tier is Tier.LOCAL and self.nbytes == 0
                and (prev.step, prev.owner_rank) == (self.step, self.owner_rank))

    def phase_seconds(self, phase: Phase, tier: str = "") -> float:
        return sum(s for p, t, s in self.phases if p == phase and t == tier)

    def to_wire(self) -> tier_pb2.RestoreBreakdown:
        out = tier_pb2.RestoreBreakdown(step=self.step, owner_rank=self.owner_rank, tier=to_wire(self.tier),
                                        bytes=self.nbytes, seconds=self.seconds, finished_unix=self.finished_unix,
                                        trigger=self.trigger)
        for phase, tier, secs in self.phases:
            out.phases.add(phase=_PHASE_WIRE[phase], tier=to_wire(tier) if tier else tier_pb2.TIER_UNSPECIFIED,
                           seconds=secs)
        return out

    def describe(self) -> str:
        """The phases as one line's tail: ``plan 0.012s, fetch peer 0.301s, verify peer 0.040s``."""
        return ", ".join(f"{p} {t + ' ' if t else ''}{s:.3f}s" for p, t, s in self.phases)


class RestoreClock:
    """The phases of one restore as they happen (thread-safe: a transfer's threads add verify time)."""

    def __init__(self, step: int, owner_rank: int, trigger: Trigger, started: float | None = None):
        """``started``: the ``time.monotonic()`` the restore began (its plan), if before now."""
        self.step, self.owner_rank, self.trigger = step, owner_rank, trigger
        self._t0 = time.monotonic() if started is None else started
        self._lock = threading.Lock()
        self._seconds: dict[tuple[Phase, str], float] = {}

    def add(self, phase: Phase, tier: Tier | str | None, seconds: float) -> None:
        """``seconds`` more of ``phase`` (on ``tier``; None or "" for plan)."""
        key = (phase, str(tier) if tier else "")
        with self._lock:
            self._seconds[key] = self._seconds.get(key, 0.0) + max(0.0, seconds)

    @contextlib.contextmanager
    def timing(self, phase: Phase, tier: Tier | str | None = None) -> Iterator[None]:
        """Time the block as ``phase`` (on ``tier``), whether it succeeds or fails."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(phase, tier, time.monotonic() - t0)

    @contextlib.contextmanager
    def fetching(self, tier: Tier) -> Iterator[None]:
        """Time the block as ``fetch`` on ``tier``; the crc32c checks in it (this thread's, see
        :func:`verified`) count as ``verify`` on ``tier``."""
        token = _VERIFYING.set((self, str(tier)))
        try:
            with self.timing("fetch", tier):
                yield
        finally:
            _VERIFYING.reset(token)

    def finish(self, tier: Tier, nbytes: int) -> RestoreRecord:
        """The record of the restore, now done, with its data from ``tier``."""
        with self._lock:
            items = dict(self._seconds)
        order = {p: i for i, p in enumerate(PHASE_ORDER)}
        phases = tuple((p, t, s) for (p, t), s in sorted(items.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])))
        return RestoreRecord(step=self.step, owner_rank=self.owner_rank, trigger=self.trigger, tier=tier,
                             nbytes=int(nbytes), phases=phases, seconds=time.monotonic() - self._t0,
                             finished_unix=time.time())


# The clock (and tier) a fetch in this thread adds its crc32c time to, set by RestoreClock.fetching.
_VERIFYING: contextvars.ContextVar[tuple[RestoreClock, str] | None] = contextvars.ContextVar(
    "mtc_restore_verifying", default=None)


def verified(seconds: float) -> None:
    """A transfer's crc32c check took ``seconds``: counted as ``verify`` of the restore fetching in this
    thread, if any (two clock reads per chunk of several MiB: nothing against the checksum itself)."""
    current = _VERIFYING.get()
    if current is not None:
        current[0].add("verify", current[1], seconds)


class PhaseSink(Protocol):
    """Where a finished restore goes (:class:`replicator.metrics.ReplicatorMetrics`)."""

    def observe_restore(self, record: RestoreRecord) -> None: ...


def report(clock: RestoreClock, sink: PhaseSink, *, rank: int, tier: Tier, nbytes: int,
           where: str) -> RestoreRecord:
    """Finish ``clock`` (data from ``tier``, ``where`` for the log): one log line, the metrics, the last
    restore of the host."""
    rec = clock.finish(tier, nbytes)
    sink.observe_restore(rec)
    log.info("restore: rank %d now holds rank %d's data of step %d (%s) from %s: %d bytes in %.3fs: %s",
             rank, rec.owner_rank, rec.step, rec.trigger, where, rec.nbytes, rec.seconds, rec.describe())
    return rec
