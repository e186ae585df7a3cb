"""Native steps built shard by shard for the export tests (tests/controller_client/test_export*.py,
tests/faults/test_export_memory.py), with no JAX and no array ever whole in memory: each rank's shards are
generated, written through the sidecar's writer (crc32c per file and per block, as a save writes them) and,
for a bucket, uploaded and dropped before the next rank's.

An array is given by its global shape, dtype and the grid its shards cut it into (shards per dimension); its
bytes are a pure function of (seed, path, shard index), so a test compares what Orbax restores with
:func:`shard_data` region by region without keeping the state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from controller_client.export.source import numpy_dtype
from replicator.backup.bucket import BackupStore
from replicator.backup.storage.filesystem import FileStore
from sidecar import layout, writer

Region = tuple[tuple[int, int], ...]
JOB = "t"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One array: global shape, dtype, shards per dimension (ceil-sized, the last smaller, as JAX cuts)."""

    shape: tuple[int, ...]
    dtype: str
    grid: tuple[int, ...] = ()
    key_impl: str | None = None

    def shards(self) -> list[Region]:
        grid = self.grid or (1,) * len(self.shape)
        sizes = [-(-n // g) for n, g in zip(self.shape, grid, strict=True)]
        out = []
        for cell in itertools.product(*(range(g) for g in grid)):
            region = tuple((i * s, min(n, (i + 1) * s)) for i, s, n in zip(cell, sizes, self.shape, strict=True))
            if all(a < b for a, b in region) or not region:
                out.append(region)
        return out

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


def shard_data(seed: int, path: str, spec: Spec, region: Region) -> np.ndarray:
    """The bytes of ``region`` (one saved shard) of array ``path``: random, fixed by (seed, path, region)."""
    dtype = numpy_dtype(spec.dtype)
    shape = tuple(b - a for a, b in region)
    key = hashlib.sha256(f"{seed}/{path}/{region}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    raw = np.frombuffer(rng.bytes(math.prod(shape) * dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def expected(seed: int, path: str, spec: Spec, region: Region) -> np.ndarray:
    """Region ``region`` of array ``path`` as saved (assembled from the shards it overlaps)."""
    out = np.empty(tuple(b - a for a, b in region), dtype=numpy_dtype(spec.dtype))
    for shard in spec.shards():
        inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, shard, strict=True))
        if all(lo < hi for lo, hi in inter):
            data = shard_data(seed, path, spec, shard)
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, region, strict=True))] = \
                data[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(inter, shard, strict=True))]
    return out


def owners(arrays: dict[str, Spec], ranks: int, replicas: int = 1) -> dict[int, list[tuple[str, Region]]]:
    """Which rank saves which shard: round robin, each shard by ``replicas`` ranks (data-parallel copies)."""
    out: dict[int, list[tuple[str, Region]]] = {r: [] for r in range(ranks)}
    k = 0
    for path, spec in sorted(arrays.items()):
        for region in spec.shards():
            for j in range(replicas):
                out[(k + j) % ranks].append((path, region))
            k += 1
    return out


def write_rank(root: Path, step: int, rank: int, ranks: int, arrays: dict[str, Spec],
               mine: list[tuple[str, Region]], values: dict[str, Any], seed: int) -> Path:
    """Rank ``rank``'s save of ``step`` under ``root`` (``<root>/steps/<step>``): its shards and every value."""
    copies = []
    for path, spec in sorted(arrays.items()):
        shards = [writer.ShardCopy(region, shard_data(seed, path, spec, region)) for p, region in mine if p == path]
        copies.append(writer.ArrayCopy(path, spec.shape, spec.dtype, spec.key_impl, shards))
    vals = [layout.ValueEntry(p, v) for p, v in sorted(values.items())]
    writer.write_step(writer.HostStep(root, JOB, step, rank, ranks, copies, vals))
    return layout.steps_dir(root) / layout.step_name(step)


def write_roots(base: Path, step: int, arrays: dict[str, Spec], values: dict[str, Any], *, ranks: int = 4,
                replicas: int = 1, seed: int = 0) -> list[Path]:
    """Every rank's save of ``step`` as ``base/<rank>/steps/<step>`` (the layout ``mtc backups download``
    makes); the roots."""
    roots = []
    for rank, mine in owners(arrays, ranks, replicas).items():
        root = base / str(rank)
        write_rank(root, step, rank, ranks, arrays, mine, values, seed)
        roots.append(root)
    return roots


def write_bucket(bucket: Path, scratch: Path, step: int, arrays: dict[str, Spec], values: dict[str, Any], *,
                 ranks: int = 4, seed: int = 0, progress: Callable[[int], None] | None = None) -> BackupStore:
    """A committed backup of ``step`` in the file bucket ``bucket``, each rank written under ``scratch``,
    uploaded, and removed before the next (disk: the bucket plus one rank's share)."""
    backups = BackupStore(FileStore(bucket), JOB)
    staging = backups.begin(step, ranks)
    for rank, mine in owners(arrays, ranks).items():
        root = scratch / f"rank-{rank}"
        d = write_rank(root, step, rank, ranks, arrays, mine, values, seed)
        backups.upload_rank(staging, rank, d)
        shutil.rmtree(root)
        if progress is not None:
            progress(rank)
    backups.commit(staging)
    return backups


def regions_of(spec: Spec, max_bytes: int) -> Iterator[Region]:
    """The array cut into row blocks of at most ``max_bytes`` (at least one row): what a check reads at once."""
    if not spec.shape:
        yield ()
        return
    row = max(1, spec.nbytes // max(1, spec.shape[0]))
    step = max(1, max_bytes // row)
    for a in range(0, spec.shape[0], step):
        yield ((a, min(spec.shape[0], a + step)), *((0, n) for n in spec.shape[1:]))


# Run in a fresh interpreter that imports Orbax, JAX and numpy only (not this repository): restore the checkpoint
# at argv[1] with plain Orbax and print one JSON line per leaf (its keystr path, type, dtype, shape, the sha256
# of its bytes, or its value). argv[2] "whole": one StandardCheckpointer().restore of everything; "each": one
# PyTreeCheckpointer partial restore per top-level array (what a step larger than the verifier's memory needs).
_RESTORE = r"""
import hashlib, json, sys
from absl import flags; flags.FLAGS(['x'])
import jax, numpy as np
import orbax.checkpoint as ocp
path, mode = sys.argv[1], sys.argv[2]

def emit(key, v):
    if hasattr(v, 'shape'):
        a = np.array(np.asarray(v), order='C')
        rec = {'path': key, 'type': type(v).__name__, 'dtype': a.dtype.name, 'shape': list(a.shape),
               'sha256': hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()}
    else:
        rec = {'path': key, 'type': type(v).__name__, 'value': v}
    print(json.dumps(rec), flush=True)

def flat(tree):
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [(jax.tree_util.keystr(k), v) for k, v in leaves]

if mode == 'whole':
    for key, v in flat(ocp.StandardCheckpointer().restore(path)):
        emit(key, v)
else:
    meta = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for name, m in sorted(meta.items()):
        if hasattr(m, 'shape') and m.shape is not None and type(m).__name__ == 'ArrayMetadata':
            item = {name: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev)}
            args = ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                          partial_restore=True)
            got = ocp.PyTreeCheckpointer().restore(path, args=args)
            emit(jax.tree_util.keystr((jax.tree_util.DictKey(name),)), got[name])
            del got
        else:
            print(json.dumps({'path': f"['{name}']", 'type': type(m).__name__, 'metadata': True}), flush=True)
"""


def orbax_restore(path: Path, mode: str = "whole", timeout: float = 300.0) -> dict[str, dict[str, Any]]:
    """What plain Orbax restores from ``path`` (see ``_RESTORE``): keystr path -> its record."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # this repository is not importable there
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _RESTORE, str(path), mode], capture_output=True, text=True,
                          timeout=timeout, cwd="/", env=env)
    if proc.returncode != 0:
        raise AssertionError(f"Orbax could not restore {path}: {proc.stderr[-3000:]}")
    out = {}
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        out[rec["path"]] = rec
    return out


def digest(a: np.ndarray) -> str:
    """The sha256 ``orbax_restore`` reports for an array with these bytes."""
    a = np.array(a, order="C")
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()
