"""Bringing a step's data to this host from the other tiers: a peer's RAM disk or the bucket.

Every fetch — a copy task, a restore, a sidecar's whole-step or file-subset fetch — walks the
coordinator's sources (fastest first) through one ladder, :func:`fetch_from`. A source is a
:class:`PeerSource` or a :class:`BucketSource` behind one small interface (``bring`` the whole step,
read its ``manifest``, fetch some ``files``); which one is decided once, in :meth:`Fetcher.source`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import tier_pb2
from replicator import restore_phases
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics
from replicator.net.rpc import Unavailable, details
from replicator.net.security import TlsOptions
from replicator.options import ReplicatorOptions
from replicator.peer import client as peer_client
from replicator.peer import protocol as peer_protocol
from replicator.peer.channels import PeerChannels
from replicator.peer.progress import FetchProgress
from replicator.restore_phases import RestoreClock
from replicator.tasks import TaskRunner
from replicator.tier_wire import WIRE_BUCKET_HOLDER, from_wire
from replicator.tiers import BUCKET_HOLDER, HolderRank, Tier
from sidecar import faults, layout, spares

if TYPE_CHECKING:  # the bucket's backends load only when a --backup-url is configured
    from replicator.backup.agent import BackupAgent
    from replicator.erasure.host import EcHost

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a peer that refuses connections is waited for before its copy counts as failed (the next tier,
# often the bucket, is tried then): a restarting daemon (every daemon restarts at each Orbax handshake) is
# back within a second, and a bucket download of a large step takes minutes.
PEER_RESTART_WAIT_SECONDS = 3.0


class Source(Protocol):
    """One place a rank's data of a step can come from."""

    tier: Tier
    owner_rank: int
    holder_rank: HolderRank  # BUCKET_HOLDER for the bucket
    content_hash: str | None
    where: str  # for logs and errors

    def bring(self, step: int) -> layout.StepManifest:
        """The whole step directory into this host's store (single-flight)."""

    def manifest(self, step: int) -> layout.StepManifest:
        """The step's manifest, without its data."""

    def files(self, step: int, entries: list[layout.FileEntry], dest: Path,
              pieces: Sequence[layout.FilePiece] = ()) -> int:
        """``entries`` into ``dest``, each verified (only ``pieces`` of them, where the tier can); the bytes
        moved."""


class PeerSource:
    """Another host's RAM disk, through its peer service."""

    def __init__(self, fetcher: Fetcher, src: cpb.RestoreSource):
        self._f = fetcher
        self.tier = from_wire(src.kind)
        self.owner_rank, self.holder_rank = src.owner_rank, src.holder_rank
        self.address = src.holder_address
        self.content_hash = src.content_hash or None
        self.where = f"peer rank {src.holder_rank}"  # what the sidecar is told (FetchFilesResponse.source)

    def bring(self, step: int) -> layout.StepManifest:
        return self._f.fetch_peer(self.address, self.owner_rank, step, self.content_hash)

    def manifest(self, step: int) -> layout.StepManifest:
        f = self._f
        return peer_client.get_manifest(self.address, self.owner_rank, step, token=f.token, tls=f.tls,
                                        timeout_seconds=f.opts.rpc_timeout_seconds, channels=f.channels)

    def files(self, step: int, entries: list[layout.FileEntry], dest: Path,
              pieces: Sequence[layout.FilePiece] = ()) -> int:
        # No manifest round trip: the peer offers the files as its manifest lists them (a mismatch is
        # refused), and each file (or piece) must match the asked-for crc32c on arrival.
        f = self._f
        return peer_client.fetch_files(self.address, self.owner_rank, step, entries, dest, token=f.token,
                                       tls=f.tls, throttle=f.throttle,
                                       timeout_seconds=f.opts.transfer_timeout_seconds, pieces=pieces,
                                       channels=f.channels)


class ParitySource:
    """Erasure coding: this host's own rank's data rebuilt from its code group (the other members' data and
    parity over the peer tier, ``replicator.erasure.rebuild.rebuild_own``), committed as its own step."""

    tier = Tier.PEER  # other hosts' RAM disks, as users read a restore's tier
    holder_rank = WIRE_BUCKET_HOLDER  # no one holder (the wire's -1)

    def __init__(self, fetcher: Fetcher, src: cpb.RestoreSource):
        from replicator.erasure.wire import CodeGroupSpec

        self._f = fetcher
        self.owner_rank = src.owner_rank
        self.group = CodeGroupSpec.from_proto(src.group)  # ValueError when malformed: the next source
        self.content_hash = self.group.hash_of(src.owner_rank)
        if src.content_hash and src.content_hash != self.content_hash:
            raise ValueError(f"parity source of rank {src.owner_rank}: content hash {src.content_hash[:12]}, its "
                             f"code group names {self.content_hash[:12]}")
        self.where = f"code group ec:{self.group.k}+{self.group.m} of ranks {list(self.group.members)}"

    def bring(self, step: int) -> layout.StepManifest:
        from replicator.erasure.rebuild import rebuild_own

        f, rank = self._f, self.owner_rank
        if f.ec is None or rank != f.store.rank:
            raise ValueError(f"rank {rank}'s data is rebuilt from parity only on its own host")
        ec = f.ec
        return f.tasks.once(rank, step, self.content_hash, lambda: rebuild_own(ec, step, self.group),
                            lambda: f.store.manifest(rank, step))

    def manifest(self, step: int) -> layout.StepManifest:
        return self.bring(step)  # the manifest is rebuilt with the data (the stream's first part)

    def files(self, step: int, entries: list[layout.FileEntry], dest: Path,
              pieces: Sequence[layout.FilePiece] = ()) -> int:
        raise FileNotFoundError("files of a step are not read from parity: rebuild the step first")


class BucketSource:
    """The job's committed backups."""

    tier = Tier.BUCKET
    holder_rank = BUCKET_HOLDER
    content_hash = None
    where = "bucket"

    def __init__(self, fetcher: Fetcher, src: cpb.RestoreSource):
        self._f = fetcher
        self.owner_rank = src.owner_rank

    def _agent(self) -> BackupAgent:
        if self._f.bucket is None:
            raise RuntimeError("no backup tier configured")
        return self._f.bucket

    def bring(self, step: int) -> layout.StepManifest:
        return self._f.download(self.owner_rank, step)

    def manifest(self, step: int) -> layout.StepManifest:
        return self._agent().read_manifest(step, self.owner_rank)

    def files(self, step: int, entries: list[layout.FileEntry], dest: Path,
              pieces: Sequence[layout.FilePiece] = ()) -> int:
        return self._agent().fetch_files(step, self.owner_rank, entries, dest)  # whole files, ranged reads


def fetched_tier(src: Source) -> Tier:
    """The tier a restore's bytes come from, as users read it: ``peer`` (another host's RAM disk, the owner's
    own or a copy's: the coordinator names the owner's ``local``) or ``bucket``."""
    return Tier.BUCKET if src.tier is Tier.BUCKET else Tier.PEER


class AbandonedSave(FileNotFoundError):
    """Every source holds only an older save of the step than the one asked for (the job rolled back and
    saved the step again; the coordinator has not heard of the newer copies yet)."""


def fetch_from(sources: Sequence[Source], attempt: Callable[[Source], T], *, what: str, missing: str) -> T:
    """``attempt(source)`` for each source in turn (fastest first) until one succeeds: its answer.

    Raises ``FileNotFoundError(missing)`` when there is no source at all, :class:`AbandonedSave` when every
    source held only an abandoned save, :class:`Unavailable` naming every source's error when none served.
    """
    errors = []
    abandoned = 0
    for src in sources:
        try:
            return attempt(src)
        except AbandonedSave as e:
            abandoned += 1
            errors.append(f"{src.where}: {e}")
        except Exception as e:  # the next tier
            log.warning("%s from %s failed: %s", what, src.where, e)
            errors.append(f"{src.where}: {type(e).__name__}: {details(e)}")
    if not sources:
        raise FileNotFoundError(missing)
    if abandoned == len(sources):
        raise AbandonedSave(f"{what}: " + "; ".join(errors))
    raise Unavailable(f"{what} is unreachable: " + "; ".join(errors))


class Fetcher:
    """The daemon's transfers into this host's store, single-flight through the :class:`TaskRunner`."""

    def __init__(self, opts: ReplicatorOptions, store: RamDiskStore, tasks: TaskRunner,
                 bucket: BackupAgent | None, metrics: ReplicatorMetrics, *, token: str | None,
                 tls: TlsOptions | None):
        self.opts, self.store, self.tasks, self.bucket = opts, store, tasks, bucket
        self.metrics, self.counters = metrics, metrics.counters
        self.token, self.tls = token, tls
        # One kept channel per peer for every copy, manifest and file fetch (closed by :meth:`close`).
        self.channels = PeerChannels()
        self.throttle: peer_protocol.Throttle | None = None  # set once the peer service is up
        self.ec: EcHost | None = None  # erasure coding: this host's side (rebuilds from parity)
        # Whole-step peer fetches running now: their watermark, for a sidecar that reads while they land.
        self._landing: dict[tuple[int, int], FetchProgress] = {}
        self._landing_lock = threading.Lock()
        # This rank's own steps being brought for a restore (either path): when they appear on the RAM
        # disk they are not saves (:meth:`restored_among`).
        self._restoring: set[int] = set()

    def close(self) -> None:
        """Close the channels to peers (the daemon stops): fetches still running fail, leaving no copy."""
        self.channels.close()

    def landing(self, owners: Sequence[int], step: int) -> FetchProgress | None:
        """The progress of a running peer fetch of one of ``owners``' ``step``, if any."""
        with self._landing_lock:
            return next((p for o in owners if (p := self._landing.get((o, step))) is not None), None)

    def _mark_restoring(self, step: int) -> None:
        with self._landing_lock:
            self._restoring.add(step)

    def restored_among(self, steps: set[int]) -> set[int]:
        """Which of these own steps on the RAM disk a restore brought, not a save (forgotten once asked)."""
        with self._landing_lock:
            restored = self._restoring & steps
            self._restoring -= restored
        return restored

    def source(self, src: cpb.RestoreSource) -> Source:
        """The fetchable tier a coordinator's source names."""
        if src.kind == tier_pb2.TIER_PARITY:
            return ParitySource(self, src)
        return BucketSource(self, src) if from_wire(src.kind) is Tier.BUCKET else PeerSource(self, src)

    def sources(self, srcs: Sequence[cpb.RestoreSource]) -> list[Source]:
        """:meth:`source` of each; one that is malformed is left out (logged)."""
        out: list[Source] = []
        for s in srcs:
            try:
                out.append(self.source(s))
            except ValueError as e:
                log.warning("ignoring a restore source of rank %d: %s", s.owner_rank, e)
        return out

    # ------------------------------------------------------------------ whole steps, single-flight
    def fetch_peer(self, address: str, owner: int, step: int, content_hash: str | None) -> layout.StepManifest:
        """Fetch ``owner``'s ``step`` from the peer at ``address`` (single-flight, see :meth:`TaskRunner.once`)."""
        return self.tasks.once(owner, step, content_hash,
                               lambda: self._fetch_now(address, owner, step, content_hash),
                               lambda: self.store.manifest(owner, step))

    def download(self, owner: int, step: int) -> layout.StepManifest:
        """Fetch ``owner``'s ``step`` from the bucket (single-flight, see :meth:`TaskRunner.once`)."""
        if self.bucket is None:
            raise RuntimeError("no backup tier configured")
        bucket = self.bucket
        parent = self.store.step_dir(owner, step).parent

        def download() -> layout.StepManifest:
            bucket.download(step, owner, parent)
            m = self.store.manifest(owner, step)
            if m is None:
                raise RuntimeError(f"the download of rank {owner} step {step} left no committed copy")
            return m

        return self.tasks.once(owner, step, None, download, lambda: self.store.manifest(owner, step))

    def _fetch_now(self, address: str, owner: int, step: int, content_hash: str | None) -> layout.StepManifest:
        dest = self.store.step_dir(owner, step).parent
        t0 = time.monotonic()
        progress = FetchProgress()
        with self._landing_lock:
            self._landing[(owner, step)] = progress
        try:
            m = peer_client.fetch_step(address, owner, step, dest, token=self.token, tls=self.tls,
                                       timeout_seconds=self.opts.transfer_timeout_seconds,
                                       throttle=self.throttle, expected_content_hash=content_hash,
                                       spare_dir=spares.spare_dir(self.store.root), progress=progress,
                                       connect_wait_seconds=PEER_RESTART_WAIT_SECONDS, channels=self.channels)
        except BaseException as e:
            progress.failed(e)  # e.g. the manifest call failed before the fetch began
            raise
        finally:
            with self._landing_lock:
                if self._landing.get((owner, step)) is progress:
                    del self._landing[(owner, step)]
        dt = time.monotonic() - t0
        log.info("copy: fetched rank %d step %d from %s: %d bytes in %.3fs (%.2f GiB/s)",
                 owner, step, address, m.total_bytes, dt, m.total_bytes / max(dt, 1e-9) / 2**30)
        return m

    # ------------------------------------------------------------------ the coordinator's tasks
    def copy(self, task: cpb.CopyTask) -> None:
        """A copy task: another rank's step onto this host's RAM disk (redundancy)."""
        if self.store.has(task.owner_rank, task.step):
            return
        faults.point("copy.before_fetch")
        t0 = time.monotonic()
        m = self.fetch_peer(task.source_address, task.owner_rank, task.step, task.content_hash or None)
        self.metrics.observe_transfer("peer_copy", time.monotonic() - t0)
        self.counters.add("copies")
        self.counters.add("copy_bytes", m.total_bytes)

    def restore(self, rank: int, task: cpb.RestoreTask, plan_seconds: float = 0.0,
                planned_at: float | None = None) -> None:
        """A restore task: ``rank``'s (this host's) data of the step to restore, from the first source that has it.

        ``plan_seconds``: the heartbeat that carried the task (the restore's ``plan`` phase), sent at
        ``planned_at`` (``time.monotonic()``; None: now)."""
        if not task.sources:
            return
        self._mark_restoring(task.step)
        t0 = time.monotonic()
        clock = RestoreClock(task.step, rank, "task", started=planned_at)
        clock.add("plan", None, plan_seconds)

        def attempt(src: Source) -> None:
            if self.store.holds_data_for(rank, task.step, src.content_hash):
                with clock.fetching(Tier.LOCAL):
                    self.store.attest_restored(task.step, src.content_hash)  # held as a replica's copy
                restore_phases.report(clock, self.metrics, rank=rank, tier=Tier.LOCAL, nbytes=0,
                                      where="this host's RAM disk")
                return
            t1 = time.monotonic()
            with clock.fetching(fetched_tier(src)):
                if src.tier is not Tier.BUCKET and self.store.has(src.owner_rank, task.step):
                    # A stale copy under the same name (e.g. an older save of this step): replace it.
                    self.store.delete(src.owner_rank, task.step)
                if src.tier is not Tier.BUCKET:
                    faults.point("restore.peer.before_fetch")
                src.bring(task.step)
            now = time.monotonic()
            m = self.store.manifest(src.owner_rank, task.step)
            nbytes = m.total_bytes if m is not None else 0
            self.metrics.observe_transfer(f"restore_{'bucket' if src.tier is Tier.BUCKET else 'peer'}", now - t1)
            self._count_restore(now - t0, nbytes)
            restore_phases.report(clock, self.metrics, rank=rank, tier=fetched_tier(src), nbytes=nbytes,
                                  where=src.where)
            if src.owner_rank != rank:
                # Kept under the replica's name: record (and report) that it is this rank's data too, so the
                # identity does not rest on the replica's host alone (issue #19).
                self.store.attest_restored(task.step, src.content_hash)

        fetch_from(self.sources(task.sources), attempt,
                        what=f"restore of rank {rank} step {task.step}", missing="")

    # ------------------------------------------------------------------ for the sidecar
    def _count_restore(self, seconds: float, nbytes: int) -> None:
        """This host now holds its rank's data of a restore step, fetched from a peer or the bucket."""
        self.metrics.restore_seconds.observe(seconds)
        self.counters.add("restores")
        self.counters.add("restore_bytes", nbytes)

    def for_sidecar(self, sources: Sequence[cpb.RestoreSource], savers: list[int], owner: int, step: int,
                    manifest_only: bool, min_generation: int = 0,
                    clock: RestoreClock | None = None) -> tuple[str, bytes]:
        """``owner``'s ``step`` (or its manifest) from the first of ``sources`` that serves it: (the copy's
        directory relative to the local root, or the manifest JSON when ``manifest_only``; of a save of at
        least ``min_generation``, else :class:`AbandonedSave`). ``clock`` (whole steps): the restore's
        phases, reported once the data is here."""

        def attempt(src: Source) -> tuple[str, bytes]:
            if manifest_only:
                m = src.manifest(step)
                if m.generation < min_generation:
                    raise AbandonedSave(f"its copy is of an abandoned save (generation {m.generation} < "
                                        f"{min_generation})")
                return "", m.to_json()
            tier = fetched_tier(src) if not self.store.has(src.owner_rank, step, src.content_hash) else Tier.LOCAL
            with clock.fetching(tier) if clock is not None else contextlib.nullcontext():
                if tier is not Tier.LOCAL:
                    if src.owner_rank == self.store.rank:
                        self._mark_restoring(step)  # lands as this rank's own step: not a save
                    if self.store.has(src.owner_rank, step):
                        self.store.delete(src.owner_rank, step)  # a stale copy of an older save
                    src.bring(step)
            if owner == self.store.rank and src.owner_rank != owner:
                self.store.attest_restored(step, src.content_hash)  # this rank's data as a replica's copy
            rel = self.store.step_dir(src.owner_rank, step).relative_to(self.store.root).as_posix()
            if clock is None:
                log.info("rank %d's data of step %d fetched for the sidecar from %s", owner, step, src.where)
            else:
                m = self.store.manifest(src.owner_rank, step)
                nbytes = m.total_bytes if m is not None and tier is not Tier.LOCAL else 0
                rec = restore_phases.report(clock, self.metrics, rank=self.store.rank, tier=tier, nbytes=nbytes,
                                            where=f"{src.where} for the sidecar")
                if tier is not Tier.LOCAL and owner == self.store.rank:
                    # This host's data of the step, brought for its sidecar before (or instead of) the
                    # coordinator's restore task: the same restore, counted the same way.
                    self._count_restore(rec.seconds, nbytes)
            return rel, b""

        return fetch_from(self.sources(sources), attempt,
                               what=f"rank {owner}'s data of step {step}",
                               missing=f"rank {owner}'s data of step {step} is on no tier the coordinator knows "
                                       f"(savers {savers})")

    def files_for_sidecar(self, sources: Sequence[cpb.RestoreSource], savers: list[int], owner: int, step: int,
                          entries: list[layout.FileEntry], dest: Path,
                          pieces: Sequence[layout.FilePiece] = (),
                          clock: RestoreClock | None = None) -> tuple[str, int]:
        """``entries`` of ``owner``'s ``step`` into ``dest`` from the first sources that serve them (a source
        that fails mid-way leaves the files still missing to the next): (where from, bytes moved).
        ``clock``: the restore's phases, reported once every file is here."""
        t0 = time.monotonic()
        moved = 0

        def attempt(src: Source) -> tuple[str, int]:
            nonlocal moved
            todo = [e for e in entries if not (dest / e.name).exists()]
            if todo:
                names = {e.name for e in todo}
                with clock.fetching(fetched_tier(src)) if clock is not None else contextlib.nullcontext():
                    n = src.files(step, todo, dest, [pc for pc in pieces if pc.name in names])
                moved += n
                self.counters.add("reshard_files", len(todo))
                self.counters.add("reshard_bytes", n)  # the bytes moved: of files fetched in pieces, the pieces
                log.info("%d files (%d bytes moved) of rank %d step %d fetched for the sidecar from %s in %.3fs",
                         len(todo), n, owner, step, src.where, time.monotonic() - t0)
            if clock is not None:
                restore_phases.report(clock, self.metrics, rank=self.store.rank, tier=fetched_tier(src), nbytes=moved,
                                      where=f"{src.where} ({len(entries)} files) for the sidecar")
            return src.where, moved

        return fetch_from(self.sources(sources), attempt,
                               what=f"files of rank {owner}'s step {step}",
                               missing=f"rank {owner}'s data of step {step} is on no tier the coordinator knows "
                                       f"(savers {savers})")


def other_sources(sources: Sequence[Any], rank: int) -> list[Any]:
    """The sources that are not this host's own RAM disk (absent or bad when asked for)."""
    return [x for x in sources if x.kind in (tier_pb2.TIER_BUCKET, tier_pb2.TIER_PARITY) or x.holder_rank != rank]
