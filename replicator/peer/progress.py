"""How far a step being fetched has landed: the watermark a reader follows while the copy is still running.

A :class:`FetchProgress` is handed to ``client.fetch_step``; the writer thread records each file's bytes
written so far (``landed``), the fetch records the temporary directory it writes into, the directory it
commits to, and the outcome. Any number of observers (the sidecar's streamed restore, through the local
control service) wait on it for news: they read a file's bytes up to its watermark from the temporary
directory while the rest is still arriving, verifying each block themselves. Nothing here is a commit:
the copy still becomes visible only by the rename in ``fetch_step``, after every file's crc32c matched.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from sidecar.layout import StepManifest


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One observation: ``landed[i]`` bytes of file ``i`` are written (in order, from offset 0); -1: the
    file is not opened yet (0: its part file exists, at its full size, nothing written)."""

    version: int
    manifest: StepManifest | None
    tmp_dir: Path | None
    final_dir: Path | None
    landed: tuple[int, ...]
    committed: bool
    error: str | None

    @property
    def finished(self) -> bool:
        return self.committed or self.error is not None


class FetchProgress:
    """Thread-safe watermark of one fetch (one writer, any number of waiting observers)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._manifest: StepManifest | None = None
        self._tmp: Path | None = None
        self._final: Path | None = None
        self._landed: list[int] = []
        self._committed = False
        self._error: str | None = None

    def _bump(self) -> None:
        self._version += 1
        self._cond.notify_all()

    def begin(self, manifest: StepManifest, tmp_dir: Path, final_dir: Path) -> None:
        """The fetch writes ``manifest``'s files under ``tmp_dir`` (as ``<name>`` + part suffix until each
        is verified) and commits them as ``final_dir``."""
        with self._cond:
            self._manifest, self._tmp, self._final = manifest, Path(tmp_dir), Path(final_dir)
            self._landed = [-1] * len(manifest.files)
            self._bump()

    def landed(self, index: int, nbytes: int) -> None:
        """File ``index`` of the manifest now has its first ``nbytes`` bytes written."""
        with self._cond:
            if 0 <= index < len(self._landed) and nbytes > self._landed[index]:
                self._landed[index] = nbytes
                self._bump()

    def committed(self) -> None:
        with self._cond:
            self._committed = True
            self._bump()

    def failed(self, error: BaseException | str) -> None:
        with self._cond:
            if not self._committed and self._error is None:
                self._error = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
                self._bump()

    def snapshot(self) -> Snapshot:
        with self._cond:
            return Snapshot(self._version, self._manifest, self._tmp, self._final, tuple(self._landed),
                            self._committed, self._error)

    def wait(self, after_version: int, timeout_seconds: float) -> Snapshot:
        """The state once its version exceeds ``after_version`` (or as it is after ``timeout_seconds``)."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while self._version <= after_version and not (self._committed or self._error):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return Snapshot(self._version, self._manifest, self._tmp, self._final, tuple(self._landed),
                            self._committed, self._error)
