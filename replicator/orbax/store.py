"""The replicator's store in Orbax mode: ingests Orbax's committed step directories into ``<local>/steps``.

Orbax (multi-tier checkpointing, ``ReplicatorCheckpointManager``) commits step N of this host as the
directory ``<local>/<N>`` (renamed from ``<N>.orbax-checkpoint-tmp`` as its last act, with
``commit_success.txt`` inside). :class:`OrbaxStore` hard-links every file of it into a temporary sibling
under ``<local>/steps`` (same filesystem: no byte is copied), records its files (size, crc32c) and its
replica-independent identity (``orbax_content_hash``) in a ``MANIFEST.json`` of kind ``orbax``, and commits
it as ``<local>/steps/<N>`` (tmp + rename: never half-visible). From then on the step is an ordinary store
step: replicated, backed up, collected and restored like a native one.

``<local>/<N>`` itself is left where Orbax put it, now a directory of links into our copy. Orbax's step
deleter (a preservation policy deleting N right after saving N+1) may be between finding ``<local>/<N>``
and removing it at any moment; had the directory been moved away in that window, its ``rmtree`` would raise
``FileNotFoundError`` out of Orbax's ``close()``. Orbax deleting the links leaves our copy whole; our GC
of step N removes the links with it (they would otherwise keep its bytes on the RAM disk).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from replicator.local.store import RamDiskStore
from replicator.orbax import contract as oc
from replicator.tiers import Holding
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
        self._ingest_lock = threading.RLock()  # delete() runs inside ingest()
        self._failed: set[tuple[int, int]] = set()  # (step, inode) already reported as not ingestible
        self.ingested: list[int] = []

    # ------------------------------------------------------------------ ingestion
    def ingest(self) -> list[int]:
        """Link every committed ``<local>/<N>`` (a real directory) into the store; returns the steps taken.

        A ``<local>/<N>`` whose files are shared with our copy (ingested already, or a restore marker Orbax
        renamed) is not ingested again; a symlink whose target is gone (an older daemon's marker, collected)
        is removed, so Orbax never lists it. A hard-link copy whose store copy went another way (a peer's
        copy it was restored from, collected) holds the only links left to those bytes: it is an ordinary
        Orbax step then, and ingested.
        """
        taken = []
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
                    taken.append(step)
        if taken:
            self.ingested.extend(taken)
        return taken

    def _ingest_one(self, src: Path, step: int) -> bool:
        try:
            key = (step, src.stat().st_ino)
        except FileNotFoundError:
            return False  # Orbax deleted it since the listing
        if key in self._failed:
            return False
        steps = layout.steps_dir(self.root)
        final = steps / layout.step_name(step)
        tmp = commit.make_tmp_dir(steps, step)
        try:
            oc.link_tree(src, tmp, copy_unlinkable=False)
        except (OSError, ValueError) as e:
            commit.remove_owned_dir(tmp)
            if isinstance(e, FileNotFoundError):  # a file went under us: Orbax's deleter is removing the step
                log.info("Orbax deleted step %d (%s) while it was being ingested: not taken", step, src)
                return False
            self._failed.add(key)
            self._on_error(f"cannot link Orbax step {step} ({src}) into the store: {e}")
            return False
        try:
            faults.point("orbax.ingest.after_link")
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
            # Unreadable OCDBT data and the like: never publish it. Orbax's directory is untouched (only
            # links were made); do not retry it.
            commit.remove_owned_dir(tmp)
            self._failed.add(key)
            self._on_error(f"cannot ingest Orbax step {step} of rank {self.rank}: {e}")
            return False
        log.info("ingested Orbax step %d of rank %d: %d files, %d bytes, content %s", step, self.rank,
                 len(files), manifest.total_bytes, content_id[:12])
        return True

    def delete(self, owner: int, step: int, content_hash: str | None = None) -> bool:
        """:meth:`RamDiskStore.delete`, and for this rank's own step also Orbax's ``<local>/<N>`` when it is
        links to the copy being deleted (first: the data files then have one link, and their pages go to
        the spare pool)."""
        with self._ingest_lock:
            if owner == self.rank:
                self._remove_links_to(step, content_hash)
            return super().delete(owner, step, content_hash)

    def _remove_links_to(self, step: int, content_hash: str | None) -> None:
        links = self.root / layout.step_name(step)
        ours = self.step_dir(self.rank, step)
        try:
            if links.is_symlink() or not os.path.samefile(links / oc.COMMIT_SUCCESS_FILE,
                                                          ours / oc.COMMIT_SUCCESS_FILE):
                return
        except OSError:
            return  # no such directory, or not a committed Orbax step: nothing of ours
        if content_hash and (m := self.manifest(self.rank, step)) is not None and m.content_hash != content_hash:
            return  # another save than the one to delete: RamDiskStore.delete keeps it, and so do we
        shutil.rmtree(links, ignore_errors=True)
        log.info("removed %s: links to step %d, which is collected", links, step)

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

