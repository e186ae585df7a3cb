"""A host's last restore, phase by phase, as `mtc status` shows it (the typed ``mtc.v1.RestoreBreakdown``),
and in Orbax mode its last handshake (``mtc.v1.HandshakeBreakdown``, replicator/orbax/handshake_clock.py).

The replicator times every restore of a host's data (``replicator.restore_phases``) and reports the last one
with its heartbeat (and in its local status); these render it as the JSON documents and table cells of
``mtc status``, ``mtc status --hosts`` and ``mtc status --local-dir``.
"""

from __future__ import annotations

from typing import Any

from controller_client.admin.common import fmt_bytes, when
from mtc_rpc import tier_pb2
from replicator.coordinator.tier_wire import tier_name

_PHASES = {tier_pb2.RESTORE_PHASE_PLAN: "plan", tier_pb2.RESTORE_PHASE_FETCH: "fetch",
           tier_pb2.RESTORE_PHASE_VERIFY: "verify", tier_pb2.RESTORE_PHASE_LOAD: "load"}


def _tier(value: int) -> str | None:
    return tier_name(value) if value != tier_pb2.TIER_UNSPECIFIED else None


def restore_doc(b: Any) -> dict[str, Any]:
    """``b`` (a RestoreBreakdown) as plain data: step, owner rank, tier, bytes, seconds, when, trigger, and
    ``phases``: a list of {phase, tier (None for plan), seconds}."""
    return {"step": b.step, "owner_rank": b.owner_rank, "tier": _tier(b.tier), "bytes": b.bytes,
            "seconds": b.seconds, "finished_unix": b.finished_unix or None, "trigger": b.trigger,
            "phases": [{"phase": _PHASES.get(p.phase, "unspecified"), "tier": _tier(p.tier), "seconds": p.seconds}
                       for p in b.phases]}


def restore_text(b: Any, *, short: bool = False) -> str:
    """One line: ``step 7 (rank 3's data) from peer, 1.2 MiB in 0.31s: plan 0.010s, fetch peer 0.250s, ...``."""
    phases = ", ".join(f"{_PHASES.get(p.phase, '?')} {(_tier(p.tier) + ' ') if _tier(p.tier) else ''}"
                       f"{p.seconds:.3f}s" for p in b.phases)
    head = f"step {b.step} from {_tier(b.tier) or '?'}, {fmt_bytes(b.bytes)} in {b.seconds:.3f}s"
    if short:
        return f"{head}: {phases}"
    return f"{head} ({b.trigger}, rank {b.owner_rank}'s data, {when(b.finished_unix)}): {phases}"


def handshake_doc(h: Any) -> dict[str, Any]:
    """``h`` (a HandshakeBreakdown) as plain data: number, seconds, when, outcome, and ``phases``: a list of
    {phase, seconds} in the order they ran."""
    return {"number": h.number, "seconds": h.seconds, "finished_unix": h.finished_unix or None,
            "outcome": h.outcome, "phases": [{"phase": p.phase, "seconds": p.seconds} for p in h.phases]}


def handshake_text(h: Any, *, short: bool = False) -> str:
    """One line: ``0.412s: stop 0.000s, layout 0.010s, start 0.040s, hosts 0.150s, plan 0.200s, marker 0.010s``
    (then, unless ``short``, the handshake's number, when and its outcome)."""
    head = f"{h.seconds:.3f}s: " + ", ".join(f"{p.phase} {p.seconds:.3f}s" for p in h.phases)
    return head if short else f"{head} (handshake {h.number}, {when(h.finished_unix)}: {h.outcome})"
