"""The plan of a streamed export: each array's zarr chunk shape and the pieces its saved shards are read in.

Pure arithmetic, no I/O. A piece is a contiguous byte range of one saved shard that fills one region of the
global array, at most about one chunk: reading a shard's pieces in order reads the shard front to back once
(so its crc32c is computed on the way), and each piece is handed to TensorStore as one write.

The chunk shape nests in the saved shards' grid: the shard shape where a shard fits ``chunk_bytes``; else
ones in the leading dimensions, a run of ``k`` along one dimension and the shard's extent in the rest, ``k``
a divisor of the shard's extent there when one is at least half the largest ``k`` that fits (then every
chunk lies in one shard), else that largest ``k`` (a chunk straddling two shards is then written in two
parts, which TensorStore merges: correct, one extra read of that chunk).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator

Region = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of a saved shard, which fill ``region`` of the array."""

    region: Region
    offset: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)


def grid_shape(global_shape: tuple[int, ...], shards: Iterable[Region]) -> tuple[int, ...] | None:
    """The shape of the shard at the origin when the saved shards form a regular grid that covers the array
    once (each starts at a multiple of that shape and spans it, or up to the array's end); else None."""
    regions = sorted(set(shards))
    if not regions:
        return None
    origin = next((r for r in regions if all(a == 0 for a, _ in r)), None)
    if origin is None or len(origin) != len(global_shape):
        return None
    shape = tuple(b - a for a, b in origin)
    if any(n <= 0 for n in shape) and math.prod(global_shape) > 0:
        return None
    total = 0
    for r in regions:
        for (a, b), s, n in zip(r, shape, global_shape, strict=True):
            if s <= 0 or a % s or b != min(a + s, n):
                return None
        total += math.prod(b - a for a, b in r)
    return shape if total == math.prod(global_shape) else None


def _divisor_at_most(n: int, k: int) -> int:
    """The largest divisor of ``n`` that is at most ``k`` (``k >= 1``)."""
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= k:
                    best = d
        i += 1
    return best


def chunk_shape(shard_shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """The zarr chunk shape for shards of ``shard_shape``: at most ``chunk_bytes`` (or one element) per chunk,
    nested in the shard grid (see the module docstring). A zero extent becomes 1 (zarr needs chunks >= 1)."""
    shape = tuple(max(1, n) for n in shard_shape)
    if math.prod(shape) * itemsize <= chunk_bytes:
        return shape
    for d in range(len(shape)):
        rest = itemsize * math.prod(shape[d + 1 :])
        if rest > chunk_bytes and d + 1 < len(shape):
            continue  # one row of the next dimensions is more than a chunk already: ones here, split further in
        fit = max(1, min(shape[d], chunk_bytes // rest))
        div = _divisor_at_most(shape[d], fit)
        k = div if 2 * div >= fit else fit
        return (1,) * d + (k,) + shape[d + 1 :]
    return shape  # unreachable: the last dimension always returns


def pieces(shard: Region, chunks: tuple[int, ...], itemsize: int) -> Iterator[Piece]:
    """The pieces of the saved shard at ``shard``: its intersection with each chunk of the grid, in the order
    of the shard's bytes. ValueError when one would not be a contiguous byte range of the shard (a chunk
    shape that does not nest in this shard)."""
    extent = tuple(b - a for a, b in shard)
    if not shard:
        yield Piece((), 0, itemsize)
        return
    if any(n <= 0 for n in extent):
        return
    strides = [itemsize * math.prod(extent[j + 1 :]) for j in range(len(extent))]
    cells = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(shard, chunks, strict=True)]
    expect = 0
    for cell in itertools.product(*cells):
        region = tuple((max(a, i * c), min(b, (i + 1) * c)) for (a, b), i, c in zip(shard, cell, chunks,
                                                                                  strict=True))
        offset = sum((lo - a) * st for (lo, _), (a, _), st in zip(region, shard, strides, strict=True))
        length = itemsize * math.prod(hi - lo for lo, hi in region)
        if offset != expect:
            raise ValueError(f"chunks {chunks} do not cut shard {shard} into contiguous byte ranges")
        expect = offset + length
        yield Piece(region, offset, length)


def chunk_regions(global_shape: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[Region]:
    """Every chunk of the array's grid (clipped to the array), in C order: what an export assembles one by one
    when the saved shards form no regular grid."""
    if not global_shape:
        yield ()
        return
    if any(n <= 0 for n in global_shape):
        return
    for cell in itertools.product(*(range(-(-n // c)) for n, c in zip(global_shape, chunks, strict=True))):
        yield tuple((i * c, min(n, (i + 1) * c)) for i, c, n in zip(cell, chunks, global_shape, strict=True))
