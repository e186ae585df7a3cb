"""The sidecar's per-host operations, called by a dispatcher for the hosts whose devices it reaches.

In a Pathways job each colocated-Python call runs on one worker host and sees that host's devices only; in
a multi-controller job each process is a host; in tests and the demo one process plays several simulated
hosts. The functions here therefore take the list of ranks to act for and group shards by device -> rank.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import json
import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from sidecar import commit, faults, layout, pieces, reader, saves, spares, tree, writer
from sidecar.failures import RankMismatchError, StepAlreadyExistsError
from sidecar.notify import notify_step_committed
from sidecar.remote import PreemptionNotice, ReplicatorFetcher, backup_now, preemption_notice, replicator_rank

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HostConfig:
    """What every host needs to know to save and restore; pickled into colocated calls."""

    job: str
    local_directory: str  # may contain "{host}" (the rank) so simulated hosts get their own directory
    nodes: int
    device_rank: dict[int, int]  # device id (of the devices the arrays live on) -> rank
    write_threads: int = 2
    keep_local: int | None = 2  # None: the replicator decides what to delete
    cross_host_reads: bool = True  # read other ranks' directories when they are on this machine
    notify_replicator: bool = False  # tell the host's replicator (Unix socket in the root) of each commit
    # The active ranks (elastic training): they save and restore; empty = every rank of ``nodes``.
    savers: tuple[int, ...] = ()
    # Ask the host's replicator for data this host lacks (other ranks' shards, a copy to replace a bad one).
    remote_fetch: bool = False
    fetch_timeout_seconds: float = 300.0
    # The manager issuing the calls: a save failing in the background is raised to it only (sidecar.writer).
    owner: str = ""

    def root(self, rank: int) -> Path:
        return Path(self.local_directory.format(host=rank, rank=rank))

    def read_roots(self, rank: int) -> list[Path]:
        roots = [self.root(rank)]
        if self.cross_host_reads:
            for r in range(self.nodes):
                p = self.root(r)
                if p not in roots and p.is_dir():
                    roots.append(p)
        return roots


@dataclasses.dataclass(frozen=True)
class ArrayMeta:
    path: str
    key_impl: str | None


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: it holds numpy arrays, which have no plain equality
class SaveRequest:
    """One save as the controller hands it to the hosts: built once (``CheckpointManager.save``) and passed
    down unchanged through the dispatcher (and a colocated call, pickled) to :func:`save_on_hosts`.

    The device arrays are not in it: they travel beside it, as the colocated call's array argument (JAX moves
    them to each worker; everything else of a colocated call is pickled). ``metas`` describes them, in order.
    """

    step: int
    metas: tuple[ArrayMeta, ...]  # one per device array: its tree path and PRNG key implementation
    host_arrays: tuple[tuple[str, np.ndarray], ...]  # numpy leaves (tree path, value): every host writes them
    values: tuple[layout.ValueEntry, ...]  # plain leaves (ints, strings, ...)
    generation: int = 0  # this save's (the same on every host; a newer save of a step number supersedes)
    replace: bool = False  # the job rolled back: a committed copy of ``step`` is abandoned and replaced


def ranks_of(config: HostConfig, devices: Sequence[Any]) -> list[int]:
    return sorted({config.device_rank[d.id] for d in devices if d.id in config.device_rank})


# Roots whose replicator confirmed the rank this process acts for there (a sidecar lives for many calls).
_CONFIRMED: dict[Path, int] = {}


def confirm_ranks(config: HostConfig, ranks: Sequence[int]) -> None:
    """Check, once per root and process, that the replicator serving each rank's root serves that rank.

    The controller derives a host's rank from its devices (slice index and index in the slice); the
    replicator takes its rank from its own flags (on Kubernetes the JobSet Pod index). Were they to differ,
    one host's shards would be labelled as another rank's. A root no replicator serves yet is checked at a
    later call. Raises :class:`RankMismatchError` (before anything is written) on a mismatch."""
    if not (config.notify_replicator or config.remote_fetch):
        return
    for r in ranks:
        root = config.root(r)
        if _CONFIRMED.get(root) == r:
            continue
        served = replicator_rank(root)
        if served is None:
            continue
        if served != r:
            import socket

            raise RankMismatchError(
                f"host {socket.gethostname()}: the controller assigned it rank {r} (from its devices' slice index "
                f"and index in the slice), but the replicator serving {root} serves rank {served} (its --rank, on "
                "Kubernetes the JobSet job index x hosts per slice + Pod index): likely cause: the Pods' indices "
                "and the order of the devices' slice_index / task index disagree; nothing was written")
        _CONFIRMED[root] = r


def save_on_hosts(config: HostConfig, ranks: Sequence[int], request: SaveRequest, arrays: Sequence[jax.Array]) -> None:
    """Take a host copy of each rank's addressable shards of ``arrays`` and queue the background write of
    ``request`` (its ``generation`` and ``replace``: see :class:`SaveRequest`)."""
    step = request.step
    layout.step_name(step)
    confirm_ranks(config, ranks)
    writers = {r: writer.writer_for(config.root(r), config.write_threads) for r in ranks}
    writer.raise_failures(list(writers.values()), owner=config.owner)
    # A step committed on every host is saved: saving it again is a mistake, unless the job rolled back (it
    # restored an older step and saves forward: ``replace``), which abandons the newer steps. One committed
    # on some hosts only was never complete (the trainer died between the hosts' commits): saving it again
    # replaces those copies atomically (writer.write_step).
    held = [r for r, w in writers.items() if (layout.steps_dir(w.root) / str(step) / layout.MANIFEST_NAME).is_file()]
    if held and len(held) == len(writers) and not request.replace:
        raise StepAlreadyExistsError(f"step {step} already exists for ranks {held} (to save it again, restore an "
                                     "older step first)")
    if held:
        log.warning("ranks %s: step %d is saved again: the abandoned copies are replaced", held, step)
    per_rank: dict[int, list[writer.ArrayCopy]] = {r: [] for r in ranks}
    for arr, meta in zip(arrays, request.metas, strict=True):
        copies: dict[int, writer.ArrayCopy] = {}
        seen: dict[int, set] = {}
        for shard in arr.addressable_shards:
            r = config.device_rank.get(shard.device.id)
            if r not in per_rank:
                continue
            idx = reader.normalize_index(shard.index, arr.shape)
            if idx in seen.setdefault(r, set()):
                continue  # replicated within the host: one copy per host is enough
            seen[r].add(idx)
            ac = copies.get(r)
            if ac is None:
                ac = copies[r] = writer.ArrayCopy(
                    meta.path, tuple(arr.shape), tree.dtype_name(arr.dtype), meta.key_impl, []
                )
            ac.shards.append(writer.ShardCopy(idx, writer.device_to_host(shard.data)))
        for r in ranks:
            if r not in copies:
                raise ValueError(f"array {meta.path!r} has no shard on rank {r}'s devices")
            per_rank[r].append(copies[r])
    faults.point("save.after_host_copy")
    for r in ranks:
        for path, value in request.host_arrays:
            full = tuple((0, n) for n in value.shape)
            per_rank[r].append(
                writer.ArrayCopy(path, tuple(value.shape), tree.dtype_name(value.dtype), None,
                                 [writer.ShardCopy(full, writer.host_copy(value))])
            )
        hs = writer.HostStep(config.root(r), config.job, step, r, config.nodes, per_rank[r], list(request.values),
                             savers=tuple(config.savers), generation=request.generation)
        writers[r].submit(hs, config.keep_local, config.notify_replicator, config.owner)


@dataclasses.dataclass(frozen=True)
class RestoreLeaf:
    """One array leaf to restore: stored shape/dtype (key data for PRNG keys) and where it goes."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    key_impl: str | None
    sharding: Any  # a jax.sharding.Sharding over the devices the host functions see
    as_bytes: bool = False  # numpy leaf: delivered as its raw bytes (uint8, replicated), any dtype kept


def _check_leaf(src: reader.StepSource, leaf: RestoreLeaf) -> reader.SavedArray:
    sa = src.arrays.get(leaf.path)
    if sa is None:
        raise ValueError(f"leaf {leaf.path!r} is not an array in step {src.step}")
    if tuple(sa.global_shape) != tuple(leaf.shape):
        raise ValueError(f"leaf {leaf.path!r}: saved shape {sa.global_shape} != target shape {leaf.shape}")
    if sa.dtype != leaf.dtype or sa.key_impl != leaf.key_impl:
        what = f"{sa.dtype}/{sa.key_impl}" if sa.key_impl or leaf.key_impl else sa.dtype
        want = f"{leaf.dtype}/{leaf.key_impl}" if sa.key_impl or leaf.key_impl else leaf.dtype
        raise ValueError(f"leaf {leaf.path!r}: saved dtype {what} != target dtype {want}")
    return sa


def open_step(config: HostConfig, rank: int, step: int,
              located: dict[int, tuple[tuple[int, ...], int]] | None = None,
              bad: dict[Path, str] | None = None,
              manifests: dict[tuple[int, int], layout.StepManifest] | None = None) -> reader.StepSource:
    """The committed data of ``step`` that ``rank`` may read (its own directory first); with
    ``remote_fetch``, also what the host's replicator can bring from peers or the bucket.

    ``located``: where the step's savers were already located during this restore (shared by the ranks
    of one call, so that one restore asks the coordinator ``LocateStep`` once, not once per rank).
    ``bad``: the corrupt copies found (and dropped) so far by the ranks of one call, shared, so that a rank
    that opens the step after another dropped a copy still reports corruption, not absence.
    ``manifests``: other savers' manifests fetched so far by the ranks of one call, shared likewise."""
    fetcher = None
    if config.remote_fetch:
        fetcher = ReplicatorFetcher(config.root(rank), config.fetch_timeout_seconds, located=located,
                                    manifests=manifests)
    return reader.StepSource(step, config.read_roots(rank), fetcher=fetcher, drop_bad=True, own_rank=rank,
                             bad=bad)


def check_structure(src: reader.StepSource, paths: Sequence[str]) -> None:
    """The step's leaves are the target's. What this host's own copies list is checked first; only when the
    target has a leaf they lack are the other savers' manifests fetched (a leaf that only another host holds
    and the target lacks is reported by that host's own check), so that a restore onto the same mesh asks no
    replicator for N-1 manifests."""
    wanted = set(paths)
    saved = src.known_paths
    if not wanted <= saved:
        saved = src.paths
    missing = sorted(wanted - saved)
    extra = sorted(saved - wanted)
    if missing and src.unreachable:
        # Absence, not a mismatch: the savers that may hold the leaf did not answer (retried by the manager).
        first = min(src.unreachable)
        raise FileNotFoundError(f"target leaf {missing[0]!r} is in no manifest of step {src.step} reachable here; "
                                f"ranks {sorted(src.unreachable)} are unreachable (rank {first}: "
                                f"{src.unreachable[first]})")
    if missing:
        raise ValueError(f"target leaf {missing[0]!r} is not in step {src.step}")
    if extra:
        raise ValueError(f"step {src.step} has leaf {extra[0]!r} that the target lacks")


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What one restore fan-out returns: each leaf's array, and the step's plain (non-array) values."""

    arrays: list[Any]
    values: dict[str, Any]


def restore_on_hosts(
    config: HostConfig, ranks: Sequence[int], step: int, leaves: Sequence[RestoreLeaf], all_paths: Sequence[str]
) -> RestoreResult:
    """Build each leaf's arrays from the verified saved shards; each rank fills its own devices only."""
    confirm_ranks(config, ranks)
    with spares.quiet():  # no spare pool is filled while this reads
        writer.raise_failures([writer.writer_for(config.root(r), config.write_threads) for r in ranks], wait=True,
                              owner=config.owner)
        located: dict[int, tuple[tuple[int, ...], int]] = {}
        bad: dict[Path, str] = {}
        manifests: dict[tuple[int, int], layout.StepManifest] = {}
        sources = {r: open_step(config, r, step, located, bad, manifests) for r in ranks}
        try:
            arrays = _restore_leaves(config, sources, leaves, all_paths)
            values = next(iter(sources.values())).values if sources else {}
            return RestoreResult(arrays, dict(values))
        finally:
            for src in sources.values():
                src.close()  # the scratch copies of other hosts' files: the arrays hold what they need


def _restore_leaves(config: HostConfig, sources: dict[int, reader.StepSource], leaves: Sequence[RestoreLeaf],
                    all_paths: Sequence[str]) -> list[Any]:
    for src in sources.values():
        check_structure(src, all_paths)
    plans = [_targets(config, sources, leaf) for leaf in leaves]
    wanted, owners = _prefetch_plan(sources, leaves, plans)
    # Every target shard of all leaves in one parallel pass, the largest first, so that both cores stay busy to
    # the end. The buffers become the device buffers (on CPU without a copy), so this holds no more host memory
    # than placing leaf by leaf.
    keys = _shard_keys(leaves, plans)
    got = _assemble_fetching(config, sources, keys, wanted, owners) if wanted else _assemble_all(config, sources, keys)
    cleanup = None
    if wanted and not any(leaf.as_bytes for leaf in leaves):  # host leaves are read while placed
        # Every target shard is built: the other ranks' files fetched for them are removed while they are placed.
        cleanup = threading.Thread(target=lambda: [src.close_fetched() for src in sources.values()],
                                   name="mtc-fetched-cleanup")
        cleanup.start()
    try:
        return [_restore_leaf(config, sources, leaf, targets, got) for leaf, targets in zip(leaves, plans, strict=True)]
    finally:
        if cleanup is not None:
            cleanup.join()


def _shard_keys(leaves: Sequence[RestoreLeaf], plans: Sequence[list[tuple[Any, int, tuple[tuple[int, int], ...]]]]
                ) -> list[tuple[str, int, tuple[tuple[int, int], ...]]]:
    """The distinct target shards (leaf path, rank, index) of all leaves, the largest first."""
    keys = [(leaf.path, r, idx) for leaf, targets in zip(leaves, plans, strict=True)
            for r, idx in dict.fromkeys((r, idx) for _, r, idx in targets)]
    keys.sort(key=lambda k: -math.prod(b - a for a, b in k[2]))
    return keys


def _targets(config: HostConfig, sources: dict[int, reader.StepSource],
             leaf: RestoreLeaf) -> list[tuple[Any, int, tuple[tuple[int, int], ...]]]:
    """(device, rank, index) of each target shard of ``leaf`` the ranks of ``sources`` fill (none for a
    host leaf: every rank builds it whole); checks first that every source saved the leaf as the target says."""
    for src in sources.values():
        _check_leaf(src, leaf)
    if leaf.as_bytes:
        return []
    wanted = [(device, config.device_rank.get(device.id), reader.normalize_index(index, leaf.shape))
              for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items()]
    return [(d, r, idx) for d, r, idx in wanted if r in sources]


def _assemble_all(config: HostConfig, sources: dict[int, reader.StepSource],
                  keys: Sequence[tuple[str, int, tuple[tuple[int, int], ...]]]) -> dict:
    """Read distinct target shards (leaf path, rank, index) in parallel (reads and crc32c release the GIL)."""
    def one(k: tuple[str, int, tuple[tuple[int, int], ...]]) -> Any:
        return sources[k[1]].assemble(k[0], k[2])

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, config.write_threads)) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def _restore_leaf(config: HostConfig, sources: dict[int, reader.StepSource], leaf: RestoreLeaf,
                  wanted: list[tuple[Any, int, tuple[tuple[int, int], ...]]], got: dict) -> Any:
    """Build one leaf's array from its target shards ``wanted`` (from :func:`_targets`, which checked the
    leaf); ``got``: shards already read."""
    if leaf.as_bytes:
        # Host (numpy) leaves travel as raw bytes so that 64-bit dtypes survive JAX's default x32.
        bufs = []
        for device in leaf.sharding.addressable_devices:
            r = config.device_rank.get(device.id)
            if r in sources:
                full = sources[r].assemble(leaf.path, tuple((0, n) for n in leaf.shape))
                flat = np.array(full, copy=True).reshape(-1).view(np.uint8)  # one buffer per device
                bufs.append(jax.device_put(flat, device))
        nbytes = math.prod(leaf.shape) * tree.dtype_from_name(leaf.dtype).itemsize
        for src in sources.values():
            src.drop_cache()
        return jax.make_array_from_single_device_arrays((nbytes,), leaf.sharding, bufs)
    keys = list(dict.fromkeys((leaf.path, r, idx) for _, r, idx in wanted))
    rest = [k for k in keys if k not in got]
    if rest:
        got.update(_assemble_all(config, sources, rest))
    mine = {k: got.pop(k) for k in keys}
    datas = []
    placed: set[int] = set()
    for _, r, idx in wanted:
        data = mine[(leaf.path, r, idx)]
        if id(data) in placed:
            # On CPU an aligned buffer becomes the device buffer itself; two devices must never share
            # one (a donated input would be overwritten under the other).
            data = data.copy()
        placed.add(id(data))
        datas.append(data)
    buffers = jax.device_put(datas, [d for d, _, _ in wanted])  # one batched transfer (half the dispatch cost)
    arr = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, buffers)
    if leaf.key_impl:
        arr = jax.random.wrap_key_data(arr, impl=leaf.key_impl)
    for src in sources.values():
        src.drop_cache()
    return arr


def _prefetch_plan(sources: dict[int, reader.StepSource], leaves: Sequence[RestoreLeaf],
                   plans: Sequence[list[tuple[Any, int, tuple[tuple[int, int], ...]]]]
                   ) -> tuple[dict[tuple[int, int], dict[str, pieces.Needs]], dict[tuple, set[int]]]:
    """(reading rank, other rank) -> the files of the other rank's data the reading rank needs for its target
    shards and host leaves (a restore onto another mesh or onto other slices): only the saved shards
    overlapping them, and of those only the bytes covering the rows needed (see
    ``reader.StepSource.remote_needs``); and per read (leaf path, rank, region) the other ranks whose files it
    needs. The other savers' manifests the ranks lack come first, in one round."""
    reads = [(leaf.path, r, tuple((0, n) for n in leaf.shape)) for leaf in leaves if leaf.as_bytes for r in sources]
    reads += [(leaf.path, r, idx) for leaf, targets in zip(leaves, plans, strict=True) for _, r, idx in targets]
    _load_manifests(sources, {r for path, r, idx in reads if sources[r].lacks(path, idx)})
    wanted: dict[tuple[int, int], dict[str, pieces.Needs]] = {}
    owners: dict[tuple, set[int]] = {}
    for path, r, idx in reads:
        for o, files in sources[r].remote_needs(path, idx).items():
            pieces.merge_needs(wanted.setdefault((r, o), {}), files)
            owners.setdefault((path, r, idx), set()).add(o)
    return wanted, owners


def _load_manifests(sources: dict[int, reader.StepSource], ranks: set[int]) -> None:
    """The manifests of the other savers that ``ranks`` lack, in one round: each asked for once, by the first
    of ``ranks`` lacking it, all at once (their fetchers share the answers, see :func:`open_step`)."""
    asker = {o: r for r in sorted(ranks, reverse=True) for o in sources[r].missing_manifests()}
    asks: dict[int, list[int]] = {}
    for owner, rank in asker.items():
        asks.setdefault(rank, []).append(owner)
    if len(asks) <= 1:
        for rank, owners in asks.items():
            sources[rank].load_manifests(owners)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(asks), thread_name_prefix="mtc-manifests") as pool:
        list(pool.map(lambda r: sources[r].load_manifests(asks[r]), asks))


def _assemble_fetching(config: HostConfig, sources: dict[int, reader.StepSource],
                       keys: Sequence[tuple[str, int, tuple[tuple[int, int], ...]]],
                       wanted: dict[tuple[int, int], dict[str, pieces.Needs]], owners: dict[tuple, set[int]]) -> dict:
    """Read the target shards ``keys`` (leaf path, rank, index) while the files ``wanted`` (from
    :func:`_prefetch_plan`) are fetched in parallel: first the parts copies on this host hold (reads and crc32c
    release the GIL), then the rest of each target shard as soon as the fetches of the other ranks' files it
    needs (``owners``) are done, not once every fetch is. A failed fetch is logged: the reads then try the
    other tiers."""
    with (concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(wanted)),
                                                thread_name_prefix="mtc-prefetch") as fetch_pool,
          concurrent.futures.ThreadPoolExecutor(max_workers=max(1, config.write_threads)) as pool):
        fetches = {fetch_pool.submit(sources[r].prefetch, o, files): (r, o) for (r, o), files in sorted(wanted.items())}
        local = {k: pool.submit(sources[k[1]].assemble_local, k[0], k[2]) for k in keys}

        def rest(k: tuple[str, int, tuple[tuple[int, int], ...]]) -> Any:
            return sources[k[1]].assemble(k[0], k[2], local[k].result())

        waits = {k: {(k[1], o) for o in owners.get(k, ())} for k in keys}  # the fetches each one waits for
        done = {k: pool.submit(rest, k) for k in keys if not waits[k]}
        for f in concurrent.futures.as_completed(fetches):
            try:
                f.result()
            except (OSError, layout.ManifestError, RuntimeError) as e:
                log.warning("prefetch failed: %s", e)
            for k in keys:
                if fetches[f] in waits[k]:
                    waits[k].discard(fetches[f])
                    if not waits[k]:
                        done[k] = pool.submit(rest, k)
        got = {k: done[k].result() for k in keys}
    for src in sources.values():
        src.drop_cache()
    return got


class HostQuery(enum.Enum):
    """The small questions a dispatcher asks every rank (answers: see :func:`query_on_hosts`)."""

    STEPS = "steps"  # arg: timeout (s) for surfacing failed saves -> StepsAnswer
    WAIT = "wait"  # arg: timeout (s): wait for every queued save -> True
    WAKE = "wake"  # ask the host's replicator to report now -> whether it answered
    PREEMPTION = "preemption"  # what the host's replicator knows of a preemption notice -> PreemptionNotice
    BACKUP_NOW = "backup_now"  # ask the host's replicator for an immediate backup -> whether it answered


@dataclasses.dataclass(frozen=True)
class StepsAnswer:
    """One rank's answer to ``STEPS``; its size does not grow with the job's (ranks travel as ranges).

    ``steps``: committed steps in its own directory; ``in_flight``: saves still being written; ``held``:
    every save it can read (see :func:`held_steps`).
    """

    steps: tuple[int, ...]
    in_flight: int
    held: tuple[saves.StepSave, ...]

    def to_wire(self) -> list[Any]:
        return [list(self.steps), self.in_flight, [h.to_wire() for h in self.held]]

    @classmethod
    def from_wire(cls, data: Any) -> StepsAnswer:
        steps, in_flight, held = data
        return cls(tuple(int(s) for s in steps), int(in_flight),
                   tuple(saves.StepSave.from_wire(h) for h in held))


def query_on_hosts(config: HostConfig, ranks: Sequence[int], query: HostQuery | str,
                   arg: Any = None) -> dict[int, Any]:
    """Ask each of ``ranks`` one :class:`HostQuery` (its value string is accepted: it crosses processes)."""
    query = HostQuery(query)
    confirm_ranks(config, ranks)
    result: dict[int, Any] = {}
    writers = [writer.writer_for(config.root(r), config.write_threads) for r in ranks]
    if query in (HostQuery.STEPS, HostQuery.WAIT):
        writer.raise_failures(writers, arg, wait=query is HostQuery.WAIT, owner=config.owner)
    for r, w in zip(ranks, writers, strict=True):
        if query is HostQuery.STEPS:
            result[r] = StepsAnswer(tuple(commit.committed_steps(layout.steps_dir(w.root))), w.in_flight(),
                                    held_steps(config, r))
        elif query is HostQuery.PREEMPTION:
            result[r] = preemption_notice(w.root)
        elif query is HostQuery.BACKUP_NOW:
            result[r] = backup_now(w.root)
        elif query is HostQuery.WAIT:
            result[r] = True
        else:
            result[r] = notify_step_committed(w.root, -1)
    return result


def held_steps(config: HostConfig, rank: int) -> tuple[saves.StepSave, ...]:
    """Every save this host can read, newest generation per step, ascending by step.

    Ranks held are those whose committed data of the step (at that generation) is on this host's RAM disk
    (its own, peer copies) or in another host's directory it may read; the controller unions the answers
    (:func:`sidecar.saves.complete_steps`) to decide which steps are complete without a coordinator, and
    before the coordinator has heard.
    """
    seen: list[saves.StepSave] = []
    for root in config.read_roots(rank):
        dirs = [layout.steps_dir(root)]
        peers = root / layout.PEER_DIR
        if peers.is_dir():
            dirs.extend(sorted(p for p in peers.iterdir() if p.is_dir()))
        for parent in dirs:
            for step in commit.committed_steps(parent):
                try:
                    m = layout.read_manifest(parent / layout.step_name(step))
                except (OSError, layout.ManifestError):
                    continue
                savers = saves.RankRanges.of(m.savers) if m.savers else saves.RankRanges.every(m.nodes)
                seen.append(saves.StepSave(step, m.generation, savers, saves.RankRanges.of((m.rank,))))
    return tuple(s for _, s in sorted(saves.merge(seen).items()))


def _to_wire(query: HostQuery, answer: Any) -> Any:
    return answer.to_wire() if query in (HostQuery.STEPS, HostQuery.PREEMPTION) else bool(answer)


def _from_wire(query: HostQuery, data: Any) -> Any:
    if query is HostQuery.STEPS:
        return StepsAnswer.from_wire(data)
    if query is HostQuery.PREEMPTION:
        return PreemptionNotice.from_wire(data)
    return bool(data)


def encode_result(query: HostQuery | str, answers: dict[int, Any], size: int) -> np.ndarray:
    """``answers`` (rank -> answer to ``query``) as a fixed-size byte row (length-prefixed JSON)."""
    query = HostQuery(query)
    data = json.dumps([[r, _to_wire(query, a)] for r, a in sorted(answers.items())]).encode()
    if len(data) > size - 4:
        raise ValueError(f"host answer of {len(data)} bytes exceeds {size - 4}")
    buf = np.zeros(size, dtype=np.uint8)
    buf[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
    buf[4 : 4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf


def decode_result(query: HostQuery | str, buf: np.ndarray) -> dict[int, Any]:
    """The answers :func:`encode_result` encoded (an all-zero row: none)."""
    query = HostQuery(query)
    n = int.from_bytes(bytes(buf[:4]), "little")
    if n == 0:
        return {}
    return {int(r): _from_wire(query, a) for r, a in json.loads(bytes(buf[4 : 4 + n]))}
