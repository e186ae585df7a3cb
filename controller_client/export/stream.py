"""Write a downloaded native step as a standard Orbax checkpoint, streaming: no array is ever whole in memory.

Each array becomes a zarr array in the checkpoint's OCDBT database (:mod:`orbax_files`) whose chunks nest in
the saved shards' grid (:mod:`plan`). Each saved shard is read front to back once, one piece (at most a chunk)
at a time, its crc32c computed on the way and checked after its last byte; each piece is handed to TensorStore
as one write, which encodes it (zstd), stores it and drops it (no chunk cache). At most ``in_flight`` writes
are pending; the next piece is read while they run.

Memory, whatever the state's size: at most :func:`working_set_bytes` of chunk-sized buffers, ``(4 x in_flight
+ 1) x chunk_bytes`` (144 MiB at the defaults, 16 MiB chunks and 2 writes pending), plus ~70 MiB of
interpreter, numpy and TensorStore; and the OCDBT index, ~50 bytes per chunk. Where the saved shards form no
regular grid (never for one JAX sharding) each chunk is assembled from the shards it overlaps, read through
file mappings after a streamed crc32c pass over each shard: the mapped pages are page cache the kernel may drop.

A copy found corrupt (crc32c mismatch, short file) is dropped and the shard streamed again from the next
copy (a data-parallel replica); with none left the export fails. The checkpoint is written under a temporary
sibling of ``dest`` and renamed into place after ``_CHECKPOINT_METADATA``, written last: a failed export
leaves nothing at ``dest``.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from controller_client.export import orbax_files, plan
from controller_client.export.leaves import Leaf, tree_leaves
from controller_client.export.source import (
    ArrayIndex,
    ShardCopy,
    StepIndex,
    index_step,
    numpy_dtype,
    read_pieces,
    verify_whole,
)
from sidecar import checksums, commit

log = logging.getLogger(__name__)

# The unit of reading, encoding and writing. 16 MiB: measured exporting 1 GiB in 128 MiB shards (in_flight 2),
# 8 MiB chunks took 2.0 s and peaked at 156 MiB, 16 MiB 1.15 s and 178 MiB, 32 MiB 1.8 s and 382 MiB.
CHUNK_BYTES = 16 << 20
# Writes pending while the next piece is read: 2 keeps both cores busy (TensorStore encoding two chunks, this
# thread reading and verifying the next): 1.15 s against 1.72 s with 1 in the measurement above.
IN_FLIGHT_WRITES = 2
# Each pending write holds up to about four chunk-sized buffers at its peak (the piece, its zstd encoding,
# the bytes on their way into the OCDBT data file): measured up to 8.5 chunks above the interpreter with 2
# writes pending and one piece being read (16 MiB chunks: 170-206 MiB peaks, the interpreter ~70).
BUFFERS_PER_WRITE = 4
# OCDBT b-tree nodes of at most 64 KiB (Orbax's writers use 100 MB: one root node). The export commits once
# per chunk or two, and every commit rewrites the nodes on its path: with one root node that holds every key
# the cost of a commit grew with the chunks written (2.8 -> 5.6 ms per write over 8000 writes, 511 MiB of
# rewritten nodes); with 64 KiB nodes it stayed flat (1.9-3.0 ms, 72 MiB). Readers take any node size.
OCDBT_NODE_BYTES = 64 << 10
OCDBT_CACHE_BYTES = 0  # no cache of OCDBT nodes: a 16 MiB cache filled and stayed full (+37 MiB peak vs +10)
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """How an export streams: the zarr chunk size (the unit of memory), the writes kept pending, TensorStore's
    threads, the OCDBT node size."""

    chunk_bytes: int = CHUNK_BYTES
    in_flight: int = IN_FLIGHT_WRITES
    copy_threads: int = 2
    io_threads: int = 4
    ocdbt_node_bytes: int = OCDBT_NODE_BYTES

    def __post_init__(self) -> None:
        if self.chunk_bytes < 4096 or min(self.in_flight, self.copy_threads, self.io_threads) < 1 \
                or self.ocdbt_node_bytes < 256:
            raise ValueError(f"bad export options {self}")


def working_set_bytes(options: ExportOptions) -> int:
    """The chunk-sized buffers an export holds at once, at most: each pending write's
    (:data:`BUFFERS_PER_WRITE`) and the piece being read. The interpreter, numpy and TensorStore add ~70 MiB."""
    return (BUFFERS_PER_WRITE * options.in_flight + 1) * options.chunk_bytes


class _Writes:
    """TensorStore writes pending, at most ``limit``: a submit waits for the oldest first when there are."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending: collections.deque[Any] = collections.deque()

    def make_room(self) -> None:
        while len(self.pending) >= self.limit:
            self.pending.popleft().result()

    def submit(self, future: Any) -> None:
        self.make_room()
        self.pending.append(future)

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()


def _return_freed_buffers() -> None:
    """Have glibc serve every buffer of 1 MiB or more from its own mapping, returned to the kernel when freed.

    By default glibc raises that threshold to the largest buffer freed so far (up to 32 MiB), after which
    pieces and encoded chunks come from heaps it keeps: peak RSS grew with the state, 161 -> 227 -> 279 -> 305
    MiB exporting 64 MiB, 256 MiB, 1 GiB, 2 GiB; with the threshold fixed, 204 MiB at 256 MiB and 216 MiB at
    2 GiB. And two heaps rather than one per thread (TensorStore's pools): 256 MiB -> 2 GiB grew the peak by
    14 MiB instead of 35 (4 MiB chunks). A no-op where there is no glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
        libc.mallopt(M_ARENA_MAX, 2)
    except (OSError, AttributeError):
        log.debug("no mallopt here: buffers freed may stay in the heap")


def _target(store: Any, region: plan.Region) -> Any:
    return store[tuple(slice(a, b) for a, b in region)] if region else store


def _write_shard(store: Any, arr: ArrayIndex, index: plan.Region, chunks: tuple[int, ...],
                 writes: _Writes, bad: list[str]) -> int:
    """Stream one saved shard into ``store`` from its first good copy; returns its bytes."""
    dtype = numpy_dtype(arr.dtype)
    pieces = list(plan.pieces(index, chunks, dtype.itemsize))
    errors: list[BaseException] = []
    for copy in arr.shards[index]:
        try:
            for piece, buf in read_pieces(copy, pieces):
                writes.submit(_target(store, piece.region).write(
                    buf.view(dtype).reshape(piece.shape), can_reference_source_data_indefinitely=True).commit)
            return copy.entry.length
        except (OSError, EOFError, checksums.ChecksumError) as e:
            # Let every write of this copy land before the next copy's writes of the same chunks.
            writes.drain()
            log.warning("bad copy of shard %s of %r: %s; trying the next one", list(index), arr.path, e)
            bad.append(f"{copy.path}: {e}")
            errors.append(e)
    if errors:
        raise errors[-1]
    raise FileNotFoundError(f"no copy of shard {list(index)} of {arr.path!r}")


def _write_assembled(store: Any, arr: ArrayIndex, chunks: tuple[int, ...], writes: _Writes) -> int:
    """The fallback for shards that form no regular grid: each shard verified by a streamed pass, then each
    chunk assembled from the shards it overlaps, read through file mappings (page cache, not the heap)."""
    dtype = numpy_dtype(arr.dtype)
    good: dict[plan.Region, ShardCopy] = {}
    for index, copies in arr.shards.items():
        for copy in copies:
            try:
                verify_whole(copy)
            except (OSError, EOFError, checksums.ChecksumError) as e:
                log.warning("bad copy of shard %s of %r: %s", list(index), arr.path, e)
                continue
            good[index] = copy
            break
        else:
            raise checksums.ChecksumError(f"every copy of shard {list(index)} of {arr.path!r}")
    total = 0
    for region in plan.chunk_regions(arr.global_shape, chunks):
        out = np.empty(tuple(b - a for a, b in region), dtype=dtype)
        covered = 0
        for index, copy in good.items():
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, index, strict=True))
            if any(lo >= hi for lo, hi in inter):
                continue
            shard = np.memmap(copy.path, dtype=dtype, mode="r", offset=copy.entry.offset,
                              shape=tuple(b - a for a, b in index))
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, region, strict=True))] = \
                shard[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, index, strict=True))]
            del shard
            covered += math.prod(hi - lo for lo, hi in inter)
        if covered != out.size:
            raise FileNotFoundError(f"the saved shards of {arr.path!r} cover {covered} of {out.size} elements "
                                    f"of chunk {list(region)}")
        writes.submit(_target(store, region).write(out, can_reference_source_data_indefinitely=True).commit)
        total += out.nbytes
    return total


def _write_array(ts: Any, ctx: Any, kvstore: dict[str, Any], leaf: Leaf, arr: ArrayIndex,
                 options: ExportOptions, bad: list[str]) -> tuple[tuple[int, ...], bool]:
    """One array into the database; (its chunk shape, whether it was streamed shard by shard)."""
    itemsize = numpy_dtype(arr.dtype).itemsize
    grid = plan.grid_shape(arr.global_shape, arr.shards)
    chunks = plan.chunk_shape(grid if grid is not None else arr.global_shape, itemsize, options.chunk_bytes)
    store = ts.open(orbax_files.array_spec(kvstore, leaf, chunks), context=ctx).result()
    writes = _Writes(options.in_flight)
    if grid is not None:
        for index in sorted(arr.shards):
            _write_shard(store, arr, index, chunks, writes, bad)
    else:
        log.info("the saved shards of %r form no regular grid: assembling it chunk by chunk", arr.path)
        _write_assembled(store, arr, chunks, writes)
    writes.drain()
    return chunks, grid is not None


def _write_metadata(tmp: Path, leaves: list[Leaf], chunks: dict[str, tuple[int, ...]], init_ns: int) -> None:
    """The JSON files Orbax reads; ``_CHECKPOINT_METADATA`` last (the commit marker)."""
    (tmp / "array_metadatas").mkdir()
    files = {
        "_METADATA": orbax_files.metadata(leaves),
        "_sharding": orbax_files.sharding(leaves),
        "array_metadatas/process_0": orbax_files.array_metadatas(leaves, chunks),
    }
    for name, doc in files.items():
        commit.write_file_atomic(tmp / name, json.dumps(doc).encode())
    commit.write_file_atomic(tmp / orbax_files.CHECKPOINT_METADATA,
                             json.dumps(orbax_files.checkpoint_metadata(init_ns, time.time_ns())).encode())


def _write_checkpoint(tmp: Path, index: StepIndex, leaves: list[Leaf], options: ExportOptions) -> dict[str, Any]:
    """Every leaf's data, then the metadata, into ``tmp``; what was written."""
    import tensorstore as ts  # the [jax] extra (Orbax's dependency): only `mtc export` needs it

    init_ns = time.time_ns()
    ctx = ts.Context(orbax_files.ts_context(options.copy_threads, options.io_threads, OCDBT_CACHE_BYTES))
    kvstore = orbax_files.kvstore_spec(str(tmp), options.ocdbt_node_bytes)
    chunks: dict[str, tuple[int, ...]] = {}
    bad: list[str] = []
    assembled = []
    total = 0
    for leaf in leaves:
        if leaf.kind == "array":
            t0 = time.monotonic()
            arr = index.arrays[leaf.path]
            chunks[leaf.name], streamed = _write_array(ts, ctx, kvstore, leaf, arr, options, bad)
            nbytes = math.prod(arr.global_shape) * numpy_dtype(arr.dtype).itemsize
            total += nbytes
            if not streamed:
                assembled.append(leaf.path)
            secs = time.monotonic() - t0
            log.info("exported %r: %d bytes in %.2fs (%.1f MiB/s), chunks %s", leaf.path, nbytes, secs,
                     nbytes / max(secs, 1e-9) / 2**20, list(chunks[leaf.name]))
        elif leaf.kind == "scalar":
            store = ts.open(orbax_files.array_spec(kvstore, leaf, ()), context=ctx).result()
            store.write(np.asarray(leaf.value, dtype=leaf.dtype)).result()
    _write_metadata(tmp, leaves, chunks, init_ns)
    return {"bytes": total, "bad_copies": bad, "assembled": assembled}


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux ``VmHWM``; else ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def export_step(step: int, roots: list[Path], dest: Path, options: ExportOptions | None = None) -> dict[str, Any]:
    """Write ``step`` (every rank's data under ``roots``, as ``<root>/steps/<step>``) to ``dest`` as a standard
    Orbax checkpoint, streaming (see the module docstring). FileExistsError when ``dest`` exists."""
    options = options or ExportOptions()
    t0 = time.monotonic()
    _return_freed_buffers()
    dest = Path(dest).absolute()
    if dest.exists():
        raise FileExistsError(f"{dest} exists already")
    index = index_step(step, roots)
    leaves = tree_leaves({p: (a.global_shape, a.dtype) for p, a in index.arrays.items()}, index.values)
    tmp = commit.make_tmp_dir(dest.parent, step)
    try:
        info = _write_checkpoint(tmp, index, leaves, options)
        commit.publish_dir(tmp, dest, orbax_files.CHECKPOINT_METADATA)
    except BaseException:
        commit.remove_owned_dir(tmp)
        raise
    secs = time.monotonic() - t0
    log.info("exported step %d to %s: %d bytes in %.2fs (%.1f MiB/s)", step, dest, info["bytes"], secs,
             info["bytes"] / max(secs, 1e-9) / 2**20)
    keys = {p: a.key_impl for p, a in index.arrays.items() if a.key_impl}
    return {"step": step, "dest": str(dest), "leaves": len(leaves), "bytes": info["bytes"],
            "prng_key_leaves": keys, "seconds": round(secs, 3), "chunk_bytes": options.chunk_bytes,
            "working_set_bytes": working_set_bytes(options), "bad_copies": info["bad_copies"],
            "assembled_arrays": info["assembled"], "peak_rss_bytes": peak_rss_bytes()}
