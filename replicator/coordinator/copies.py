"""Copy tasks: what each host must copy (or, for an identical replica, attest) so every rank's data has enough
copies. Part of :class:`CoordinatorState`.

:class:`CopyPlanner` keeps per (step, replica group) the tasks derived from the accepted hashes
(:class:`~replicator.coordinator.coverage.Coverage`), the holdings and the lost hosts; it re-derives the groups
coverage re-derived, and every group once after the set of lost hosts changed. Only the queries for tasks
refresh it, so a restore right after a slice is lost does not wait for every group's copy plan.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator, Mapping

from replicator.coordinator.coverage import Auth, Coverage
from replicator.coordinator.facts import Facts, carries_bytes
from replicator.coordinator.hosts import HostRegistry
from replicator.coordinator.model import CopyTask
from replicator.tiers import Tier


def _task_order(t: CopyTask) -> tuple[int, bool, int]:
    return (t.owner_rank, not t.hash_only, t.dest_rank)


class CopyPlanner:
    """Per step and replica group the copy tasks, and per destination host its tasks."""

    def __init__(self, facts: Facts, coverage: Coverage, hosts: HostRegistry, copies: int | None = None):
        self._facts = facts
        # Whole copies wanted per rank besides its own (copies:N); 0 in ec mode, where parity protects the data
        # and only the hash-only attestations of identical data-parallel replicas are planned.
        self._copies = facts.topology.replicas if copies is None else copies
        self._coverage = coverage
        self._hosts = hosts
        self._dirty: dict[int, set[int]] = {}  # step -> groups whose copy tasks must be re-derived
        self.stale_all = False  # the lost hosts changed: every group's destinations may change
        self._tasks: dict[int, dict[int, tuple[CopyTask, ...]]] = {}  # step -> group -> tasks
        self._by_dest: dict[int, dict[int, dict[int, tuple[CopyTask, ...]]]] = {}  # step -> dest -> group -> tasks

    def clear(self) -> None:
        """Forget every task (see :meth:`Coverage.clear`)."""
        self._dirty = {}
        self.stale_all = False
        self._tasks.clear()
        self._by_dest.clear()

    def replication_plan(self, step: int) -> list[CopyTask]:
        self.refresh()
        tasks = [t for group in self._tasks.get(step, {}).values() for t in group]
        tasks.sort(key=_task_order)
        return tasks

    def tasks_for(self, dest: int, step: int) -> list[CopyTask]:
        self.refresh()
        groups = self._by_dest.get(step, {}).get(dest, {})
        out = [t for g in groups.values() for t in g]
        out.sort(key=_task_order)
        return out

    def refresh(self) -> None:
        """Bring coverage up to date, then re-derive the tasks of every group whose coverage changed."""
        cov = self._coverage
        cov.refresh()
        if cov.vanished:
            for step in cov.vanished:
                for view in (self._tasks, self._by_dest, self._dirty):
                    view.pop(step, None)
            cov.vanished.clear()
        if cov.changed:
            for step, groups in cov.changed.items():
                self._dirty.setdefault(step, set()).update(groups)
            cov.changed.clear()
        if self.stale_all:
            self.stale_all = False
            every = set(range(self._facts.h))
            for step in self._facts.known_steps():
                self._dirty[step] = set(every)
        if self._dirty:
            dirty, self._dirty = self._dirty, {}
            for step, groups in dirty.items():
                for g in groups:
                    self._derive(step, g)

    def _derive(self, step: int, group: int) -> None:
        """Recompute the copy tasks of one replica group of one step (its coverage is current)."""
        auth = self._coverage.auth.get(step, {})
        by_dest = self._by_dest.setdefault(step, {})
        for t in self._tasks.get(step, {}).get(group, ()):
            slot = by_dest.get(t.dest_rank)
            if slot is not None:
                slot.pop(group, None)
                if not slot:
                    del by_dest[t.dest_rank]
        tasks = self._group_tasks(step, group, auth)
        per_dest: dict[int, list[CopyTask]] = {}
        for t in tasks:
            per_dest.setdefault(t.dest_rank, []).append(t)
        for dest, ts in per_dest.items():
            by_dest.setdefault(dest, {})[group] = tuple(ts)
        if tasks:
            self._tasks.setdefault(step, {})[group] = tuple(tasks)
        else:
            self._tasks.get(step, {}).pop(group, None)

    def _group_tasks(self, step: int, group: int, auth: Mapping[int, Auth]) -> list[CopyTask]:
        facts, topology, lost = self._facts, self._facts.topology, self._hosts.lost
        by_owner = facts.index.get(step, {})
        want_total = min(1 + self._copies, topology.nodes)
        # Bytes and copies assigned per source so far; made when the first byte copy is planned (most groups plan
        # none, and two Counters cost more than the rest of such a group's derivation).
        assigned: tuple[collections.Counter[int], collections.Counter[int]] | None = None
        tasks = []
        members = facts.members[group]
        for owner in members:
            a = auth.get(owner)
            if a is None or a.content_hash is None:
                continue
            pieces = by_owner.get(owner, {})
            holders = sorted(
                x for x, h in pieces.items() if carries_bytes(h) and h.content_hash == a.content_hash
            )
            attested, identical = [], []
            for rep in members:
                if rep == owner or not facts.holds_local(step, rep, a.content_hash):
                    continue
                claim = pieces.get(rep)
                if claim is not None and claim.tier is Tier.REPLICA and claim.content_hash == a.content_hash:
                    attested.append(rep)
                else:
                    identical.append(rep)
            for rep in identical:
                rep_size = by_owner[rep][rep].size
                tasks.append(CopyTask(owner, step, rep, rep, a.content_hash, rep_size, hash_only=True))
            have = set(holders) | set(attested) | set(identical)
            mine = pieces.get(owner)
            if mine is not None and mine.tier is Tier.REPLICA and mine.content_hash == a.content_hash:
                have.add(owner)  # the owner's host holds it as a replica's bytes (restored from them)
            needed = want_total - len(have)
            if needed <= 0 or not holders:
                continue  # enough copies, or no bytes of this rank's data to copy from
            size = pieces[holders[0]].size
            dests = list(
                itertools.islice(
                    (x for x in self._live_preference(owner) if x not in lost and x not in have),
                    needed,
                )
            )
            if assigned is None:
                assigned = (collections.Counter(), collections.Counter())
            load, count = assigned
            for dest in dests:
                src = min(
                    holders,
                    key=lambda x, d=dest: (load[x], count[x], topology.ring_distance(x, d), x),
                )
                load[src] += size
                count[src] += 1
                tasks.append(CopyTask(owner, step, src, dest, a.content_hash, size))
        tasks.extend(self._witness_tasks(step, members, auth, tasks))
        return tasks

    def _witness_tasks(self, step: int, members: tuple[int, ...], auth: Mapping[int, Auth],
                       tasks: list[CopyTask]) -> list[CopyTask]:
        """Hash-only tasks for the hosts that hold (or are told to copy) one replica's data identical to another
        replica's and no record of the other's: each records that it holds the other's bytes too (a witness).

        Without them the identity of a rank's data rests on its own host and the replicas' hosts that
        attested it; once those are replaced, copies of an identical replica's data elsewhere prove nothing
        and the step stops being complete (issue #33, simulation seeds 12979, 18572, 32504). A witness
        told along with the copy that brings the bytes records it at once: the coordinator that knows the
        identity may be gone by the time the copy lands."""
        facts, lost = self._facts, self._hosts.lost
        by_owner = facts.index.get(step, {})
        copies: dict[str, dict[int, int]] = {}  # content hash -> host holding or getting a replica's copy -> size
        for m in members:
            for x, h in by_owner.get(m, {}).items():
                if x != m and h.tier is Tier.PEER and x not in lost and facts.current(h):
                    copies.setdefault(h.content_hash, {}).setdefault(x, h.size)
        for t in tasks:
            if not t.hash_only:
                copies.setdefault(t.content_hash, {}).setdefault(t.dest_rank, t.size)
        out = []
        for owner in members:
            a = auth.get(owner)
            if a is None or a.content_hash not in copies:
                continue
            pieces = by_owner.get(owner, {})
            for x, size in sorted(copies[a.content_hash].items()):
                if x not in pieces and not any(t.owner_rank == owner and t.dest_rank == x for t in tasks):
                    out.append(CopyTask(owner, step, x, x, a.content_hash, size, hash_only=True))
        return out

    def restore_witnesses(self, rank: int, step: int, content_hashes: set[str]) -> list[CopyTask]:
        """Hash-only tasks that go with a restore of ``rank``'s data of ``step`` (bytes of ``content_hashes``):
        one for each data-parallel replica of ``rank`` whose data is identical and of which that host has no
        record. Like a witness told along with a copy, the host records it at once and reports it once the
        restore lands: the coordinator that knows the identity may be gone by then, and with it the last
        record of it (simulation seed 95210, issue #33: the replica's host and the coordinator replaced
        15 ms after the restore landed)."""
        self.refresh()
        auth = self._coverage.auth.get(step, {})
        by_owner = self._facts.index.get(step, {})
        out = []
        for rep in self._facts.topology.replicas_of(rank):
            a = auth.get(rep)
            if a is None or a.content_hash not in content_hashes or rank in by_owner.get(rep, {}):
                continue
            out.append(CopyTask(rep, step, rank, rank, a.content_hash, 0, hash_only=True))
        return out

    def _live_preference(self, owner: int) -> Iterator[int]:
        """:meth:`JobTopology.iter_copy_preference` without the slices whose every host is lost.

        Same order; skipping dead slices keeps re-planning after a slice loss O(hosts), not O(hosts^2).
        """
        d, h = self._facts.topology.data_parallelism, self._facts.h
        s, i = divmod(owner, h)
        lost_in: collections.Counter[int] = self._hosts.lost_per_slice
        others = [(s + ds) % d for ds in range(1, d) if lost_in[(s + ds) % d] < h]
        if others:
            for di in range(h):
                for sl in others:
                    yield sl * h + (i + di) % h
        if lost_in[s] < h:
            for di in range(1, h):
                yield s * h + (i + di) % h


def verified_replicas(facts: Facts, step: int) -> list[tuple[int, int, str]]:
    """``(owner_rank, replica_rank, content_hash)`` where both hosts hold identical local data of ``step`` now."""
    by_owner = facts.index.get(step, {})
    topology = facts.topology
    out = []
    for owner in range(topology.nodes):
        mine = by_owner.get(owner, {}).get(owner)
        if mine is None or mine.tier is not Tier.LOCAL:
            continue
        for rep in topology.replicas_of(owner):
            theirs = by_owner.get(rep, {}).get(rep)
            if (
                theirs is not None
                and theirs.tier is Tier.LOCAL
                and theirs.content_hash == mine.content_hash
            ):
                out.append((owner, rep, mine.content_hash))
    return out
