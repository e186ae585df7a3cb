"""A host's committed step as one byte stream (its MANIFEST.json, then its files in manifest order), and back.

Erasure coding works on byte ranges of equal length, not on files: a code group pads each member's stream
to the group's shard geometry (:mod:`replicator.erasure.group`). Putting the manifest first makes a rebuilt
stream self-describing: a lost host's MANIFEST.json is rebuilt with its files, and every file it lists is then
checked against its crc32c as it is written back (:func:`unpack_stream`).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from sidecar.checksums import ChecksumError, crc32c, crc32c_extend
from sidecar.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, StepManifest, parse_manifest, resolve_under


@dataclasses.dataclass(frozen=True)
class StreamPart:
    """File ``name`` occupies bytes [start, start + size) of the stream; crc32c as the manifest records it."""

    name: str
    start: int
    size: int
    crc32c: int


class StepStream:
    """Read any byte range of one committed step directory as the stream ``MANIFEST.json + files``."""

    def __init__(self, step_dir: Path, manifest_bytes: bytes):
        self.step_dir = Path(step_dir)
        self.manifest_bytes = manifest_bytes
        self.manifest: StepManifest = parse_manifest(manifest_bytes)
        parts = [StreamPart(MANIFEST_NAME, 0, len(manifest_bytes), crc32c(manifest_bytes))]
        at = len(manifest_bytes)
        for f in self.manifest.files:
            parts.append(StreamPart(f.name, at, f.size, f.crc32c))
            at += f.size
        self.parts = tuple(parts)
        self.length = at
        self._starts = [p.start for p in parts]

    @classmethod
    def open(cls, step_dir: Path) -> StepStream:
        with open(Path(step_dir) / MANIFEST_NAME, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        return cls(step_dir, data)

    def ranges(self, offset: int, length: int) -> list[tuple[int, int, int]]:
        """Where bytes [offset, offset + length) of the stream are (cut at its end): (part index, offset in
        the part, length) in stream order; part 0 is the manifest, the others are files (read locally by
        :meth:`read`, or from a peer by byte range)."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        stop = min(offset + length, self.length)
        out = []
        i = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        while offset < stop:
            part = self.parts[i]
            end = min(stop, part.start + part.size)
            if end > offset:
                out.append((i, offset - part.start, end - offset))
                offset = end
            i += 1
        return out

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the stream, cut at its end (shorter, never padded). Bytes are
        read as they are on disk: the caller checks them (a parity file's crc32c covers what was encoded)."""
        out = bytearray()
        for i, at, n in self.ranges(offset, length):
            if i == 0:
                out += self.manifest_bytes[at:at + n]
            else:
                out += _pread(resolve_under(self.step_dir, self.parts[i].name), at, n)
        return bytes(out)


def _pread(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise ChecksumError(f"{path} (short: {len(data)} of {length} bytes at {offset})", 0, 0)
    return data


def unpack_stream(chunks: Iterable[bytes], manifest_bytes_len: int, stream_len: int, dest_dir: Path) -> StepManifest:
    """Write a step's stream (in order, any chunking; bytes past ``stream_len`` are padding and ignored) back
    into ``dest_dir`` as MANIFEST.json and its files, each checked against its crc32c as it completes.

    ``manifest_bytes_len`` and ``stream_len`` come from the code group's manifest. Raises
    :class:`ChecksumError` naming the first file that does not match, ValueError when the stream is shorter
    than ``stream_len`` or its manifest lists a different total. ``dest_dir`` is a temporary directory the
    caller commits (``sidecar.commit``); nothing here decides what is a step.
    """
    dest_dir = Path(dest_dir)
    it = _exact(chunks, stream_len)
    mbytes = bytearray()
    for piece in _take(it, manifest_bytes_len):
        mbytes += piece
    manifest = parse_manifest(bytes(mbytes))  # its own sha256 checks it
    total = manifest_bytes_len + sum(f.size for f in manifest.files)
    if total != stream_len:
        raise ValueError(f"rebuilt manifest lists {total} stream bytes, the code group recorded {stream_len}")
    for f in manifest.files:
        path = resolve_under(dest_dir, f.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        crc = 0
        with open(path, "wb") as out:
            for piece in _take(it, f.size):
                crc = crc32c_extend(crc, piece)
                out.write(piece)
        if crc != f.crc32c:
            raise ChecksumError(f"rebuilt {f.name}", f.crc32c, crc)
    (dest_dir / MANIFEST_NAME).write_bytes(mbytes)
    return manifest


class _exact:
    """An iterator of memoryviews over ``chunks`` cut at exactly ``length`` bytes, with put-back for :func:`_take`."""

    def __init__(self, chunks: Iterable[bytes], length: int):
        self._it = iter(chunks)
        self._left = length
        self.pending = memoryview(b"")

    def next_piece(self) -> memoryview:
        if self.pending:
            piece, self.pending = self.pending, memoryview(b"")
            return piece
        while self._left > 0:
            try:
                piece = memoryview(next(self._it))
            except StopIteration:
                raise ValueError(f"stream ended {self._left} bytes early") from None
            piece = piece[: self._left]
            self._left -= len(piece)
            if piece:
                return piece
        raise ValueError("stream ended early")


def _take(it: _exact, n: int) -> Iterable[memoryview]:
    """Exactly ``n`` bytes from ``it``, as pieces."""
    while n > 0:
        piece = it.next_piece()
        if len(piece) > n:
            it.pending = piece[n:]
            piece = piece[:n]
        n -= len(piece)
        yield piece
