"""A restore onto another mesh asks for the other savers' manifests in one round (each once, all at once, for
every rank of the call), and finishes a rank's target shards as soon as that rank's own fetches are done,
while other ranks' fetches are still running."""

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


class DirFetcher:
    """Fetches other hosts' files from their directories (whole files); manifests from their step directories,
    cached in ``manifests`` shared by the ranks of one call (as ``ReplicatorFetcher``'s are). ``before_manifest``
    and ``before_files`` run first (to hold or record a request)."""

    def __init__(self, base, rank, manifests: dict, before_manifest, before_files):
        self.base, self.rank, self.root, self.manifests = base, rank, base / str(rank), manifests
        self.before_manifest, self.before_files = before_manifest, before_files

    def manifest(self, owner, step, min_generation=0):
        if (owner, step) not in self.manifests:
            self.before_manifest(self.rank, owner)
            self.manifests[(owner, step)] = layout.read_manifest(self.base / str(owner) / "steps" / str(step))
        return self.manifests[(owner, step)]

    def fetch(self, owner, step, replace=False):
        raise AssertionError("a whole step was fetched")

    def fetch_files(self, owner, step, files, pieces=()):  # whole files (a fetcher may)
        self.before_files(self.rank, owner)
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        for f in files:
            (dest / f.name).write_bytes((self.base / str(owner) / "steps" / str(step) / f.name).read_bytes())
        return dest


def _reshard(tmp_path, monkeypatch, before_manifest=lambda r, o: None, before_files=lambda r, o: None):
    """Save a 64x256 array sharded 2x4 on 4 simulated hosts and restore it onto a 4x2 mesh (each host needs
    another host's shards) through :class:`DirFetcher`; checks the values."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    x = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P("a", "b")))}
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    manifests: dict = {}

    def open_step(config, rank, step, located=None, bad=None, manifests_=None):
        fetcher = DirFetcher(tmp_path, rank, manifests, before_manifest, before_files)
        return reader.StepSource(
            step, [config.root(rank)], fetcher=fetcher, drop_bad=True, own_rank=rank, bad=bad
        )

    monkeypatch.setattr(host, "open_step", open_step)
    other = Mesh(np.array(devs).reshape(4, 2), ("a", "b"))
    out = mgr.restore(
        1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P("a", "b")))}
    )
    np.testing.assert_array_equal(np.asarray(out["w"]), x)


def test_the_other_savers_manifests_are_asked_for_once_all_at_once(tmp_path, monkeypatch):
    # Ranks 0-3 each lack the 3 others' manifests: 4 distinct ones, which must all be in flight together.
    asked: list[tuple[int, int]] = []
    together = threading.Barrier(4, timeout=WAIT_SECONDS)

    def before_manifest(rank, owner):
        asked.append((rank, owner))
        together.wait()  # BrokenBarrierError (the restore fails) unless all 4 are asked for at once

    _reshard(tmp_path, monkeypatch, before_manifest=before_manifest)
    assert sorted(owner for _, owner in asked) == [0, 1, 2, 3]


def test_a_ranks_target_shards_are_finished_while_another_ranks_fetch_runs(tmp_path, monkeypatch):
    # Rank 3's fetch waits until rank 0's fetched files were read (its target shards finished): before, every
    # rank's fetched part was read only once all fetches were done.
    read_fetched_0 = threading.Event()
    waited: list[bool] = []

    def mark(path):
        if str(path).startswith(str(layout.fetch_dir(tmp_path / "0"))):
            read_fetched_0.set()

    def before_files(rank, owner):
        if rank == 3:
            waited.append(read_fetched_0.wait(WAIT_SECONDS))

    spy_reads(monkeypatch, mark)
    _reshard(tmp_path, monkeypatch, before_files=before_files)
    assert waited == [True]
