"""Read a committed step back: locate every saved shard, verify its crc32c, assemble any target shard.

The target shard need not match a saved one: it is assembled from every saved shard that overlaps it, which
is what restoring onto a different mesh (elastic training) needs.

One module past 700 lines on purpose: it is mostly one class, :class:`StepSource`, whose copies, dropped bad
copies, fetched scratch files and landing copies are guarded by one lock and one heal order; the landing
copy itself lives in :mod:`sidecar.landing`, the planning of pieces of other ranks' files in :mod:`sidecar.pieces`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from sidecar import checksums, commit, layout, saves, tree
from sidecar.landing import Landing
from sidecar.pieces import Needs, merge_needs, plan_pieces, span_covers

log = logging.getLogger(__name__)

# Shards at least this large are mapped rather than read (one mapping each; small ones are read so that
# a tree of many tiny leaves does not use up the process's mapping limit).
MAP_MIN_BYTES = 1 << 20
# Manifests of savers with no copy here fetched at once (each a round trip through the host's replicator).
MANIFEST_FETCH_THREADS = 8


@dataclasses.dataclass(frozen=True)
class RemoteRank:
    """Where a shard is when no copy on this host holds it: remote rank ``rank``'s data, fetched on demand."""

    rank: int


@dataclasses.dataclass(frozen=True)
class SavedShard:
    # A committed step directory (or scratch directory) on this host, a copy still landing here, or remote.
    step_dir: Path | Landing | RemoteRank
    entry: layout.ShardEntry
    copy: int = 0  # which load of ``step_dir`` (a bad copy replaced under the same name is a new one)
    # Bytes [a, b) of the shard this copy holds, when it holds only those (a fetched piece); None: all.
    have: tuple[int, int] | None = None

    def covers(self, part: tuple[int, int] | None) -> bool:
        """This copy can serve bytes ``part`` of the shard (None: the whole shard)."""
        return span_covers(self.have, part)


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


class Fetcher(Protocol):
    """Reaches tiers beyond this host's RAM disk (the host's replicator: peers, then the bucket)."""

    def locate(self, step: int) -> tuple[tuple[int, ...], int]:
        """(the ranks that saved ``step``, the save's generation); FileNotFoundError if no tier has it."""

    def manifest(self, owner: int, step: int, min_generation: int = 0) -> layout.StepManifest:
        """``owner``'s verified manifest of ``step`` from the fastest tier holding it; of a save of at least
        ``min_generation`` (older copies are of an abandoned save of the step)."""

    def fetch(self, owner: int, step: int, replace: bool = False) -> Path:
        """Bring ``owner``'s data of ``step`` (or a byte-identical replica's) onto this host; its directory.

        ``replace``: the local copy is bad; fetch another one from a peer or the bucket."""

    def fetch_files(self, owner: int, step: int, files: Sequence[layout.FileEntry],
                    pieces: Sequence[layout.FilePiece] = ()) -> Path:
        """Bring only ``files`` of ``owner``'s ``step`` (as its manifest lists them) onto this host, each
        verified by its crc32c: a new scratch directory of this process holding just them (no manifest), for
        the reader to remove with ``commit.remove_owned_dir`` when done. ``pieces``: only these byte ranges
        of them (each verified by its own crc32c) where the tier can; the fetcher may bring the whole files."""

    # Optional: ``stream(owner, step) -> Landing``, the whole step as it lands (see sidecar.landing); a
    # fetcher without it makes a host that lacks its own data wait for the committed copy instead.


@dataclasses.dataclass
class Partial:
    """A region being assembled (:meth:`StepSource.assemble_local`): its buffer, the saved shards copied into
    it and the elements they cover; ``whole``: the region is one saved shard, read already."""

    out: np.ndarray | None
    whole: np.ndarray | None = None
    done: set[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=set)
    covered: int = 0


class BadCopyError(checksums.ChecksumError):
    """A copy of a shard is unusable (checksum mismatch, short or missing file); other copies may be fine."""


class CorruptStepError(OSError):
    """Part of a step could not be read because the copies that held it were corrupt (and no other tier
    had it): corruption, not absence. Names each bad copy and what was wrong with it."""


class StepSource:
    """All committed data of one step reachable from some host roots (own dir first), plus what a
    :class:`Fetcher` can bring from peers or the bucket.

    Only the newest save of the step is used: after a rollback a step number may have been saved again
    (higher ``generation``), and copies of the abandoned save are ignored.

    Another rank's data that no local copy holds is fetched file by file: only the files of the saved shards
    a read overlaps (one file per saved shard, see ``sidecar.writer``), into scratch directories that
    :meth:`close` removes.
    """

    def __init__(self, step: int, roots: Iterable[Path], fetcher: Fetcher | None = None,
                 drop_bad: bool = False, own_rank: int | None = None, bad: dict[Path, str] | None = None):
        self.step = step
        # The rank whose RAM disk ``roots[0]`` is: its own data, when fetched, is fetched whole (the host's
        # copy of its own step must be complete again), other ranks' file by file.
        self.own_rank = own_rank
        self.roots = list(roots)
        self.fetcher = fetcher
        self.drop_bad = drop_bad
        self.manifests: list[tuple[Path | Landing, layout.StepManifest]] = []
        self.arrays: dict[str, SavedArray] = {}
        self.values: dict[str, object] = {}
        self.generation = -1
        self.savers: tuple[int, ...] = ()
        self._cache: dict[tuple[str, tuple], np.ndarray] = {}
        self._lock = threading.Lock()
        self._tried_manifests: set[int] = set()
        self._fetched: set[tuple[int, bool]] = set()
        self._copies = 0
        self._copy_at: dict[Path, int] = {}
        self._heal = threading.RLock()
        self.unreachable: dict[int, str] = {}  # rank -> why its data could not be fetched
        self._remote: dict[int, layout.StepManifest] = {}  # manifests of ranks with no copy on this host
        self._scratch: dict[Path, int] = {}  # scratch directory of fetched files -> owner rank
        self._have: dict[tuple[int, str], Path] = {}  # (owner, file) -> scratch directory holding it
        # (owner, file) -> (scratch directory, the bytes of each shard it holds) of each fetch of pieces of it.
        self._have_pieces: dict[tuple[int, str], list[tuple[Path, Needs]]] = {}
        # Copies found corrupt (and dropped) -> why; may be shared by the ranks of one restore call.
        self.bad: dict[Path, str] = bad if bad is not None else {}
        self._bad_owner: dict[Path, int] = {}  # a copy dropped as bad here -> whose data it held
        found = []
        for root in self.roots:
            for d in step_dirs_in(root, step):
                try:
                    found.append((d, layout.read_manifest(d)))
                except (OSError, layout.ManifestError) as e:
                    log.warning("unusable manifest in %s: %s", d, e)
                    self._drop(d, e)
        if not found and fetcher is not None:
            self.savers, self.generation = fetcher.locate(step)
        elif not found:
            raise FileNotFoundError(
                f"step {step} not found in {', '.join(str(r) for r in self.roots) or 'no directory'}"
            )
        newest = saves.newest_generation((m.generation for _, m in found), default=self.generation)
        for d, m in found:
            if m.step != step:
                raise layout.ManifestError(f"{d} holds step {m.step}, expected {step}")
            if m.generation < newest:
                log.info("ignoring %s: an abandoned save of step %d (a newer one exists)", d, step)
                continue
            self._add(d, m)
        self._landings: list[Landing] = []
        self._stream_own()

    def _stream_own(self) -> None:
        """This host lacks its own data of the step: have its replicator bring it (or join the copy it is
        making already) and read the copy while it lands, each block verified as it passes the watermark,
        instead of waiting for the committed copy. The replicator still commits it for next time."""
        stream = getattr(self.fetcher, "stream", None)
        own = self.own_rank
        if stream is None or own is None or own in self.owners or (self.savers and own not in self.savers):
            return
        try:
            landing = stream(own, self.step)
        except (OSError, layout.ManifestError, ValueError) as e:
            log.info("rank %d's data of step %d cannot be streamed here (%s): read when fetched", own, self.step, e)
            if isinstance(e, FileNotFoundError):
                # No tier has it (the replicator waited for a source already): do not ask again for this read.
                self.unreachable.setdefault(own, str(e))
                self._tried_manifests.add(own)
                self._fetched.add((own, False))
            return
        m = landing.manifest
        if m.step != self.step or m.generation < self.generation:
            landing.close()
            log.warning("the replicator streams rank %d step %d generation %d for step %d generation %d: ignored",
                        m.rank, m.step, m.generation, self.step, self.generation)
            return
        if landing.committed:  # the copy was here already (e.g. an identical replica's)
            landing.close()
            if all(d != landing.final for d, _ in self.manifests):
                try:
                    self._add(landing.final, layout.read_manifest(landing.final))
                except (OSError, layout.ManifestError) as e:
                    log.warning("unusable copy %s: %s", landing.final, e)
            return
        log.info("reading rank %d's step %d as it lands in %s", m.rank, self.step, landing.tmp)
        self._landings.append(landing)
        with self._lock:
            self._add(landing, m)

    def _drop_landing(self, landing: Landing, why: BaseException) -> None:
        """A landing copy failed (bad block, peer lost): read nothing more from it (the replicator's own
        whole-file check rejects the copy too, and its fetch moves on to the next tier)."""
        with self._heal, self._lock:
            if isinstance(why, checksums.ChecksumError):
                self.bad[landing.final] = str(why)
            for sa in self.arrays.values():
                for idx in list(sa.shards):
                    sa.shards[idx] = [loc for loc in sa.shards[idx] if loc.step_dir is not landing]
            self.manifests = [(d, m) for d, m in self.manifests if d is not landing]
            self._copy_at.pop(landing, None)  # type: ignore[call-overload]
        landing.close()

    def _add(self, d: Path | Landing, m: layout.StepManifest) -> None:
        if self.generation < 0 or m.generation > self.generation or not self.savers:
            self.generation, self.savers = m.generation, m.expected_ranks
        self.manifests.append((d, m))
        self._copies += 1
        self._copy_at[d] = copy = self._copies
        self._index(m, d, copy)

    def _index(self, m: layout.StepManifest, where: Path | Landing | RemoteRank, copy: int = 0) -> None:
        """Record ``m``'s values and where its shards are (a local step directory, or a remote rank's
        virtual location); every rank must agree on each array's shape, dtype and key type."""
        for v in m.values:
            self.values.setdefault(v.path, v.value)
        for a in m.arrays:
            sa = self.arrays.get(a.path)
            if sa is None:
                sa = self.arrays[a.path] = SavedArray(a.path, a.global_shape, a.dtype, a.key_impl, {})
            elif (sa.global_shape, sa.dtype, sa.key_impl) != (a.global_shape, a.dtype, a.key_impl):
                raise layout.ManifestError(f"ranks disagree on shape/dtype of {a.path!r} in step {self.step}")
            for s in a.shards:
                sa.shards.setdefault(s.index, []).append(SavedShard(where, s, copy))

    def _drop(self, step_dir: Path, why: BaseException, copy: int = 0, gone: bool = False) -> None:
        """A bad copy: forget it here and, when allowed, delete it so no inventory lists it any longer
        (the replicator then fetches a good copy again). A replacement already fetched under the same name
        (a concurrent reader found the copy bad first) is kept. ``gone``: the copy was deleted under us;
        forget it without calling it corrupt."""
        with self._heal, self._lock:
            if copy and self._copy_at.get(step_dir, copy) != copy:
                return
            if not gone:
                self.bad[step_dir] = str(why)
                rank = next((m.rank for d, m in self.manifests if d == step_dir), None)
                if rank is not None:
                    self._bad_owner[step_dir] = rank
            for sa in self.arrays.values():
                for idx in list(sa.shards):
                    sa.shards[idx] = [loc for loc in sa.shards[idx] if loc.step_dir != step_dir]
            self.manifests = [(d, m) for d, m in self.manifests if d != step_dir]
            self._copy_at.pop(step_dir, None)
            if self.drop_bad and not gone:
                log.warning("dropping the bad copy %s: %s", step_dir, why)
                commit.delete_step(step_dir)

    @property
    def landings(self) -> tuple[Landing, ...]:
        """The copies this source reads while they land (the host's own data it lacked)."""
        return tuple(self._landings)

    @property
    def owners(self) -> set[int]:
        return {m.rank for _, m in self.manifests}

    @property
    def paths(self) -> set[str]:
        """Every leaf path of the step (fetching the manifests of savers with no copy on this host)."""
        self.load_all_manifests()
        return self.known_paths

    @property
    def known_paths(self) -> set[str]:
        """The leaf paths of the manifests known so far (no fetching)."""
        return set(self.arrays) | set(self.values)

    def load_all_manifests(self) -> None:
        """Learn every saver's manifest (their shard layout), fetching those not on this host."""
        if self.fetcher is None:
            return
        with self._heal:  # concurrent readers wait for the manifests another one is fetching
            self._load_all_manifests()

    def _load_all_manifests(self) -> None:
        have = self.owners
        owners = [o for o in self.savers if o not in have and o not in self._tried_manifests]
        self._tried_manifests.update(owners)
        if not owners:
            return
        fetcher = self.fetcher
        assert fetcher is not None

        def one(owner: int) -> layout.StepManifest | BaseException:
            try:
                return fetcher.manifest(owner, self.step, min_generation=max(self.generation, 0))
            except (OSError, layout.ManifestError) as e:
                return e

        # Concurrently: each is a round trip through this host's replicator to a peer (~15 ms here).
        workers = min(len(owners), MANIFEST_FETCH_THREADS)
        if workers == 1:
            got = [one(owners[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mtc-manifests") as pool:
                got = list(pool.map(one, owners))
        for owner, m in zip(owners, got, strict=True):
            if isinstance(m, BaseException):
                log.warning("manifest of rank %d step %d unreachable: %s", owner, self.step, m)
                self.unreachable.setdefault(owner, str(m))
                continue
            if m.generation < self.generation:
                log.info("ignoring rank %d's manifest of step %d: generation %d, an abandoned save (this step's "
                         "is %d)", owner, self.step, m.generation, self.generation)
                continue
            self._remote_layout(m)

    def _remote_layout(self, m: layout.StepManifest) -> None:
        """Record where a remote rank's shards are (no bytes yet): a virtual location fetched on demand."""
        self._remote[m.rank] = m
        self._index(m, RemoteRank(m.rank))

    def _materialise(self, loc: SavedShard, replace_dir: Path | None = None, owner: int | None = None) -> list[SavedShard]:
        """Fetch the file of the shard a virtual location names, or the whole step of the rank (``owner``, when
        its manifest is gone already) whose local copy in ``replace_dir`` is bad (it is this host's copy: it
        must be whole again)."""
        if self.fetcher is None:
            return []
        if replace_dir is not None:
            owner, replace = (self._owner_of(replace_dir) if owner is None else owner), True
        elif isinstance(loc.step_dir, RemoteRank):
            owner, replace = loc.step_dir.rank, False
            if loc.entry is not None and owner in self._remote and owner != self.own_rank:
                return self.fetch_files(owner, {loc.entry.file})
        else:
            return []  # a local copy is only replaced through ``replace_dir``
        if owner is None:
            return []
        with self._heal:  # one fetch at a time; a concurrent reader never deletes a fresh replacement
            if (owner, replace) in self._fetched:
                return []
            t0 = time.monotonic()
            d = self.fetcher.fetch(owner, self.step, replace=replace)
            m = layout.read_manifest(d)
            with self._lock:
                self._add(d, m)
            self._fetched.add((owner, replace))
        log.info("rank %d's data of step %d now at %s (%.3fs)", owner, self.step, d, time.monotonic() - t0)
        return [SavedShard(d, s) for a in m.arrays for s in a.shards]

    def remote_needs(self, path: str, index: tuple[tuple[int, int], ...]) -> dict[int, dict[str, Needs]]:
        """Remote rank -> file -> (saved shard -> the bytes [a, b) of it a read of ``index`` of ``path`` will
        need, block-aligned; None: all of it), for the saved shards overlapping ``index`` that no copy on this
        host holds. Merge several reads' needs with :func:`merge_needs`; fetch them with :meth:`prefetch`."""
        arr = self.arrays.get(path)
        if arr is None or self.fetcher is None:
            return {}
        size = math.prod(b - a for a, b in index)
        if self._covered(arr, index, local_only=True) >= size:
            return {}
        self.load_all_manifests()  # where the rest is (once per step source)
        out: dict[int, dict[str, Needs]] = {}
        for sidx, locs in arr.shards.items():
            if not locs or not all(isinstance(sl.step_dir, RemoteRank) for sl in locs):
                continue
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, sidx, strict=True)]
            if all(lo < hi for lo, hi in inter):
                e = locs[0].entry
                need = None
                src_sl = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sidx, strict=True))
                rows = self._partial_rows(arr, sidx, src_sl) if size > 0 else None
                if rows is not None:
                    row_bytes = e.length // max(1, sidx[0][1] - sidx[0][0])
                    first, last = checksums.blocks_covering(e, rows[0] * row_bytes, rows[1] * row_bytes)
                    need = (first * e.block_size, min(last * e.block_size, e.length))
                merge_needs(out.setdefault(locs[0].step_dir.rank, {}), {e.file: {e: need}})
        return out

    def prefetch(self, owner: int, files: Iterable[str] | Mapping[str, Needs] | None = None) -> None:
        """Fetch ``files`` of ``owner``'s data now (all of it when None; given as :meth:`remote_needs` maps
        them, only the pieces needed): restores fetch what every host needs in parallel before reading."""
        if files is not None and owner in self._remote and owner != self.own_rank:
            self.fetch_files(owner, files)
            return
        self._materialise(SavedShard(RemoteRank(owner), None))  # type: ignore[arg-type]

    def fetch_files(self, owner: int, files: Iterable[str] | Mapping[str, Needs]) -> list[SavedShard]:
        """Fetch the named files of remote rank ``owner`` (those not fetched already) and make the shards
        they hold readable here; returns the new locations. ``files`` as :meth:`remote_needs` maps them: of
        a file whose every needed shard needs only some of its bytes, only those pieces."""
        if self.fetcher is None:
            return []
        m = self._remote[owner]
        needs: Mapping[str, Needs] = files if isinstance(files, Mapping) else {}
        with self._heal:  # one fetch at a time per source; concurrent readers wait for the files they need
            want = sorted(f for f in set(files) if (owner, f) not in self._have)
            if not want:
                return []
            by_name = {f.name: f for f in m.files}
            pieces, spans = plan_pieces(m, {f: needs[f] for f in want if f in needs})
            want = [f for f in want if f not in spans or not self._pieces_held(owner, f, spans[f])]
            if not want:
                return []
            names = set(want)
            pieces = [pc for pc in pieces if pc.name in names]
            t0 = time.monotonic()
            d = self.fetcher.fetch_files(owner, self.step, [by_name[f] for f in want], pieces=pieces)
            new = []
            with self._lock:
                self._scratch[d] = owner
                self._copies += 1
                self._copy_at[d] = copy = self._copies
                names = set(want)
                for a in m.arrays:
                    sa = self.arrays[a.path]
                    for sh in a.shards:
                        if sh.file in names:
                            have = spans[sh.file].get(sh) if sh.file in spans else None
                            if sh.file in spans and sh not in spans[sh.file]:
                                continue  # a shard of a file fetched in pieces that none of them covers
                            loc = SavedShard(d, sh, copy, have)
                            sa.shards.setdefault(sh.index, []).append(loc)
                            new.append(loc)
                for f in want:
                    if f in spans:
                        self._have_pieces.setdefault((owner, f), []).append((d, spans[f]))
                    else:
                        self._have[(owner, f)] = d
        moved = sum(pc.length for pc in pieces) + sum(by_name[f].size for f in want if f not in spans)
        log.info("%d files (%d bytes%s) of rank %d's step %d fetched to %s (%.3fs)", len(want), moved,
                 f", {len(pieces)} pieces" if pieces else "", owner, self.step, d, time.monotonic() - t0)
        return new

    def _pieces_held(self, owner: int, file: str, spans: Needs) -> bool:
        """Every span of ``file`` is in pieces fetched already."""
        with self._lock:
            held = list(self._have_pieces.get((owner, file), ()))
        return all(any(sh in h and span_covers(h[sh], span) for _, h in held) for sh, span in spans.items())

    def _drop_fetched(self, d: Path, file: str) -> None:
        """A fetched file turned out bad: forget (and delete) it, so that a read fetches it again."""
        with self._heal, self._lock:
            owner = self._scratch[d]
            for sa in self.arrays.values():
                for idx in list(sa.shards):
                    sa.shards[idx] = [x for x in sa.shards[idx] if x.step_dir != d or x.entry.file != file]
            if self._have.get((owner, file)) == d:
                del self._have[(owner, file)]
            held = [x for x in self._have_pieces.get((owner, file), []) if x[0] != d]
            if held:
                self._have_pieces[(owner, file)] = held
            else:
                self._have_pieces.pop((owner, file), None)
            try:
                layout.resolve_under(d, file).unlink()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Remove the scratch directories of fetched files (arrays already built from them stay valid:
        their bytes are mapped or copied)."""
        for landing in self._landings:
            landing.close()
        with self._heal, self._lock:
            for d in self._scratch:
                commit.remove_owned_dir(d)
                for sa in self.arrays.values():
                    for idx in list(sa.shards):
                        sa.shards[idx] = [x for x in sa.shards[idx] if x.step_dir != d]
            self._scratch.clear()
            self._have.clear()
            self._have_pieces.clear()

    def _owner_of(self, step_dir: Path) -> int | None:
        for d, m in self.manifests:
            if d == step_dir:
                return m.rank
        try:
            return layout.read_manifest(step_dir).rank
        except (OSError, layout.ManifestError):
            return None

    def read_shard(self, arr: SavedArray, index: tuple[tuple[int, int], ...],
                   rows: tuple[int, int] | None = None) -> np.ndarray:
        """The verified bytes of one saved shard, as an array of its shape.

        ``rows``: only rows [r0, r1) of the shard's leading dimension (relative to the shard), a contiguous
        byte range: of a copy with block crc32cs only the blocks covering it are read and verified (a copy
        without them is read whole and sliced).

        Tries each copy in turn, local ones first; a bad copy (crc mismatch, short or missing file) is
        dropped and the next tier is tried — another local copy, then a peer or the bucket through the
        fetcher — within this call.
        """
        key = (arr.path, index, rows)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        shape = tuple(b - a for a, b in index)
        part = None  # (byte start, byte stop) within the shard, and the shape of the rows
        if rows is not None:
            row_bytes = math.prod(shape[1:]) * tree.dtype_from_name(arr.dtype).itemsize
            part = (rows[0] * row_bytes, rows[1] * row_bytes, (rows[1] - rows[0], *shape[1:]))
        dtype = tree.dtype_from_name(arr.dtype)
        errors: list[BaseException] = []
        tried: set[tuple[Path, int]] = set()
        refetches = 0
        for _ in range(len(arr.shards.get(index, [])) + 8):
            # Committed copies here first, then one still landing here, then remote ones.
            locs = sorted(arr.shards.get(index, []), key=lambda sl: (isinstance(sl.step_dir, RemoteRank),
                                                                      isinstance(sl.step_dir, Landing)))
            # (A copy holding only pieces of the shard serves only reads within them.)
            locs = [sl for sl in locs if (sl.step_dir, sl.copy) not in tried
                    and sl.covers(None if part is None else (part[0], part[1]))]
            if not locs:
                break
            loc = locs[0]
            tried.add((loc.step_dir, loc.copy))
            if isinstance(loc.step_dir, RemoteRank):
                try:
                    self._materialise(loc)
                except (OSError, layout.ManifestError, RuntimeError) as err:
                    errors.append(err)
                    self.unreachable.setdefault(loc.step_dir.rank, str(err))
                    log.warning("could not fetch %s for %s%s: %s", loc.step_dir, arr.path, index, err)
                continue
            e = loc.entry
            if e.length != math.prod(shape) * dtype.itemsize:
                errors.append(layout.ManifestError(f"{loc.step_dir}: shard length {e.length} != shape {shape}"))
                continue
            if isinstance(loc.step_dir, Landing):
                try:
                    buf = loc.step_dir.read(e)
                except (OSError, EOFError, layout.ManifestError) as err:  # ChecksumError is an OSError
                    log.warning("the copy of %s%s landing in %s failed: %s", arr.path, index, loc.step_dir.tmp, err)
                    errors.append(err)
                    self._drop_landing(loc.step_dir, err)
                    if not arr.shards.get(index) and self.own_rank is not None:
                        try:  # the committed copy, from whichever tier the replicator reaches (peer, bucket)
                            self._materialise(SavedShard(RemoteRank(self.own_rank), None))  # type: ignore[arg-type]
                        except (OSError, layout.ManifestError, RuntimeError) as ferr:
                            errors.append(ferr)
                            log.warning("no committed copy of rank %d's step %d either: %s", self.own_rank,
                                        self.step, ferr)
                    continue
                if part is not None:
                    buf = buf[part[0] : part[1]]
                out = buf.view(dtype).reshape(shape if part is None else part[2])
                with self._lock:
                    self._cache[key] = out
                return out
            try:
                path = layout.resolve_under(loc.step_dir, e.file)
                cover = None if part is None else checksums.blocks_covering(e, part[0], part[1])
                if cover is not None:
                    buf = checksums.read_blocks_verified(path, e, *cover, mapped=e.length >= MAP_MIN_BYTES)
                    skip = cover[0] * e.block_size
                    buf = buf[part[0] - skip : part[1] - skip]
                elif e.length >= MAP_MIN_BYTES:
                    buf = checksums.map_verified(path, e.length, e.crc32c, e.offset)
                else:
                    buf = checksums.read_verified(path, e.length, e.crc32c, e.offset)
                if part is not None and cover is None:
                    buf = buf[part[0] : part[1]]
            except (OSError, EOFError, checksums.ChecksumError) as err:
                if (isinstance(err, FileNotFoundError) and loc.step_dir not in self._scratch
                        and not (loc.step_dir / layout.MANIFEST_NAME).exists()):
                    # The whole copy went (a GC, or the RAM disk replaced under us): absence, not corruption,
                    # unless a concurrent read of this step dropped it as corrupt: then that is the error.
                    log.info("the copy %s went while it was read: %s", loc.step_dir, err)
                    with self._lock:
                        why = self.bad.get(loc.step_dir)
                        owner = self._bad_owner.get(loc.step_dir)
                    errors.append(err if why is None else BadCopyError(f"{loc.step_dir} ({why})", e.crc32c, 0))
                    self._drop(loc.step_dir, err, loc.copy, gone=True)
                    # Dropped as bad by a concurrent read, which is fetching a good copy: wait for it (or fetch
                    # it) rather than give up on the shard while the heal is in flight. A copy that simply went
                    # (no owner recorded) is not brought back.
                    self._replace_copy(arr, index, loc, errors, owner)
                    continue
                bad = err if isinstance(err, checksums.ChecksumError) else BadCopyError(
                    f"{loc.step_dir}/{e.file} ({type(err).__name__}: {err})", e.crc32c, 0)
                log.warning("bad copy of %s%s in %s: %s", arr.path, index, loc.step_dir, err)
                errors.append(bad)
                owner = self._scratch.get(loc.step_dir)
                if owner is not None:  # a fetched file: fetch it again (the replicator checks every tier)
                    self._drop_fetched(loc.step_dir, e.file)
                    if refetches < 2:
                        refetches += 1
                        tried.discard((RemoteRank(owner), 0))
                    continue
                owner = self._owner_of(loc.step_dir)  # before the drop forgets it
                self._drop(loc.step_dir, bad, loc.copy)
                self._replace_copy(arr, index, loc, errors, owner)
                continue
            out = buf.view(dtype).reshape(shape if part is None else part[2])
            with self._lock:
                self._cache[key] = out
            return out
        checksum = [e for e in errors if isinstance(e, checksums.ChecksumError)]
        if checksum:
            raise checksum[0]
        if errors:
            raise errors[0]
        raise FileNotFoundError(f"no copy of shard {index} of {arr.path!r} in step {self.step}")

    def _replace_copy(self, arr: SavedArray, index: tuple, loc: SavedShard, errors: list[BaseException],
                      owner: int | None = None) -> None:
        """After dropping ``loc``'s copy (``owner``'s data): when no copy of the shard is left, or the bad copy
        was this host's own, fetch one from other tiers (this host's copy of its own step must be whole again,
        even when a replica here serves this read)."""
        own = bool(self.roots) and owner is not None and owner == self.own_rank \
            and Path(loc.step_dir).is_relative_to(self.roots[0])
        if arr.shards.get(index) and not own:
            return
        try:
            self._materialise(loc, replace_dir=loc.step_dir, owner=owner)
        except (OSError, layout.ManifestError, RuntimeError) as ferr:
            errors.append(ferr)
            log.warning("no replacement for the copy in %s: %s", loc.step_dir, ferr)

    def drop_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def _covered(self, arr: SavedArray, index: tuple[tuple[int, int], ...], local_only: bool) -> int:
        """Elements of ``index`` covered by saved shards (counting overlaps between them once per shard)."""
        total = 0
        for sidx, locs in arr.shards.items():
            if not locs or (local_only and all(isinstance(sl.step_dir, RemoteRank) for sl in locs)):
                continue
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, sidx, strict=True)]
            if all(lo < hi for lo, hi in inter):
                total += math.prod(hi - lo for lo, hi in inter)
        return total

    @staticmethod
    def _partial_rows(arr: SavedArray, sidx: tuple[tuple[int, int], ...],
                      src_sl: tuple[slice, ...]) -> tuple[int, int] | None:
        """The rows [r0, r1) of saved shard ``sidx`` a read of ``src_sl`` of it needs, when reading just
        those saves bytes (its copies carry block crc32cs and the rows do not cover all of its blocks)."""
        if not src_sl or not arr.shards.get(sidx):
            return None
        r0, r1 = src_sl[0].start, src_sl[0].stop
        entry = arr.shards[sidx][0].entry
        row_bytes = entry.length // max(1, sidx[0][1] - sidx[0][0])
        if checksums.blocks_covering(entry, r0 * row_bytes, r1 * row_bytes) is None:
            return None
        return r0, r1

    def assemble_local(self, path: str, index: tuple[tuple[int, int], ...]) -> Partial:
        """The first half of :meth:`assemble`: the parts of region ``index`` of array ``path`` that copies on
        this host hold (read and verified now), so that a restore reads them while other ranks' files are
        still being fetched; pass the result to :meth:`assemble` for the rest."""
        arr = self.arrays[path]
        locs = arr.shards.get(index, [])
        if _held_here(locs):
            try:
                return Partial(None, whole=self.read_shard(arr, index))
            except (OSError, layout.ManifestError):
                if self.fetcher is None:
                    raise
                return Partial(None)  # :meth:`assemble` builds it from whatever copies are left
        return self._fill(arr, index, Partial(None), local_only=True)

    def assemble(self, path: str, index: tuple[tuple[int, int], ...], partial: Partial | None = None) -> np.ndarray:
        """Build the region ``index`` of array ``path`` from the saved shards overlapping it (with ``partial``,
        from :meth:`assemble_local`: only the parts it has not read)."""
        arr = self.arrays[path]
        if partial is not None and partial.whole is not None:
            return partial.whole
        if partial is None and arr.shards.get(index):
            try:
                return self.read_shard(arr, index)
            except (OSError, layout.ManifestError):
                if self.fetcher is None:
                    raise
        size = math.prod(b - a for a, b in index)
        if self.fetcher is not None and self._covered(arr, index, local_only=False) < size:
            self.load_all_manifests()
        return self._check_covered(arr, index, self._fill(arr, index, partial or Partial(None), local_only=False))

    def _fill(self, arr: SavedArray, index: tuple[tuple[int, int], ...], got: Partial, local_only: bool) -> Partial:
        """Copy into ``got.out`` each saved shard overlapping ``index`` not copied yet (with ``local_only``, only
        those a copy on this host holds)."""
        shape = tuple(b - a for a, b in index)
        size = math.prod(shape)
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
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, sidx, strict=True)]
            if any(lo >= hi for lo, hi in inter) and size > 0:
                continue
            dst_sl = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, index, strict=True))
            src_sl = tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, sidx, strict=True))
            rows = self._partial_rows(arr, sidx, src_sl) if size > 0 else None
            if rows is not None:
                # Part of the saved shard's rows: a contiguous byte range, read (and verified) alone.
                src = self.read_shard(arr, sidx, rows=rows)
                src_sl = (slice(None), *src_sl[1:])
            else:
                src = self.read_shard(arr, sidx)
            out[dst_sl] = src[src_sl]
            got.done.add(sidx)
            got.covered += math.prod(hi - lo for lo, hi in inter)
        return got

    def _check_covered(self, arr: SavedArray, index: tuple[tuple[int, int], ...], got: Partial) -> np.ndarray:
        """``got.out`` when the copied shards cover all of ``index``; else why not (FileNotFoundError, or
        CorruptStepError naming the copies dropped as corrupt)."""
        path, covered, size = arr.path, got.covered, math.prod(b - a for a, b in index)
        if covered < size:
            if self.fetcher is None:
                where = "the rest lives on another host (run the replicator)"
            elif self.unreachable:
                first = min(self.unreachable)
                where = (f"ranks {sorted(self.unreachable)} of savers {list(self.savers)} are unreachable "
                         f"(rank {first}: {self.unreachable[first]})")
            else:
                where = f"no tier holds it (savers {list(self.savers)}, reachable here {sorted(self.owners)})"
            msg = (f"step {self.step}: the saved shards reachable here cover {covered} of {size} "
                   f"elements of {path!r}{list(index)}; {where}")
            if self.bad:
                bad = "; ".join(f"{d}: {why}" for d, why in sorted(self.bad.items()))
                raise CorruptStepError(f"{msg}; corrupt copies (dropped): {bad}")
            raise FileNotFoundError(msg)
        assert got.out is not None
        return got.out


def _held_here(locs: Iterable[SavedShard]) -> bool:
    """A copy on this host (committed, or fetched into scratch) is among ``locs``: no fetch, no landing wait."""
    return any(isinstance(sl.step_dir, Path) for sl in locs)


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
