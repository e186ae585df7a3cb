"""Write one host's shards of a step to its RAM directory: preallocated files, crc32c, atomic commit.

Saving is split in two: :func:`device_to_host` (the only part ``save`` blocks on) brings each of the host's
addressable shards to host memory; :class:`HostWriter` writes them in the background.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from sidecar import checksums, commit, faults, layout, spares
from sidecar.notify import notify_step_committed

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ShardCopy:
    """A host copy of one shard: its global index and its bytes (C-contiguous numpy array)."""

    index: tuple[tuple[int, int], ...]
    data: np.ndarray


@dataclasses.dataclass
class ArrayCopy:
    path: str
    global_shape: tuple[int, ...]
    dtype: str
    key_impl: str | None
    shards: list[ShardCopy]


@dataclasses.dataclass
class HostStep:
    """Everything one host writes for one step."""

    root: Path
    job: str
    step: int
    rank: int
    nodes: int
    arrays: list[ArrayCopy]
    values: list[layout.ValueEntry]
    savers: tuple[int, ...] = ()  # the active ranks of this save (empty: every rank)
    generation: int = 0

    @property
    def nbytes(self) -> int:
        return sum(s.data.nbytes for a in self.arrays for s in a.shards)


# Unit of a shard file's write: a multiple of layout.BLOCK_BYTES that stays in the CPU's cache between its
# crc32c and its copy into the page cache (1-4 MiB measured best; 16 MiB lost most of the gain).
WRITE_CHUNK_BYTES = 4 * layout.BLOCK_BYTES
# The spare pool's fill after a save waits this long first: the step just committed is being made safe (the
# replicator's report, peer copies, replica attestation) and the fill, writing a step's size of fresh pages, took
# the CPU from it. bench.emergency (4 hosts on 2 cores): a fill right after save(1) stretched `safe_after` from
# 0.55-0.67 s to 1.5-2.4 s, the coordinator reporting the step redundant ~0.8 s after the last commit instead
# of ~0.1 s. The next save of a training loop comes minutes later; one that comes sooner finds the pool as
# before the fill (cancelled: a save stops it).
PREWARM_DELAY_SECONDS = 1.0


class SaveError(RuntimeError):
    """A background save failed; raised at the next call on the writer."""


def _write_file(path: Path, data: np.ndarray) -> tuple[int, tuple[int, ...]]:
    """Preallocate and write one shard file, fsync it, and return the crc32c of its bytes and, for a file
    larger than ``layout.BLOCK_BYTES``, the crc32c of each block (one pass: the whole-file crc is combined
    from the blocks').

    ``path`` may already exist: a recycled file that :func:`write_step` put there (its tmpfs pages are
    overwritten instead of freshly allocated: ~4.9 vs ~2.6 GiB/s measured), sized to ``data``.
    """
    flat = data.reshape(-1).view(np.uint8)
    blocked = flat.nbytes > layout.BLOCK_BYTES
    blocks: list[int] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if flat.nbytes:
            os.posix_fallocate(fd, 0, flat.nbytes)
            faults.point("save.mid_file")
        view = memoryview(flat)
        # Each chunk's crc32cs are taken just before it is written, while its bytes are in the CPU's cache:
        # one pass over the source instead of two (512 MiB: 0.21-0.22 CPU-s against 0.26 measured).
        for start in range(0, flat.nbytes, WRITE_CHUNK_BYTES):
            end = min(flat.nbytes, start + WRITE_CHUNK_BYTES)
            if blocked:
                blocks.extend(checksums.crc32c(flat[b : min(end, b + layout.BLOCK_BYTES)])
                              for b in range(start, end, layout.BLOCK_BYTES))
            off = start
            while off < end:
                off += os.pwrite(fd, view[off:end], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    if blocked:
        return checksums.combine_blocks(blocks, layout.BLOCK_BYTES, flat.nbytes), tuple(blocks)
    return checksums.crc32c(flat), ()


def _naming_the_disk(e: OSError, hs: HostStep) -> OSError:
    """``e`` as an error that names the step and the RAM disk. A failing ``pwrite``/``fsync`` names neither
    (``[Errno 5] Input/output error``): the same errno, hence the same OSError subclass, with the words added.
    Errors that name a file already, and the project's own OSError types, are kept as they are."""
    if e.errno == errno.ENOSPC and "RAM disk full" not in str(e):
        return OSError(errno.ENOSPC, f"RAM disk full while writing step {hs.step} to {hs.root}: {e}")
    if e.errno is not None and e.filename is None and type(e).__module__ == "builtins" \
            and str(hs.root) not in str(e):
        return OSError(e.errno, f"{e.strerror or e} while writing step {hs.step} to {hs.root}")
    return e


def write_step(hs: HostStep, threads: int = 2) -> layout.StepManifest:
    """Write ``hs`` under a temporary directory and commit it as ``<root>/steps/<step>``.

    Saving a step number that is already committed (an abandoned newer step after a restore, a re-save)
    replaces it atomically. On any failure (ENOSPC included) the temporary directory is removed, the
    previous steps are untouched, and the error is raised.
    """
    sdir = layout.steps_dir(hs.root)
    final = sdir / layout.step_name(hs.step)
    tmp = commit.make_tmp_dir(sdir, hs.step)
    faults.point("save.after_tmp_dir")
    t0 = time.monotonic()
    try:
        need = hs.nbytes
        st = os.statvfs(tmp)
        pool = spares.SparePool(spares.spare_dir(hs.root))
        free = st.f_bavail * st.f_frsize + spares.spare_bytes(spares.spare_dir(hs.root))
        if need > free:
            raise OSError(
                errno.ENOSPC,
                f"RAM disk full: step {hs.step} needs {need} bytes, {free} free in {hs.root}",
            )
        jobs = []
        for li, arr in enumerate(hs.arrays):
            for si, sh in enumerate(arr.shards):
                jobs.append((li, si, layout.shard_file_name(li, si), sh.data))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as ex:
            for _, _, name, data in jobs:  # recycled files first (renames, in this thread)
                pool.take(tmp / name, data.nbytes)
            futs = {(li, si): ex.submit(_write_file, tmp / name, data) for li, si, name, data in jobs}
            crcs = {k: f.result() for k, f in futs.items()}
            faults.point("save.after_files")
        files = []
        arrays = []
        for li, arr in enumerate(hs.arrays):
            shards = []
            for si, sh in enumerate(arr.shards):
                name = layout.shard_file_name(li, si)
                crc, blocks = crcs[(li, si)]
                files.append(layout.FileEntry(name, sh.data.nbytes, crc))
                shards.append(layout.ShardEntry(sh.index, name, 0, sh.data.nbytes, crc,
                                                layout.BLOCK_BYTES if blocks else 0, blocks))
            arrays.append(layout.ArrayEntry(arr.path, arr.global_shape, arr.dtype, tuple(shards), arr.key_impl))
        manifest = layout.StepManifest(
            job=hs.job,
            step=hs.step,
            rank=hs.rank,
            nodes=hs.nodes,
            files=tuple(files),
            arrays=tuple(arrays),
            values=tuple(hs.values),
            savers=tuple(hs.savers),
            generation=hs.generation,
        )
        faults.point("save.before_manifest")
        commit.write_manifest(tmp, manifest)
        faults.point("save.after_manifest")
        faults.point("save.before_commit")
        commit.commit_dir(tmp, final, replace=True)
        faults.point("save.after_commit")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:  # the recycled pages were not enough: give them back for the retry
            spares.drop_spares(spares.spare_dir(hs.root))
        named = _naming_the_disk(e, hs)
        if named is e:
            raise
        raise named from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    dt = time.monotonic() - t0
    log.info(
        "rank %d committed step %d: %d bytes in %.3fs (%.2f GiB/s)",
        hs.rank, hs.step, need, dt, need / max(dt, 1e-9) / 2**30,
    )
    return manifest


def gc_local_steps(root: Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` committed steps (never the newest one)."""
    steps = commit.committed_steps(layout.steps_dir(root))
    keep = max(1, keep)
    doomed = steps[:-keep] if len(steps) > keep else []
    for s in doomed:
        commit.delete_step(layout.steps_dir(root) / layout.step_name(s), spare=spares.spare_dir(root))
    return doomed


class HostWriter:
    """Background writer of one host directory: one step at a time, errors kept for the next call."""

    def __init__(self, root: Path, threads: int = 2, prewarm: bool = True):
        self.root = Path(root)
        self.threads = threads
        self.prewarm = prewarm  # fill an empty spare pool after a save (sidecar.spares)
        self._queue: queue.Queue[tuple[HostStep, int | None, bool, str] | None] = queue.Queue()
        self._error: tuple[str, BaseException] | None = None  # (owner of the failed save, its error)
        self._pending = 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"mtc-writer-{self.root.name}", daemon=True)
        self._warm: threading.Thread | None = None  # the pool's fill after the last save, if any
        self._warm_stop = threading.Event()
        self.root.mkdir(parents=True, exist_ok=True)
        commit.remove_tmp_dirs(layout.steps_dir(self.root))
        spares.drop_warm(spares.spare_dir(self.root))  # a fill cut short by a crash is not a spare
        self._thread.start()

    def submit(self, hs: HostStep, keep: int | None, notify: bool = False, owner: str = "") -> None:
        """Queue ``hs``; afterwards keep ``keep`` steps (None: leave deletion to the replicator) and,
        with ``notify``, tell the host's replicator about the commit. ``owner``: the manager queueing it (see
        :meth:`raise_if_failed`)."""
        self.raise_if_failed(owner)
        with self._cv:
            self._pending += 1
        self._warm_stop.set()  # a fill still running yields to this save at its next chunk
        self._queue.put((hs, keep, notify, owner))

    def in_flight(self) -> int:
        with self._cv:
            return self._pending

    def raise_if_failed(self, owner: str = "") -> None:
        """Raise the failure of a save in the background, once, to its ``owner`` (the manager that queued it).

        A failure of another owner's save is logged and dropped: that manager is gone (a controller's next
        attempt builds a new one; on Pathways a host lost and back keeps its sidecar process, and with it this
        writer), its step was never committed here, so it is not this caller's to answer for."""
        with self._cv:
            failed, self._error = self._error, None
        if failed is None:
            return
        failed_owner, err = failed
        if failed_owner != owner:
            log.warning("%s: a save queued by an earlier checkpoint manager failed (%s); its step was not committed "
                        "here, and this manager carries on", self.root, err)
            return
        raise SaveError(f"background save to {self.root} failed: {err}") from err

    def wait(self, timeout_seconds: float | None = None, owner: str = "") -> None:
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        with self._cv:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"saves to {self.root} still running after {timeout_seconds}s")
                self._cv.wait(left)
        self.raise_if_failed(owner)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            hs, keep, notify, owner = item
            self._warm_stop.set()
            try:
                manifest = write_step(hs, self.threads)
                if keep is not None:
                    faults.point("save.before_local_gc")
                    gc_local_steps(self.root, keep)
                if notify:
                    faults.point("save.before_notify")

                    notify_step_committed(self.root, hs.step)
                    faults.point("save.after_notify")
            except BaseException as e:  # kept and re-raised in the caller's thread
                log.error("save of step %d to %s failed: %s", hs.step, self.root, e)
                with self._cv:
                    self._error = (owner, e)
                manifest = None
            finally:
                del hs, item
                # The fill starts before the save counts as finished, so whoever waited for the save finds it in
                # self._warm (wait_pool_filled).
                if manifest is not None:
                    try:
                        self._start_prewarm(manifest)
                    except RuntimeError as e:  # no thread to spare: the next save writes fresh pages
                        log.warning("could not start filling the spare pool of %s: %s", self.root, e)
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _start_prewarm(self, manifest: layout.StepManifest) -> None:
        if self.prewarm and self._queue.empty() and not (self._warm is not None and self._warm.is_alive()):
            self._warm_stop.clear()
            if self._queue.empty():  # else the save queued meanwhile goes first
                self._warm = threading.Thread(target=self._prewarm, args=(manifest,), daemon=True,
                                              name=f"mtc-prewarm-{self.root.name}")
                self._warm.start()

    def wait_pool_filled(self, timeout_seconds: float | None = None) -> bool:
        """Wait for the saves queued so far and then the spare pool's fill after them (if any) to end: True if
        it ended within ``timeout_seconds``. A benchmark's warm-up calls it so that the timed save finds the pool
        as a training loop's next save does, minutes later; nothing else needs to (a save stops a fill)."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        self.wait(timeout_seconds)
        w = self._warm
        if w is not None:
            w.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            return not w.is_alive()
        return True

    def _prewarm(self, manifest: layout.StepManifest) -> None:
        """Fill an empty spare pool for the next save (sidecar.spares), until another save is queued.

        Its own thread, not joined by the next save: that save asks it to stop (at its next chunk) and writes
        meanwhile. At the process's normal CPU priority, not SCHED_IDLE. With SCHED_IDLE,
        tests/controller_client/test_elastic.py::test_rollback_then_save_forward failed in each of 4 runs of
        its file, and passed without it. The likely cause: this thread holds the GIL between its writes, and
        an idle-class thread descheduled while holding it stalls every Python thread of the process (the
        training loop's too) for as long as the CPU is busy elsewhere. It begins ``PREWARM_DELAY_SECONDS`` after
        the save, unless a save or ``close`` stops it first.
        """
        if self._warm_stop.wait(PREWARM_DELAY_SECONDS):
            return
        spare = spares.spare_dir(self.root)
        try:
            st = os.statvfs(self.root)
            t0 = time.monotonic()
            added = spares.prewarm(spare, [f.size for f in manifest.files], st.f_bavail * st.f_frsize,
                                   stop=lambda: self._warm_stop.is_set() or spares.quieted())
            if added:
                log.info("spare pool of %s: %d bytes ready for the next save (%.3fs)", self.root, added,
                         time.monotonic() - t0)
        except OSError as e:  # an optimisation only: the next save writes fresh pages
            log.warning("could not fill the spare pool of %s: %s", self.root, e)

    def close(self) -> None:
        self._warm_stop.set()
        self._queue.put(None)
        self._thread.join(timeout=60)
        if self._warm is not None:
            self._warm.join(timeout=60)


def raise_failures(writers: list[HostWriter], timeout_seconds: float | None = None, wait: bool = False,
                   owner: str = "") -> None:
    """Wait for (optionally) and collect every writer's background failure of ``owner``'s saves; raise one
    error naming all."""
    errors: list[BaseException] = []
    for w in writers:
        try:
            w.wait(timeout_seconds, owner) if wait else w.raise_if_failed(owner)
        except (SaveError, TimeoutError) as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise SaveError("; ".join(str(e) for e in errors)) from errors[0]


_WRITERS: dict[str, HostWriter] = {}
_WRITERS_LOCK = threading.Lock()


def writer_for(root: Path, threads: int = 2) -> HostWriter:
    """The process-wide writer of ``root`` (one per host directory)."""
    key = os.path.realpath(root)
    with _WRITERS_LOCK:
        w = _WRITERS.get(key)
        if w is None:
            w = _WRITERS[key] = HostWriter(Path(root), threads)
        return w


def host_copy(x: Any) -> np.ndarray:
    """A C-contiguous host copy of a host array the caller may change after ``save`` (a numpy leaf)."""
    return np.array(x, copy=True, order="C")


def device_to_host(x: Any) -> np.ndarray:
    """A C-contiguous host array of one device buffer (a ``jax.Array`` shard) that nothing changes until the
    write is done: the part of a save the caller waits for.

    On TPU and GPU ``np.asarray`` transfers the buffer into new host memory: one copy (``np.array(copy=True)``
    made a second one). On CPU it is a read-only view of the device buffer itself, no copy: while a view
    references it, JAX declines to donate the buffer (a jitted step that donates it allocates its output
    anew) and ``delete()`` keeps its memory (tests/controller_client/test_manager.py), as Orbax's own host
    transfer relies on."""
    a = np.asarray(x)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)
