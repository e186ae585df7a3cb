"""Where :mod:`replicator.tier_wire` used to live: its names, re-exported for the code that still imports them
from here (``controller_client.admin``; its owner moves those imports to :mod:`replicator.tier_wire`)."""

from __future__ import annotations

from replicator.tier_wire import (
    WIRE_BUCKET_HOLDER,
    from_wire,
    holder_to_wire,
    holding_from_wire,
    holding_to_wire,
    tier_name,
    to_wire,
)

__all__ = ["WIRE_BUCKET_HOLDER", "from_wire", "holder_to_wire", "holding_from_wire", "holding_to_wire",
           "tier_name", "to_wire"]
