"""Build a target region of an array from the saved shards of a step that overlap it.

The target need not match a saved shard: restoring onto a different mesh (elastic training) assembles it
from every saved shard it overlaps, each read (and verified) through :meth:`sidecar.reader.StepSource.read_shard`
— of a saved shard whose copies carry block crc32cs only the rows needed. A restore first reads the parts
copies on this host hold (:func:`assemble_local`) while other ranks' files are fetched, then the rest
(:func:`assemble`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from sidecar import checksums, layout, regions, tree
from sidecar.copies import HERE, SavedArray, SavedShard


class StepSource(Protocol):
    """What assembling needs of a step being read (:class:`sidecar.reader.StepSource`; a protocol, so that
    the reader, which hands off to this module, is not imported back)."""

    arrays: dict[str, SavedArray]
    fetcher: Any  # the link to the host's replicator, None when reading only this host's copies

    def read_shard(self, arr: SavedArray, index: regions.Region, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The verified bytes of one saved shard (or rows of it)."""

    def load_manifests(self) -> None:
        """Learn every rank's manifest of the step (to find copies elsewhere)."""

    def not_covered(self, path: str, index: regions.Region, covered: int) -> OSError:
        """Why a region could be read only in part."""


@dataclasses.dataclass
class Partial:
    """A region being assembled (:func:`assemble_local`): its buffer, the saved shards copied into
    it and the elements they cover; ``whole``: the region is one saved shard, read already."""

    out: np.ndarray | None
    whole: np.ndarray | None = None
    done: set[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=set)
    covered: int = 0


def covered(arr: SavedArray, index: regions.Region, local_only: bool) -> int:
    """Elements of ``index`` covered by saved shards (with ``local_only``, those with a copy on this host
    or landing here)."""
    return regions.covered(index, (sidx for sidx, locs in arr.shards.items() if locs and not (
        local_only and all(sl.where.remote is not None for sl in locs))))


def partial_rows(arr: SavedArray, sidx: regions.Region, src_sl: tuple[slice, ...]) -> tuple[int, int] | None:
    """:func:`regions.partial_rows` of saved shard ``sidx`` (None when no copy of it is left)."""
    locs = arr.shards.get(sidx)
    return regions.partial_rows(locs[0].entry, sidx, src_sl) if locs else None


def assemble_local(step: StepSource, path: str, index: regions.Region) -> Partial:
    """The first half of :func:`assemble`: the parts of region ``index`` of array ``path`` that copies on
    this host hold (read and verified now), so that a restore reads them while other ranks' files are
    still being fetched; pass the result to :func:`assemble` for the rest."""
    arr = step.arrays[path]
    locs = arr.shards.get(index, [])
    if _held_here(locs):
        try:
            return Partial(None, whole=step.read_shard(arr, index))
        except (OSError, layout.ManifestError):
            if step.fetcher is None:
                raise
            return Partial(None)  # :func:`assemble` builds it from whatever copies are left
    return _fill(step, arr, index, Partial(None), local_only=True)


def assemble(step: StepSource, path: str, index: regions.Region, partial: Partial | None = None) -> np.ndarray:
    """Build the region ``index`` of array ``path`` from the saved shards overlapping it (with ``partial``,
    from :func:`assemble_local`: only the parts it has not read)."""
    arr = step.arrays[path]
    if partial is not None and partial.whole is not None:
        return partial.whole
    if partial is None and arr.shards.get(index):
        try:
            return step.read_shard(arr, index)
        except (OSError, layout.ManifestError):
            if step.fetcher is None:
                raise
    if step.fetcher is not None and covered(arr, index, local_only=False) < regions.size(index):
        step.load_manifests()
    return _check_covered(step, arr, index, _fill(step, arr, index, partial or Partial(None), local_only=False))


def _fill(step: StepSource, arr: SavedArray, index: regions.Region, got: Partial, local_only: bool) -> Partial:
    """Copy into ``got.out`` each saved shard overlapping ``index`` not copied yet (with ``local_only``, only
    those a copy on this host holds)."""
    shape = regions.shape(index)
    size = regions.size(index)
    dtype = tree.dtype_from_name(arr.dtype)
    if got.out is None:
        got.out = checksums.aligned_empty(size * dtype.itemsize).view(dtype).reshape(shape)
    out = got.out
    # The saved shards of one step partition the array (every saver used the same sharding; replicas
    # share an index), so summing intersections counts each element once.
    for sidx, locs in list(arr.shards.items()):
        if not locs or sidx in got.done:
            continue
        if local_only and not _held_here(locs):
            continue
        inter = regions.intersection(index, sidx)
        if size > 0 and not regions.overlaps(index, sidx):
            continue
        dst_sl = regions.slices_within(inter, index)
        src_sl = regions.slices_within(inter, sidx)
        rows = partial_rows(arr, sidx, src_sl) if size > 0 else None
        if rows is not None:
            # Part of the saved shard's rows: a contiguous byte range, read (and verified) alone.
            src = step.read_shard(arr, sidx, rows=rows)
            src_sl = (slice(None), *src_sl[1:])
        else:
            src = step.read_shard(arr, sidx)
        out[dst_sl] = src[src_sl]
        got.done.add(sidx)
        got.covered += regions.size(inter)
    return got


def _check_covered(step: StepSource, arr: SavedArray, index: regions.Region, got: Partial) -> np.ndarray:
    """``got.out`` when the copied shards cover all of ``index``; else why not (see
    :meth:`sidecar.reader.StepSource.not_covered`)."""
    if got.covered < regions.size(index):
        raise step.not_covered(arr.path, index, got.covered)
    assert got.out is not None
    return got.out


def _held_here(locs: Iterable[SavedShard]) -> bool:
    """A copy on this host (committed, or fetched into scratch) is among ``locs``: no fetch, no landing wait."""
    return any(sl.where.rung == HERE for sl in locs)
