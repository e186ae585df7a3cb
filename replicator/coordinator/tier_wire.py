"""The one conversion between :class:`~replicator.coordinator.planner.Tier` and the wire's ``mtc.v1.Tier``.

Code compares tiers as ``Tier`` members; messages carry the proto enum; people read the names
(``local``, ``peer``, ``replica``, ``bucket``) in CLI tables and status JSON.
"""

from __future__ import annotations

from mtc_rpc import tier_pb2
from replicator.coordinator.model import Tier

_TO_WIRE = {
    Tier.LOCAL: tier_pb2.TIER_LOCAL,
    Tier.PEER: tier_pb2.TIER_PEER,
    Tier.REPLICA: tier_pb2.TIER_REPLICA,
    Tier.BUCKET: tier_pb2.TIER_BUCKET,
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
