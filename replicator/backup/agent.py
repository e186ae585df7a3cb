"""One host's share of the backup tier: upload the ranks the coordinator assigns it, download from the bucket.

The coordinator's side (what to back up, who uploads what, the commit) is
:mod:`replicator.backup.scheduler`; this host-side :class:`BackupAgent` only does the work it is handed and
reports the outcome on its next heartbeat.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mtc_rpc import coordinator_pb2 as pb
from replicator.backup.bucket import BackupStore
from sidecar.layout import FileEntry, StepManifest, read_manifest

log = logging.getLogger(__name__)

# How many recent stagings each host remembers its uploads into (a task repeated for one is not redone).
UPLOADS_REMEMBERED = 4


@dataclasses.dataclass(frozen=True)
class AgentStatus:
    """One host's backup work so far (its local status)."""

    uploaded_bytes: int
    last_error: str


# (step, rank, bytes, seconds, error) after each rank's upload (rank -1 and an error: the task failed).
UploadObserver = Callable[[int, int, int, float, str], None]


class BackupAgent:
    """One host's side: upload assigned ranks, download from the bucket, report results."""

    def __init__(self, bucket: BackupStore):
        self.bucket = bucket
        self._reports: list[pb.BackupReport] = []
        self._lock = threading.Lock()
        self.uploaded_bytes = 0
        self.last_error = ""
        # staging id -> the ranks this host uploaded into it (the newest few stagings). A task handed out again
        # before its report reached the coordinator (the heartbeat that asked was sent while it ran) is
        # answered from here: uploading again could race the commit that renames the staging away.
        self._uploaded: collections.OrderedDict[str, set[int]] = collections.OrderedDict()
        # Called after each rank's upload: the daemon's metrics and logs.
        self.on_upload: UploadObserver | None = None

    def run_task(self, task: pb.BackupTask, store: Any) -> None:
        """Upload ``task``'s ranks from ``store`` (the host's RAM disk) and queue the report of what got in."""
        done: list[int] = []
        error = ""
        with self._lock:
            already = set(self._uploaded.get(task.staging, ()))
        try:
            owners = list(task.source_owner_ranks) or list(task.ranks)
            if len(owners) != len(task.ranks):
                raise ValueError(f"backup task: {len(owners)} source owners for {len(task.ranks)} ranks")
            staging = None
            for rank, owner in zip(task.ranks, owners, strict=True):
                if rank in already:  # uploaded by this host already: reported again, not redone
                    done.append(rank)
                    continue
                if staging is None:
                    staging = self.bucket.open_staging(task.staging)
                step_dir = store.step_dir(owner, task.step)
                manifest = read_manifest(step_dir)
                if owner != rank:
                    # A byte-identical replica's data stands in for a rank whose own copies are gone
                    # (the coordinator proved the content hashes equal): the backup holds it as that rank.
                    manifest = dataclasses.replace(manifest, rank=rank)
                res = self.bucket.upload_rank(staging, rank, step_dir, manifest)
                self.uploaded_bytes += res.bytes_uploaded
                done.append(rank)
                self._note_uploaded(task.staging, rank)
                if self.on_upload is not None:
                    self.on_upload(task.step, rank, res.bytes_uploaded, res.seconds, "")
        except Exception as e:
            # Deliberately broad: whatever failed (the RAM disk, a manifest, the bucket's client library, whose
            # own errors pass through the Store once its retries are spent) comes back to the coordinator as
            # this report's error, so that it moves the share to another holder; an escaping error would
            # leave the run waiting for a report that never comes.
            error = f"{type(e).__name__}: {e}"
            self.last_error = error
            log.warning("backup upload of step %d failed: %s", task.step, error)
            if self.on_upload is not None:
                self.on_upload(task.step, -1, 0, 0.0, error)
        with self._lock:
            # The staging id is echoed: the coordinator counts the report only toward that run.
            self._reports.append(pb.BackupReport(step=task.step, uploaded_ranks=done, error=error,
                                                 staging=task.staging))

    def _note_uploaded(self, staging_id: str, rank: int) -> None:
        with self._lock:
            self._uploaded.setdefault(staging_id, set()).add(rank)
            self._uploaded.move_to_end(staging_id)
            while len(self._uploaded) > UPLOADS_REMEMBERED:
                self._uploaded.popitem(last=False)

    def download(self, step: int, rank: int, dest_parent: Path) -> Path:
        """``rank``'s committed backup of ``step`` into ``dest_parent`` (committed there, verified)."""
        return self.bucket.download_rank(step, rank, dest_parent)

    def read_manifest(self, step: int, rank: int) -> StepManifest:
        """The manifest of ``rank``'s committed backup of ``step``."""
        return self.bucket.read_manifest(step, rank)

    def fetch_files(self, step: int, rank: int, entries: Sequence[FileEntry], dest_dir: Path) -> int:
        """Only ``entries`` of ``rank``'s backup of ``step`` into ``dest_dir`` (ranged reads); bytes moved."""
        return self.bucket.fetch_files(step, rank, entries, dest_dir)

    def unthrottle(self) -> None:
        """A preemption notice: upload at full speed from now on."""
        self.bucket.unthrottle()

    def drain_reports(self) -> list[pb.BackupReport]:
        """The reports queued since the last call (sent with the next heartbeat)."""
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def status(self) -> AgentStatus:
        return AgentStatus(uploaded_bytes=self.uploaded_bytes, last_error=self.last_error)
