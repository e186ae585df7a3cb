"""Read a committed step back: locate every saved shard, verify its crc32c, assemble any target shard.

The target shard need not match a saved one: it is assembled from every saved shard that overlaps it, which
is what restoring onto a different mesh (elastic training) needs.

A read of one saved shard goes down one ladder of copies, fastest first (the kinds are
:mod:`sidecar.copies`); :class:`StepSource` keeps the index of every copy and heals it, under one lock and
one heal order. Beside it: the copy landing from a peer (:mod:`sidecar.landing`), the files fetched from
other ranks (:mod:`sidecar.fetched`), the planning of pieces of them (:mod:`sidecar.pieces`) and the region
arithmetic (:mod:`sidecar.regions`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from sidecar import assemble, checksums, commit, layout, regions, tree
from sidecar.assemble import Partial
from sidecar.copies import (
    Attempt,
    Copy,
    FetchedFiles,
    LandingCopy,
    RemoteRank,
    SavedArray,
    SavedShard,
    StepDir,
)
from sidecar.fetched import FetchedFileSet
from sidecar.landing import Landing
from sidecar.pieces import Needs, merge_needs, plan_pieces

log = logging.getLogger(__name__)

# Manifests of savers with no copy here fetched at once (each a round trip through the host's replicator).
MANIFEST_FETCH_THREADS = 8


# What a restore drops (read buffers: mappings of shard files) is released by one background thread, so that
# unmapping them (~6 ms per 64 MiB here; munmap releases the GIL) is off the restore's critical path.
_to_release: queue.SimpleQueue[object] = queue.SimpleQueue()
_releaser_lock = threading.Lock()
_releaser: threading.Thread | None = None


def release_later(obj: object) -> None:
    """Drop the caller's reference to ``obj`` on the background releaser thread (the last one unmaps or
    frees its buffers there); the caller must hold no other reference."""
    global _releaser
    with _releaser_lock:
        if _releaser is None or not _releaser.is_alive():  # none yet, or not in this (forked) process
            _releaser = threading.Thread(target=_release_loop, name="mtc-release", daemon=True)
            _releaser.start()
    _to_release.put(obj)


def _release_loop() -> None:
    while True:
        obj = _to_release.get()
        del obj  # before waiting for the next


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


class ReplicatorLink(Protocol):
    """The sidecar's link to its host's replicator, which reaches the tiers beyond this host's RAM disk
    (peers, then the bucket); :class:`sidecar.remote.ReplicatorFetcher` is the real one."""

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

    # Optional: ``files_verified = True``: ``fetch_files`` names a file in its directory only once every byte it
    # wrote there matched the crc32c asked for, and nothing else writes that directory (the replicator's
    # FetchFiles): the reader then reads those bytes without verifying them again (sidecar.copies.FetchedFiles).
    # Without it, every read of a fetched file verifies it.
    #
    # Optional: ``stream(owner, step) -> Landing``, the whole step as it lands (see sidecar.landing); a
    # link without it makes a host that lacks its own data wait for the committed copy instead.


class BadCopyError(checksums.ChecksumError):
    """A copy of a shard is unusable (checksum mismatch, short or missing file); other copies may be fine."""


class CorruptStepError(OSError):
    """Part of a step could not be read because the copies that held it were corrupt (and no other tier
    had it): corruption, not absence. Names each bad copy and what was wrong with it."""


def _fetch_manifests(fetcher: ReplicatorLink, step: int, min_generation: int,
                     owners: list[int]) -> list[layout.StepManifest | BaseException]:
    """The manifests of ``owners``' data of ``step`` (or why each is unreachable), fetched concurrently: each is
    a round trip through this host's replicator to a peer (~15 ms here)."""

    def one(owner: int) -> layout.StepManifest | BaseException:
        try:
            return fetcher.manifest(owner, step, min_generation=min_generation)
        except (OSError, layout.ManifestError) as e:
            return e

    workers = min(len(owners), MANIFEST_FETCH_THREADS)
    if workers <= 1:
        return [one(o) for o in owners]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mtc-manifests") as pool:
        return list(pool.map(one, owners))


class StepSource:
    """All committed data of one step reachable from some host roots (own dir first), plus what a
    :class:`ReplicatorLink` can bring from peers or the bucket.

    Only the newest save of the step is used: after a rollback a step number may have been saved again
    (higher ``generation``), and copies of the abandoned save are ignored.

    Another rank's data that no local copy holds is fetched file by file: only the files of the saved shards
    a read overlaps (one file per saved shard, see ``sidecar.writer``), into scratch directories that
    :meth:`close` removes.
    """

    def __init__(self, step: int, roots: Iterable[Path], fetcher: ReplicatorLink | None = None,
                 drop_bad: bool = False, own_rank: int | None = None, bad: dict[Path, str] | None = None):
        self.step = step
        # The rank whose RAM disk ``roots[0]`` is: its own data, when fetched, is fetched whole (the host's
        # copy of its own step must be complete again), other ranks' file by file.
        self.own_rank = own_rank
        self.roots = list(roots)
        self.fetcher = fetcher
        self.drop_bad = drop_bad
        self.manifests: list[tuple[Copy, layout.StepManifest]] = []
        self.arrays: dict[str, SavedArray] = {}
        self.values: dict[str, object] = {}
        self.generation = -1
        self.savers: tuple[int, ...] = ()
        self._cache: dict[tuple[str, tuple], np.ndarray] = {}
        self._lock = threading.Lock()
        self._tried_manifests: set[int] = set()
        self._fetched: set[tuple[int, bool]] = set()
        self._copies = 0
        self._copy_at: dict[Copy, int] = {}
        self._heal = threading.RLock()
        self.unreachable: dict[int, str] = {}  # rank -> why its data could not be fetched
        self._remote: dict[int, layout.StepManifest] = {}  # manifests of ranks with no copy on this host
        self._files = FetchedFileSet()  # other ranks' files fetched for this source
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
                    self.drop_copy(d, e)
        if not found and fetcher is not None:
            self.savers, self.generation = fetcher.locate(step)
        elif not found:
            raise FileNotFoundError(
                f"step {step} not found in {', '.join(str(r) for r in self.roots) or 'no directory'}"
            )
        for d, m in layout.current_copies(found, step):
            self._add(StepDir(d), m)
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
            if all(d != StepDir(landing.final) for d, _ in self.manifests):
                try:
                    self._add(StepDir(landing.final), layout.read_manifest(landing.final))
                except (OSError, layout.ManifestError) as e:
                    log.warning("unusable copy %s: %s", landing.final, e)
            return
        log.info("reading rank %d's step %d as it lands in %s", m.rank, self.step, landing.tmp)
        self._landings.append(landing)
        with self._lock:
            self._add(LandingCopy(landing), m)

    def _forget_where(self, gone: Callable[[SavedShard], bool]) -> None:
        """Remove the copies ``gone`` picks from the index (the caller holds ``_lock``)."""
        for sa in self.arrays.values():
            for idx in list(sa.shards):
                sa.shards[idx] = [loc for loc in sa.shards[idx] if not gone(loc)]

    def _drop_landing(self, where: LandingCopy, why: BaseException) -> None:
        """A landing copy failed (bad block, peer lost): read nothing more from it (the replicator's own
        whole-file check rejects the copy too, and its fetch moves on to the next tier)."""
        with self._heal, self._lock:
            if isinstance(why, checksums.ChecksumError):
                self.bad[where.landing.final] = str(why)
            self._forget_where(lambda loc: loc.where == where)
            self.manifests = [(d, m) for d, m in self.manifests if d != where]
            self._copy_at.pop(where, None)
        where.landing.close()

    def _add(self, d: Copy, m: layout.StepManifest) -> None:
        if self.generation < 0 or m.generation > self.generation or not self.savers:
            self.generation, self.savers = m.generation, m.expected_ranks
        self.manifests.append((d, m))
        self._copies += 1
        self._copy_at[d] = copy = self._copies
        self._index(m, d, copy)

    def _index(self, m: layout.StepManifest, where: Copy, copy: int = 0) -> None:
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

    def drop_copy(self, step_dir: Path, why: BaseException, copy: int = 0, gone: bool = False) -> None:
        """A bad copy: forget it here and, when allowed, delete it so no inventory lists it any longer
        (the replicator then fetches a good copy again). A replacement already fetched under the same name
        (a concurrent reader found the copy bad first) is kept. ``gone``: the copy was deleted under us;
        forget it without calling it corrupt."""
        where = StepDir(step_dir)
        with self._heal, self._lock:
            if copy and self._copy_at.get(where, copy) != copy:
                return
            if not gone:
                self.bad[step_dir] = str(why)
                rank = next((m.rank for d, m in self.manifests if d == where), None)
                if rank is not None:
                    self._bad_owner[step_dir] = rank
            self._forget_where(lambda loc: loc.where == where)
            self.manifests = [(d, m) for d, m in self.manifests if d != where]
            self._copy_at.pop(where, None)
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
        self.load_manifests()
        return self.known_paths

    @property
    def known_paths(self) -> set[str]:
        """The leaf paths of the manifests known so far (no fetching)."""
        return set(self.arrays) | set(self.values)

    def missing_manifests(self) -> list[int]:
        """The savers whose manifest this source lacks and has not asked for yet (none without a fetcher)."""
        if self.fetcher is None:
            return []
        have = self.owners
        return [o for o in self.savers if o not in have and o not in self._tried_manifests]

    def load_manifests(self, owners: Iterable[int] | None = None) -> None:
        """Learn the manifests (shard layouts) of ``owners`` (default: every saver) that this host lacks,
        fetched all at once (of those :meth:`missing_manifests` lists)."""
        if self.fetcher is None:
            return
        with self._heal:  # concurrent readers wait for the manifests another one is fetching
            wanted = None if owners is None else set(owners)
            asked = [o for o in self.missing_manifests() if wanted is None or o in wanted]
            self._tried_manifests.update(asked)
            got = _fetch_manifests(self.fetcher, self.step, max(self.generation, 0), asked)
            for owner, m in zip(asked, got, strict=True):
                if isinstance(m, BaseException):
                    log.warning("manifest of rank %d step %d unreachable: %s", owner, self.step, m)
                    self.unreachable.setdefault(owner, str(m))
                elif m.generation < self.generation:
                    log.info("ignoring rank %d's manifest of step %d: generation %d, an abandoned save (this "
                             "step's is %d)", owner, self.step, m.generation, self.generation)
                else:
                    self._remote_layout(m)

    def _remote_layout(self, m: layout.StepManifest) -> None:
        """Record where a remote rank's shards are (no bytes yet): a virtual location fetched on demand."""
        self._remote[m.rank] = m
        self._index(m, RemoteRank(m.rank))

    def bring(self, owner: int, entry: layout.ShardEntry | None = None) -> None:
        """Fetch ``owner``'s data onto this host: of another rank whose manifest is known, just the file
        holding ``entry``; else (this host's own data, or ``entry`` None) all of it."""
        if self.fetcher is None:
            return
        if entry is not None and owner in self._remote and owner != self.own_rank:
            self.fetch_files(owner, {entry.file})
            return
        self._fetch_whole(owner, replace=False)

    def _fetch_whole(self, owner: int, replace: bool) -> None:
        """Fetch all of ``owner``'s data of the step (``replace``: the copy here is bad, bring another)."""
        if self.fetcher is None:
            return
        with self._heal:  # one fetch at a time; a concurrent reader never deletes a fresh replacement
            if (owner, replace) in self._fetched:
                return
            t0 = time.monotonic()
            d = self.fetcher.fetch(owner, self.step, replace=replace)
            m = layout.read_manifest(d)
            with self._lock:
                self._add(StepDir(d), m)
            self._fetched.add((owner, replace))
        log.info("rank %d's data of step %d now at %s (%.3fs)", owner, self.step, d, time.monotonic() - t0)

    def lacks(self, path: str, index: regions.Region) -> bool:
        """Copies on this host do not cover region ``index`` of array ``path``, and a fetcher may bring the rest."""
        arr = self.arrays.get(path)
        return arr is not None and self.fetcher is not None and \
            assemble.covered(arr, index, local_only=True) < regions.size(index)

    def remote_needs(self, path: str, index: regions.Region) -> dict[int, dict[str, Needs]]:
        """Remote rank -> file -> (saved shard -> the bytes [a, b) of it a read of ``index`` of ``path`` will
        need, block-aligned; None: all of it), for the saved shards overlapping ``index`` that no copy on this
        host holds. Merge several reads' needs with :func:`merge_needs`; fetch them with :meth:`prefetch`."""
        if not self.lacks(path, index):
            return {}
        arr = self.arrays[path]
        size = regions.size(index)
        self.load_manifests()  # where the rest is (once per step source)
        out: dict[int, dict[str, Needs]] = {}
        for sidx, locs in arr.shards.items():
            owner = locs[0].where.remote if locs else None
            if owner is None or any(sl.where.remote is None for sl in locs) or not regions.overlaps(index, sidx):
                continue
            e = locs[0].entry
            src_sl = regions.slices_within(regions.intersection(index, sidx), sidx)
            rows = regions.partial_rows(e, sidx, src_sl) if size > 0 else None
            need = None if rows is None else regions.block_span(e, sidx, rows)
            merge_needs(out.setdefault(owner, {}), {e.file: {e: need}})
        return out

    def prefetch(self, owner: int, files: Iterable[str] | Mapping[str, Needs] | None = None) -> None:
        """Fetch ``files`` of ``owner``'s data now (all of it when None; given as :meth:`remote_needs` maps
        them, only the pieces needed): restores fetch what every host needs in parallel before reading."""
        if files is not None and owner in self._remote and owner != self.own_rank:
            self.fetch_files(owner, files)
            return
        self.bring(owner)

    def fetch_files(self, owner: int, files: Iterable[str] | Mapping[str, Needs]) -> list[SavedShard]:
        """Fetch the named files of remote rank ``owner`` (those not fetched already) and make the shards
        they hold readable here; returns the new locations. ``files`` as :meth:`remote_needs` maps them: of
        a file whose every needed shard needs only some of its bytes, only those pieces."""
        if self.fetcher is None:
            return []
        m = self._remote[owner]
        needs: Mapping[str, Needs] = files if isinstance(files, Mapping) else {}
        with self._heal:  # one fetch at a time per source; concurrent readers wait for the files they need
            want = sorted(f for f in set(files) if not self._files.holds(owner, f))
            if not want:
                return []
            by_name = {f.name: f for f in m.files}
            pieces, spans = plan_pieces(m, {f: needs[f] for f in want if f in needs})
            want = [f for f in want if f not in spans or not self._files.pieces_held(owner, f, spans[f])]
            if not want:
                return []
            names = set(want)
            pieces = [pc for pc in pieces if pc.name in names]
            t0 = time.monotonic()
            d = self.fetcher.fetch_files(owner, self.step, [by_name[f] for f in want], pieces=pieces)
            where = FetchedFiles(d, owner, verified=getattr(self.fetcher, "files_verified", False) is True)
            new = []
            with self._lock:
                self._copies += 1
                self._copy_at[where] = copy = self._copies
                for a in m.arrays:
                    sa = self.arrays[a.path]
                    for sh in a.shards:
                        if sh.file in names:
                            have = spans[sh.file].get(sh) if sh.file in spans else None
                            if sh.file in spans and sh not in spans[sh.file]:
                                continue  # a shard of a file fetched in pieces that none of them covers
                            loc = SavedShard(where, sh, copy, have)
                            sa.shards.setdefault(sh.index, []).append(loc)
                            new.append(loc)
                self._files.add(d, owner, want, spans)
        moved = sum(pc.length for pc in pieces) + sum(by_name[f].size for f in want if f not in spans)
        log.info("%d files (%d bytes%s) of rank %d's step %d fetched to %s (%.3fs)", len(want), moved,
                 f", {len(pieces)} pieces" if pieces else "", owner, self.step, d, time.monotonic() - t0)
        return new

    def close(self) -> None:
        """Stop following the copies landing here and remove the scratch directories of fetched files
        (arrays already built from them stay valid: their bytes are mapped or copied)."""
        for landing in self._landings:
            landing.close()
        self.close_fetched()

    def close_fetched(self) -> None:
        """Remove the scratch directories of other ranks' files fetched so far (a later read of them fetches
        them again)."""
        with self._heal, self._lock:
            gone = {FetchedFiles(d, owner) for d, owner in self._files.close().items()}
            self._forget_where(lambda loc: loc.where in gone)

    def owner_of(self, step_dir: Path) -> int | None:
        """Whose data the committed copy in ``step_dir`` holds (None: unknown, its manifest unreadable)."""
        where = StepDir(step_dir)
        for d, m in self.manifests:
            if d == where:
                return m.rank
        try:
            return layout.read_manifest(step_dir).rank
        except (OSError, layout.ManifestError):
            return None

    # ------------------------------------------------------------------ the ladder
    def read_shard(self, arr: SavedArray, index: regions.Region, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The verified bytes of one saved shard, as an array of its shape.

        ``rows``: only rows [r0, r1) of the shard's leading dimension (relative to the shard), a contiguous
        byte range: of a copy with block crc32cs only the blocks covering it are read and verified (a copy
        without them is read whole and sliced).

        Tries each copy in turn, fastest first (see :mod:`sidecar.copies`): committed or fetched copies here,
        then one still landing here, then remote ones, brought here through the fetcher (a peer, else the
        bucket). A copy that fails (crc mismatch, short or missing file, a lost peer) is forgotten in the way
        of its kind, and the next one is tried, within this call.
        """
        key = (arr.path, index, rows)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        dtype = tree.dtype_from_name(arr.dtype)
        shape = out_shape = regions.shape(index)
        span = None  # (byte start, byte stop) within the shard
        if rows is not None:
            start, stop, out_shape = regions.rows_span(index, dtype.itemsize, rows)
            span = (start, stop)
        nbytes = regions.size(index) * dtype.itemsize
        attempt = Attempt(arr.path, index, arr.shards)
        for _ in range(len(arr.shards.get(index, [])) + 8):
            # (A copy holding only pieces of the shard serves only reads within them.)
            loc = min((sl for sl in arr.shards.get(index, [])
                       if (sl.where, sl.copy) not in attempt.tried and sl.covers(span)),
                      key=lambda sl: sl.where.rung, default=None)
            if loc is None:
                break
            where = loc.where
            attempt.tried.add((where, loc.copy))
            if where.remote is None and loc.entry.length != nbytes:
                attempt.errors.append(layout.ManifestError(f"{where}: shard length {loc.entry.length} != shape {shape}"))
                continue
            try:
                buf = where.read(self, loc.entry, span)
            except where.failures as err:
                where.forget(self, loc, err, attempt)
                continue
            if buf is None:  # brought here: a nearer copy holds it now
                continue
            out = buf.view(dtype).reshape(out_shape)
            with self._lock:
                self._cache[key] = out
            return out
        checksum = [e for e in attempt.errors if isinstance(e, checksums.ChecksumError)]
        if checksum:
            raise checksum[0]
        if attempt.errors:
            raise attempt.errors[0]
        raise FileNotFoundError(f"no copy of shard {index} of {arr.path!r} in step {self.step}")

    # How each kind of copy is forgotten when a read of it fails (called by the copy's ``forget``).
    def fetch_failed(self, where: RemoteRank, err: BaseException, attempt: Attempt) -> None:
        attempt.errors.append(err)
        self.unreachable.setdefault(where.rank, str(err))
        log.warning("could not fetch %s for %s%s: %s", where, attempt.path, attempt.index, err)

    def landing_failed(self, where: LandingCopy, err: BaseException, attempt: Attempt) -> None:
        log.warning("the copy of %s%s landing in %s failed: %s", attempt.path, attempt.index, where.landing.tmp, err)
        attempt.errors.append(err)
        self._drop_landing(where, err)
        if not attempt.copies_left() and self.own_rank is not None:
            try:  # the committed copy, from whichever tier the replicator reaches (peer, bucket)
                self.bring(self.own_rank)
            except (OSError, layout.ManifestError, RuntimeError) as ferr:
                attempt.errors.append(ferr)
                log.warning("no committed copy of rank %d's step %d either: %s", self.own_rank, self.step, ferr)

    def dir_failed(self, where: StepDir, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        e, step_dir = loc.entry, where.path
        if isinstance(err, FileNotFoundError) and not (step_dir / layout.MANIFEST_NAME).exists():
            # The whole copy went (a GC, or the RAM disk replaced under us): absence, not corruption,
            # unless a concurrent read of this step dropped it as corrupt: then that is the error.
            log.info("the copy %s went while it was read: %s", step_dir, err)
            with self._lock:
                why = self.bad.get(step_dir)
                owner = self._bad_owner.get(step_dir)
            attempt.errors.append(err if why is None else BadCopyError(f"{step_dir} ({why})", e.crc32c, 0))
            self.drop_copy(step_dir, err, loc.copy, gone=True)
            # Dropped as bad by a concurrent read, which is fetching a good copy: wait for it (or fetch
            # it) rather than give up on the shard while the heal is in flight. A copy that simply went
            # (no owner recorded) is not brought back.
            self.replace_copy(step_dir, owner, attempt)
            return
        bad = _bad_copy(where, e, err)
        log.warning("bad copy of %s%s in %s: %s", attempt.path, attempt.index, step_dir, err)
        attempt.errors.append(bad)
        owner = self.owner_of(step_dir)  # before the drop forgets it
        self.drop_copy(step_dir, bad, loc.copy)
        self.replace_copy(step_dir, owner, attempt)

    def fetched_failed(self, where: FetchedFiles, loc: SavedShard, err: BaseException, attempt: Attempt) -> None:
        log.warning("bad copy of %s%s in %s: %s", attempt.path, attempt.index, where.path, err)
        attempt.errors.append(_bad_copy(where, loc.entry, err))
        # Forget (and delete) the file, so that the read fetches it again (the replicator checks every tier).
        with self._heal, self._lock:
            self._forget_where(lambda x: x.where == where and x.entry.file == loc.entry.file)
            self._files.forget_file(where.path, where.owner, loc.entry.file)
        if attempt.refetches < 2:
            attempt.refetches += 1
            attempt.tried.discard((RemoteRank(where.owner), 0))

    def replace_copy(self, step_dir: Path, owner: int | None, attempt: Attempt) -> None:
        """After dropping the copy in ``step_dir`` (``owner``'s data): when no copy of the shard is left, or the
        bad copy was this host's own, fetch one from other tiers (this host's copy of its own step must be whole
        again, even when a replica here serves this read)."""
        own = bool(self.roots) and owner is not None and owner == self.own_rank \
            and step_dir.is_relative_to(self.roots[0])
        if attempt.copies_left() and not own:
            return
        try:
            owner = self.owner_of(step_dir) if owner is None else owner
            if owner is not None:
                self._fetch_whole(owner, replace=True)
        except (OSError, layout.ManifestError, RuntimeError) as ferr:
            attempt.errors.append(ferr)
            log.warning("no replacement for the copy in %s: %s", step_dir, ferr)

    def drop_cache(self) -> None:
        """Forget the shards read so far (released in the background, see :func:`release_later`)."""
        with self._lock:
            dropped, self._cache = self._cache, {}
        if dropped:
            release_later(dropped)

    def not_covered(self, path: str, index: regions.Region, covered: int) -> OSError:
        """Why only ``covered`` elements of region ``index`` of ``path`` could be read: FileNotFoundError, or
        CorruptStepError naming the copies dropped as corrupt."""
        size = regions.size(index)
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
            return CorruptStepError(f"{msg}; corrupt copies (dropped): {bad}")
        return FileNotFoundError(msg)

    def assemble_local(self, path: str, index: regions.Region) -> Partial:
        """The parts of region ``index`` of array ``path`` that copies on this host hold, read now (see
        :func:`sidecar.assemble.assemble_local`)."""
        return assemble.assemble_local(self, path, index)

    def assemble(self, path: str, index: regions.Region, partial: Partial | None = None) -> np.ndarray:
        """Build the region ``index`` of array ``path`` (see :func:`sidecar.assemble.assemble`)."""
        return assemble.assemble(self, path, index, partial)

def _bad_copy(where: Copy, entry: layout.ShardEntry, err: BaseException) -> checksums.ChecksumError:
    """``err`` (a failed read of ``entry`` from ``where``) as the checksum error it stands for."""
    if isinstance(err, checksums.ChecksumError):
        return err
    return BadCopyError(f"{where}/{entry.file} ({type(err).__name__}: {err})", entry.crc32c, 0)


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
