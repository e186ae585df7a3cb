"""The coordinator's decisions (replication, global completeness, restore, GC) as pure functions of hosts' reports.

No I/O, no threads, no clocks: a :class:`CoordinatorState` is fed events (registrations, inventories,
committed steps, backups) and answers queries. Every answer depends only on the *current* reported
facts, never on the order they arrived in, so a restarted coordinator that receives every host's
report again gives the same answers. Rules are summarised in ``docs/coordinator.md``.

Vocabulary: a piece of data is one rank's (``owner_rank``) data for one ``step``, identified by the
``content_hash`` of its manifest (:attr:`sidecar.layout.StepManifest.content_hash`). Data-parallel
replicas of a rank usually hold data with the same hash; such a replica counts as a verified copy.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from replicator.coordinator.topology import JobTopology

Key = tuple[int, int]  # (owner_rank, step)
_BUCKET_HOLDER = "bucket"


class Tier(enum.StrEnum):
    """Where a piece of data lives, fastest first."""

    LOCAL = "local"  # the host's own rank's data, on its RAM disk
    PEER = "peer"  # a copy of another rank's data on this host's RAM disk
    # An attestation, not bytes: this host's own LOCAL data of the step was verified (by hash) to be
    # identical to ``owner_rank``'s, a data-parallel replica of it. Reporting it keeps that knowledge
    # alive after the owner's host is lost and across a coordinator restart.
    REPLICA = "replica"
    BUCKET = "bucket"  # a committed backup


class NotRegisteredError(LookupError):
    """A host reported before registering (e.g. the coordinator restarted): register and re-report."""


class StaleIncarnationError(ValueError):
    """A report or registration from an older incarnation of a host than the one registered."""


def _check_int(name: str, value: object, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_hash(value: object, *, optional: bool = False) -> str | None:
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

    def __post_init__(self) -> None:
        _check_int("owner_rank", self.owner_rank)
        _check_int("step", self.step)
        _check_hash(self.content_hash)
        _check_int("size", self.size)
        try:
            tier = Tier(self.tier)
        except ValueError:
            raise ValueError(f"unknown tier {self.tier!r}") from None
        if tier is Tier.BUCKET:
            raise ValueError("a host cannot hold the bucket tier; use report_backup / report_backup_ranks")
        object.__setattr__(self, "tier", tier)

    @property
    def key(self) -> Key:
        return (self.owner_rank, self.step)

    def to_dict(self) -> dict[str, Any]:
        return {
            "owner_rank": self.owner_rank,
            "step": self.step,
            "content_hash": self.content_hash,
            "size": self.size,
            "tier": str(self.tier),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Holding:
        try:
            return cls(
                d["owner_rank"], d["step"], d["content_hash"], d.get("size", 0), d.get("tier", "local")
            )
        except KeyError as e:
            raise ValueError(f"holding lacks field {e}") from None


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
    ``holder_rank``; BUCKET: download (``holder_rank`` is None). ``owner_rank`` is whose data it is:
    the rank itself or a byte-identical data-parallel replica (then the data is that rank's directory).
    ``content_hash`` is None only for a bucket copy whose hash nobody reported.
    """

    kind: Tier
    holder_rank: int | None
    owner_rank: int
    content_hash: str | None
    size: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "holder_rank": self.holder_rank,
            "owner_rank": self.owner_rank,
            "content_hash": self.content_hash,
            "size": self.size,
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


@dataclasses.dataclass(frozen=True)
class _Auth:
    """The accepted content hash of one rank's step and whether it is definitive (owner or bucket said so)."""

    content_hash: str | None
    definitive: bool


class CoordinatorState:
    """The coordinator's global view, built only from hosts' reports; every query is deterministic."""

    def __init__(self, topology: JobTopology):
        if not isinstance(topology, JobTopology):
            raise ValueError(f"topology must be a JobTopology, got {type(topology).__name__}")
        self.topology = topology
        self._incarnation: dict[int, int] = {}
        self._reported: set[int] = set()
        self._holdings: dict[int, dict[Key, Holding]] = {}
        # step -> owner_rank -> holder_rank -> Holding (the same objects as in _holdings).
        self._index: dict[int, dict[int, dict[int, Holding]]] = {}
        # step -> rank -> content hash (None: committed in the bucket, hash not reported).
        self._bucket: dict[int, dict[int, str | None]] = {}
        self._backups_in_progress: set[int] = set()
        self._pinned: set[int] = set()

    # ----------------------------------------------------------------------------------------- events

    def register(self, rank: int, incarnation: int) -> bool:
        """Register a host's process. Returns True when it is a new incarnation (it must report inventory).

        A newer incarnation drops what the host held before (its RAM disk may not have survived);
        an older one raises :class:`StaleIncarnationError`; the same one is a no-op.
        """
        self.topology.check_rank(rank)
        _check_int("incarnation", incarnation)
        known = self._incarnation.get(rank)
        if known is not None and incarnation < known:
            raise StaleIncarnationError(f"rank {rank}: incarnation {incarnation} < registered {known}")
        if known == incarnation:
            return False
        self._drop_holdings(rank)
        self._reported.discard(rank)
        self._incarnation[rank] = incarnation
        return True

    def forget_host(self, rank: int) -> None:
        """The host is lost or its RAM disk was wiped: drop its registration and everything it held."""
        self.topology.check_rank(rank)
        self._drop_holdings(rank)
        self._reported.discard(rank)
        self._incarnation.pop(rank, None)

    def report_inventory(
        self, rank: int, holdings: Iterable[Holding], incarnation: int | None = None
    ) -> None:
        """Replace everything host ``rank`` holds with ``holdings`` (validated first; bad input changes nothing)."""
        self._check_reporter(rank, incarnation)
        new = self._validated(rank, holdings)
        self._drop_holdings(rank)
        for h in new.values():
            self._add(rank, h)
        self._reported.add(rank)

    def report_committed(self, rank: int, holding: Holding, incarnation: int | None = None) -> None:
        """Host ``rank`` committed one piece of data (its own step or a peer copy); replaces the same key."""
        self._check_reporter(rank, incarnation)
        (h,) = self._validated(rank, [holding]).values()
        self._remove(rank, h.key)
        self._add(rank, h)

    def report_removed(self, rank: int, keys: Iterable[Key], incarnation: int | None = None) -> None:
        """Host ``rank`` deleted these ``(owner_rank, step)`` pieces (e.g. after GC); unknown keys are ignored."""
        self._check_reporter(rank, incarnation)
        checked = []
        for key in keys:
            if not isinstance(key, tuple | list) or len(key) != 2:
                raise ValueError(f"key must be (owner_rank, step), got {key!r}")
            self.topology.check_rank(key[0])
            checked.append((key[0], _check_int("step", key[1])))
        for key in checked:
            self._remove(rank, key)

    def report_backup(
        self, step: int, committed: bool = True, content_hashes: Mapping[int, str] | None = None
    ) -> None:
        """A backup of ``step`` holding every rank was committed (``committed=False``: it is gone or failed).

        Either way the step is no longer being backed up.
        """
        _check_int("step", step)
        if committed:
            hashes = self._validated_bucket_hashes(content_hashes or {})
            self._bucket[step] = {r: hashes.get(r) for r in range(self.topology.nodes)}
        else:
            self._bucket.pop(step, None)
        self._backups_in_progress.discard(step)

    def report_backup_ranks(self, step: int, content_hashes: Mapping[int, str | None]) -> None:
        """The bucket holds committed data of these ranks for ``step`` (hash None: not known)."""
        _check_int("step", step)
        hashes = self._validated_bucket_hashes(content_hashes)
        if hashes:
            self._bucket.setdefault(step, {}).update(hashes)

    def mark_backup_in_progress(self, step: int) -> None:
        """``step`` is being uploaded: GC must not touch it until :meth:`report_backup` or the clear call."""
        self._backups_in_progress.add(_check_int("step", step))

    def clear_backup_in_progress(self, step: int) -> None:
        self._backups_in_progress.discard(_check_int("step", step))

    def pin(self, step: int) -> None:
        """An active restore uses ``step``: GC keeps every copy of it until :meth:`unpin`."""
        self._pinned.add(_check_int("step", step))

    def unpin(self, step: int) -> None:
        self._pinned.discard(_check_int("step", step))

    # ---------------------------------------------------------------------------------------- queries

    @property
    def registered(self) -> dict[int, int]:
        """rank -> incarnation of every registered host."""
        return dict(sorted(self._incarnation.items()))

    def holdings_of(self, rank: int) -> list[Holding]:
        self.topology.check_rank(rank)
        return sorted(self._holdings.get(rank, {}).values(), key=lambda h: (h.step, h.owner_rank))

    def backup_ranks(self, step: int) -> dict[int, str | None]:
        """rank -> hash of every rank the bucket holds for ``step``."""
        return dict(sorted(self._bucket.get(step, {}).items()))

    def known_steps(self) -> list[int]:
        return sorted(set(self._index) | set(self._bucket))

    def sources(self, step: int) -> dict[int, list[Source]]:
        """Every usable source of every rank's data for ``step``, fastest tier first (ranks without any omitted)."""
        _check_int("step", step)
        auth = self._auth_hashes(step)
        out = {}
        for rank in range(self.topology.nodes):
            found = self._rank_sources(step, rank, auth)
            if found:
                out[rank] = found
        return out

    def missing_ranks(self, step: int) -> list[int]:
        """Ranks whose ``step`` data is on no tier."""
        found = self.sources(step)
        return [r for r in range(self.topology.nodes) if r not in found]

    def is_complete(self, step: int) -> bool:
        return not self.missing_ranks(step)

    def globally_complete_steps(self) -> list[int]:
        """Steps whose every rank's data is on at least one tier, ascending."""
        return [s for s in self.known_steps() if self.is_complete(s)]

    def newest_complete_step(self) -> int | None:
        for step in reversed(self.known_steps()):
            if self.is_complete(step):
                return step
        return None

    def is_redundant(self, step: int) -> bool:
        """Every rank's data has at least two copies on distinct hosts (the bucket counts as one)."""
        found = self.sources(step)
        if len(found) < self.topology.nodes:
            return False
        return all(len({_holder_id(s) for s in srcs}) >= 2 for srcs in found.values())

    def verified_replicas(self, step: int) -> list[tuple[int, int, str]]:
        """``(owner_rank, replica_rank, content_hash)`` where both hosts hold identical local data now.

        A daemon may persist these on the replica and report them as ``Tier.REPLICA`` holdings, so the
        equivalence survives the owner's loss and a coordinator restart.
        """
        _check_int("step", step)
        by_owner = self._index.get(step, {})
        out = []
        for owner in range(self.topology.nodes):
            mine = by_owner.get(owner, {}).get(owner)
            if mine is None or mine.tier is not Tier.LOCAL:
                continue
            for rep in self.topology.replicas_of(owner):
                theirs = by_owner.get(rep, {}).get(rep)
                if (
                    theirs is not None
                    and theirs.tier is Tier.LOCAL
                    and theirs.content_hash == mine.content_hash
                ):
                    out.append((owner, rep, mine.content_hash))
        return out

    def replication_plan(self, step: int) -> list[CopyTask]:
        """Tasks that put every rank's ``step`` data on ``1 + replicas`` distinct hosts (capped at nodes).

        A data-parallel replica whose local step has the same content hash is a verified copy: it
        gets a ``hash_only`` task (record the equivalence, move no bytes) and, with the default
        ``replicas=1``, nothing is copied for that rank. Otherwise byte copies go to the rank's
        ``copy_preference`` order (registered hosts without a valid copy), with sources spread across
        the hosts holding valid data, least bytes assigned first. The answer depends only on the
        current state; call it again after reports arrive (done tasks drop out).
        """
        _check_int("step", step)
        auth = self._auth_hashes(step)
        by_owner = self._index.get(step, {})
        alive = set(self._incarnation)
        want_total = min(1 + self.topology.replicas, self.topology.nodes)
        load: collections.Counter[int] = collections.Counter()
        count: collections.Counter[int] = collections.Counter()
        tasks = []
        for owner in range(self.topology.nodes):
            a = auth.get(owner)
            if a is None or a.content_hash is None:
                continue
            pieces = by_owner.get(owner, {})
            holders = sorted(
                x for x, h in pieces.items() if _carries_bytes(h) and h.content_hash == a.content_hash
            )
            attested, identical = [], []
            for rep in self.topology.replicas_of(owner):
                if not self._holds_local(step, rep, a.content_hash):
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
            needed = want_total - len(have)
            if needed <= 0 or not holders:
                continue  # enough copies, or no bytes of this rank's data to copy from
            size = pieces[holders[0]].size
            dests = list(
                itertools.islice(
                    (x for x in self.topology.iter_copy_preference(owner) if x in alive and x not in have),
                    needed,
                )
            )
            for dest in dests:
                src = min(
                    holders,
                    key=lambda x, d=dest: (load[x], count[x], self.topology.ring_distance(x, d), x),
                )
                load[src] += size
                count[src] += 1
                tasks.append(CopyTask(owner, step, src, dest, a.content_hash, size))
        tasks.sort(key=lambda t: (t.owner_rank, not t.hash_only, t.dest_rank))
        return tasks

    def _holds_local(self, step: int, rank: int, content_hash: str) -> bool:
        mine = self._index.get(step, {}).get(rank, {}).get(rank)
        return mine is not None and mine.tier is Tier.LOCAL and mine.content_hash == content_hash

    def restore_plan(self, restoring: bool = True, force_step: int | None = None) -> RestorePlan:
        """The newest step recoverable for every rank, and per rank the fastest source.

        Local first (the host's own data, or a replica's identical data already on it), then a peer
        (the holder with the fewest bytes assigned so far, ties by ring distance, so no single host
        serves everybody), then the bucket. ``restoring=True`` pins the chosen step against GC until
        :meth:`unpin`. ``force_step`` (operator override) must be recoverable for every rank, else
        ValueError. With nothing recoverable the plan has ``step=None`` and a reason.
        """
        waiting = tuple(sorted(set(self._incarnation) - self._reported))
        if force_step is not None:
            _check_int("force_step", force_step)
            missing = self.missing_ranks(force_step)
            if missing:
                raise ValueError(
                    f"step {force_step} is not recoverable: no tier holds ranks {_ranges(missing)}"
                )
            step = force_step
        else:
            step = self.newest_complete_step()
            if step is None:
                known = self.known_steps()
                if known:
                    newest = known[-1]
                    reason = (
                        f"no step is recoverable for every rank; newest known step {newest} lacks ranks "
                        f"{_ranges(self.missing_ranks(newest))}"
                    )
                else:
                    reason = "no step is recoverable for every rank: nothing reported on any tier"
                return RestorePlan(None, {}, reason, waiting)
        found = self.sources(step)
        load: collections.Counter[int] = collections.Counter()
        count: collections.Counter[int] = collections.Counter()
        chosen: dict[int, Source] = {}
        for rank in range(self.topology.nodes):
            srcs = found[rank]
            local = [s for s in srcs if s.kind is Tier.LOCAL]
            peers = [s for s in srcs if s.kind is Tier.PEER]
            if local:
                pick = min(local, key=lambda s, r=rank: (s.owner_rank != r, s.owner_rank))
            elif peers:
                pick = min(
                    peers,
                    key=lambda s, r=rank: (
                        load[s.holder_rank],
                        count[s.holder_rank],
                        s.owner_rank != r,
                        self.topology.ring_distance(r, s.holder_rank),
                        s.owner_rank,
                    ),
                )
                load[pick.holder_rank] += pick.size
                count[pick.holder_rank] += 1
            else:
                pick = srcs[-1]
            chosen[rank] = pick
        if restoring:
            self.pin(step)
        kinds = collections.Counter(str(s.kind) for s in chosen.values())
        how = ", ".join(f"{kinds[k]} {k}" for k in (Tier.LOCAL, Tier.PEER, Tier.BUCKET) if kinds[k])
        what = "operator-forced step" if force_step is not None else "newest globally complete step"
        return RestorePlan(step, chosen, f"{what} {step}: {how}", waiting)

    def gc_plan(self, keep_local: int) -> dict[int, list[Key]]:
        """What each host may delete: ``{holder_rank: [(owner_rank, step), ...]}`` (hosts with nothing omitted).

        Never touched: the newest globally complete step, steps being backed up, pinned steps. Each
        host keeps its ``keep_local`` newest steps (local and peer together); older steps go, and so
        do incomplete steps older than the newest complete one and copies whose hash contradicts the
        owner's (or the bucket's) definitive hash.
        """
        _check_int("keep_local", keep_local, 1)
        complete = set(self.globally_complete_steps())
        newest = max(complete) if complete else None
        protected = set(self._backups_in_progress) | set(self._pinned)
        if newest is not None:
            protected.add(newest)
        auth_cache: dict[int, dict[int, _Auth]] = {}
        plan: dict[int, list[Key]] = {}
        for holder in sorted(self._holdings):
            held = self._holdings[holder]
            newest_held = sorted({s for _, s in held}, reverse=True)[:keep_local]
            doomed = []
            for key, h in held.items():
                step = h.step
                if step in protected:
                    continue
                drop = step not in newest_held
                drop = drop or (newest is not None and step < newest and step not in complete)
                if not drop and h.tier is not Tier.LOCAL:
                    if step not in auth_cache:
                        auth_cache[step] = self._auth_hashes(step)
                    a = auth_cache[step].get(h.owner_rank)
                    drop = a is not None and a.definitive and a.content_hash != h.content_hash
                if drop:
                    doomed.append(key)
            if doomed:
                plan[holder] = sorted(doomed, key=lambda k: (k[1], k[0]))
        return plan

    def pinned_steps(self) -> list[int]:
        """Steps pinned against GC (restores, the operator), ascending."""
        return sorted(self._pinned)

    def backups_in_progress(self) -> list[int]:
        """Steps being uploaded to the bucket, ascending."""
        return sorted(self._backups_in_progress)

    def status(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) for the admin CLI."""
        complete = self.globally_complete_steps()
        newest = complete[-1] if complete else None
        hosts = {}
        for rank in sorted(set(self._incarnation) | set(self._holdings)):
            held = self._holdings.get(rank, {})
            hosts[rank] = {
                "incarnation": self._incarnation.get(rank),
                "inventory_reported": rank in self._reported,
                "steps": sorted({s for _, s in held}),
                "pieces": len(held),
                "bytes": sum(h.size for h in held.values() if _carries_bytes(h)),
            }
        steps = {}
        for step in self.known_steps():
            found = self.sources(step)
            steps[step] = {
                "complete": len(found) == self.topology.nodes,
                "redundant": self.is_redundant(step),
                "missing_ranks": [r for r in range(self.topology.nodes) if r not in found],
                "ranks": {
                    r: [{"kind": str(s.kind), "holder": s.holder_rank, "owner": s.owner_rank} for s in srcs]
                    for r, srcs in found.items()
                },
            }
        return {
            "topology": self.topology.to_dict(),
            "hosts": hosts,
            "steps": steps,
            "complete_steps": complete,
            "newest_complete_step": newest,
            "backups": {
                s: {"ranks": sorted(b), "complete": len(b) == self.topology.nodes}
                for s, b in sorted(self._bucket.items())
            },
            "in_flight": {
                "saving": [s for s in self.known_steps() if newest is None or s > newest],
                "backing_up": sorted(self._backups_in_progress),
                "pinned": sorted(self._pinned),
            },
        }

    # -------------------------------------------------------------------------------------- internals

    def _check_reporter(self, rank: int, incarnation: int | None) -> None:
        self.topology.check_rank(rank)
        known = self._incarnation.get(rank)
        if known is None:
            raise NotRegisteredError(
                f"rank {rank} is not registered; register and report the inventory again"
            )
        if incarnation is not None and _check_int("incarnation", incarnation) != known:
            raise StaleIncarnationError(
                f"rank {rank}: report from incarnation {incarnation}, registered {known}"
            )

    def _validated(self, holder: int, holdings: Iterable[Holding]) -> dict[Key, Holding]:
        out: dict[Key, Holding] = {}
        for h in holdings:
            if not isinstance(h, Holding):
                raise ValueError(f"expected a Holding, got {type(h).__name__}")
            self.topology.check_rank(h.owner_rank)
            if h.tier is Tier.LOCAL and h.owner_rank != holder:
                raise ValueError(f"host {holder} reports rank {h.owner_rank}'s data as local")
            if h.tier is Tier.PEER and h.owner_rank == holder:
                raise ValueError(f"host {holder} reports its own data as a peer copy")
            if h.tier is Tier.REPLICA and h.owner_rank not in self.topology.replicas_of(holder):
                raise ValueError(f"rank {h.owner_rank} is not a data-parallel replica of host {holder}")
            prev = out.get(h.key)
            if prev is not None and prev != h:
                raise ValueError(
                    f"host {holder} reports (owner_rank, step) {h.key} twice with different data"
                )
            out[h.key] = h
        return out

    def _validated_bucket_hashes(self, hashes: Mapping[int, str | None]) -> dict[int, str | None]:
        if not isinstance(hashes, Mapping):
            raise ValueError(f"content_hashes must be a mapping rank -> hash, got {type(hashes).__name__}")
        return {self.topology.check_rank(r): _check_hash(h, optional=True) for r, h in hashes.items()}

    def _add(self, holder: int, h: Holding) -> None:
        self._holdings.setdefault(holder, {})[h.key] = h
        self._index.setdefault(h.step, {}).setdefault(h.owner_rank, {})[holder] = h

    def _remove(self, holder: int, key: Key) -> None:
        held = self._holdings.get(holder)
        if not held or key not in held:
            return
        del held[key]
        if not held:
            del self._holdings[holder]
        owner, step = key
        by_owner = self._index[step]
        del by_owner[owner][holder]
        if not by_owner[owner]:
            del by_owner[owner]
        if not by_owner:
            del self._index[step]

    def _drop_holdings(self, holder: int) -> None:
        for key in list(self._holdings.get(holder, {})):
            self._remove(holder, key)

    def _auth_hashes(self, step: int) -> dict[int, _Auth]:
        """The accepted hash of each rank's ``step`` data.

        Definitive: the owner's local copy, else the bucket's. Otherwise the hash most copies (and replica attestations) agree on, ties by smallest hash.
        """
        by_owner = self._index.get(step, {})
        bucket = self._bucket.get(step, {})
        out = {}
        for owner in sorted(set(by_owner) | set(bucket)):
            holders = by_owner.get(owner, {})
            mine = holders.get(owner)
            if mine is not None and mine.tier is Tier.LOCAL:
                out[owner] = _Auth(mine.content_hash, True)
            elif bucket.get(owner) is not None:
                out[owner] = _Auth(bucket[owner], True)
            elif holders:
                votes = collections.Counter(h.content_hash for h in holders.values())
                best = min(votes.items(), key=lambda kv: (-kv[1], kv[0]))[0]
                out[owner] = _Auth(best, False)
            else:
                out[owner] = _Auth(None, False)
        return out

    def _rank_sources(self, step: int, rank: int, auth: Mapping[int, _Auth]) -> list[Source]:
        """Valid sources of ``rank``'s data: its own or an identical replica's, local < peer < bucket."""
        by_owner = self._index.get(step, {})
        mine = auth.get(rank)
        want = mine.content_hash if mine is not None else None
        found = []
        for owner in [rank, *self.topology.replicas_of(rank)]:
            a = auth.get(owner)
            for holder, h in by_owner.get(owner, {}).items():
                if not _carries_bytes(h) or a is None or h.content_hash != a.content_hash:
                    continue  # an attestation, or a stale copy of an older save of this step
                if owner != rank and h.content_hash != want:
                    continue  # a replica's data counts only when proven identical
                kind = Tier.LOCAL if holder == rank else Tier.PEER
                found.append(Source(kind, holder, owner, h.content_hash, h.size))
        bucket = self._bucket.get(step, {})
        if rank in bucket:
            b = bucket[rank]
            if b is None or want is None or b == want:
                size = found[0].size if found else 0
                found.append(Source(Tier.BUCKET, None, rank, b if b is not None else want, size))
        order = {Tier.LOCAL: 0, Tier.PEER: 1, Tier.BUCKET: 2}
        found.sort(key=lambda s: (order[s.kind], s.owner_rank != rank, s.holder_rank or 0, s.owner_rank))
        return found


def _carries_bytes(h: Holding) -> bool:
    return h.tier is not Tier.REPLICA


def _holder_id(s: Source) -> int | str:
    return _BUCKET_HOLDER if s.holder_rank is None else s.holder_rank


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: readable even for thousands of ranks."""
    parts = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)
