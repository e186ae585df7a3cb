"""The backup tier's bucket layout names and its typed records: options, staging, commit record, results, errors.

The names of the layout (described in :mod:`replicator.backup.bucket`, which implements the protocol over
it) and the versioned records written into it (``BEGIN.json``: :class:`Staging`; the commit record:
:class:`BackupCommit`), each validated in ``from_dict`` / ``from_json``, with the values the protocol
returns and the errors it raises. No I/O here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from sidecar.layout import STEP_PATTERN, ManifestError

BACKUP_FORMAT_VERSION = 1
STAGING_DIR = "staging"
STEPS_DIR = "steps"
COMMITS_DIR = "commits"
DATA_DIR = "data"
RANKS_DIR = "ranks"
BEGIN_NAME = "BEGIN.json"
COMMIT_NAME = "COMMIT.json"
STRATEGY_RENAME = "rename"
STRATEGY_MARKER = "marker"
STAGING_ID_RE = re.compile(f"^{STEP_PATTERN}-[0-9a-f]{{12}}$")


class BackupError(RuntimeError):
    """Base class of the backup tier's own errors."""


class IncompleteBackupError(BackupError):
    """A commit was asked for a staging in which some rank's manifest or data is missing."""


class UnsupportedBucketError(BackupError):
    """The store supports neither an atomic prefix rename nor create-only writes: no safe commit exists."""


@dataclasses.dataclass(frozen=True)
class BackupOptions:
    """Throttling and commit choices of a BackupStore.

    ``max_bytes_per_second`` limits the average upload rate of this process (None = unlimited);
    ``commit_strategy`` is ``"auto"`` (rename when the store can, else marker), ``"rename"`` or ``"marker"``.
    """

    max_parallel_uploads: int = 8
    max_parallel_downloads: int = 8
    max_bytes_per_second: float | None = None
    commit_strategy: str = "auto"

    def __post_init__(self) -> None:
        if self.max_parallel_uploads < 1 or self.max_parallel_downloads < 1:
            raise ValueError("max_parallel_uploads and max_parallel_downloads must be >= 1")
        if self.max_bytes_per_second is not None and self.max_bytes_per_second <= 0:
            raise ValueError("max_bytes_per_second must be positive or None")
        if self.commit_strategy not in ("auto", STRATEGY_RENAME, STRATEGY_MARKER):
            raise ValueError(f"commit_strategy must be auto, rename or marker, got {self.commit_strategy!r}")


@dataclasses.dataclass(frozen=True)
class Staging:
    """Handle of one backup attempt of ``step``; pass ``to_dict()`` to the other hosts' daemons."""

    step: int
    nodes: int
    staging_id: str
    created_unix: float = 0.0
    # The ranks that saved the step (elastic training: the active hosts); empty = every rank.
    ranks: tuple[int, ...] = ()

    @property
    def expected_ranks(self) -> tuple[int, ...]:
        return self.ranks or tuple(range(self.nodes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": BACKUP_FORMAT_VERSION,
            "step": self.step,
            "nodes": self.nodes,
            "staging_id": self.staging_id,
            "created_unix": self.created_unix,
            **({"ranks": list(self.ranks)} if self.ranks else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Staging:
        try:
            s = cls(int(d["step"]), int(d["nodes"]), str(d["staging_id"]), float(d.get("created_unix", 0.0)),
                    tuple(sorted({int(r) for r in d.get("ranks", ())})))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"malformed staging record: {e}") from e
        check_staging_id(s.staging_id, s.step)
        if s.nodes < 1 or any(not 0 <= r < s.nodes for r in s.ranks):
            raise ManifestError(f"bad node count {s.nodes} or ranks {list(s.ranks)}")
        return s


@dataclasses.dataclass(frozen=True)
class BackupCommit:
    """The commit record: which staging holds step ``step`` and the content hash of every rank."""

    job: str
    step: int
    nodes: int
    staging_id: str
    strategy: str
    rank_hashes: tuple[str, ...]
    total_bytes: int
    committed_unix: float
    format_version: int = BACKUP_FORMAT_VERSION
    # The save's generation (every rank's manifest carries the same one); 0 in records written before it
    # was recorded (then the manifests tell, see BackupStore.committed_generation).
    generation: int = 0

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        d["rank_hashes"] = list(self.rank_hashes)
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BackupCommit:
        try:
            d = json.loads(data)
            if int(d["format_version"]) != BACKUP_FORMAT_VERSION:
                raise ManifestError(f"unsupported backup format_version {d['format_version']}")
            c = cls(
                job=str(d["job"]),
                step=int(d["step"]),
                nodes=int(d["nodes"]),
                staging_id=str(d["staging_id"]),
                strategy=str(d["strategy"]),
                rank_hashes=tuple(str(h) for h in d["rank_hashes"]),
                total_bytes=int(d["total_bytes"]),
                committed_unix=float(d["committed_unix"]),
                generation=int(d.get("generation", 0)),
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"malformed commit record: {e}") from e
        check_staging_id(c.staging_id, c.step)
        if c.generation < 0:
            raise ManifestError(f"commit record has a bad generation {c.generation}")
        # "" = the rank did not save this step (elastic training); at least one rank did.
        if len(c.rank_hashes) != c.nodes or not any(c.rank_hashes) or not all(
                h == "" or re.fullmatch(r"[0-9a-f]{64}", h) for h in c.rank_hashes):
            raise ManifestError("commit record has bad rank hashes")
        return c


@dataclasses.dataclass(frozen=True)
class UploadResult:
    """What ``upload_rank`` did: bytes sent vs. found already uploaded (same content hash)."""

    step: int
    rank: int
    files_uploaded: int
    bytes_uploaded: int
    files_reused: int
    bytes_reused: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class CapabilityReport:
    """Outcome of ``check_capabilities``: the commit strategy in use and what the store offered."""

    strategy: str
    rename_prefix: bool
    create_only: bool
    detail: str


def check_staging_id(staging_id: str, step: int) -> None:
    """ManifestError unless ``staging_id`` is a staging id (``<step>-<12 hex>``) of ``step``."""
    m = STAGING_ID_RE.match(staging_id)
    if not m or int(m.group(1)) != step:
        raise ManifestError(f"bad staging id {staging_id!r} for step {step}")
