"""The coordinator's value objects: copy tasks, restore sources and plans, the errors of its reports.

Frozen dataclasses with ``to_dict`` where they cross a boundary; the rules that act on them live in
:mod:`replicator.coordinator.planner` and its parts. The vocabulary every role shares (``Tier``,
``Holding``, ``Key``, ``inventory_digest`` ...) is :mod:`replicator.tiers`', re-exported here for the
code that imports it from the coordinator (the CLI's admin views, tests). Rank ranges and their text are
:mod:`sidecar.saves`' (:func:`~sidecar.saves.rank_ranges`, :func:`~sidecar.saves.format_ranks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from replicator.erasure.wire import CodeGroupSpec
from replicator.tiers import (
    BUCKET_HOLDER,
    HolderRank,
    Holding,
    InventoryKey,
    Key,
    Tier,
    check_hash,
    check_int,
    group_to_dict,
    inventory_digest,
    inventory_key,
)

__all__ = [  # the vocabulary, re-exported (see the module docstring)
    "BUCKET_HOLDER", "HolderRank", "Holding", "InventoryKey", "Key", "Tier", "check_hash", "check_int",
    "inventory_digest", "inventory_key",
    "CopyTask", "NotRegisteredError", "RestorePlan", "Source", "StaleIncarnationError",
]


class NotRegisteredError(LookupError):
    """A host reported before registering (e.g. the coordinator restarted): register and re-report."""


class StaleIncarnationError(ValueError):
    """A report or registration from an older incarnation of a host than the one registered."""


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """Copy ``owner_rank``'s ``step`` from ``source_rank``'s RAM disk to ``dest_rank``'s, then verify.

    ``hash_only``: ``dest_rank`` is a data-parallel replica whose own local step already has this
    ``content_hash`` (``source_rank == dest_rank``); no bytes move. The destination only records
    that fact and reports it as a :attr:`Tier.REPLICA` holding, so it outlives the owner's host and
    a coordinator restart.
    """

    owner_rank: int
    step: int
    source_rank: int
    dest_rank: int
    content_hash: str
    size: int = 0
    hash_only: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a restoring rank gets its data.

    ``kind`` LOCAL: already on the restoring host (``holder_rank`` == the rank); PEER: fetch from
    ``holder_rank``; BUCKET: download (``holder_rank`` is :data:`BUCKET_HOLDER`). ``owner_rank`` is whose
    data it is: the rank itself or a byte-identical data-parallel replica (then the data is that rank's
    directory).
    ``content_hash`` is None only for a bucket copy whose hash nobody reported.

    PARITY (erasure coding): rebuild ``owner_rank``'s data (``content_hash``) from ``group``: ``holder_rank``
    is :data:`BUCKET_HOLDER` (no one host holds it) and ``helpers`` are the members whose intact data or
    parity the rebuild reads (the ones whose addresses the restoring host needs).
    """

    kind: Tier
    holder_rank: HolderRank
    owner_rank: int
    content_hash: str | None
    size: int = 0
    group: CodeGroupSpec | None = None
    helpers: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "holder_rank": self.holder_rank,
            "owner_rank": self.owner_rank,
            "content_hash": self.content_hash,
            "size": self.size,
            **({"group": group_to_dict(self.group), "helpers": list(self.helpers)} if self.group is not None else {}),
        }


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores (None: nothing recoverable) and, per rank, where its data comes from.

    ``waiting_for`` lists registered hosts that have not reported an inventory yet: a plan made
    before they report may pick an older step than necessary.
    """

    step: int | None
    sources: Mapping[int, Source]
    reason: str
    waiting_for: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return self.step is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "reason": self.reason,
            "waiting_for": list(self.waiting_for),
            "sources": {r: s.to_dict() for r, s in sorted(self.sources.items())},
        }
