"""The replicator's store in Orbax mode: ingests Orbax's committed step directories into ``<local>/steps``.

Orbax (multi-tier checkpointing, ``ReplicatorCheckpointManager``) commits step N of this host as the
directory ``<local>/<N>`` (renamed from ``<N>.orbax-checkpoint-tmp`` as its last act, with
``commit_success.txt`` inside). :class:`OrbaxStore` moves each such directory -- a rename on the same
filesystem, O(1) -- to a temporary sibling under ``<local>/steps``, records its files (size, crc32c) and its
replica-independent identity (``orbax_content_hash``) in a ``MANIFEST.json`` of kind ``orbax``, and commits
it as ``<local>/steps/<N>`` (tmp + rename: never half-visible). From then on the step is an ordinary store
step: replicated, backed up, collected and restored like a native one. Once moved, Orbax cannot restore it
in the same incarnation (the contract); a restart restores it through a restore marker.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from replicator.coordinator.model import Holding
from replicator.local.store import RamDiskStore
from replicator.orbax import contract as oc
from sidecar import checksums, commit, faults, layout

log = logging.getLogger(__name__)


class OrbaxStore(RamDiskStore):
    """A :class:`RamDiskStore` rooted at Orbax's local directory that ingests Orbax's committed steps.

    ``on_error(text)`` receives non-fatal problems (a step that could not be ingested) so that the daemon
    can report them to Orbax (``replicator.errors``).
    """

    def __init__(self, root: Path, rank: int, *, job: str, nodes: int,
                 on_error: Callable[[str], None] | None = None):
        super().__init__(root, rank)
        self.job = job
        self.nodes = nodes
        self._on_error = on_error or (lambda text: None)
        self._ingest_lock = threading.Lock()
        self._failed: set[tuple[int, int]] = set()  # (step, inode) already reported as not ingestible
        self.ingested: list[int] = []

    def _startup_cleanup(self) -> None:
        """Give interrupted ingests back to Orbax's name before the temporary directories are removed.

        A daemon killed while ingesting leaves Orbax's committed step N (``commit_success.txt`` inside) in an
        unowned ``steps/.tmp-<N>-*``: it goes back to ``<local>/<N>`` (our half-written manifest dropped)
        and the next ingest takes it again, instead of start-up cleanup deleting the only copy.
        """
        steps = layout.steps_dir(self.root)
        for tmp in sorted(steps.glob(layout.TMP_PREFIX + "*")):
            step = layout.parse_step_name(tmp.name[len(layout.TMP_PREFIX):].split("-", 1)[0])
            if step is None or not (tmp / oc.COMMIT_SUCCESS_FILE).is_file() or commit.tmp_dir_is_owned(tmp):
                continue
            dest = self.root / layout.step_name(step)
            if os.path.lexists(dest) or (steps / layout.step_name(step) / layout.MANIFEST_NAME).is_file():
                continue  # Orbax saved it again, or the ingest committed: the leftover is just removed
            (tmp / layout.MANIFEST_NAME).unlink(missing_ok=True)
            os.rename(tmp, dest)
            log.warning("gave the interrupted ingest of Orbax step %d back to %s", step, dest)
        super()._startup_cleanup()

    # ------------------------------------------------------------------ ingestion
    def ingest(self) -> list[int]:
        """Move every committed ``<local>/<N>`` (a real directory) into the store; returns the steps moved.

        A restore's ``<local>/<N>`` (Orbax renamed our marker: hard links to a store copy, or an older
        daemon's symlink into the store) is not ingested again; a symlink whose target is gone (collected)
        is removed, so Orbax never lists it. A hard-link copy whose store copy was collected holds the only
        links left to those bytes: it is an ordinary Orbax step then, and ingested.
        """
        moved = []
        with self._ingest_lock:
            for child in sorted(self.root.iterdir()):
                step = layout.parse_step_name(child.name)
                if step is None:
                    continue
                if child.is_symlink():
                    if not child.exists():
                        child.unlink(missing_ok=True)
                        log.info("removed %s: its target was collected", child)
                    continue
                if oc.is_restored_copy(child):
                    continue
                if not child.is_dir() or not (child / oc.COMMIT_SUCCESS_FILE).is_file():
                    continue  # not a committed Orbax step (Orbax renames the tmp dir only when done)
                if self._ingest_one(child, step):
                    moved.append(step)
        if moved:
            self.ingested.extend(moved)
        return moved

    def _ingest_one(self, src: Path, step: int) -> bool:
        key = (step, src.stat().st_ino)
        if key in self._failed:
            return False
        steps = layout.steps_dir(self.root)
        final = steps / layout.step_name(step)
        tmp = commit.make_tmp_dir(steps, step)
        try:
            # rename(2) onto the fresh, empty temporary directory: same filesystem, O(1).
            os.rename(src, tmp)
        except OSError as e:
            os.rmdir(tmp)
            self._failed.add(key)
            self._on_error(f"cannot move Orbax step {step} ({src}) into the store: {e}")
            return False
        try:
            faults.point("orbax.ingest.after_move")
            files = checksums.scan_files(tmp, exclude=(layout.MANIFEST_NAME, oc.BACKUP_REQUESTED_FILE))
            content_id = oc.orbax_content_hash(tmp)
            manifest = layout.StepManifest(job=self.job, step=step, rank=self.rank, nodes=self.nodes,
                                           files=files, kind=layout.KIND_ORBAX, content_id=content_id)
            commit.write_manifest(tmp, manifest)
            if os.path.lexists(final):
                # Orbax saved this step number again (e.g. after restoring an older step): the new save wins.
                self.delete(self.rank, step)
            faults.point("orbax.ingest.before_commit")
            commit.commit_dir(tmp, final)
        except (OSError, ValueError) as e:
            # Unreadable OCDBT data and the like: never publish it. Give the directory back to Orbax's
            # name so that nothing is lost, and do not retry it.
            try:
                (tmp / layout.MANIFEST_NAME).unlink(missing_ok=True)
                os.rename(tmp, src)
                self._failed.add((step, src.stat().st_ino))
            except OSError:
                commit.remove_tmp_dirs(steps)
            self._on_error(f"cannot ingest Orbax step {step} of rank {self.rank}: {e}")
            return False
        log.info("ingested Orbax step %d of rank %d: %d files, %d bytes, content %s", step, self.rank,
                 len(files), manifest.total_bytes, content_id[:12])
        return True

    def inventory(self) -> list[Holding]:
        """Ingest first, so a step Orbax just committed is reported (and replicated) in this heartbeat."""
        try:
            self.ingest()
        except OSError as e:  # the local directory vanished under us (host wiped): report what is left
            log.warning("ingesting Orbax steps failed: %s", e)
        return super().inventory()

    def forget_replicas(self, steps: set[int]) -> None:
        """Drop the replica attestations of ``steps`` and of ranks outside the job (after a re-labelling)."""
        with self._lock:
            gone = [k for k in self._replica_of if k[1] in steps or k[0] >= self.nodes]
            for k in gone:
                del self._replica_of[k]
            if gone:
                self._save_replicas()

    # ------------------------------------------------------------------ restore sources and requests
    def data_dir_for(self, step: int, owners: set[int] | None = None) -> Path | None:
        """The directory on this host holding this rank's data of ``step``, or None.

        Own ``steps/<N>`` first (saved here, or fetched back from a peer or the bucket), then a copy of a
        byte-identical replica's data (``peer/<o>/<N>``, ``o`` in ``owners``: owners the coordinator
        validated for this rank). With ``owners`` None only this rank's own data counts.
        """
        allowed = {self.rank} if owners is None else set(owners)
        if self.rank in allowed and self.has(self.rank, step):
            return self.step_dir(self.rank, step)
        for owner in sorted(allowed - {self.rank}):
            if self.has(owner, step):
                return self.step_dir(owner, step)
        return None

    def backup_requests(self) -> list[int]:
        """Own steps Orbax asked to back up now (``_BACKUP_REQUESTED``, Orbax >= 0.12.10; never 0.12.8)."""
        return [s for s in self.own_steps() if oc.backup_requested(self.step_dir(self.rank, s))]
