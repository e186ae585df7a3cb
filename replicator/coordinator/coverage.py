"""Which content hash of each rank's data is accepted, who holds valid copies of it, which steps are complete.
Part of :class:`CoordinatorState`.

:class:`Coverage` is derived from :class:`~replicator.coordinator.facts.Facts` only, per (step, replica group):
a change marks the group dirty (``Facts.dirty``) and the next query re-derives just the dirty groups. It
records what it re-derived (:attr:`Coverage.changed`, :attr:`Coverage.vanished`) for the copy-task view.

A step is *durable* when it is complete and stays complete whichever one host is lost: every rank's data *and*
the record that it is that rank's (its accepted hash) survive without any one host's facts. Two holders of a
rank's bytes are not enough when only one host's report says they are its data (seed 19 of tests/simulation:
rank 2's data equal to rank 0's, known from host 2's report alone, counted twice held; GC deleted the durable
step before, and host 2's replacement left no complete step). Copies mode: durable is *redundant*.

Erasure coding (``ec:K+M``, :mod:`~replicator.coordinator.parity`): a rank whose data no host holds is covered
too when it can be rebuilt from its code group (a :attr:`Tier.PARITY` source, after LOCAL and PEER, before the
bucket), with or without one host; a step is *redundant* when it is complete and every code group of it has all
its parity (it survives M hosts of each group).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from replicator.coordinator.facts import Facts, carries_bytes
from replicator.coordinator.model import Source
from replicator.coordinator.parity import ParityView
from replicator.tiers import BUCKET_HOLDER, Holding, Tier

_TIER_ORDER = {Tier.LOCAL: 0, Tier.PEER: 1, Tier.PARITY: 2, Tier.BUCKET: 3}
_COPY = frozenset({Tier.LOCAL, Tier.PEER})  # the sources that are copies held by a host


class Auth(NamedTuple):
    """The accepted content hash of one rank's step and whether it is definitive (owner or bucket said so).
    A named tuple: one is made per owner and host on every derivation (a frozen dataclass costs ~4x more)."""

    content_hash: str | None
    definitive: bool


class Coverage:
    """Per step: each rank's accepted hash (:attr:`auth`), its sources (:attr:`cov`), and completeness.

    Completeness is kept incrementally: per step, what its expected ranks are keyed by, that set, and how
    many of them no tier covers; re-deriving a group adjusts the count by its own members only. So is
    durability: how many expected ranks are uncovered or would be without some one host (:attr:`_risky`).
    """

    def __init__(self, facts: Facts, parity: ParityView | None = None):
        self._facts = facts
        self._parity = parity if parity is not None and parity.enabled else None
        self.auth: dict[int, dict[int, Auth]] = {}
        self.cov: dict[int, dict[int, tuple[Source, ...]]] = {}
        self.complete: set[int] = set()
        self._expected: dict[int, tuple[Any, frozenset[int]]] = {}
        self._uncovered: dict[int, int] = {}
        self._fragile: dict[int, int] = {}  # step -> expected ranks uncovered, or covered but not durably
        # step -> covered ranks (expected or not) that the loss of some one host would leave uncovered.
        self._risky: dict[int, set[int]] = {}
        # Since the copy-task view last looked: step -> groups re-derived; steps no tier holds any more.
        self.changed: dict[int, set[int]] = {}
        self.vanished: set[int] = set()
        # (Facts.version, newest_complete_step()) as last answered: asked several times per heartbeat, and
        # the complete steps and the abandoned ones change only with the facts.
        self._newest: tuple[int, int | None] | None = None

    def clear(self) -> None:
        """Forget every derived view (the next refresh after touching every group recomputes them)."""
        for view in (self.auth, self.cov, self._expected, self._uncovered, self._fragile, self._risky, self.changed):
            view.clear()
        self.complete.clear()
        self.vanished.clear()
        self._newest = None

    def refresh(self) -> None:
        """Re-derive the groups that changed since the last refresh."""
        facts = self._facts
        if facts.dirty:
            dirty, facts.dirty = facts.dirty, {}
            for step, groups in dirty.items():
                self._refresh_step(step, groups)

    # ---------------------------------------------------------------------------------------- queries

    def sources(self, step: int) -> dict[int, list[Source]]:
        self.refresh()
        return {r: list(s) for r, s in sorted(self.cov.get(step, {}).items())}

    def rank_sources(self, step: int, rank: int) -> list[Source]:
        self.refresh()
        return list(self.cov.get(step, {}).get(rank, ()))

    def covered_count(self, step: int) -> int:
        self.refresh()
        return len(self.cov.get(step, {}))

    def missing_ranks(self, step: int) -> list[int]:
        self.refresh()
        found = self.cov.get(step, {})
        return [r for r in self._facts.expected_ranks(step) if r not in found]

    def is_complete(self, step: int) -> bool:
        self.refresh()
        return step in self.complete and not self._facts.is_abandoned(step)

    def complete_steps(self) -> list[int]:
        self.refresh()
        return sorted(s for s in self.complete if not self._facts.is_abandoned(s))

    def newest_complete_step(self) -> int | None:
        self.refresh()
        version = self._facts.version
        if self._newest is not None and self._newest[0] == version:
            return self._newest[1]
        newest = next((s for s in sorted(self.complete, reverse=True) if not self._facts.is_abandoned(s)), None)
        self._newest = (version, newest)
        return newest

    def newest_durable_step(self) -> int | None:
        """The newest complete step that stays complete whichever one host is lost (O(steps), kept incrementally)."""
        self.refresh()
        for step in sorted(self.complete, reverse=True):
            if self._fragile.get(step, 1) == 0 and not self._facts.is_abandoned(step):
                return step
        return None

    def newest_redundant_step(self) -> int | None:
        """The newest redundant step (:meth:`is_redundant`; O(steps), kept incrementally)."""
        if self._parity is None:
            return self.newest_durable_step()
        self.refresh()
        for step in sorted(self.complete, reverse=True):
            if self._parity.redundant(step) and not self._facts.is_abandoned(step):
                return step
        return None

    def coding_step(self) -> int | None:
        """ec mode: the step whose parity the code groups compute now, kept by GC until they have it
        (:meth:`~replicator.coordinator.parity.ParityView.coding_step`); None in copies mode. O(steps)."""
        if self._parity is None:
            return None
        return self._parity.coding_step(self.newest_redundant_step())

    def is_durable(self, step: int) -> bool:
        """``step`` is complete and stays complete whichever one host is lost. O(1)."""
        self.refresh()
        return step in self.complete and self._fragile.get(step, 1) == 0

    def is_redundant(self, step: int) -> bool:
        """Copies mode: :meth:`is_durable`; ec mode: complete and every code group has all its parity. O(1)."""
        if self._parity is None:
            return self.is_durable(step)
        self.refresh()
        return step in self.complete and self._parity.redundant(step)

    # ------------------------------------------------------------------------------------- derivation

    def _refresh_step(self, step: int, groups: set[int]) -> None:
        facts = self._facts
        if not facts.has_step(step):
            for view in (self.auth, self.cov, self._expected, self._uncovered, self._fragile, self._risky,
                         self.changed):
                view.pop(step, None)
            self.complete.discard(step)
            self.vanished.add(step)
            return
        self.changed.setdefault(step, set()).update(groups)
        key = facts.expected_key(step)
        cached = self._expected.get(step)
        cov = self.cov.setdefault(step, {})
        if cached is None or cached[0] != key or step not in self._uncovered:
            for g in groups:
                self._derive(step, g)
            expected = frozenset(facts.expected_ranks(step))
            self._expected[step] = (key, expected)
            uncovered = sum(1 for r in expected if r not in cov)
            risky = self._risky.get(step, set())
            fragile = sum(1 for r in expected if r not in cov or r in risky)
        else:
            expected = cached[1]
            uncovered, fragile = self._uncovered[step], self._fragile[step]
            risky = self._risky.setdefault(step, set())
            for g in groups:
                members = [r for r in facts.members[g] if r in expected]
                before = sum(1 for r in members if r in cov)
                fragile_before = sum(1 for r in members if r not in cov or r in risky)
                self._derive(step, g)
                uncovered -= sum(1 for r in members if r in cov) - before
                fragile += sum(1 for r in members if r not in cov or r in risky) - fragile_before
        self._uncovered[step] = uncovered
        self._fragile[step] = fragile
        if uncovered == 0:
            self.complete.add(step)
        else:
            self.complete.discard(step)

    def _derive(self, step: int, group: int) -> None:
        """Recompute the accepted hashes and sources of one replica group of one step from the facts."""
        facts = self._facts
        members = facts.members[group]
        by_owner = facts.index.get(step, {})
        bucket = facts.bucket.get(step, {})
        auth = self.auth.setdefault(step, {})
        for o in members:
            current = {x: h for x, h in by_owner.get(o, {}).items() if facts.current(h)}
            a = _auth_one(current, bucket, o)
            if a is None:
                auth.pop(o, None)
            else:
                auth[o] = a
        cov = self.cov.setdefault(step, {})
        for r in members:
            found = self._rank_sources(step, r, auth)
            if found:
                cov[r] = tuple(found)
            else:
                cov.pop(r, None)
        risky = self._risky.setdefault(step, set())
        risky.difference_update(members)
        risky.update(self._risky_members(step, group))

    def _risky_members(self, step: int, group: int) -> set[int]:
        """The covered members of replica ``group`` that the loss of some one host would leave uncovered: their
        data, or every record that it is theirs (their accepted hash), would go with it; or another hash would be
        accepted (a stale copy of an earlier save left). Only the hosts holding data or attestations of the
        group and (ec mode) the members of their code groups matter (a handful)."""
        facts = self._facts
        members = facts.members[group]
        cov = self.cov.get(step, {})
        alive = [r for r in members if r in cov]
        now = self.auth.get(step, {})
        by_owner = facts.index.get(step, {})
        hosts = {x for o in members for x in by_owner.get(o, {})}
        if self._parity is not None:
            for r in alive:
                gi = facts.code_group_of.get(r)
                if gi is not None:
                    hosts.update(facts.code_groups[gi].members)
        bucket = facts.bucket.get(step, {})
        out: set[int] = set()
        for x in sorted(hosts):
            if len(out) == len(alive):
                break
            # Without x, only the accepted hashes of the owners x holds a piece of can differ from ``now``.
            auth = {o: now[o] for o in members if o in now}
            changed = set()  # the owners whose accepted content hash differs without x (or none is accepted)
            for o in members:
                held = by_owner.get(o, {})
                if x not in held:
                    continue
                current = {y: h for y, h in held.items() if y != x and facts.current(h)}
                a = _auth_one(current, bucket, o)
                before = auth.get(o)
                if a is None:
                    auth.pop(o, None)
                else:
                    auth[o] = a
                if (a is None) != (before is None) or (a is not None and a.content_hash != before.content_hash):
                    changed.add(o)
            for r in alive:
                if r not in out and not self._kept_without(step, r, auth, x, changed):
                    out.add(r)
        return out

    def _kept_without(self, step: int, rank: int, auth: Mapping[int, Auth], x: int, changed: set[int]) -> bool:
        """``rank`` (covered now) keeps a source of its accepted data without host ``x``; ``auth``: the accepted
        hashes without x, ``changed``: the owners whose accepted content hash differs from now's."""
        now = self.auth[step].get(rank)
        if rank not in changed:
            # By the rules of _sources, a copy of rank's data now is one without x too if it is not x's and
            # its owner's accepted hash does not change; with no hash changed there are no others.
            want = now.content_hash if now is not None else None
            size = None  # the first such copy's size
            for s in self.cov[step][rank]:
                if s.kind in _COPY and s.holder_rank != x and s.owner_rank not in changed:
                    if want is None or s.content_hash in (None, want):  # as _keeps
                        return True
                    if size is None:
                        size = s.size
            if not changed:
                return _keeps(now, self._other_sources(step, rank, auth, x, size))
        return _keeps(now, self._sources(step, rank, auth, without=x))

    def _rank_sources(self, step: int, rank: int, auth: Mapping[int, Auth]) -> list[Source]:
        """Valid sources of ``rank``'s data (:meth:`_sources`), local < peer < parity < bucket."""
        found = list(self._sources(step, rank, auth))
        if len(found) > 1:
            order = _TIER_ORDER
            found.sort(key=lambda s: (order[s.kind], s.owner_rank != rank, s.holder_rank or 0, s.owner_rank))
        return found

    def _sources(self, step: int, rank: int, auth: Mapping[int, Auth], without: int | None = None) -> Iterator[Source]:
        """Valid sources of ``rank``'s data, unordered and lazily (a durability check stops at the first that
        keeps it): its own or an identical replica's copies, then :meth:`_other_sources`.
        ``without``: as if that host held nothing (``auth`` must be derived without it too)."""
        facts = self._facts
        by_owner = facts.index.get(step, {})
        mine = auth.get(rank)
        want = mine.content_hash if mine is not None else None
        size = None  # the first copy's size
        group = facts.members[rank % facts.h]
        for owner in (rank, *(m for m in group if m != rank)):
            a = auth.get(owner)
            if a is None:
                continue  # no accepted hash: none of its copies counts
            for holder, h in by_owner.get(owner, {}).items():
                if holder == without or not facts.current(h):
                    continue  # a copy of an abandoned save of this step number (before a rollback)
                if not carries_bytes(h) or h.content_hash != a.content_hash:
                    continue  # an attestation, or a stale copy of an older save of this step
                if owner != rank and h.content_hash != want:
                    continue  # a replica's data counts only when proven identical
                kind = Tier.LOCAL if holder == rank else Tier.PEER
                if size is None:
                    size = h.size
                yield Source(kind, holder, owner, h.content_hash, h.size)
        yield from self._other_sources(step, rank, auth, without, size)

    def _other_sources(self, step: int, rank: int, auth: Mapping[int, Auth], without: int | None,
                       size: int | None) -> Iterator[Source]:
        """The sources of ``rank``'s data besides copies: a rebuild from its code group when no copy counts
        (``size`` None; else the first copy's size, the bucket source's), then the bucket's."""
        mine = auth.get(rank)
        want = mine.content_hash if mine is not None else None
        if size is None and self._parity is not None:
            rb = self._parity.rebuild(step, rank, want if mine is not None and mine.definitive else None, without)
            if rb is not None:
                size = 0
                yield Source(Tier.PARITY, BUCKET_HOLDER, rank, rb.spec.hash_of(rank), 0, rb.spec, rb.helpers)
        bucket = self._facts.bucket.get(step, {})
        if rank in bucket:
            b = bucket[rank]
            if b is None or want is None or b == want:
                yield Source(Tier.BUCKET, BUCKET_HOLDER, rank, b if b is not None else want, size or 0)


def _keeps(now: Auth | None, sources: Iterable[Source]) -> bool:
    """``sources`` (a rank's without some host) still give the data accepted now: a source of the accepted hash
    (a parity source's group names it), or of an unreported one (the bucket's copy as committed)."""
    want = now.content_hash if now is not None else None
    return any(want is None or s.content_hash in (None, want) for s in sources)


def _auth_one(holders: Mapping[int, Holding], bucket: Mapping[int, str | None], owner: int) -> Auth | None:
    """The accepted hash of ``owner``'s data of one step.

    Definitive: the owner's local copy, else the bucket's. Otherwise the hash most copies (and
    replica attestations) agree on, ties by smallest hash.
    """
    mine = holders.get(owner)
    if mine is not None and mine.tier is Tier.LOCAL:
        return Auth(mine.content_hash, True)
    if bucket.get(owner) is not None:
        return Auth(bucket[owner], True)
    if holders:
        votes: dict[str, int] = {}  # not a Counter: this runs per owner and host on every derivation
        for h in holders.values():
            votes[h.content_hash] = votes.get(h.content_hash, 0) + 1
        best = min(votes.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        return Auth(best, False)
    if owner in bucket:
        return Auth(None, False)
    return None
