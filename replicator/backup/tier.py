"""The backup tier of one daemon, built from its options: the host's agent and the coordinator's scheduler.

Both sides share one :class:`~replicator.backup.bucket.BackupStore` over ``--backup-url``: the host's
:class:`~replicator.backup.agent.BackupAgent` uploads and downloads, and the
:class:`~replicator.backup.scheduler.BucketScheduler` (built only where the coordinator runs) plans and
commits.
"""

from __future__ import annotations

from collections.abc import Callable

from replicator.backup.agent import BackupAgent
from replicator.backup.bucket import BackupOptions, BackupStore
from replicator.backup.scheduler import BucketScheduler
from replicator.backup.storage import GcsOptions, open_store
from replicator.coordinator.topology import JobTopology
from replicator.options import ReplicatorOptions


def bucket_options(opts: ReplicatorOptions) -> dict:
    """The backend options the daemon's flags set for ``opts.backup_url`` (gs://: the per-request timeout)."""
    if opts.backup_url.lower().startswith("gs://"):
        return {"options": GcsOptions(timeout_seconds=opts.bucket_timeout_seconds)}
    return {}


def make_backup(opts: ReplicatorOptions, job: str, rank: int, nodes: int
                ) -> tuple[BackupAgent, Callable[[JobTopology], BucketScheduler]]:
    """The host agent and (for the coordinator) the scheduler factory for ``opts.backup_url``."""
    store = open_store(opts.backup_url, **bucket_options(opts))
    bopts = BackupOptions(max_parallel_uploads=max(1, opts.transfer_threads),
                          max_bytes_per_second=float(opts.max_bytes_per_second) or None)
    bucket = BackupStore(store, job, bopts)
    bucket.check_capabilities()
    agent = BackupAgent(bucket)

    def factory(topology: JobTopology) -> BucketScheduler:
        minutes = opts.backup_interval_minutes
        if not minutes and not opts.backup_interval_steps:
            minutes = 30.0
        return BucketScheduler(bucket, topology, interval_steps=opts.backup_interval_steps,
                               interval_minutes=minutes, keep=opts.backup_keep,
                               force_restore_step=opts.restore_from_backup)

    return agent, factory
