"""bench.goodput's faults on storage: the copy a corruption hits, and what the operator removes after a bad restore.

Both work on a system's storage folder as bench.goodput_run lays it out (``local<host>`` per host, ``persistent``
for the bucket tier) and on the step folders the systems write there: a path component all digits is a step
(our replicator's ``steps/<step>`` and ``peer/<rank>/<step>``, Orbax's ``<step>``), temporary folders are not.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from bench.emergency_common import PROCESSES, SLICES

HOSTS_PER_SLICE = PROCESSES // SLICES
CORRUPT_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Corruption:
    """``nbytes`` flipped at ``offset`` of ``path``, a file of step ``step`` whose folder is ``step_dir``."""

    step: int
    path: Path
    offset: int
    nbytes: int
    step_dir: Path

    def describe(self, root: Path) -> str:
        return f"step {self.step}: {self.path.relative_to(root)} ({self.nbytes} bytes at {self.offset})"


def _step_dir(root: Path, path: Path) -> tuple[int, Path] | None:
    """(step, its folder): the innermost all-digit component of ``path`` under ``root`` (a peer copy's
    ``peer/<rank>/<step>`` names its rank first), None outside any step."""
    parts = path.relative_to(root).parts[:-1]
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return int(parts[i]), root.joinpath(*parts[:i + 1])
    return None


def newest_largest(root: Path) -> tuple[int, Path, Path] | None:
    """(step, file, step folder): the largest file of the newest committed step under ``root``."""
    best: tuple[int, int, Path, Path] | None = None
    if not root.is_dir():
        return None
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        found = _step_dir(root, path)
        if found is None:
            continue
        key = (found[0], path.stat().st_size, path, found[1])
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else (best[0], best[2], best[3])


def corrupt_newest(root: Path) -> Corruption | None:
    """Flip 64 bytes in the middle of the largest file of the newest committed step under ``root``; None when
    ``root`` holds no committed step."""
    found = newest_largest(root)
    if found is None:
        return None
    step, path, step_dir = found
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read(CORRUPT_BYTES)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return Corruption(step, path, size // 2, len(data), step_dir)


def restore_first_root(system: str, storage: Path, host: int) -> Path:
    """Where ``system`` reads ``host``'s data of its newest step first, after a job restart.

    - ``ours``: the host's own committed steps on its RAM disk (``local<host>/steps``; peers and the bucket
      only when a copy fails its crc32c);
    - ``orbax_p2p``: the host's local folder (peers, then the persistent tier, only for what it lacks);
    - ``orbax_emergency``: the host at the same place in the first slice whose local folder holds a step: its
      primary slice (slice 0) writes the persistent tier only, the other slices keep the local copies, and a
      restore reads the first slice holding the step complete and broadcasts it;
    - ``orbax_standard``: the bucket folder, its only copy.

    Where that local tier holds nothing (every RAM disk replaced), the bucket folder.
    """
    persistent = storage / "persistent"
    if system == "orbax_standard":
        return persistent
    if system == "ours":
        candidates = [storage / f"local{host}" / "steps"]
    elif system == "orbax_emergency":
        position = host % HOSTS_PER_SLICE
        candidates = [storage / f"local{s * HOSTS_PER_SLICE + position}" for s in range(SLICES)]
    elif system == "orbax_p2p":
        candidates = [storage / f"local{host}"]
    else:
        raise ValueError(f"unknown system {system!r}")
    for root in candidates:
        if newest_largest(root) is not None:
            return root
    return persistent


def _is_step_dir(path: Path, step: int) -> bool:
    """``path`` is a folder of step ``step`` (not a rank's folder holding step folders)."""
    return (path.is_dir() and path.name == str(step)
            and not any(c.is_dir() and c.name.isdigit() for c in path.iterdir()))


def remove_step(storage: Path, step: int) -> list[str]:
    """Remove every copy of ``step`` under ``storage`` (every tier); returns what went, relative."""
    gone = []
    for path in sorted(storage.rglob(str(step)), key=lambda p: len(p.parts)):
        if path.exists() and _is_step_dir(path, step):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(str(path.relative_to(storage)))
    return gone


def remove_everything(storage: Path) -> None:
    """Every tier emptied: the job starts from scratch."""
    for child in storage.iterdir():
        shutil.rmtree(child, ignore_errors=True)
