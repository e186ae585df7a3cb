"""What the coordinator (and its admin service) may know of the backup tier's scheduler: one typed view."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BackupSchedulerStatus:
    """The bucket scheduler's state at one moment (``BackupScheduler.status()``; None: no bucket)."""

    url: str
    committed_steps: tuple[int, ...]  # oldest first
    in_progress_step: int  # -1: none
    in_progress_done_ranks: tuple[int, ...]
    skipped: int
    failures: int
    last_error: str
    interval_steps: int
    interval_minutes: float
    keep: int
    last_success_unix: float | None
    emergency_step: int | None
    emergency_done: bool

    @property
    def newest_committed(self) -> int:
        return self.committed_steps[-1] if self.committed_steps else -1

    @property
    def interval_seconds(self) -> float:
        return float(self.interval_minutes or 0.0) * 60.0
