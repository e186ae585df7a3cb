"""A code group of one step as the coordinator names it on the wire (``mtc.v1.CodeGroup``), validated.

The coordinator plans code groups (:func:`replicator.erasure.placement.code_groups`) and sends each parity
holder a ``ParityTask`` and each restoring host a ``RestoreSource`` of tier ``TIER_PARITY`` carrying one; a host
reports the parity it holds as a ``Holding`` of tier ``TIER_PARITY`` whose content hash is the group's
:meth:`CodeGroupSpec.digest`. Everything here is pure: no RPC, no disk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

from replicator.erasure.group import GroupLayout
from replicator.erasure.redundancy import MAX_FRAGMENTS

# The digest's prefix: a parity holding's content hash is never mistaken for a step's (which is hex).
DIGEST_PREFIX = "ec1-"


@dataclasses.dataclass(frozen=True)
class CodeGroupSpec:
    """One code group of one step: ec:K+M over ``members`` (position order), each member's content hash of the
    step and the Peer address of its host (empty: not reachable now, e.g. lost)."""

    k: int
    m: int
    members: tuple[int, ...]
    content_hashes: tuple[str, ...]
    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("k", "m"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"code group {name} must be an int >= 1, got {v!r}")
        if self.k + self.m > MAX_FRAGMENTS:
            raise ValueError(f"code group ec:{self.k}+{self.m}: K + M must be <= {MAX_FRAGMENTS}")
        n = len(self.members)
        if len(self.content_hashes) != n or len(self.addresses) != n:
            raise ValueError(f"code group of {n} members needs {n} content hashes and {n} addresses, got "
                             f"{len(self.content_hashes)} and {len(self.addresses)}")
        for h in self.content_hashes:
            if not isinstance(h, str) or not h:
                raise ValueError(f"code group content hash must be a non-empty str, got {h!r}")
        for a in self.addresses:
            if not isinstance(a, str):
                raise ValueError(f"code group address must be a str, got {a!r}")
        GroupLayout(self.k, self.m, self.members)  # members: ints >= 0, distinct, at least K + M of them (ValueError otherwise)

    @functools.cached_property
    def layout(self) -> GroupLayout:
        # Cached (the spec is frozen): asked per rank on every coverage derivation in ec mode.
        return GroupLayout(self.k, self.m, self.members)

    def digest(self) -> str:
        """The parity holdings' content hash: equal exactly when K, M, the members and their data are."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        text = f"{self.k}+{self.m}|" + "|".join(f"{r}={h}" for r, h in zip(self.members, self.content_hashes,
                                                                           strict=True))
        return DIGEST_PREFIX + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def address_of(self, rank: int) -> str:
        return self.addresses[self.layout.position(rank)]

    def hash_of(self, rank: int) -> str:
        return self.content_hashes[self.layout.position(rank)]

    def to_proto(self, message: Any) -> Any:
        """Fill a ``mtc.v1.CodeGroup`` (``message``, e.g. ``task.group``) and return it."""
        message.k, message.m = self.k, self.m
        message.members[:] = list(self.members)
        message.content_hashes[:] = list(self.content_hashes)
        message.addresses[:] = list(self.addresses)
        return message

    @classmethod
    def from_proto(cls, message: Any) -> CodeGroupSpec:
        """From a ``mtc.v1.CodeGroup`` (from the coordinator: checked all the same); ValueError if malformed."""
        return cls(int(message.k), int(message.m), tuple(int(r) for r in message.members),
                   tuple(message.content_hashes), tuple(message.addresses))
