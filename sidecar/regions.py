"""Regions of an array and the bytes of a saved shard a read of part of it needs: pure arithmetic, no I/O.

A region is a [start, stop) pair per dimension, as a saved shard's ``index`` and a target shard are given.
A read of a target region copies, from each saved shard overlapping it, their intersection; of a saved shard
whose copies carry block crc32cs, only the leading-dimension rows it needs are read (a contiguous byte range).
Used by :mod:`sidecar.reader`; the pieces of remote files those bytes make are :mod:`sidecar.pieces`'.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from sidecar import checksums, layout

Region = tuple[tuple[int, int], ...]


def shape(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def size(region: Region) -> int:
    """Elements in ``region``."""
    return math.prod(b - a for a, b in region)


def intersection(a: Region, b: Region) -> Region:
    """The part of ``a`` inside ``b`` (some dimension empty, ``lo >= hi``, when they do not overlap)."""
    return tuple((max(p, r), min(q, s)) for (p, q), (r, s) in zip(a, b, strict=True))


def overlaps(a: Region, b: Region) -> bool:
    """``a`` and ``b`` share at least one element."""
    return all(lo < hi for lo, hi in intersection(a, b))


def slices_within(inner: Region, outer: Region) -> tuple[slice, ...]:
    """``inner`` (a part of ``outer``) as slices of an array holding ``outer``."""
    return tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inner, outer, strict=True))


def covered(region: Region, saved: Iterable[Region]) -> int:
    """Elements of ``region`` covered by the ``saved`` shards' regions (counting overlaps between them once
    per shard: the saved shards of one step partition the array, replicas sharing an index)."""
    total = 0
    for s in saved:
        inter = intersection(region, s)
        if all(lo < hi for lo, hi in inter):
            total += size(inter)
    return total


def row_bytes(entry: layout.ShardEntry, saved: Region) -> int:
    """Bytes per leading-dimension row of the saved shard ``entry`` (its region ``saved``)."""
    return entry.length // max(1, saved[0][1] - saved[0][0])


def partial_rows(entry: layout.ShardEntry, saved: Region, src: tuple[slice, ...]) -> tuple[int, int] | None:
    """The rows [r0, r1) of the saved shard ``entry`` (region ``saved``) a read of ``src`` of it needs, when
    reading just those saves bytes (its copies carry block crc32cs and the rows do not cover all its blocks)."""
    if not src:
        return None
    r0, r1 = src[0].start, src[0].stop
    rb = row_bytes(entry, saved)
    if checksums.blocks_covering(entry, r0 * rb, r1 * rb) is None:
        return None
    return r0, r1


def rows_span(region: Region, itemsize: int, rows: tuple[int, int]) -> tuple[int, int, tuple[int, ...]]:
    """Rows [r0, r1) of a shard of ``region`` (items of ``itemsize`` bytes): (byte start, byte stop) within the
    shard, and the shape of those rows."""
    sh = shape(region)
    rb = math.prod(sh[1:]) * itemsize
    return rows[0] * rb, rows[1] * rb, (rows[1] - rows[0], *sh[1:])


def block_span(entry: layout.ShardEntry, saved: Region, rows: tuple[int, int]) -> tuple[int, int]:
    """The bytes [a, b) of the saved shard ``entry`` (region ``saved``) whose blocks hold rows [r0, r1)."""
    rb = row_bytes(entry, saved)
    first, last = checksums.blocks_covering(entry, rows[0] * rb, rows[1] * rb)
    return first * entry.block_size, min(last * entry.block_size, entry.length)
