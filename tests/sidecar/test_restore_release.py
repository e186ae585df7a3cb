"""What a restore onto another mesh drops leaves its critical path: the read buffers (mappings of shard files)
are unmapped by a background thread, and the other ranks' files fetched for it are removed while the arrays
are placed, not after (both still before the restore returns, for the files)."""

import threading
import time
import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import checksums, commit, host, layout, reader

WAIT_SECONDS = 10.0


class DirFetcher:
    """Fetches other hosts' files from their directories (all under one tmp dir) into a scratch directory."""

    def __init__(self, base, rank):
        self.base, self.root = base, base / str(rank)

    def manifest(self, owner, step, min_generation=0):
        return layout.read_manifest(self.base / str(owner) / "steps" / str(step))

    def fetch(self, owner, step, replace=False):
        raise AssertionError("a whole step was fetched")

    def fetch_files(self, owner, step, files, pieces=()):  # whole files (a fetcher may)
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        for f in files:
            (dest / f.name).write_bytes((self.base / str(owner) / "steps" / str(step) / f.name).read_bytes())
        return dest


def _save(tmp_path, rows: int = 64, cols: int = 256):
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    x = np.random.default_rng(5).standard_normal((rows, cols)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P("a", "b")))}  # every saved shard unique
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    return mgr, x


def _fetch_dirs_empty(tmp_path) -> bool:
    return all(
        not any(layout.fetch_dir(tmp_path / str(r)).iterdir())
        for r in range(4)
        if layout.fetch_dir(tmp_path / str(r)).is_dir()
    )


def test_fetched_files_are_removed_while_the_arrays_are_placed(tmp_path, monkeypatch):
    mgr, x = _save(tmp_path)
    monkeypatch.setattr(
        host,
        "open_step",
        lambda config, rank, step, located=None, bad=None, manifests=None: reader.StepSource(
            step,
            [config.root(rank)],
            fetcher=DirFetcher(tmp_path, rank),
            drop_bad=True,
            own_rank=rank,
            bad=bad,
        ),
    )
    removed_while_placing: list[bool] = []
    real_restore_leaf = host._restore_leaf

    def restore_leaf(*a, **kw):
        deadline = time.monotonic() + WAIT_SECONDS
        while not _fetch_dirs_empty(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        removed_while_placing.append(_fetch_dirs_empty(tmp_path))
        return real_restore_leaf(*a, **kw)

    monkeypatch.setattr(host, "_restore_leaf", restore_leaf)
    other = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    out = mgr.restore(
        1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P("a", "b")))}
    )
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert removed_while_placing == [True]
    assert _fetch_dirs_empty(tmp_path)


def test_dropped_reads_are_unmapped_off_the_reading_thread(tmp_path):
    # 1024x4096 float32 on 8 devices: saved shards of 2 MiB, mapped (>= MAP_MIN_BYTES).
    _save(tmp_path, rows=1024, cols=4096)
    src = reader.StepSource(1, [tmp_path / "0"])
    arr = next(iter(src.arrays.values()))
    index = next(iter(arr.shards))
    buf = src.read_shard(arr, index)
    base = buf
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, checksums._LeasedMap), "the shard was read, not mapped"
    unmapped_on: list[str] = []
    done = threading.Event()

    def unmapped() -> None:
        unmapped_on.append(threading.current_thread().name)
        done.set()

    weakref.finalize(base, unmapped)
    del buf, base
    src.drop_cache()
    assert done.wait(WAIT_SECONDS)
    assert unmapped_on == ["mtc-release"]
