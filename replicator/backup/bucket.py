"""The backup commit protocol on top of a Store: staged uploads, content-hash dedup, atomic commit, restore.

Bucket layout under the store root (the URL's prefix)::

    <job>/staging/<step>-<nonce>/BEGIN.json               staging record (step, nodes, id, creation time)
    <job>/staging/<step>-<nonce>/data/<hash>/<file>       file bytes, keyed by the rank's content hash
    <job>/staging/<step>-<nonce>/ranks/<rank>.json        rank's StepManifest (uploaded after its data)
    <job>/commits/<step>.json                             "marker" commit: create-only record -> staging id
    <job>/steps/<step>/{BEGIN,COMMIT}.json, data/, ranks/ "rename" commit: the staging folder, renamed

A backup is visible only once committed: by the atomic rename of its staging folder to ``steps/<step>``
(hierarchical-namespace buckets, POSIX directories), or else by a commit record written last with a
create-only precondition. Readers only ever look at committed steps.

A step number saved again after a rollback (a newer ``generation``, see ``sidecar.layout.StepManifest``)
supersedes its abandoned backup: the commit removes the older backup (commit record first, so it is never
half-visible) and then commits the new one. At every moment the bucket holds either the old save of the
step, none, or the new one, each whole; a crash in between leaves none, and the next backup brings it.

Why one class for the protocol: staging, upload, commit, supersession, retention and download are one
protocol over one bucket layout, and each step's correctness depends on the others' names and ordering (a
commit record written last, a supersede that removes the record first). The layout's names and the typed
records it writes and returns are in ``records.py``; the storage backends it runs on are in ``storage/``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from replicator.net.throttle import RateLimiter
from sidecar import faults
from sidecar.checksums import ChecksumError, crc32c_extend, file_crc32c
from sidecar.commit import commit_dir, make_tmp_dir, write_manifest
from sidecar.layout import (
    MANIFEST_NAME,
    FileEntry,
    ManifestError,
    StepManifest,
    check_job_name,
    parse_step_name,
    read_manifest,
    resolve_under,
    step_name,
)

from .records import (
    BEGIN_NAME,
    COMMIT_NAME,
    COMMITS_DIR,
    DATA_DIR,
    RANKS_DIR,
    STAGING_DIR,
    STAGING_ID_RE,
    STEPS_DIR,
    STRATEGY_MARKER,
    STRATEGY_RENAME,
    BackupCommit,
    BackupError,
    BackupOptions,
    CapabilityReport,
    IncompleteBackupError,
    Staging,
    UnsupportedBucketError,
    UploadResult,
    check_staging_id,
)
from .storage.base import Store, UnsupportedOperation

# The protocol's values and errors are part of this module's interface (callers import them from here).
__all__ = [
    "BackupCommit",
    "BackupError",
    "BackupOptions",
    "BackupStore",
    "CapabilityReport",
    "IncompleteBackupError",
    "Staging",
    "UnsupportedBucketError",
    "UploadResult",
]

log = logging.getLogger(__name__)

_MAX_RECORD_BYTES = 16 << 20
# Ranged reads of fetch_files: large enough to amortise a request, small enough to bound memory per thread.
RANGE_BYTES = 16 << 20


def _data_name(base: str, content_hash: str, file_name: str) -> str:
    return f"{base}/{DATA_DIR}/{content_hash}/{file_name}"


def _data_key(manifest: StepManifest) -> str:
    """The folder under ``data/`` holding a rank's files: replicas with equal keys share it.

    The content hash, unless the manifest carries a ``content_id`` (Orbax steps): data-parallel Orbax
    replicas share that identity but not their bytes (per-writer metadata, OCDBT file names), so their
    files are keyed by the file list instead and never overwrite each other's.
    """
    if not manifest.content_id:
        return manifest.content_hash
    h = hashlib.sha256()
    for f in sorted(manifest.files, key=lambda f: f.name):
        h.update(json.dumps([f.name, f.size, f.crc32c]).encode() + b"\n")
    return "files-" + h.hexdigest()


def _staged_ranks(store: Store, job: str, base: str, begin: Staging) -> tuple[tuple[str, ...], int, int]:
    """(each rank's content hash, "" for a rank that did not save the step; total bytes; the save's
    generation) of the staging at ``base``, once every saver's manifest and files are there.

    IncompleteBackupError names what is missing; ManifestError when a manifest is of another step or rank,
    or the ranks' manifests are of different saves (generations) of the step. Reads only.
    """
    present = {o.name: o for o in store.list(base)}
    hashes: list[str] = []
    missing: list[str] = []
    total = 0
    expected = set(begin.expected_ranks)
    generations: set[int] = set()
    for rank in range(begin.nodes):
        if rank not in expected:
            hashes.append("")  # did not save this step
            continue
        name = f"{base}/{RANKS_DIR}/{rank}.json"
        if name not in present:
            missing.append(f"manifest of rank {rank}")
            continue
        m = StepManifest.from_json(store.read(name))
        if m.step != begin.step or m.rank != rank:
            raise ManifestError(f"{name} is step {m.step} rank {m.rank}")
        generations.add(m.generation)
        hashes.append(m.content_hash)
        total += m.total_bytes
        for f in m.files:
            o = present.get(_data_name(base, _data_key(m), f.name))
            if o is None or o.size != f.size or (o.crc32c is not None and o.crc32c != f.crc32c):
                missing.append(f"rank {rank} file {f.name}")
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise IncompleteBackupError(f"cannot commit {job} step {begin.step}: missing {shown}")
    if len(generations) > 1:
        raise ManifestError(f"cannot commit {job} step {begin.step}: its ranks' manifests are of "
                            f"different saves (generations {sorted(generations)})")
    return tuple(hashes), total, generations.pop() if generations else 0


class BackupStore:
    """Backups of job ``job`` in ``store`` (see the module docstring for the layout and protocol).

    Thread-safe; several processes (one per host) may upload ranks of the same staging concurrently.

    Why ~490 lines in one class: staging, commit, reads and retention are one protocol over one bucket layout
    (staging ids, the commit marker or rename, the content-addressed data names); split apart, each part
    would re-derive that layout (the records and names it shares live in ``records.py``).
    """

    def __init__(self, store: Store, job: str, options: BackupOptions | None = None):
        check_job_name(job)
        self.store = store
        self.job = job
        self.options = options or BackupOptions()
        self._limiter = (
            RateLimiter(self.options.max_bytes_per_second, burst_bytes=int(self.options.max_bytes_per_second / 4))
            if self.options.max_bytes_per_second else None
        )
        self._report: CapabilityReport | None = None

    def unthrottle(self) -> None:
        """Upload at full speed from now on (an emergency backup on a preemption notice)."""
        self._limiter = None

    # ------------------------------------------------------------------ names

    def _staging_prefix(self, staging_id: str) -> str:
        return f"{self.job}/{STAGING_DIR}/{staging_id}"

    # ------------------------------------------------------------------ capabilities

    def check_capabilities(self) -> CapabilityReport:
        """Decide the commit strategy: atomic rename if offered, else a probed create-only precondition.

        Raises UnsupportedBucketError (with what is missing) when neither works. The create-only probe
        really writes twice, because some stores (e.g. gcp-storage-emulator) silently ignore preconditions.
        """
        caps = self.store.capabilities
        want = self.options.commit_strategy
        create_only, why = (
            self._probe_create_only() if caps.create_only else (False, "not offered by backend")
        )
        if caps.rename_prefix and want in ("auto", STRATEGY_RENAME):
            strategy = STRATEGY_RENAME
        elif create_only and want in ("auto", STRATEGY_MARKER):
            strategy = STRATEGY_MARKER
        else:
            raise UnsupportedBucketError(
                f"{self.store.url}: cannot commit backups safely (strategy {want!r}): "
                f"atomic folder rename {'available' if caps.rename_prefix else 'unavailable (no hierarchical namespace)'}, "
                f"create-only preconditions {'available' if create_only else 'unavailable (' + why + ')'}. "
                "Use a Cloud Storage bucket (hierarchical namespace recommended) or a local folder."
            )
        detail = (
            f"{self.store.url}: commit by {strategy} (rename={caps.rename_prefix}, create_only={create_only})"
        )
        self._report = CapabilityReport(strategy, caps.rename_prefix, create_only, detail)
        log.info("%s", detail)
        return self._report

    def _probe_create_only(self) -> tuple[bool, str]:
        probe = f"{self.job}/.probe-{uuid.uuid4().hex[:12]}"
        try:
            self.store.write(probe, b"1", create_only=True)
            try:
                self.store.write(probe, b"2", create_only=True)
            except FileExistsError:
                return True, "enforced"
            return False, "the store accepted a second create-only write: preconditions are ignored"
        except UnsupportedOperation as e:
            return False, str(e)
        finally:
            self.store.delete(probe)

    def _strategy(self) -> str:
        return (self._report or self.check_capabilities()).strategy

    # ------------------------------------------------------------------ writing

    def begin(self, step: int, nodes: int, ranks: Iterable[int] = ()) -> Staging:
        """Start a backup attempt of ``step`` for ``ranks`` (default ``0..nodes-1``); nothing becomes visible yet."""
        step_name(step)
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive int, got {nodes!r}")
        ranks = tuple(sorted(set(ranks)))
        if any(not 0 <= r < nodes for r in ranks):
            raise ValueError(f"ranks {list(ranks)} outside 0..{nodes - 1}")
        if ranks == tuple(range(nodes)):
            ranks = ()
        staging = Staging(step, nodes, f"{step}-{uuid.uuid4().hex[:12]}", time.time(), ranks)
        self.store.write(
            f"{self._staging_prefix(staging.staging_id)}/{BEGIN_NAME}", json.dumps(staging.to_dict()).encode()
        )
        log.info("backup of %s step %d: staging %s for %d ranks", self.job, step, staging.staging_id, nodes)
        return staging

    def open_staging(self, staging_id: str) -> Staging:
        """The Staging another process began (read back from its BEGIN record)."""
        if not isinstance(staging_id, str) or not STAGING_ID_RE.match(staging_id):
            raise ValueError(f"bad staging id {staging_id!r}")
        data = self.store.read(f"{self._staging_prefix(staging_id)}/{BEGIN_NAME}")
        return Staging.from_dict(json.loads(data))

    def upload_rank(
        self, staging: Staging, rank: int, step_dir: Path, manifest: StepManifest | None = None
    ) -> UploadResult:
        """Upload rank ``rank``'s committed step directory into ``staging``, then its manifest.

        Each file is written with its manifest crc32c, which the store checks on the bytes it reads from the
        file (a corrupt local step is never backed up: ``Store.write`` keeps nothing that does not match; the
        gs:// backend checks before a file's last chunk is sent, and the service again), and the stored
        object's crc32c after. No separate checksum pass reads the file first. Files already present under
        the same content hash (a data-parallel replica uploaded them) are not sent again.
        """
        t0 = time.monotonic()
        step_dir = Path(step_dir)
        manifest = manifest or read_manifest(step_dir)
        if not isinstance(rank, int) or not 0 <= rank < staging.nodes:
            raise ValueError(f"rank {rank!r} outside 0..{staging.nodes - 1}")
        if manifest.step != staging.step or manifest.rank != rank:
            raise ValueError(
                f"manifest is step {manifest.step} rank {manifest.rank}, staging wants step {staging.step} rank {rank}"
            )
        base = self._staging_prefix(staging.staging_id)
        self.store.stat(f"{base}/{BEGIN_NAME}")  # FileNotFoundError: no such staging (aborted or committed)
        content_hash = _data_key(manifest)
        existing = {o.name: o for o in self.store.list(f"{base}/{DATA_DIR}/{content_hash}")}
        todo, reused = [], []
        for f in manifest.files:
            name = _data_name(base, content_hash, f.name)
            o = existing.get(name)
            if o is not None and o.size == f.size and (o.crc32c is None or o.crc32c == f.crc32c):
                reused.append(f)
            else:
                todo.append(f)

        def upload(f: Any) -> int:
            path = resolve_under(step_dir, f.name)
            size = os.stat(path).st_size
            if size != f.size:
                raise ChecksumError(f"{path} (before upload, size {size} vs {f.size})", f.crc32c, 0)
            info = self.store.write(
                _data_name(base, content_hash, f.name),
                path,
                crc32c=f.crc32c,
                throttle=self._limiter.acquire if self._limiter else None,
            )
            faults.point("backup.upload.mid_upload")
            if info.size != f.size or (info.crc32c is not None and info.crc32c != f.crc32c):
                raise ChecksumError(
                    f"{self.store.url}/{info.name} (after upload)", f.crc32c, info.crc32c or 0
                )
            return f.size

        if todo:
            workers = min(self.options.max_parallel_uploads, len(todo))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="backup-up") as pool:
                sent = sum(pool.map(upload, todo))
        else:
            sent = 0
        faults.point("backup.upload.before_manifest")
        self.store.write(f"{base}/{RANKS_DIR}/{rank}.json", manifest.to_json())
        faults.point("backup.upload.after_manifest")
        secs = time.monotonic() - t0
        log.info(
            "backup %s step %d rank %d: uploaded %d files / %d bytes in %.2fs (%.1f MiB/s), reused %d files",
            self.job, staging.step, rank, len(todo), sent, secs, sent / max(secs, 1e-9) / 2**20, len(reused),
        )  # fmt: skip
        return UploadResult(
            staging.step, rank, len(todo), sent, len(reused), sum(f.size for f in reused), secs
        )

    def commit(self, staging: Staging) -> int:
        """Verify every rank's manifest and data are in ``staging``, then make the backup visible atomically.

        IncompleteBackupError names what is missing (nothing changes); ManifestError when the ranks'
        manifests are of different saves (generations) of the step; FileExistsError when the step is already
        committed from this save or a newer one. An older save of the step (abandoned by a rollback) is
        superseded: removed, then this one committed (see the module docstring). Returns the committed step.
        """
        strategy = self._strategy()
        base = self._staging_prefix(staging.staging_id)
        begin = self.open_staging(staging.staging_id)
        if begin.step != staging.step or begin.nodes != staging.nodes:
            raise ValueError(f"staging {staging.staging_id} is step {begin.step} with {begin.nodes} nodes")
        hashes, total, generation = _staged_ranks(self.store, self.job, base, begin)
        if staging.step in self.committed_steps():
            old = self.committed_generation(staging.step)
            if old >= generation:
                raise FileExistsError(f"{self.job} step {staging.step} already has a committed backup "
                                      f"(generation {old}, this one {generation})")
            log.warning("backup of %s step %d: superseding the abandoned save (generation %d) by generation %d",
                        self.job, staging.step, old, generation)
            self._delete_backup(staging.step)
        record = BackupCommit(self.job, staging.step, staging.nodes, staging.staging_id, strategy, hashes, total,
                              time.time(), generation=generation)
        faults.point("backup.commit.before_record")
        if strategy == STRATEGY_RENAME:
            # A steps/<N> folder without COMMIT.json is the remains of a retention that crashed midway
            # (the record goes first): garbage by construction, and it would block the rename.
            self._remove_uncommitted_step_dir(staging.step)
            self.store.write(f"{base}/{COMMIT_NAME}", record.to_json())
            faults.point("backup.commit.after_record")
            self.store.rename_prefix(base, f"{self.job}/{STEPS_DIR}/{step_name(staging.step)}")
            faults.point("backup.commit.after_rename")
        else:
            try:
                self.store.write(
                    f"{self.job}/{COMMITS_DIR}/{step_name(staging.step)}.json",
                    record.to_json(),
                    create_only=True,
                )
            except FileExistsError:
                raise FileExistsError(
                    f"{self.job} step {staging.step} already has a committed backup"
                ) from None
        log.info("committed backup of %s step %d (%d ranks, %d bytes) by %s", self.job, staging.step, staging.nodes,
                 total, strategy)
        return staging.step

    def abort(self, staging: Staging) -> int:
        """Delete an uncommitted staging (e.g. after a failed upload). Returns objects deleted."""
        check_staging_id(staging.staging_id, staging.step)
        if staging.staging_id in self._referenced_staging_ids():
            raise BackupError(f"staging {staging.staging_id} is a committed backup; use apply_retention")
        return self.store.delete(self._staging_prefix(staging.staging_id), recursive=True)

    # ------------------------------------------------------------------ reading

    def _marker_steps(self) -> list[int]:
        out = []
        for o in self.store.list(f"{self.job}/{COMMITS_DIR}"):
            stem = o.name.rsplit("/", 1)[-1]
            if stem.endswith(".json") and parse_step_name(stem[:-5]) is not None:
                out.append(int(stem[:-5]))
        return out

    def _renamed_steps(self) -> list[int]:
        out = []
        for o in self.store.list(f"{self.job}/{STEPS_DIR}", shallow=True):
            stem = o.name.rsplit("/", 1)[-1]
            if o.is_dir and parse_step_name(stem) is not None:
                try:
                    self.store.stat(f"{o.name}/{COMMIT_NAME}")
                except FileNotFoundError:
                    continue  # a half-deleted backup: its commit record went first
                out.append(int(stem))
        return out

    def committed_steps(self) -> list[int]:
        """Steps with a committed backup, ascending."""
        return sorted(set(self._marker_steps()) | set(self._renamed_steps()))

    def commit_record(self, step: int) -> tuple[BackupCommit, str]:
        """(commit record, prefix holding the backup's data/ and ranks/); FileNotFoundError if uncommitted."""
        name = step_name(step)
        for record_name, base in (
            (f"{self.job}/{COMMITS_DIR}/{name}.json", None),
            (f"{self.job}/{STEPS_DIR}/{name}/{COMMIT_NAME}", f"{self.job}/{STEPS_DIR}/{name}"),
        ):
            try:
                data = self.store.read(record_name)
            except FileNotFoundError:
                continue
            rec = BackupCommit.from_json(data[: _MAX_RECORD_BYTES + 1])
            if rec.step != step or rec.job != self.job:
                raise ManifestError(f"{record_name} describes {rec.job} step {rec.step}")
            return rec, base or self._staging_prefix(rec.staging_id)
        raise FileNotFoundError(f"{self.store.url}: {self.job} step {step} has no committed backup")

    def committed_generation(self, step: int) -> int:
        """The generation of the save committed as ``step`` (FileNotFoundError if none is)."""
        rec, _ = self.commit_record(step)
        if rec.generation:
            return rec.generation
        # A record written before generations were recorded: every rank's manifest carries it.
        rank = next(r for r, h in enumerate(rec.rank_hashes) if h)
        return self.read_manifest(step, rank).generation

    def read_manifest(self, step: int, rank: int) -> StepManifest:
        """Rank ``rank``'s manifest of committed step ``step``, checked against the commit record."""
        rec, base = self.commit_record(step)
        if not isinstance(rank, int) or not 0 <= rank < rec.nodes:
            raise ValueError(f"rank {rank!r} outside 0..{rec.nodes - 1} of {self.job} step {step}")
        if not rec.rank_hashes[rank]:
            raise FileNotFoundError(f"rank {rank} did not save {self.job} step {step} (backed up ranks: "
                                    f"{[r for r, h in enumerate(rec.rank_hashes) if h]})")
        m = StepManifest.from_json(self.store.read(f"{base}/{RANKS_DIR}/{rank}.json"))
        if m.step != step or m.rank != rank or m.content_hash != rec.rank_hashes[rank]:
            raise ManifestError(
                f"manifest of {self.job} step {step} rank {rank} does not match its commit record"
            )
        return m

    def download_rank(self, step: int, rank: int, dest_parent: Path) -> Path:
        """Restore rank's data of committed ``step`` as ``dest_parent/<step>`` (verified, then renamed in).

        Raises ChecksumError on any corrupt file and leaves nothing behind; FileExistsError when a committed
        step (one with its manifest) is at ``dest_parent/<step>`` already. A directory there without a
        manifest is debris of a killed writer or of a deleter that walked into it; the commit replaces it.
        """
        t0 = time.monotonic()
        rec, base = self.commit_record(step)
        manifest = self.read_manifest(step, rank)
        dest_parent = Path(dest_parent)
        final = dest_parent / step_name(step)
        if (final / MANIFEST_NAME).is_file():
            raise FileExistsError(f"{final} already exists")
        tmp = make_tmp_dir(dest_parent, step)
        content_hash = _data_key(manifest)

        def fetch(f: Any) -> int:
            dest = resolve_under(tmp, f.name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            info = self.store.read_to_file(_data_name(base, content_hash, f.name), dest)
            faults.point("restore.bucket.mid_download")
            if info.size != f.size or info.crc32c != f.crc32c:
                raise ChecksumError(
                    f"{self.store.url}/{_data_name(base, content_hash, f.name)} (size {info.size} vs {f.size})",
                    f.crc32c,
                    info.crc32c if info.crc32c is not None else file_crc32c(dest)[1],
                )
            return f.size

        try:
            files = list(manifest.files)
            if files:
                workers = min(self.options.max_parallel_downloads, len(files))
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="backup-down") as pool:
                    got = sum(pool.map(fetch, files))
            else:
                got = 0
            write_manifest(tmp, manifest)
            faults.point("restore.bucket.before_commit")
            commit_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        secs = time.monotonic() - t0
        log.info(
            "restored %s step %d rank %d from backup: %d bytes in %.2fs (%.1f MiB/s)",
            self.job, step, rank, got, secs, got / max(secs, 1e-9) / 2**20,
        )  # fmt: skip
        return final

    def fetch_files(self, step: int, rank: int, entries: Sequence[FileEntry], dest_dir: Path) -> int:
        """Copy some files of rank's committed ``step`` into the existing ``dest_dir`` with ranged reads.

        ``entries`` must be listed identically (name, size, crc32c) by the backup's manifest, else
        ManifestError (it is another save). Each file is read in ``RANGE_BYTES`` ranges into a part file and
        gets its name only once its crc32c matched (ChecksumError otherwise; the part is removed). Files
        already present in ``dest_dir`` are left alone. Returns the bytes read.
        """
        t0 = time.monotonic()
        rec, base = self.commit_record(step)
        manifest = self.read_manifest(step, rank)
        listed = set(manifest.files)
        for e in entries:
            if e not in listed:
                raise ManifestError(f"{self.job} step {step} rank {rank} in the bucket does not list {e.name} "
                                    f"as asked (size {e.size}, crc32c {e.crc32c:08x}): another save")
        key = _data_key(manifest)
        dest_dir = Path(dest_dir)

        def fetch(f: FileEntry) -> int:
            final = resolve_under(dest_dir, f.name)
            if final.exists():
                return 0
            final.parent.mkdir(parents=True, exist_ok=True)
            part = final.with_name(final.name + ".part")
            name = _data_name(base, key, f.name)
            crc, got = 0, 0
            try:
                with open(part, "wb") as out:
                    while got < f.size:
                        chunk = self.store.read(name, got, min(RANGE_BYTES, f.size - got))
                        if not chunk:
                            raise EOFError(f"{self.store.url}/{name} ended after {got} of {f.size} bytes")
                        crc = crc32c_extend(crc, chunk)
                        out.write(chunk)
                        got += len(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                if crc != f.crc32c:
                    raise ChecksumError(f"{self.store.url}/{name}", f.crc32c, crc)
                os.rename(part, final)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
            return got

        todo = list(entries)
        got = 0
        if todo:
            workers = min(self.options.max_parallel_downloads, len(todo))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="backup-range") as pool:
                got = sum(pool.map(fetch, todo))
        secs = time.monotonic() - t0
        log.info("read %d files (%d bytes) of %s step %d rank %d from the bucket in %.2fs",
                 len(todo), got, self.job, step, rank, secs)
        return got

    # ------------------------------------------------------------------ garbage collection

    def _delete_backup(self, step: int) -> None:
        rec, base = self.commit_record(step)
        # The commit record goes first, so a half-deleted backup is never visible as committed.
        if base.startswith(f"{self.job}/{STEPS_DIR}/"):
            self.store.delete(f"{base}/{COMMIT_NAME}")
        else:
            self.store.delete(f"{self.job}/{COMMITS_DIR}/{step_name(step)}.json")
        faults.point("backup.retention.mid_delete")
        n = self.store.delete(base, recursive=True)
        log.info("retention: deleted backup of %s step %d (%d objects)", self.job, step, n)

    def apply_retention(self, keep: int, pinned: Iterable[int] = ()) -> list[int]:
        """Delete committed backups except the newest ``keep`` (>= 1) and the ``pinned`` steps.

        Returns the steps deleted, ascending.
        """
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (the newest backup is never deleted), got {keep!r}")
        pinned_set = {int(p) for p in pinned}
        steps = self.committed_steps()
        doomed = [s for s in steps[:-keep] if s not in pinned_set]
        for s in doomed:
            self._delete_backup(s)
        return doomed

    def _referenced_staging_ids(self) -> set[str]:
        ids = set()
        for step in self._marker_steps():
            try:
                ids.add(self.commit_record(step)[0].staging_id)
            except FileNotFoundError:
                continue
        return ids

    def _remove_uncommitted_step_dir(self, step: int) -> bool:
        prefix = f"{self.job}/{STEPS_DIR}/{step_name(step)}"
        try:
            self.store.stat(f"{prefix}/{COMMIT_NAME}")
            return False
        except FileNotFoundError:
            pass
        n = self.store.delete(prefix, recursive=True)
        if n:
            log.info("removed %d objects of a half-deleted backup of %s step %d", n, self.job, step)
        return n > 0

    def clean_stale_staging(self, older_than_seconds: float) -> list[str]:
        """Delete uncommitted stagings whose newest object is older than ``older_than_seconds``.

        The threshold must exceed the longest backup (upload + commit) you run: a staging that is
        still being uploaded or committed must not look stale. Also removes the remains of half-deleted
        renamed backups (``steps/<N>`` without its commit record). Returns what was deleted (staging
        ids, and ``steps/<N>`` for such remains).
        """
        if older_than_seconds < 0:
            raise ValueError("older_than_seconds must be >= 0")
        referenced = self._referenced_staging_ids()
        now = time.time()
        removed = []
        for d in self.store.list(f"{self.job}/{STAGING_DIR}", shallow=True):
            sid = d.name.rsplit("/", 1)[-1]
            if not d.is_dir or sid in referenced:
                continue
            objs = self.store.list(d.name)
            newest = max((o.mtime for o in objs if o.mtime is not None), default=None)
            if newest is not None and now - newest < older_than_seconds:
                continue
            if sid in self._referenced_staging_ids():  # committed meanwhile
                continue
            self.store.delete(d.name, recursive=True)
            removed.append(sid)
        for d in self.store.list(f"{self.job}/{STEPS_DIR}", shallow=True):
            stem = d.name.rsplit("/", 1)[-1]
            if (
                d.is_dir
                and parse_step_name(stem) is not None
                and self._remove_uncommitted_step_dir(int(stem))
            ):
                removed.append(f"{STEPS_DIR}/{stem}")
        if removed:
            log.info("removed %d stale backup stagings of %s: %s", len(removed), self.job, removed)
        return removed
