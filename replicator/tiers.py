"""The replicator's shared vocabulary: tiers, holdings and their keys, the check of a host's inventory.

The ground floor of ``replicator/``: the coordinator, the host's stores, the fetch ladder, the heartbeat
and the erasure-coding duty all speak these words, so they live below every role (STYLE.md 22). Frozen
dataclasses validated on construction, with ``to_dict``/``from_dict`` where they cross a boundary; no I/O.
The coordinator's own value objects (copy tasks, restore sources and plans) are
:mod:`replicator.coordinator.model`'s.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

# The one import up a floor: a parity holding carries its code group, the erasure tier's value type.
from replicator.erasure.wire import CodeGroupSpec

Key = tuple[int, int]  # (owner_rank, step)


class Tier(enum.StrEnum):
    """Where a piece of data lives, fastest first."""

    LOCAL = "local"  # the host's own rank's data, on its RAM disk
    PEER = "peer"  # a copy of another rank's data on this host's RAM disk
    # An attestation, not bytes: this host's own LOCAL data of the step was verified (by hash) to be
    # identical to ``owner_rank``'s, a data-parallel replica of it. Reporting it keeps that knowledge
    # alive after the owner's host is lost and across a coordinator restart. With ``owner_rank`` the
    # host's own rank (a self-attestation): the host restored its rank's data of the step from a
    # replica's byte-identical data and keeps it as that replica's peer copy; the holding says that
    # its own rank's data has this hash, so the identity survives the loss of the replica's host.
    REPLICA = "replica"
    BUCKET = "bucket"  # a committed backup
    # Erasure coding (``--redundancy ec:K+M``): a host's parity shards of one step's code group, not a rank's
    # bytes. ``owner_rank`` is the holder's own rank, ``content_hash`` the group's digest, and the holding
    # carries its :class:`~replicator.erasure.wire.CodeGroupSpec` (without addresses). The coordinator keeps
    # these apart from data (their key would collide with the holder's LOCAL data of the step).
    PARITY = "parity"


HolderRank = int | None
"""Who holds a copy of some data: a host's rank, or ``None`` for the bucket (:data:`BUCKET_HOLDER`)."""

BUCKET_HOLDER: HolderRank = None
"""The bucket as a holder, everywhere in the coordinator's model and the daemon's fetch ladder (no host holds
it). The wire spells it -1: :func:`replicator.tier_wire.holder_to_wire` converts, in one place."""


def check_int(name: str, value: object, minimum: int = 0) -> int:
    if type(value) is int and value >= minimum:  # the common case first (a plain int; bool is not one)
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_hash(value: object, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"content_hash must be a non-empty str, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Holding:
    """One piece of data a host reports holding: ``owner_rank``'s ``step``, hash, bytes and tier."""

    owner_rank: int
    step: int
    content_hash: str
    size: int = 0
    tier: Tier = Tier.LOCAL
    # Elastic training (see "savers and generations" below): the save's generation and the ranks that
    # saved the step, as inclusive ranges ((first, last), ...); empty = every rank.
    generation: int = 0
    savers: tuple[tuple[int, int], ...] = ()
    # Tier.PARITY only (and required there): the code group the parity was computed for, addresses empty.
    group: CodeGroupSpec | None = None

    def __post_init__(self) -> None:
        check_int("owner_rank", self.owner_rank)
        check_int("generation", self.generation)
        if type(self.savers) is not tuple or self.savers:  # most name no savers (every rank saved the step)
            ranges = tuple((int(a), int(b)) for a, b in self.savers)
            if any(a < 0 or b < a for a, b in ranges):
                raise ValueError(f"bad savers ranges {self.savers!r}")
            object.__setattr__(self, "savers", ranges)
        check_int("step", self.step)
        check_hash(self.content_hash)
        check_int("size", self.size)
        tier = self.tier
        if type(tier) is not Tier:
            try:
                tier = Tier(tier)
            except ValueError:
                raise ValueError(f"unknown tier {self.tier!r}") from None
        if tier is Tier.BUCKET:
            raise ValueError("a host cannot hold the bucket tier; use report_backup / report_backup_ranks")
        object.__setattr__(self, "tier", tier)
        if tier is Tier.PARITY:
            g = self.group
            if not isinstance(g, CodeGroupSpec):
                raise ValueError(f"a parity holding needs its code group, got {g!r}")
            if self.owner_rank not in g.members:
                raise ValueError(f"rank {self.owner_rank} holds parity of a code group it is not in: {list(g.members)}")
            if any(g.addresses):  # addresses are the coordinator's to give, not part of what is held
                object.__setattr__(self, "group", dataclasses.replace(g, addresses=("",) * len(g.members)))
        elif self.group is not None:
            raise ValueError(f"only a parity holding carries a code group (tier {tier})")

    @property
    def key(self) -> Key:
        """(owner_rank, step): unique among a host's data holdings; a parity holding has the same key as the
        holder's LOCAL data of the step, so an inventory that holds both is keyed by :func:`inventory_key`."""
        return (self.owner_rank, self.step)

    @property
    def is_parity(self) -> bool:
        return self.tier is Tier.PARITY

    def to_dict(self) -> dict[str, Any]:
        return {
            "owner_rank": self.owner_rank,
            "step": self.step,
            "content_hash": self.content_hash,
            "size": self.size,
            "tier": str(self.tier),
            "generation": self.generation,
            "savers": [list(r) for r in self.savers],
            **({"group": group_to_dict(self.group)} if self.group is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Holding:
        try:
            g = d.get("group")
            return cls(
                d["owner_rank"], d["step"], d["content_hash"], d.get("size", 0), d.get("tier", "local"),
                d.get("generation", 0), tuple(tuple(r) for r in d.get("savers", ())),
                group_from_dict(g) if g is not None else None,
            )
        except KeyError as e:
            raise ValueError(f"holding lacks field {e}") from None


def group_to_dict(g: CodeGroupSpec) -> dict[str, Any]:
    return {"k": g.k, "m": g.m, "members": list(g.members), "content_hashes": list(g.content_hashes)}


def group_from_dict(d: Mapping[str, Any]) -> CodeGroupSpec:
    if not isinstance(d, Mapping):
        raise ValueError(f"a code group must be a mapping, got {type(d).__name__}")
    members = tuple(d["members"])
    return CodeGroupSpec(d["k"], d["m"], members, tuple(d["content_hashes"]), ("",) * len(members))


InventoryKey = tuple[int, int, bool]  # (owner_rank, step, is parity)


def inventory_key(h: Holding) -> InventoryKey:
    """A key unique within one host's whole inventory, parity included (:attr:`Holding.key` is not: a host's
    parity of step S and its LOCAL data of S share (own rank, S))."""
    return (h.owner_rank, h.step, h.tier is Tier.PARITY)


def inventory_digest(holdings: Iterable[Holding]) -> str:
    """A digest of a host's whole inventory (order-free): equal digests = the coordinator's view is current.
    A parity holding's line ends with its group's digest too (its content hash is what the host computed)."""
    lines = sorted(f"{h.owner_rank}/{h.step}/{h.content_hash}/{h.size}/{h.tier}/{h.generation}/{h.savers}"
                   + (f"/{h.group.digest()}" if h.group is not None else "")
                   for h in holdings)
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=16).hexdigest()
