"""The backup tier's hook in the coordinator: what it asks the scheduler and what it tells it.

The default (:class:`BackupScheduler`) does nothing: no bucket configured. The bucket's scheduler
(:class:`replicator.backup.scheduler.BucketScheduler`) implements it on the coordinator's host.
"""

from __future__ import annotations

from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.backup_status import BackupSchedulerStatus
from replicator.coordinator.planner import CoordinatorState


class BackupScheduler:
    """Hook for the backup tier: the coordinator asks it for backup work and reports progress to it.

    The default does nothing (no bucket configured).
    """

    def task_for(self, state: CoordinatorState, rank: int, newest_saved: dict[int, int]) -> pb.BackupTask | None:
        return None

    def report(self, state: CoordinatorState, rank: int, reports: list[pb.BackupReport]) -> None:
        return None

    def request(self, steps: list[int]) -> None:
        """Hosts asked for an immediate backup of these steps (Orbax's ``_BACKUP_REQUESTED``)."""
        return None

    def emergency(self, step: int | None) -> None:
        """A preemption notice: back ``step`` (the newest complete one) up at once, unthrottled."""
        return None

    def host_came_over(self) -> None:
        """A host reported that accepted another coordinator's epoch: that one may have committed backups."""
        return None

    def is_current(self, state: CoordinatorState, step: int) -> bool:
        """The bucket's backup of ``step`` (if any) is of its current save, not of one a rollback abandoned."""
        return True

    def status(self) -> BackupSchedulerStatus | None:
        """The scheduler's state (None: no bucket configured)."""
        return None

    def commit_record(self, step: int) -> tuple[float, int]:
        """(commit time, total bytes) of the bucket's backup of ``step``; ``FileNotFoundError`` if none."""
        raise FileNotFoundError(f"no backup tier: no backup of step {step}")
