"""A copy of a step that is still landing on this host's RAM disk, read while it arrives.

The host's replicator fetches a step from a peer into a temporary directory and commits it by rename once
every file's crc32c matched (``replicator.peer.client.fetch_step``). While it runs, it reports each file's
watermark — the bytes written so far, from offset 0 — over the local control service (``StreamStep``).
A :class:`Landing` holds that state; :meth:`Landing.read` maps a shard's bytes and verifies them block by
block (the manifest's block crc32cs) as the watermark passes each block, so a restore reads the data while
the rest is still on the wire instead of after the copy is committed. Nothing unverified is returned: a
block whose crc32c differs raises ``ChecksumError``, a copy that fails (peer lost) raises
``ConnectionError``, and the reader then falls back to the committed copy from another tier.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sidecar import checksums, layout
from sidecar.spares import RECYCLE_MIN_BYTES

# Shards smaller than this, or not at a mappable offset, are read once their whole file range has landed.
MAP_MIN_BYTES = 1 << 20


class _Map(mmap.mmap):
    """An mmap that can carry a finalizer (the lease on the file ends with the last array using it)."""


class Landing:
    """The watermark of one step copy being written under ``tmp_dir`` and committed as ``step_dir``.

    ``update``/``fail`` are called by whoever follows the replicator's stream; ``read`` by restore threads.
    Paths are relative to ``root`` and resolved under it (they come from another process).
    """

    def __init__(self, root: Path, manifest: layout.StepManifest, tmp_dir: str, step_dir: str,
                 part_suffix: str, *, timeout_seconds: float, close: Callable[[], None] | None = None):
        self.root = Path(root)
        self.manifest = manifest
        self.tmp = layout.resolve_under(self.root, tmp_dir) if tmp_dir else None
        self.final = layout.resolve_under(self.root, step_dir)
        if not part_suffix and self.tmp is not None:
            raise ValueError("a landing copy needs the part-file suffix")
        self.part_suffix = part_suffix
        self.timeout = timeout_seconds
        self._index = {f.name: i for i, f in enumerate(manifest.files)}
        self._landed = [-1] * len(manifest.files)
        self._committed = False
        self._error: str | None = None
        self._cond = threading.Condition()
        self._close = close

    # ------------------------------------------------------------------ fed by the stream
    def update(self, landed: Mapping[int, int], committed: bool = False) -> None:
        with self._cond:
            for i, n in landed.items():
                if 0 <= i < len(self._landed):
                    self._landed[i] = max(self._landed[i], min(int(n), self.manifest.files[i].size))
            if committed:
                self._committed = True
                self._landed = [f.size for f in self.manifest.files]
            self._cond.notify_all()

    def fail(self, why: str) -> None:
        with self._cond:
            if not self._committed and self._error is None:
                self._error = why
            self._cond.notify_all()

    @property
    def committed(self) -> bool:
        with self._cond:
            return self._committed

    @property
    def failed(self) -> str | None:
        with self._cond:
            return self._error

    def close(self) -> None:
        """Stop following the stream (the replicator's copy goes on and is committed for next time)."""
        if self._close is not None:
            self._close()
            self._close = None

    # ------------------------------------------------------------------ read side
    def wait_for(self, index: int, nbytes: int) -> int:
        """Block until file ``index`` has at least ``nbytes`` landed (``nbytes`` 0: it is opened); the
        current watermark. ConnectionError when the copy failed, TimeoutError when it stalls."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while self._landed[index] < nbytes:
                if self._error is not None:
                    raise ConnectionError(f"the copy landing in {self.tmp} failed: {self._error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.manifest.files[index].name}: {self._landed[index]} of {nbytes} "
                                       f"bytes landed in {self.timeout:.0f}s")
                self._cond.wait(left)
            return self._landed[index]

    def _open(self, name: str) -> int:
        """An fd of file ``name`` wherever it is now: its part file, its final name in the temporary
        directory, or the committed directory (each rename is atomic, so one of them holds it)."""
        rel = layout.safe_relpath(name)
        for _ in range(3):
            candidates = [self.final / rel]
            if self.tmp is not None:
                candidates[:0] = [self.tmp / f"{rel}{self.part_suffix}", self.tmp / rel]
            for p in candidates:
                try:
                    layout.resolve_under(p.parent, p.name)
                    return os.open(p, os.O_RDONLY)
                except FileNotFoundError:
                    continue
        raise FileNotFoundError(f"{name} is neither landing in {self.tmp} nor committed in {self.final}")

    def read(self, entry: layout.ShardEntry) -> np.ndarray:
        """The verified bytes of one saved shard of this copy, as they land (a uint8 array)."""
        fi = self._index.get(entry.file)
        if fi is None:
            raise layout.ManifestError(f"shard file {entry.file!r} is not in the landing copy's manifest")
        size = self.manifest.files[fi].size
        start, stop = entry.offset, entry.offset + entry.length
        if stop > size:
            raise layout.ManifestError(f"shard at {start}+{entry.length} past the end of {entry.file} ({size})")
        if entry.length < MAP_MIN_BYTES or start % mmap.ALLOCATIONGRANULARITY:
            self.wait_for(fi, stop)
            fd = self._open(entry.file)
            try:
                buf = checksums.aligned_empty(entry.length)
                got = os.preadv(fd, [memoryview(buf)], start) if entry.length else 0
            finally:
                os.close(fd)
            if got != entry.length:
                raise EOFError(f"{entry.file}: {got} of {entry.length} bytes at {start}")
            actual = checksums.crc32c(buf)
            if actual != entry.crc32c:
                raise checksums.ChecksumError(f"{entry.file} (landing)", entry.crc32c, actual)
            return buf
        self.wait_for(fi, 0)  # its part file exists, at its full size
        buf = self._map(entry.file, start, entry.length)
        bad = self._verify_as_landing(fi, entry, buf)
        if bad is not None:
            del buf  # not kept alive by the traceback: the mapping (and its lease) ends now
            raise checksums.ChecksumError(*bad)
        return buf

    def _verify_as_landing(self, fi: int, entry: layout.ShardEntry, buf: np.ndarray) -> tuple[str, int, int] | None:
        """Verify ``buf`` (the shard's mapped bytes) block by block as the watermark passes each block:
        None when every block matched, else (what, expected, actual)."""
        bs, start = entry.block_size, entry.offset
        done, crc = 0, 0  # bytes of the shard verified; their crc32c when there are no block crc32cs
        while done < entry.length:
            need = min(done + bs, entry.length) if bs else done + 1
            landed = min(self.wait_for(fi, start + need), start + entry.length) - start
            if bs:
                # Every whole block below the watermark (the last one may be short).
                while done < entry.length and min(done + bs, entry.length) <= landed:
                    end = min(done + bs, entry.length)
                    want = entry.block_crc32c[done // bs]
                    actual = checksums.crc32c(buf[done:end])
                    if actual != want:
                        return f"{entry.file} (landing, block {done // bs})", want, actual
                    done = end
            else:
                # No block crc32cs (an older manifest): extend the shard's crc32c and check it at the end.
                crc = checksums.crc32c_extend(crc, buf[done:landed])
                done = landed
        if not bs and crc != entry.crc32c:
            return f"{entry.file} (landing)", entry.crc32c, crc
        return None

    def _map(self, name: str, offset: int, length: int) -> np.ndarray:
        """Map ``length`` bytes of the file copy-on-write (only pages below the watermark are ever touched;
        the rest of the full-size part file is not written yet). A large file is leased (a shared ``flock``
        while the mapping lives) so that GC unlinks it rather than recycling its pages under the arrays."""
        fd = self._open(name)
        lease = -1
        try:
            if os.fstat(fd).st_size < offset + length:
                raise EOFError(f"{name}: the landing file is shorter than {offset + length} bytes")
            if length >= RECYCLE_MIN_BYTES:
                fcntl.flock(fd, fcntl.LOCK_SH)
                lease = fd
            mm = _Map(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        except BaseException:
            os.close(fd)
            raise
        if lease >= 0:
            weakref.finalize(mm, os.close, lease)
        else:
            os.close(fd)
        return np.frombuffer(mm, dtype=np.uint8)


def landed_map(messages: Any) -> dict[int, int]:
    """{file index: bytes} of the ``FileLanded`` entries of one stream message."""
    return {int(x.index): int(x.bytes) for x in messages}
