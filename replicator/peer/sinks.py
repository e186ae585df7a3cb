"""Where a fetched step's bytes land on the receiving host: whole files (``FileSink``: spare-pool files or
new ones, crc32c checked as the bytes arrive) or erasure-code pieces (``PieceSink``), written with ``pwrite``
under the fetch's temporary directory; replicator/peer/client.py commits the directory once all are verified."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicator import restore_phases
from replicator.peer.progress import FetchProgress
from replicator.peer.protocol import PART_SUFFIX
from sidecar import checksums, faults, layout, spares
from sidecar.checksums import ChecksumError
from sidecar.layout import FileEntry

# A file's watermark (``FetchProgress.landed``) moves on at least this many bytes at a time (and at its end): each
# move wakes every reader following the copy, and the sidecar's streamed restore gets one message per move; the
# data port's receive loop writes up to ``RECV_BYTES`` at a time, often less.
LANDED_STEP_BYTES = 4 << 20


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (a fetch's bytes landing on the RAM disk)."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
        faults.point("peer.fetch.mid_transfer")


class FileSink:
    """Writes the expected files into ``dest_dir`` under part names, in order; verifies and renames.

    Chunks must arrive in order (file by file, increasing offsets). A file is renamed to its final
    name only after its size and crc32c match its entry; ``abort()`` removes the parts.
    """

    def __init__(self, dest_dir: Path, entries: Sequence[FileEntry], pool: spares.SparePool | None = None,
                 progress: FetchProgress | None = None):
        self.dest_dir = Path(dest_dir)
        self.entries = list(entries)
        self.pool = pool
        self.progress = progress  # told each file's bytes written so far (readers follow the watermark)
        self._idx = -1
        self._fd = -1
        self._crc = 0
        self._pos = 0
        self._told = 0  # the current file's watermark as last told to ``progress``
        self._part: Path | None = None
        self.bytes = 0
        self.done: list[FileEntry] = []
        for e in self.entries:
            final = layout.resolve_under(self.dest_dir, e.name)
            if final.exists():
                raise FileExistsError(f"{final} already exists")

    def _open(self, idx: int) -> None:
        e = self.entries[idx]
        final = self.dest_dir / layout.safe_relpath(e.name)
        final.parent.mkdir(parents=True, exist_ok=True)
        layout.resolve_under(self.dest_dir, e.name)  # a symlinked parent must not lead out
        self._part = final.with_name(final.name + PART_SUFFIX)
        if self.pool is not None and self.pool.take(self._part, e.size):
            # A deleted step's file: overwriting its tmpfs pages beats allocating fresh ones (layout).
            self._fd = os.open(self._part, os.O_WRONLY)
        else:
            self._fd = os.open(self._part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            if self.progress is not None and e.size:
                # Full size at once (a sparse file on tmpfs: no pages yet), so that a reader following the
                # watermark can map the whole file while it lands (it reads only bytes already written).
                os.ftruncate(self._fd, e.size)
        self._idx, self._crc, self._pos, self._told = idx, 0, 0, 0
        if self.progress is not None:
            self.progress.landed(idx, 0)

    def write(self, idx: int, offset: int, data: Any, running_crc: int | None = None) -> None:
        """Append ``data`` to file ``idx``; ``running_crc``: the file's crc32c up to the end of ``data``
        when the caller computed it already (else it is computed here)."""
        if idx != self._idx:
            if self._fd >= 0 or idx != len(self.done) or idx >= len(self.entries):
                raise ConnectionError(f"out-of-order data: file {idx} while expecting {len(self.done)}")
            self._open(idx)
        if offset != self._pos:
            raise ConnectionError(
                f"out-of-order data in {self.entries[idx].name}: offset {offset} != {self._pos}"
            )
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._pos + n > self.entries[idx].size:
            raise ConnectionError(f"too much data for {self.entries[idx].name}")
        if n:
            if running_crc is None:  # the stream path: the file's crc32c here (the data port's is the caller's)
                t_crc = time.perf_counter()
                self._crc = checksums.crc32c_extend(self._crc, view)
                restore_phases.verified(time.perf_counter() - t_crc)
            else:
                self._crc = running_crc
            _pwrite_all(self._fd, view, offset)
        self._pos += n
        self.bytes += n
        if self.progress is not None and n and (
            self._pos - self._told >= LANDED_STEP_BYTES or self._pos == self.entries[idx].size
        ):
            self.progress.landed(idx, self._pos)
            self._told = self._pos

    def finish(self, idx: int) -> None:
        if idx != self._idx:
            self.write(idx, 0, b"")  # an empty file: open it
        e = self.entries[idx]
        if self._pos != e.size:
            raise ConnectionError(f"{e.name}: got {self._pos} of {e.size} bytes")
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        assert self._part is not None
        if self._crc != e.crc32c:
            self._part.unlink(missing_ok=True)
            raise ChecksumError(f"{e.name} from peer", e.crc32c, self._crc)
        os.rename(self._part, self._part.with_name(self._part.name[: -len(PART_SUFFIX)]))
        self._part = None
        self.done.append(e)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._part is not None:
            self._part.unlink(missing_ok=True)
            self._part = None


class PieceSink:
    """Receives byte ranges ("pieces") of files, in order, into files of their full size under ``dest_dir``
    (sparse on tmpfs: only the pieces take pages). Same interface as :class:`FileSink`, whose ``entries``
    are here the pieces (``size`` = the piece's length, ``crc32c`` = its crc32c), so the receive loops are
    the same. A file gets its final name once each of its pieces matched its crc32c; ``abort()`` removes
    the parts. The caller reads only the pieces of those files."""

    def __init__(self, dest_dir: Path, files: Sequence[FileEntry], pieces: Sequence[layout.FilePiece]):
        layout.check_pieces(files, pieces)
        self.dest_dir = Path(dest_dir)
        self.pieces = list(pieces)
        self.entries = [FileEntry(pc.name, pc.length, pc.crc32c) for pc in self.pieces]
        self._size = {f.name: f.size for f in files}
        self._last = {pc.name: i for i, pc in enumerate(self.pieces)}
        self._fds: dict[str, tuple[int, Path]] = {}
        self._idx, self._pos, self._crc = -1, 0, 0
        self.bytes = 0
        self.done: list[FileEntry] = []
        for name in self._last:
            if layout.resolve_under(self.dest_dir, name).exists():
                raise FileExistsError(f"{self.dest_dir / name} already exists")

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            final = self.dest_dir / layout.safe_relpath(name)
            final.parent.mkdir(parents=True, exist_ok=True)
            layout.resolve_under(self.dest_dir, name)  # a symlinked parent must not lead out
            part = final.with_name(final.name + PART_SUFFIX)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fd, self._size[name])
            self._fds[name] = (fd, part)
        return self._fds[name][0]

    def write(self, idx: int, offset: int, data: Any, running_crc: int | None = None) -> None:
        if idx != self._idx:
            if idx != len(self.done) or idx >= len(self.pieces):
                raise ConnectionError(f"out-of-order data: piece {idx} while expecting {len(self.done)}")
            self._idx, self._pos, self._crc = idx, 0, 0
        pc = self.pieces[idx]
        if offset != self._pos:
            raise ConnectionError(f"out-of-order data in {pc.name}: offset {offset} != {self._pos}")
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._pos + n > pc.length:
            raise ConnectionError(f"too much data for the piece {pc.offset}+{pc.length} of {pc.name}")
        if n:
            if running_crc is None:  # the stream path: the file's crc32c here (the data port's is the caller's)
                t_crc = time.perf_counter()
                self._crc = checksums.crc32c_extend(self._crc, view)
                restore_phases.verified(time.perf_counter() - t_crc)
            else:
                self._crc = running_crc
            _pwrite_all(self._fd(pc.name), view, pc.offset + offset)
        self._pos += n
        self.bytes += n

    def finish(self, idx: int) -> None:
        pc = self.pieces[idx]
        if idx != self._idx or self._pos != pc.length:
            raise ConnectionError(f"{pc.name}: got {self._pos if idx == self._idx else 0} of the piece's "
                                  f"{pc.length} bytes")
        if self._crc != pc.crc32c:
            self.abort()
            raise ChecksumError(f"{pc.name} (piece {pc.offset}+{pc.length}) from peer", pc.crc32c, self._crc)
        self.done.append(self.entries[idx])
        if self._last[pc.name] == idx:
            fd, part = self._fds.pop(pc.name)
            os.fsync(fd)
            os.close(fd)
            os.rename(part, part.with_name(part.name[: -len(PART_SUFFIX)]))

    def abort(self) -> None:
        for fd, part in self._fds.values():
            os.close(fd)
            part.unlink(missing_ok=True)
        self._fds.clear()


