"""The kinds of copy of a saved shard a reader may use, each a small type with the same few operations.

Fastest first (``rung``), as :meth:`sidecar.reader.StepSource.read_shard` tries them:

- :class:`StepDir`: a committed step directory on this host's RAM disk (its own copy, or a replica of
  another rank's data that its replicator keeps under ``peer/``);
- :class:`FetchedFiles`: a scratch directory of files of another rank's data fetched for this read, whole
  files or only the pieces (byte ranges) a read needs;
- :class:`LandingCopy`: this host's own data still landing from a peer, read while it lands
  (:mod:`sidecar.landing`);
- :class:`RemoteRank`: a rank's data no copy here holds: reading it brings it here through the host's
  replicator (from a peer's RAM disk, else the bucket), after which a nearer copy serves the read.

Each kind says what of a shard it covers, reads a shard's verified bytes, and names the errors with which
a read of it fails; ``forget`` hands such a failure to the step source, which drops the copy in the way the
kind needs (delete a bad committed copy and fetch a good one, fetch a bad fetched file again, stop following
a failed landing, mark an unreachable rank).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np

from sidecar import checksums, layout
from sidecar.landing import Landing
from sidecar.pieces import span_covers

# Shards at least this large are mapped rather than read (one mapping each; small ones are read so that
# a tree of many tiny leaves does not use up the process's mapping limit).
MAP_MIN_BYTES = 1 << 20

# Rungs of the ladder: bytes on this host now; landing here now; brought on demand from another tier.
HERE, LANDING, REMOTE = 0, 1, 2

# Bytes [a, b) of a shard (None: all of it).
Span = tuple[int, int] | None


@dataclasses.dataclass
class Attempt:
    """One read of one saved shard going down the ladder: what it reads (for messages), the copies tried,
    each copy's error, and how often a bad fetched file was fetched again."""

    path: str
    index: tuple[tuple[int, int], ...]
    shards: dict[tuple[tuple[int, int], ...], list[SavedShard]]  # the array's (live) index of copies
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    tried: set[tuple[Copy, int]] = dataclasses.field(default_factory=set)
    refetches: int = 0

    def copies_left(self) -> bool:
        return bool(self.shards.get(self.index))


class Heals(Protocol):
    """The step source a copy belongs to, as a copy's ``read`` and ``forget`` reach it."""

    def bring(self, owner: int, entry: layout.ShardEntry | None = None) -> None:
        """Fetch the file holding ``entry`` of ``owner``'s data (None: all of its data) onto this host."""

    def fetch_failed(self, where: RemoteRank, err: BaseException, attempt: Attempt) -> None: ...

    def landing_failed(self, where: LandingCopy, err: BaseException, attempt: Attempt) -> None: ...

    def dir_failed(self, where: StepDir, loc: SavedShard, err: BaseException, attempt: Attempt) -> None: ...

    def fetched_failed(self, where: FetchedFiles, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        ...


class Copy(Protocol):
    """Where a copy of saved shards is, and how it is read."""

    rung: ClassVar[int]  # its place on the ladder (HERE, LANDING, REMOTE): lower is tried first

    @property
    def remote(self) -> int | None:
        """The rank whose data reading this copy brings here; None: its bytes are on this host."""

    failures: ClassVar[tuple[type[BaseException], ...]]  # what a failed read of it raises

    def read(self, step: Heals, entry: layout.ShardEntry, span: Span) -> np.ndarray | None:
        """The verified bytes ``span`` of the shard ``entry`` (uint8); None: nothing to read here, but a nearer
        copy may hold it now."""

    def forget(self, step: Heals, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        """A read of ``loc`` raised ``err`` (one of ``failures``): have ``step`` drop this copy."""


@dataclasses.dataclass(frozen=True)
class SavedShard:
    """One copy of one saved shard: where it is, its manifest entry, and which load of ``where`` (a bad copy
    replaced under the same name is a new one)."""

    where: Copy
    entry: layout.ShardEntry
    copy: int = 0
    # Bytes [a, b) of the shard this copy holds, when it holds only those (a fetched piece); None: all.
    have: Span = None

    def covers(self, part: Span) -> bool:
        """This copy can serve bytes ``part`` of the shard (None: the whole shard)."""
        return span_covers(self.have, part)


def read_file(directory: Path, entry: layout.ShardEntry, span: Span) -> np.ndarray:
    """Bytes ``span`` of shard ``entry`` from its file under ``directory``, verified: of a copy with block
    crc32cs only the blocks covering them are read (else the whole shard, then sliced)."""
    path = layout.resolve_under(directory, entry.file)
    cover = None if span is None else checksums.blocks_covering(entry, span[0], span[1])
    if cover is not None and span is not None:
        buf = checksums.read_blocks_verified(path, entry, *cover, mapped=entry.length >= MAP_MIN_BYTES)
        skip = cover[0] * entry.block_size
        return buf[span[0] - skip : span[1] - skip]
    if entry.length >= MAP_MIN_BYTES:
        buf = checksums.map_verified(path, entry.length, entry.crc32c, entry.offset)
    else:
        buf = checksums.read_verified(path, entry.length, entry.crc32c, entry.offset)
    return buf if span is None else buf[span[0] : span[1]]


@dataclasses.dataclass(frozen=True)
class _FilesHere:
    """Verified files in a directory on this host, read straight from it."""

    path: Path
    rung: ClassVar[int] = HERE
    remote: ClassVar[None] = None
    failures: ClassVar[tuple[type[BaseException], ...]] = (OSError, EOFError, checksums.ChecksumError)

    def __str__(self) -> str:
        return str(self.path)

    def read(self, step: Heals, entry: layout.ShardEntry, span: Span) -> np.ndarray:
        return read_file(self.path, entry, span)


@dataclasses.dataclass(frozen=True)
class StepDir(_FilesHere):
    """A committed step directory on this host (its own copy, or a replica it holds)."""

    def forget(self, step: Heals, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        step.dir_failed(self, loc, err, attempt)


@dataclasses.dataclass(frozen=True)
class FetchedFiles(_FilesHere):
    """A scratch directory of files (whole, or pieces of them) of ``owner``'s data, fetched for this read.

    ``verified``: the fetcher verified every byte it put here against the crc32c the reader asked for as it
    wrote them (the host's replicator does, see ``sidecar.reader.ReplicatorLink``); nothing else writes the
    directory, so its files are read without a second pass over the bytes, and only the bytes asked for (the
    pieces this copy holds: a read never leaves them, see :meth:`SavedShard.covers`). Else every read verifies.
    """

    owner: int
    verified: bool = dataclasses.field(default=False, compare=False)

    def read(self, step: Heals, entry: layout.ShardEntry, span: Span) -> np.ndarray:
        if not self.verified:
            return read_file(self.path, entry, span)
        path = layout.resolve_under(self.path, entry.file)
        start, stop = (0, entry.length) if span is None else span
        if stop - start >= MAP_MIN_BYTES:
            return checksums.map_unverified(path, stop - start, entry.offset + start)
        return checksums.read_unverified(path, stop - start, entry.offset + start)

    def forget(self, step: Heals, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        step.fetched_failed(self, loc, err, attempt)


@dataclasses.dataclass(frozen=True)
class LandingCopy:
    """This host's own data landing from a peer, read as it lands (each block verified as it passes)."""

    landing: Landing
    rung: ClassVar[int] = LANDING
    remote: ClassVar[None] = None
    failures: ClassVar[tuple[type[BaseException], ...]] = (OSError, EOFError, layout.ManifestError)

    def __str__(self) -> str:
        return str(self.landing)

    def read(self, step: Heals, entry: layout.ShardEntry, span: Span) -> np.ndarray:
        buf = self.landing.read(entry)
        return buf if span is None else buf[span[0] : span[1]]

    def forget(self, step: Heals, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        step.landing_failed(self, err, attempt)


@dataclasses.dataclass(frozen=True)
class RemoteRank:
    """Where a shard is when no copy on this host holds it: remote rank ``rank``'s data, fetched on demand."""

    rank: int
    rung: ClassVar[int] = REMOTE
    failures: ClassVar[tuple[type[BaseException], ...]] = (OSError, layout.ManifestError, RuntimeError)

    @property
    def remote(self) -> int:
        return self.rank

    def read(self, step: Heals, entry: layout.ShardEntry, span: Span) -> None:
        step.bring(self.rank, entry)

    def forget(self, step: Heals, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        step.fetch_failed(self, err, attempt)


@dataclasses.dataclass
class SavedArray:
    """One array of a step: its shape and type, and every copy of each of its saved shards found so far."""

    path: str
    global_shape: tuple[int, ...]
    dtype: str
    key_impl: str | None
    # Saved shard index -> its copies (own directory first).
    shards: dict[tuple[tuple[int, int], ...], list[SavedShard]]
