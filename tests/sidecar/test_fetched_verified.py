"""Files of other ranks' data the host's replicator fetched for a read (``FetchFiles``) are read without a second
crc32c pass: the replicator named each only once the bytes it wrote matched the crc32cs asked for. Every other
read still verifies: committed copies, and files a link that does not vouch for its fetches brought."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import checksums, commit, layout, reader
from tests.kits.cluster import assert_equal
from tests.kits.read_spy import spy_reads
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

FSDP = P("data", "model")


@pytest.mark.slow
def test_a_reshard_reads_the_replicators_fetched_pieces_without_verifying_them_again(
    cluster_factory,  # noqa: F811
    monkeypatch,
):
    # Saved on 2x4 (shards of 2048 x 256 float32: two 1 MiB blocks), restored onto 4x2: each host reads one block
    # of each of its own two shards (verified) and one block of each of its partner's two, fetched as pieces by
    # its replicator (verified there as they landed: not again).
    cl = cluster_factory(nodes=4, data_parallelism=2, replicas=0)
    cl.start_all()
    devs = jax.devices()
    opts = CheckpointManagerOptions(
        local_directory=cl.local_template,
        job_name="t",
        coordinator_address=cl.coordinator,
        restore_wait_seconds=60,
        rpc_timeout_seconds=10,
    )
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    x = np.random.default_rng(5).standard_normal((4096, 1024)).astype(np.float32)
    tree = {
        "w": jax.device_put(x, NamedSharding(Mesh(np.array(devs).reshape(2, 4), ("data", "model")), FSDP)),
        "step": 2,
    }
    mgr.save(2, tree)
    mgr.wait_until_finished()
    verified: list[Path] = []
    spy_reads(monkeypatch, lambda p: verified.append(Path(p)))
    fetched: list[Path] = []
    real_map = checksums.map_unverified

    def map_unverified(path, *a, **kw):
        fetched.append(Path(path))
        return real_map(path, *a, **kw)

    monkeypatch.setattr(checksums, "map_unverified", map_unverified)
    other = Mesh(np.array(devs).reshape(4, 2), ("data", "model"))
    assert_equal(
        tree,
        mgr.restore(
            2, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, FSDP)), "step": 2}
        ),
    )
    fetch_dirs = {cl.ram(r).resolve() / layout.FETCH_DIR for r in range(4)}
    assert len(fetched) == 8  # two pieces on each host
    assert all(p.parent.parent in fetch_dirs for p in fetched)
    assert not [p for p in verified if p.parent.parent in fetch_dirs]  # never a second pass over them
    assert len(verified) == 8  # the own shards' blocks: still verified
    assert all(p.parent.name == "2" and p.parent.parent.name == layout.STEPS_DIR for p in verified)
    mgr.close()


class CorruptingFetcher:
    """A ReplicatorLink over other hosts' directories in one tmp dir whose first fetch brings a bad byte;
    ``vouches``: its ``files_verified`` attribute (absent when None)."""

    def __init__(self, base: Path, root: Path, vouches: object = None):
        self.base, self.root = base, root
        self.calls = 0
        if vouches is not None:
            self.files_verified = vouches

    def manifest(self, owner, step, min_generation=0):
        return layout.read_manifest(self.base / str(owner) / "steps" / str(step))

    def fetch(self, owner, step, replace=False):
        raise AssertionError("a whole step was fetched")

    def fetch_files(self, owner, step, files, pieces=()):  # whole files (a fetcher may)
        self.calls += 1
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        for f in files:
            data = bytearray((self.base / str(owner) / "steps" / str(step) / f.name).read_bytes())
            if self.calls == 1:
                data[len(data) // 2] ^= 0x40
            (dest / f.name).write_bytes(bytes(data))
        return dest


@pytest.mark.parametrize("vouches", [None, False, 1, "yes"])
def test_files_of_a_link_that_does_not_vouch_for_them_are_verified(tmp_path, vouches):
    # Only a link whose files_verified is True is trusted; a bad byte from any other is caught and fetched again.
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, FSDP))}
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    [arr] = layout.read_manifest(tmp_path / "1" / "steps" / "1").arrays
    wanted = next(s for s in arr.shards if s.index == ((0, 8), (32, 48)))  # one of rank 1's shards
    fetcher = CorruptingFetcher(tmp_path, tmp_path / "0", vouches)
    src = reader.StepSource(1, [tmp_path / "0"], fetcher=fetcher, drop_bad=True, own_rank=0)
    np.testing.assert_array_equal(src.assemble(arr.path, wanted.index), x[0:8, 32:48])
    assert fetcher.calls == 2  # the bad copy was caught by its crc32c and fetched again
    src.close()


def test_unverified_reads_return_the_bytes_at_any_offset(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    for offset, length in [(0, 1 << 20), (4096, 2 << 20), (12345, (1 << 20) + 7), (3 << 20, 0), (100, 50)]:
        want = data[offset : offset + length]
        np.testing.assert_array_equal(np.asarray(checksums.map_unverified(path, length, offset)), want)
        np.testing.assert_array_equal(np.asarray(checksums.read_unverified(path, length, offset)), want)
    with pytest.raises(EOFError):
        checksums.map_unverified(path, 1 << 20, (3 << 20) - 10)
    with pytest.raises(EOFError):
        checksums.read_unverified(path, 1 << 20, (3 << 20) - 10)
