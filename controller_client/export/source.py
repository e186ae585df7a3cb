"""The saved shards of a downloaded native step, and their bytes read piece by piece, verified as they pass.

An index of every rank's manifest under the roots (``<root>/steps/<step>``, as ``mtc backups download``
lays them out): only the newest save (generation) of the step, every rank agreeing on each array's shape
and type, each saved shard with every copy of it (data-parallel replicas share an index). Imports no JAX:
dtypes come from numpy and ``ml_dtypes`` (bfloat16, float8 ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from controller_client.export.plan import Piece, Region
from sidecar import checksums, layout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardCopy:
    """One copy of a saved shard: the step directory holding it and its manifest entry."""

    step_dir: Path
    entry: layout.ShardEntry

    @property
    def path(self) -> Path:
        return layout.resolve_under(self.step_dir, self.entry.file)


@dataclasses.dataclass
class ArrayIndex:
    """One array of the step: its shape, type and every copy of each saved shard."""

    path: str
    global_shape: tuple[int, ...]
    dtype: str
    key_impl: str | None
    shards: dict[Region, list[ShardCopy]]


@dataclasses.dataclass
class StepIndex:
    step: int
    generation: int
    ranks: tuple[int, ...]
    arrays: dict[str, ArrayIndex]
    values: dict[str, Any]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a manifest names (``ml_dtypes`` for the ones numpy lacks)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        found = getattr(ml_dtypes, name, None)
        if found is None:
            raise ValueError(f"unknown dtype {name!r} in manifest") from None
        return np.dtype(found)


def index_step(step: int, roots: list[Path]) -> StepIndex:
    """Every copy of ``step`` under ``roots``, indexed. FileNotFoundError when none holds it; ValueError when
    it is not a native step (an Orbax step is an Orbax checkpoint already); ManifestError when ranks disagree."""
    found = []
    for root in roots:
        d = layout.steps_dir(Path(root)) / layout.step_name(step)
        if (d / layout.MANIFEST_NAME).is_file():
            found.append((d, layout.read_manifest(d)))
    if not found:
        raise FileNotFoundError(f"step {step} not found under {', '.join(str(r) for r in roots) or 'no directory'}")
    kinds = {m.kind for _, m in found}
    if kinds != {layout.KIND_NATIVE}:
        raise ValueError(f"step {step} was saved by {sorted(kinds)}: only native steps are exported (an Orbax "
                         "step is an Orbax checkpoint already: use `mtc backups download`)")
    current = layout.current_copies(found, step)
    index = StepIndex(step, current[0][1].generation, (), {}, {})
    ranks = set()
    for d, m in current:
        ranks.add(m.rank)
        for v in m.values:
            index.values.setdefault(v.path, v.value)
        for a in m.arrays:
            arr = index.arrays.setdefault(a.path, ArrayIndex(a.path, tuple(a.global_shape), a.dtype, a.key_impl, {}))
            if (arr.global_shape, arr.dtype, arr.key_impl) != (tuple(a.global_shape), a.dtype, a.key_impl):
                raise layout.ManifestError(f"ranks disagree on shape/dtype of {a.path!r} in step {step}")
            for s in a.shards:
                arr.shards.setdefault(tuple(tuple(p) for p in s.index), []).append(ShardCopy(d, s))
    index.ranks = tuple(sorted(ranks))
    return index


def read_pieces(copy: ShardCopy, pieces: list[Piece]) -> Iterator[tuple[Piece, np.ndarray]]:
    """Each piece of the shard ``copy`` holds, read in order into a fresh buffer (one piece in memory at a
    time here), the shard's crc32c computed on the way and checked after its last byte: ChecksumError on a
    mismatch, EOFError when the file is short. Pieces must cover the shard front to back."""
    e = copy.entry
    crc, pos = 0, 0
    fd = os.open(copy.path, os.O_RDONLY)
    try:
        for piece in pieces:
            if piece.offset != pos:
                raise ValueError(f"piece at {piece.offset} of {copy.path}, expected {pos}")
            buf = np.empty(piece.length, dtype=np.uint8)
            view = memoryview(buf)
            got = 0
            while got < piece.length:
                n = os.preadv(fd, [view[got:]], e.offset + pos + got)
                if not n:
                    raise EOFError(f"{copy.path}: shard of {e.length} bytes at {e.offset} ends after {pos + got}")
                got += n
            crc = checksums.crc32c_extend(crc, buf)
            pos += piece.length
            yield piece, buf
    finally:
        os.close(fd)
    if pos != e.length:
        raise ValueError(f"pieces cover {pos} of the {e.length} bytes of the shard in {copy.path}")
    if crc != e.crc32c:
        raise checksums.ChecksumError(f"{copy.path} (shard {list(e.index)} of {e.length} bytes at {e.offset})",
                                      e.crc32c, crc)


def verify_whole(copy: ShardCopy) -> None:
    """Stream the shard's bytes once (8 MiB at a time) and check its crc32c."""
    e = copy.entry
    with open(copy.path, "rb") as f:
        f.seek(e.offset)
        crc, left = 0, e.length
        while left:
            chunk = f.read(min(left, checksums.CRC_CHUNK_BYTES))
            if not chunk:
                raise EOFError(f"{copy.path}: shard of {e.length} bytes at {e.offset} ends early")
            crc = checksums.crc32c_extend(crc, chunk)
            left -= len(chunk)
    if crc != e.crc32c:
        raise checksums.ChecksumError(f"{copy.path} (shard {list(e.index)})", e.crc32c, crc)
