"""The bucket as an in-memory model, behind the methods of :class:`replicator.backup.bucket.BackupStore` that the
real :class:`replicator.backup.scheduler.BucketScheduler` calls.

A staging holds the ranks uploaded into it; ``commit`` refuses (``IncompleteBackupError``) while a saver's
upload is missing from *that* staging, like the real store, so a report that names the wrong staging shows up.
Staging ids come from a counter (no uuid, no wall clock): a schedule replays exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from replicator.backup.bucket import IncompleteBackupError, Staging


@dataclasses.dataclass
class _Record:
    """What ``BucketScheduler`` reads of a commit record."""

    step: int
    staging_id: str
    rank_hashes: tuple[str, ...]
    generation: int
    committed_unix: float


class _StoreInfo:
    url = "sim://bucket"


class BucketModel:
    """Stagings and committed backups of one job, in memory."""

    def __init__(self, nodes: int, clock: Any):
        self.nodes = nodes
        self.clock = clock
        self.store = _StoreInfo()
        self._ids = 0
        self.stagings: dict[str, dict[str, Any]] = {}  # id -> {"staging": Staging, "ranks": {rank: (hash, gen)}}
        self.committed: dict[int, _Record] = {}
        self.commits = 0
        self.failed_commits = 0
        self.incomplete: list[tuple[str, list[int]]] = []  # commits refused: a saver's upload was missing

    # ------------------------------------------------------------------ BackupStore surface
    def begin(self, step: int, nodes: int, ranks: Any = ()) -> Staging:
        self._ids += 1
        ranks = tuple(sorted(set(ranks)))
        if ranks == tuple(range(nodes)):
            ranks = ()
        st = Staging(step, nodes, f"{step}-{self._ids:012x}", 0.0, ranks)
        self.stagings[st.staging_id] = {"staging": st, "ranks": {}}
        return st

    def open_staging(self, staging_id: str) -> Staging:
        if staging_id not in self.stagings:
            raise FileNotFoundError(f"no staging {staging_id}")
        return self.stagings[staging_id]["staging"]

    def upload(self, staging_id: str, rank: int, content_hash: str, generation: int) -> None:
        """A host uploaded ``rank``'s data into the staging (the model's ``upload_rank``)."""
        if staging_id not in self.stagings:
            raise FileNotFoundError(f"staging {staging_id} is gone")
        self.stagings[staging_id]["ranks"][rank] = (content_hash, generation)

    def commit(self, staging: Staging) -> int:
        entry = self.stagings.get(staging.staging_id)
        if entry is None:
            self.failed_commits += 1
            raise FileNotFoundError(f"staging {staging.staging_id} is gone")
        got = entry["ranks"]
        missing = [r for r in staging.expected_ranks if r not in got]
        if missing:
            self.failed_commits += 1
            self.incomplete.append((staging.staging_id, missing))
            raise IncompleteBackupError(f"cannot commit step {staging.step}: missing manifest of ranks {missing}")
        gens = {g for _, g in got.values()}
        gen = max(gens)
        old = self.committed.get(staging.step)
        if old is not None and old.generation >= gen:
            self.failed_commits += 1
            raise FileExistsError(f"step {staging.step} is already committed")
        hashes = tuple(got[r][0] if r in got and r in staging.expected_ranks else "" for r in range(staging.nodes))
        self.committed[staging.step] = _Record(staging.step, staging.staging_id, hashes, gen, float(self.clock()))
        del self.stagings[staging.staging_id]
        self.commits += 1
        return staging.step

    def abort(self, staging: Staging) -> int:
        self.stagings.pop(staging.staging_id, None)
        return 0

    def committed_steps(self) -> list[int]:
        return sorted(self.committed)

    def commit_record(self, step: int) -> tuple[_Record, str]:
        if step not in self.committed:
            raise FileNotFoundError(f"step {step} is not committed")
        return self.committed[step], "marker"

    def committed_generation(self, step: int) -> int:
        return self.committed[step].generation

    def apply_retention(self, keep: int, pinned: Any = ()) -> list[int]:
        steps = sorted(self.committed)
        doomed = [s for s in steps[:-keep] if s not in set(pinned)] if keep > 0 else []
        for s in doomed:
            del self.committed[s]
        return doomed

    def clean_stale_staging(self, older_than_seconds: float) -> list[str]:
        return []

    # ------------------------------------------------------------------ queries for the invariants
    def holds(self, step: int, rank: int, content_hash: str) -> bool:
        rec = self.committed.get(step)
        return rec is not None and rank < len(rec.rank_hashes) and rec.rank_hashes[rank] == content_hash

    def newest(self) -> int | None:
        return max(self.committed) if self.committed else None
