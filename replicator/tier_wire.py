"""The one conversion between the shared vocabulary (:mod:`replicator.tiers`) and the wire for tiers and holders.

Code compares tiers as :class:`~replicator.tiers.Tier` members; messages carry the proto enum
``mtc.v1.Tier``; people read the names (``local``, ``peer``, ``replica``, ``bucket``, ``parity``) in CLI tables
and status JSON. A holder is a rank or :data:`~replicator.tiers.BUCKET_HOLDER` in the model; messages'
``holder_rank`` fields spell the bucket -1. A holding (``mtc.v1.Holding``, its code group for parity) converts
here too: :func:`holding_to_wire`, :func:`holding_from_wire`.
"""

from __future__ import annotations

from typing import Any

from mtc_rpc import tier_pb2
from replicator.erasure.wire import CodeGroupSpec
from replicator.tiers import HolderRank, Holding, Tier

_TO_WIRE = {
    Tier.LOCAL: tier_pb2.TIER_LOCAL,
    Tier.PEER: tier_pb2.TIER_PEER,
    Tier.REPLICA: tier_pb2.TIER_REPLICA,
    Tier.BUCKET: tier_pb2.TIER_BUCKET,
    Tier.PARITY: tier_pb2.TIER_PARITY,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


def to_wire(tier: Tier | str) -> int:
    """The ``mtc.v1.Tier`` value of ``tier`` (a ``Tier`` or its name)."""
    return _TO_WIRE[Tier(tier)]


def from_wire(value: int) -> Tier:
    """The ``Tier`` a message names; ``ValueError`` for TIER_UNSPECIFIED or an unknown value."""
    try:
        return _FROM_WIRE[value]
    except KeyError:
        raise ValueError(f"no tier {value!r} (expected one of {sorted(_FROM_WIRE)})") from None


def tier_name(value: int) -> str:
    """The human name of a wire tier (``"local"``, ``"peer"``, ``"replica"``, ``"bucket"``)."""
    return str(from_wire(value))


WIRE_BUCKET_HOLDER = -1  # a message's holder_rank for the bucket


def holder_to_wire(holder: HolderRank) -> int:
    """A message's ``holder_rank`` for ``holder`` (the bucket: -1)."""
    return WIRE_BUCKET_HOLDER if holder is None else holder  # None: BUCKET_HOLDER


def holding_to_wire(h: Holding, message: Any) -> Any:
    """Fill a ``mtc.v1.Holding`` (``message``, e.g. ``request.holdings.add()``) from ``h`` and return it."""
    message.owner_rank, message.step, message.content_hash = h.owner_rank, h.step, h.content_hash
    message.size, message.tier, message.generation = h.size, to_wire(h.tier), h.generation
    for a, b in h.savers:
        message.savers.add(first=a, last=b)
    if h.group is not None:
        h.group.to_proto(message.group)
    return message


def holding_from_wire(message: Any) -> Holding:
    """The :class:`Holding` a ``mtc.v1.Holding`` names (a parity one with its code group); ValueError if bad."""
    tier = from_wire(message.tier)
    group = CodeGroupSpec.from_proto(message.group) if tier is Tier.PARITY else None
    return Holding(message.owner_rank, message.step, message.content_hash, message.size, tier, message.generation,
                   tuple((r.first, r.last) for r in message.savers), group)
