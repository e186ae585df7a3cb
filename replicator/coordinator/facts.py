"""What hosts and backups reported, indexed for the coordinator's derived views. Part of :class:`CoordinatorState`.

:class:`Facts` holds every host's holdings (and an index by step and owner), the bucket's ranks per step,
the saves (generations and savers) of each step, the deletions this coordinator ordered and has not heard
back on, and the steps protected from GC (pinned, being backed up). Every change bumps :attr:`Facts.version`
and marks the *replica group* of the data it concerns dirty for that step (:attr:`Facts.dirty`), which
:class:`~replicator.coordinator.coverage.Coverage` consumes to re-derive only what changed.

Erasure coding (``ec:K+M``): hosts' parity holdings are kept in indexes of their own (a host's parity of step S
has the key (own rank, S) of its LOCAL data of S), with the same report, removal and deletion-in-flight rules;
and a change to any member's data or parity of a code group marks every replica group of the code group's
members dirty (whether a member can be rebuilt depends on all of them).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

from replicator.coordinator.topology import JobTopology
from replicator.erasure.group import GroupLayout
from replicator.tiers import Holding, Key, Tier, check_hash
from sidecar import saves


class Facts:
    """The reported facts, indexed, and the change log (dirty replica groups per step) the derived views read.

    Elastic saves: a step may be saved by a subset of the ranks (the active hosts of an elastic job); it is
    complete when every rank that saved it has its data on some tier. After a rollback the same step number
    may be saved again: the save with the highest generation is the step, older copies are abandoned; and a
    step is abandoned when an older step number was saved later (the job rolled back past it).
    """

    def __init__(self, topology: JobTopology, code_groups: tuple[GroupLayout, ...] = ()):
        self.topology = topology
        h = self.h = topology.hosts_per_slice
        # Replica group (in-slice index) -> its ranks, one per slice.
        self.members: list[tuple[int, ...]] = [
            tuple(s * h + i for s in range(topology.data_parallelism)) for i in range(h)
        ]
        # Erasure coding: the job's code groups (empty: copies mode) and, per rank, the replica groups a
        # change to its data or parity makes dirty (those of every member of its code group).
        self.code_groups = code_groups
        self.code_group_of: dict[int, int] = {r: gi for gi, g in enumerate(code_groups) for r in g.members}
        self._spread: dict[int, frozenset[int]] | None = (
            {r: frozenset(x % h for x in code_groups[gi].members) for r, gi in self.code_group_of.items()}
            if code_groups else None)
        # Parity holdings: holder -> step -> Holding (everything reported); step -> holder -> Holding (without
        # the ones whose deletion is in flight); holder -> steps whose parity deletion is in flight.
        self.parity: dict[int, dict[int, Holding]] = {}
        self.parity_index: dict[int, dict[int, Holding]] = {}
        self.parity_deleting: dict[int, set[int]] = {}
        # step -> code groups whose parity view must be re-derived (ParityView consumes it, as Coverage does
        # ``dirty``).
        self.ec_dirty: dict[int, set[int]] = {}
        self.holdings: dict[int, dict[Key, Holding]] = {}
        # step -> owner_rank -> holder_rank -> Holding (the same objects as in holdings), without the
        # pieces whose deletion this coordinator ordered and the holder has not reported on since.
        self.index: dict[int, dict[int, dict[int, Holding]]] = {}
        # holder -> (owner_rank, step) pieces with a deletion in flight: they count for nothing, so that no
        # answer names a step whose pieces are just being deleted.
        self.deleting: dict[int, set[Key]] = {}
        # step -> rank -> content hash (None: committed in the bucket, hash not reported).
        self.bucket: dict[int, dict[int, str | None]] = {}
        self.backups_in_progress: set[int] = set()
        self.pinned: set[int] = set()
        # step -> generation -> number of holdings of that save; (step, generation) -> savers ranges.
        self.generations: dict[int, collections.Counter[int]] = {}
        # step -> max(generations[step]), kept as they change: asked per holding on every derivation.
        self.newest_generation: dict[int, int] = {}
        # step -> is_abandoned(step), valid while the set of (step, generation) saves is unchanged (it
        # changes only when a save appears or its last piece goes; asked per holding on every heartbeat).
        self.abandoned: dict[int, bool] = {}
        self.savers: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
        self.version = 0
        self.dirty: dict[int, set[int]] = {}  # step -> replica groups whose derived views must be re-derived

    # ------------------------------------------------------------------------------------- validation

    def split(self, holder: int, holdings: Iterable[Holding]) -> tuple[dict[Key, Holding], dict[int, Holding]]:
        """``holdings`` of host ``holder``, checked (ValueError on bad input): its data by key, its parity by step."""
        out: dict[Key, Holding] = {}
        parity: dict[int, Holding] = {}
        for h in holdings:
            if not isinstance(h, Holding):
                raise ValueError(f"expected a Holding, got {type(h).__name__}")
            self.topology.check_rank(h.owner_rank)
            if h.tier is Tier.PARITY:
                if h.owner_rank != holder:
                    raise ValueError(f"host {holder} reports parity as rank {h.owner_rank}'s")
                if parity.get(h.step, h) != h:
                    raise ValueError(f"host {holder} reports its parity of step {h.step} twice with different data")
                parity[h.step] = h
                continue
            if self.code_groups and h.savers and not saves_every_rank(h.savers, self.topology.nodes):
                raise ValueError(
                    f"host {holder} reports step {h.step} saved by ranks {saves.format_ranks(_ranks(h.savers))} "
                    f"only (an elastic save): erasure coding (--redundancy ec:K+M) codes groups of the whole "
                    f"job and does not support elastic saves; use --redundancy copies:N")
            if h.tier is Tier.LOCAL and h.owner_rank != holder:
                raise ValueError(f"host {holder} reports rank {h.owner_rank}'s data as local")
            if h.tier is Tier.PEER and h.owner_rank == holder:
                raise ValueError(f"host {holder} reports its own data as a peer copy")
            # A REPLICA holding (an attestation) may come from any host: a replica of the owner (its own step is
            # identical), the owner itself (a replica's copy restored as its data), or a witness (a copy of
            # another replica's identical data, see CopyPlanner._witness_tasks).
            prev = out.get(h.key)
            if prev is not None and prev != h:
                raise ValueError(
                    f"host {holder} reports (owner_rank, step) {h.key} twice with different data"
                )
            out[h.key] = h
        return out, parity

    def validated_bucket_hashes(self, hashes: Mapping[int, str | None]) -> dict[int, str | None]:
        if not isinstance(hashes, Mapping):
            raise ValueError(f"content_hashes must be a mapping rank -> hash, got {type(hashes).__name__}")
        return {self.topology.check_rank(r): check_hash(h, optional=True) for r, h in hashes.items()}

    # ---------------------------------------------------------------------------------------- changes

    def add(self, holder: int, h: Holding) -> None:
        self.holdings.setdefault(holder, {})[h.key] = h
        self.index.setdefault(h.step, {}).setdefault(h.owner_rank, {})[holder] = h
        gens = self.generations.get(h.step)
        if gens is None:  # not setdefault: a Counter per call costs more than the rest of add
            gens = self.generations[h.step] = collections.Counter()
        newest = self.newest_generation.get(h.step)
        if h.generation not in gens:
            self.abandoned.clear()  # a new save: which steps are abandoned may change
        gens[h.generation] += 1
        if newest is None or h.generation > newest:
            self.newest_generation[h.step] = h.generation
        if h.savers or (h.step, h.generation) not in self.savers:
            self.savers[(h.step, h.generation)] = h.savers
        if newest is not None and h.generation != newest:
            self.touch_all_groups(h.step)  # another save of this step: which copies count may change
        self.touch(h.step, h.owner_rank)

    def remove(self, holder: int, key: Key) -> None:
        held = self.holdings.get(holder)
        if not held or key not in held:
            return
        gone = held.pop(key)
        if not held:
            del self.holdings[holder]
        gens = self.generations[gone.step]
        before = self.newest_generation[gone.step]
        gens[gone.generation] -= 1
        if gens[gone.generation] <= 0:
            del gens[gone.generation]
            self.abandoned.clear()
            self.savers.pop((gone.step, gone.generation), None)
            if not gens:
                del self.generations[gone.step]
                del self.newest_generation[gone.step]
            elif (newest := max(gens)) != before:
                self.newest_generation[gone.step] = newest
                self.touch_all_groups(gone.step)
        marked = self.deleting.get(holder)
        if marked is not None and key in marked:
            marked.discard(key)  # not indexed while its deletion was in flight
            if not marked:
                del self.deleting[holder]
            self.touch(gone.step, gone.owner_rank)
        else:
            self.unindex(holder, gone)

    def unindex(self, holder: int, h: Holding) -> None:
        owner, step = h.key
        by_owner = self.index[step]
        del by_owner[owner][holder]
        if not by_owner[owner]:
            del by_owner[owner]
        if not by_owner:
            del self.index[step]
        self.touch(step, owner)

    def index_add(self, holder: int, h: Holding) -> None:
        self.index.setdefault(h.step, {}).setdefault(h.owner_rank, {})[holder] = h
        self.touch(h.step, h.owner_rank)

    def drop_holdings(self, holder: int) -> None:
        for key in list(self.holdings.get(holder, {})):
            self.remove(holder, key)
        for step in list(self.parity.get(holder, {})):
            self.remove_parity(holder, step)

    # ------------------------------------------------------------------------------------------ parity

    def add_parity(self, holder: int, h: Holding) -> None:
        """Host ``holder`` holds ``h`` (its parity of ``h.step``), replacing what it held for that step."""
        self.remove_parity(holder, h.step)
        self.parity.setdefault(holder, {})[h.step] = h
        self.parity_index.setdefault(h.step, {})[holder] = h
        self.touch(h.step, holder)

    def remove_parity(self, holder: int, step: int) -> None:
        held = self.parity.get(holder)
        if not held or step not in held:
            return
        del held[step]
        if not held:
            del self.parity[holder]
        marked = self.parity_deleting.get(holder)
        if marked is not None and step in marked:
            marked.discard(step)  # not indexed while its deletion was in flight
            if not marked:
                del self.parity_deleting[holder]
        else:
            self._unindex_parity(holder, step)
        self.touch(step, holder)

    def _unindex_parity(self, holder: int, step: int) -> None:
        at = self.parity_index[step]
        del at[holder]
        if not at:
            del self.parity_index[step]

    def mark_deleting_parity(self, holder: int, steps: Iterable[int]) -> None:
        """Host ``holder`` was told to delete its parity of these steps: it counts for nothing until it reports."""
        held = self.parity.get(holder)
        if not held:
            return
        marked = self.parity_deleting.setdefault(holder, set())
        for step in steps:
            if step in held and step not in marked:
                marked.add(step)
                self._unindex_parity(holder, step)
                self.touch(step, holder)
        if not marked:
            del self.parity_deleting[holder]

    def mark_deleting(self, holder: int, keys: Iterable[Key]) -> None:
        """Host ``holder`` was told to delete these pieces: unindex them until it reports (O(len(keys)))."""
        held = self.holdings.get(holder)
        if not held:
            return
        marked = self.deleting.setdefault(holder, set())
        for key in keys:
            if key in held and key not in marked:
                marked.add(key)
                self.unindex(holder, held[key])
        if not marked:
            del self.deleting[holder]

    def deletions_acted(self, holder: int) -> None:
        """Host ``holder`` reported after its deletions: what it still holds is indexed again."""
        marked = self.deleting.pop(holder, None)
        held = self.holdings.get(holder, {})
        for key in sorted(marked or ()):
            h = held.get(key)
            if h is not None:
                self.index_add(holder, h)
        parity = self.parity.get(holder, {})
        for step in sorted(self.parity_deleting.pop(holder, ())):
            if step in parity:
                self.parity_index.setdefault(step, {})[holder] = parity[step]
                self.touch(step, holder)

    def set_backup(self, step: int, hashes: dict[int, str | None] | None) -> None:
        """The bucket holds exactly these ranks of ``step`` (None: no backup of it); keeps ``hashes`` itself."""
        if hashes is not None:
            self.bucket[step] = hashes
            self.touch_all_groups(step)
        elif self.bucket.pop(step, None) is not None:
            self.touch_all_groups(step)

    def add_backup_ranks(self, step: int, hashes: Mapping[int, str | None]) -> None:
        """The bucket holds these ranks of ``step`` too."""
        if hashes:
            self.bucket.setdefault(step, {}).update(hashes)
            for r in hashes:
                self.touch(step, r)

    def touch(self, step: int, owner: int) -> None:
        """A fact about ``owner``'s ``step`` data changed: its replica group must be re-derived."""
        self.version += 1
        if self._spread is None:
            self.dirty.setdefault(step, set()).add(owner % self.h)
        else:
            self.dirty.setdefault(step, set()).update(self._spread[owner])
            self.ec_dirty.setdefault(step, set()).add(self.code_group_of[owner])

    def touch_all_groups(self, step: int) -> None:
        self.version += 1
        self.dirty.setdefault(step, set()).update(range(self.h))
        if self.code_groups:
            self.ec_dirty.setdefault(step, set()).update(range(len(self.code_groups)))

    # ---------------------------------------------------------------------------------------- queries

    def has_step(self, step: int) -> bool:
        """Some host or the bucket holds data (or parity) of ``step``."""
        return step in self.index or step in self.bucket or step in self.parity_index

    def known_steps(self) -> list[int]:
        return sorted(set(self.index) | set(self.bucket) | set(self.parity_index))

    def step_generation(self, step: int) -> int:
        # Kept in newest_generation: asked ~20 times per heartbeat at 10k hosts (bench.scale).
        return self.newest_generation.get(step, 0)

    def current(self, h: Holding) -> bool:
        """``h`` is of the newest save of its step (not of an abandoned one)."""
        return h.generation >= self.newest_generation.get(h.step, 0)

    def expected_ranks(self, step: int) -> list[int]:
        """The ranks whose data make up ``step``: its newest save's savers (a bucket-only step: the
        ranks its backup holds; nothing known: every rank)."""
        gens = self.generations.get(step)
        if gens:
            ranges = self.savers.get((step, max(gens)), ())
            if ranges:
                return [r for a, b in ranges for r in range(a, min(b, self.topology.nodes - 1) + 1)]
            return list(range(self.topology.nodes))
        bucket = self.bucket.get(step)
        if bucket:
            return sorted(bucket)
        return list(range(self.topology.nodes))

    def expected_key(self, step: int) -> Any:
        """What :meth:`expected_ranks` of ``step`` depends on, cheaply (a bucket-only step: its ranks)."""
        gens = self.generations.get(step)
        if gens:
            gen = max(gens)
            return ("saved", gen, self.savers.get((step, gen), ()))
        bucket = self.bucket.get(step)
        return ("bucket", frozenset(bucket) if bucket else None)

    def is_abandoned(self, step: int) -> bool:
        """An older step number carries a newer save: the job rolled back past ``step``."""
        hit = self.abandoned.get(step)
        if hit is None:
            newest = ((s, max(gens)) for s, gens in self.generations.items() if s < step)
            hit = self.abandoned[step] = saves.rolled_back(step, self.step_generation(step), newest)
        return hit

    def holds_local(self, step: int, rank: int, content_hash: str) -> bool:
        """Host ``rank`` holds its own ``step`` data with ``content_hash``."""
        mine = self.index.get(step, {}).get(rank, {}).get(rank)
        return mine is not None and mine.tier is Tier.LOCAL and mine.content_hash == content_hash


def _ranks(ranges: Iterable[tuple[int, int]]) -> list[int]:
    return [r for a, b in ranges for r in range(a, b + 1)]


def saves_every_rank(ranges: Iterable[tuple[int, int]], nodes: int) -> bool:
    """``ranges`` (a save's savers) name every rank of a job of ``nodes`` hosts."""
    return set(_ranks(ranges)) >= set(range(nodes))


def carries_bytes(h: Holding) -> bool:
    """A holding of data (an attestation, :attr:`Tier.REPLICA`, carries none)."""
    return h.tier is not Tier.REPLICA
