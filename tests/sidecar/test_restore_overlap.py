"""A restore onto another mesh reads what it can build from this host's RAM disk while other ranks' files
are still being fetched (instead of after the fetch): whole target shards, and the local parts of target
shards that need another rank's data too."""

import threading

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import commit, host, layout, reader
from tests.kits.read_spy import spy_reads

WAIT_SECONDS = 10.0


class SlowFetcher:
    """Fetches other hosts' files from their directories in one tmp dir, but only once a local read of the
    fetching host happened (or after WAIT_SECONDS): records whether that read came first."""

    def __init__(self, base, rank, local_read: threading.Event, log: list):
        self.base, self.root, self.local_read, self.log = base, base / str(rank), local_read, log

    def manifest(self, owner, step, min_generation=0):
        return layout.read_manifest(self.base / str(owner) / "steps" / str(step))

    def fetch(self, owner, step, replace=False):
        raise AssertionError("a whole step was fetched")

    def fetch_files(self, owner, step, files, pieces=()):  # whole files (a fetcher may)
        self.log.append(self.local_read.wait(WAIT_SECONDS))
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        for f in files:
            (dest / f.name).write_bytes((self.base / str(owner) / "steps" / str(step) / f.name).read_bytes())
        return dest


def _restore_with_slow_fetches(tmp_path, monkeypatch, target_spec) -> list[bool]:
    """Save a 64x256 array sharded 2x4 on 4 simulated hosts, restore it as ``target_spec`` on a 2x4 or 4x2
    mesh with fetches that wait for a local read of the fetching host: whether each fetch saw one first."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    x = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P("a", "b")))}  # every saved shard unique
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()

    events = {r: threading.Event() for r in range(4)}
    fetched_after_local_read: list[bool] = []

    def mark(path):
        for r, ev in events.items():
            if str(path).startswith(str(tmp_path / str(r) / "steps")):
                ev.set()

    spy_reads(monkeypatch, mark)
    monkeypatch.setattr(host, "open_step", lambda config, rank, step, located=None, bad=None, manifests=None: reader.StepSource(
        step, [config.root(rank)], fetcher=SlowFetcher(tmp_path, rank, events[rank], fetched_after_local_read),
        drop_bad=True, own_rank=rank, bad=bad))
    mesh_shape, spec = target_spec
    other = Mesh(np.array(devs).reshape(*mesh_shape), ("a", "b"))
    out = mgr.restore(1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, spec))})
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert all(not any(layout.fetch_dir(tmp_path / str(r)).iterdir()) for r in range(4))
    return fetched_after_local_read


def test_local_target_shards_are_read_while_other_ranks_files_are_fetched(tmp_path, monkeypatch):
    # On a 4x2 mesh each host's first device needs only its own shards, its second one another host's.
    fetched_after_local_read = _restore_with_slow_fetches(tmp_path, monkeypatch, ((4, 2), P("a", "b")))
    assert len(fetched_after_local_read) == 4
    assert all(fetched_after_local_read)


def test_the_local_part_of_a_target_shard_is_read_while_the_rest_is_fetched(tmp_path, monkeypatch):
    # Columns only: each device needs all 64 rows of its column block, rows 0-31 saved by a host of slice 0
    # and rows 32-63 by one of slice 1, so every target shard needs this host's data and another host's.
    fetched_after_local_read = _restore_with_slow_fetches(tmp_path, monkeypatch, ((2, 4), P(None, "b")))
    assert len(fetched_after_local_read) == 4
    assert all(fetched_after_local_read)
