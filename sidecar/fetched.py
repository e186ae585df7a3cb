"""The files of other ranks' data one step source fetched onto this host, whole or in pieces.

Another rank's data that no copy on this host holds is fetched file by file (only the files a read overlaps,
and of a file only the byte ranges it needs where a peer can serve them) into scratch directories of this
process. This registry remembers which directory holds which file, or which bytes of which shards of it,
so that no file is fetched twice, a bad one is fetched again, and :meth:`FetchedFileSet.close` removes them.
"""

from __future__ import annotations

import threading
from pathlib import Path

from sidecar import commit, layout
from sidecar.pieces import Needs, span_covers


class FetchedFileSet:
    """Scratch directories of fetched files -> whose data they hold, and which files (or pieces) each holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[Path, int] = {}  # scratch directory -> owner rank
        self._whole: dict[tuple[int, str], Path] = {}  # (owner, file) -> scratch directory holding it
        # (owner, file) -> (scratch directory, the bytes of each shard it holds) of each fetch of pieces of it.
        self._pieces: dict[tuple[int, str], list[tuple[Path, Needs]]] = {}

    def holds(self, owner: int, file: str) -> bool:
        """``owner``'s ``file`` was fetched whole."""
        with self._lock:
            return (owner, file) in self._whole

    def pieces_held(self, owner: int, file: str, spans: Needs) -> bool:
        """Every span of ``file`` is in pieces fetched already."""
        with self._lock:
            held = list(self._pieces.get((owner, file), ()))
        return all(any(sh in h and span_covers(h[sh], span) for _, h in held) for sh, span in spans.items())

    def add(self, d: Path, owner: int, files: list[str], spans: dict[str, Needs]) -> None:
        """Scratch directory ``d`` holds ``owner``'s ``files``: whole, or the pieces ``spans`` lists."""
        with self._lock:
            self._dirs[d] = owner
            for f in files:
                if f in spans:
                    self._pieces.setdefault((owner, f), []).append((d, spans[f]))
                else:
                    self._whole[(owner, f)] = d

    def forget_file(self, d: Path, owner: int, file: str) -> None:
        """A fetched file turned out bad: forget (and delete) it, so that a read fetches it again."""
        with self._lock:
            if self._whole.get((owner, file)) == d:
                del self._whole[(owner, file)]
            held = [x for x in self._pieces.get((owner, file), []) if x[0] != d]
            if held:
                self._pieces[(owner, file)] = held
            else:
                self._pieces.pop((owner, file), None)
        try:
            layout.resolve_under(d, file).unlink()
        except (OSError, ValueError):
            pass

    def close(self) -> dict[Path, int]:
        """Remove every scratch directory; the ones removed (and whose data each held)."""
        with self._lock:
            dirs = dict(self._dirs)
            for d in dirs:
                commit.remove_owned_dir(d)
            self._dirs.clear()
            self._whole.clear()
            self._pieces.clear()
        return dirs
