"""Read a committed step back: locate every saved shard, verify its crc32c, assemble any target shard.

The target shard need not match a saved one: it is assembled from every saved shard that overlaps it, which
is what restoring onto a different mesh (elastic training) needs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from sidecar import layout, tree

log = logging.getLogger(__name__)

# Shards at least this large are mapped rather than read (one mapping each; small ones are read so that
# a tree of many tiny leaves does not use up the process's mapping limit).
MAP_MIN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class SavedShard:
    step_dir: Path
    entry: layout.ShardEntry


@dataclasses.dataclass
class SavedArray:
    path: str
    global_shape: tuple[int, ...]
    dtype: str
    key_impl: str | None
    # One entry per distinct global index; the first location found wins (own directory first).
    shards: dict[tuple[tuple[int, int], ...], list[SavedShard]]


def step_dirs_in(root: Path, step: int) -> list[Path]:
    """Committed copies of ``step`` under one host root: its own, then the peer copies it holds."""
    root = Path(root)
    out = []
    own = layout.steps_dir(root) / layout.step_name(step)
    if (own / layout.MANIFEST_NAME).is_file():
        out.append(own)
    peers = root / layout.PEER_DIR
    if peers.is_dir():
        for owner in sorted(peers.iterdir(), key=lambda p: p.name):
            d = owner / layout.step_name(step)
            if (d / layout.MANIFEST_NAME).is_file():
                out.append(d)
    return out


class StepSource:
    """All committed data of one step reachable from some host roots (own dir first)."""

    def __init__(self, step: int, roots: Iterable[Path]):
        self.step = step
        self.manifests: list[tuple[Path, layout.StepManifest]] = []
        for root in roots:
            for d in step_dirs_in(root, step):
                self.manifests.append((d, layout.read_manifest(d)))
        if not self.manifests:
            raise FileNotFoundError(
                f"step {step} not found in {', '.join(str(r) for r in roots) or 'no directory'}"
            )
        self.arrays: dict[str, SavedArray] = {}
        self.values: dict[str, object] = {}
        for d, m in self.manifests:
            if m.step != step:
                raise layout.ManifestError(f"{d} holds step {m.step}, expected {step}")
            for v in m.values:
                self.values.setdefault(v.path, v.value)
            for a in m.arrays:
                sa = self.arrays.get(a.path)
                if sa is None:
                    sa = self.arrays[a.path] = SavedArray(a.path, a.global_shape, a.dtype, a.key_impl, {})
                elif (sa.global_shape, sa.dtype, sa.key_impl) != (a.global_shape, a.dtype, a.key_impl):
                    raise layout.ManifestError(f"ranks disagree on shape/dtype of {a.path!r} in step {step}")
                for s in a.shards:
                    sa.shards.setdefault(s.index, []).append(SavedShard(d, s))
        self._cache: dict[tuple[str, tuple], np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def paths(self) -> set[str]:
        return set(self.arrays) | set(self.values)

    def read_shard(self, arr: SavedArray, index: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The verified bytes of one saved shard, as an array of its shape; tries each known copy in turn."""
        key = (arr.path, index)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        shape = tuple(b - a for a, b in index)
        dtype = tree.dtype_from_name(arr.dtype)
        errors = []
        for loc in arr.shards[index]:
            e = loc.entry
            if e.length != math.prod(shape) * dtype.itemsize:
                errors.append(layout.ManifestError(f"{loc.step_dir}: shard length {e.length} != shape {shape}"))
                continue
            try:
                path = layout.resolve_under(loc.step_dir, e.file)
                if e.length >= MAP_MIN_BYTES:
                    buf = layout.map_verified(path, e.length, e.crc32c, e.offset)
                else:
                    buf = layout.read_verified(path, e.length, e.crc32c, e.offset)
            except (OSError, layout.ChecksumError) as err:
                log.warning("unusable copy of %s%s: %s", arr.path, index, err)
                errors.append(err)
                continue
            out = buf.view(dtype).reshape(shape)
            with self._lock:
                self._cache[key] = out
            return out
        if errors and all(isinstance(e, layout.ChecksumError) for e in errors):
            raise errors[0]
        raise errors[0] if errors else FileNotFoundError(f"no copy of shard {index} of {arr.path!r}")

    def drop_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def assemble(self, path: str, index: tuple[tuple[int, int], ...]) -> np.ndarray:
        """Build the region ``index`` of array ``path`` from the saved shards overlapping it."""
        arr = self.arrays[path]
        shape = tuple(b - a for a, b in index)
        exact = arr.shards.get(index)
        if exact:
            return self.read_shard(arr, index)
        dtype = tree.dtype_from_name(arr.dtype)
        out = layout.aligned_empty(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
        covered = 0
        for sidx in arr.shards:
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, sidx, strict=True)]
            if any(lo >= hi for lo, hi in inter) and math.prod(shape) > 0:
                continue
            src = self.read_shard(arr, sidx)
            dst_sl = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, index, strict=True))
            src_sl = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sidx, strict=True))
            out[dst_sl] = src[src_sl]
            covered += math.prod(hi - lo for lo, hi in inter)
        if covered < math.prod(shape):
            raise FileNotFoundError(
                f"step {self.step}: the saved shards reachable here cover {covered} of {math.prod(shape)} "
                f"elements of {path!r}{list(index)}; the rest lives on another host (run the replicator)"
            )
        return out


def normalize_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device index (tuple of slices, as in ``Sharding.devices_indices_map``) as [start, stop) pairs."""
    out = []
    for sl, n in zip(index, shape, strict=False):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError("strided shard indices are not supported")
        out.append((start, stop))
    out.extend((0, n) for n in shape[len(out) :])
    return tuple(out)
