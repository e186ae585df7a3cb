"""Pieces of other ranks' shard files a restore onto another mesh fetches: which bytes of which saved shards
a read needs (block-aligned spans), merged over the reads of one host, and the byte ranges (with their
crc32cs, combined from the manifest's block crc32cs) to ask a peer for. Used by :mod:`sidecar.reader`.
"""

from __future__ import annotations

from collections.abc import Mapping

from sidecar import checksums, layout

# What a read needs of a remote rank's file: saved shard -> bytes [a, b) of it (block-aligned), None: all.
Needs = dict[layout.ShardEntry, tuple[int, int] | None]


def span_covers(have: tuple[int, int] | None, span: tuple[int, int] | None) -> bool:
    """Bytes ``have`` of a shard (None: all) include bytes ``span`` of it (None: all)."""
    return have is None or (span is not None and have[0] <= span[0] and span[1] <= have[1])


def merge_needs(into: dict[str, Needs], more: Mapping[str, Needs]) -> dict[str, Needs]:
    """Add ``more`` to ``into`` (file -> shard -> bytes needed): one span per shard, the hull of both."""
    for file, shards in more.items():
        have = into.setdefault(file, {})
        for sh, span in shards.items():
            if sh in have:
                old = have[sh]
                have[sh] = None if old is None or span is None else (min(old[0], span[0]), max(old[1], span[1]))
            else:
                have[sh] = span
    return into


def plan_pieces(m: layout.StepManifest, needs: Mapping[str, Needs]) -> tuple[list[layout.FilePiece], dict[str, Needs]]:
    """The pieces to fetch of ``needs``' files, and per file fetched in pieces the bytes of each shard its
    pieces hold (None: the whole shard). A file every shard of which is needed whole is fetched whole (not
    listed). A piece's crc32c is the shard's, or one combined from its block crc32cs."""
    shards_of: dict[str, list[layout.ShardEntry]] = {}
    for a in m.arrays:
        for sh in a.shards:
            shards_of.setdefault(sh.file, []).append(sh)
    pieces: list[layout.FilePiece] = []
    spans: dict[str, Needs] = {}
    for file, need in sorted(needs.items()):
        if all(need.get(sh, 0) is None for sh in shards_of.get(file, ())):
            continue
        spans[file] = {}
        for sh in sorted(need, key=lambda e: e.offset):
            span = need[sh]
            if span is None:
                pieces.append(layout.FilePiece(file, sh.offset, sh.length, sh.crc32c))
            else:
                bs = sh.block_size
                crc = checksums.combine_blocks(sh.block_crc32c[span[0] // bs : -(-span[1] // bs)], bs,
                                               span[1] - span[0])
                pieces.append(layout.FilePiece(file, sh.offset + span[0], span[1] - span[0], crc))
            spans[file][sh] = span
    return pieces, spans
