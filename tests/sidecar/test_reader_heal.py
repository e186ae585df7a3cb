"""Reading a step with bad copies (no replicator): a bad copy is dropped and the next one used."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import checksums, commit, layout


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_bad_copy_dropped_and_replica_used(tmp_path, damage):
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}  # replicated over slices
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    step_dir = tmp_path / "0" / "steps" / "1"
    victim = step_dir / layout.read_manifest(step_dir).files[0].name
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[3] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:7])
    else:
        victim.unlink()
    target = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tree["w"].sharding)}
    out = mgr.restore(1, target)
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert not step_dir.exists()  # the bad copy is no longer listed anywhere


def test_no_good_copy_left_is_a_checksum_error_not_eof(tmp_path):
    devs = jax.devices()[:4]
    mesh = Mesh(np.array(devs).reshape(1, 4), ("data", "model"))
    x = np.arange(256, dtype=np.float32).reshape(8, 32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 1, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    step_dir = tmp_path / "0" / "steps" / "1"
    victim = step_dir / layout.read_manifest(step_dir).files[0].name
    victim.write_bytes(victim.read_bytes()[:5])
    with pytest.raises(checksums.ChecksumError, match="EOFError|short|expected"):
        mgr.restore(1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tree["w"].sharding)})


class FilesFetcher:
    """A ReplicatorLink over other hosts' directories in one tmp dir; the first copy of each file it brings is
    corrupt (a bad byte on the way), the next ones good."""

    def __init__(self, base, root):
        self.base, self.root = base, root
        self.calls: list[tuple[int, list[str]]] = []

    def manifest(self, owner, step, min_generation=0):
        return layout.read_manifest(self.base / str(owner) / "steps" / str(step))

    def fetch(self, owner, step, replace=False):
        raise AssertionError("a whole step was fetched")

    def fetch_files(self, owner, step, files, pieces=()):  # whole files (a fetcher may)
        self.calls.append((owner, [f.name for f in files]))
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        for f in files:
            data = bytearray((self.base / str(owner) / "steps" / str(step) / f.name).read_bytes())
            if len(self.calls) == 1:
                data[len(data) // 2] ^= 0x40
            (dest / f.name).write_bytes(bytes(data))
        return dest


def test_only_the_needed_file_of_another_rank_is_fetched_and_a_bad_one_fetched_again(tmp_path):
    from sidecar import reader

    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model")))}  # FSDP: every shard unique
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    m1 = layout.read_manifest(tmp_path / "1" / "steps" / "1")
    [arr] = m1.arrays
    wanted = next(s for s in arr.shards if s.index == ((0, 8), (32, 48)))  # one of rank 1's two shards
    fetcher = FilesFetcher(tmp_path, tmp_path / "0")
    src = reader.StepSource(1, [tmp_path / "0"], fetcher=fetcher, drop_bad=True, own_rank=0)
    assert arr.path in src.paths  # every saver's manifest is known; no bytes moved yet
    assert fetcher.calls == []
    assert {o: set(f) for o, f in src.remote_needs(arr.path, wanted.index).items()} == {1: {wanted.file}}
    got = src.assemble(arr.path, wanted.index)
    np.testing.assert_array_equal(got, x[0:8, 32:48])
    # Only that shard's file, twice: the corrupt copy was detected by its crc32c and fetched again.
    assert fetcher.calls == [(1, [wanted.file]), (1, [wanted.file])]
    assert len(m1.files) > 1
    src.close()
    assert list(layout.fetch_dir(tmp_path / "0").iterdir()) == []


def _two_leaves_one_bad_byte(tmp_path, pristine=None):
    """Host 0's step 1 of leaves "a" and "b" (x and x + 1), a bad byte in the file of a's first shard;
    ``pristine``: a copy of the step made before the damage. Returns x, the step dir, its manifest, and
    a's and b's first shards."""
    import shutil

    devs = jax.devices()[:4]
    mesh = Mesh(np.array(devs).reshape(1, 4), ("data", "model"))
    x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    tree = {"a": jax.device_put(x, NamedSharding(mesh, P(None, "model"))),
            "b": jax.device_put(x + 1, NamedSharding(mesh, P(None, "model")))}
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 1, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    step_dir = tmp_path / "0" / "steps" / "1"
    if pristine is not None:
        shutil.copytree(step_dir, pristine)
    m = layout.read_manifest(step_dir)
    bad = next(a for a in m.arrays if a.path == "['a']").shards[0]
    good = next(a for a in m.arrays if a.path == "['b']").shards[0]
    victim = step_dir / bad.file
    data = bytearray(victim.read_bytes())
    data[1] ^= 0x10
    victim.write_bytes(bytes(data))
    return x, step_dir, m, bad, good


def test_a_copy_dropped_as_corrupt_under_a_concurrent_read_is_reported_as_corrupt(tmp_path, monkeypatch):
    """Two threads read two shards of one copy; the first finds a bad byte and drops (deletes) the copy while
    the second is about to read its file. The second reports the corruption, not an absent file."""
    import threading

    from sidecar import reader

    x, step_dir, m, bad, good = _two_leaves_one_bad_byte(tmp_path)

    dropped = threading.Event()
    real_read = checksums.read_verified

    def read_verified(path, *a, **kw):
        if str(path).endswith(good.file):
            assert dropped.wait(30)  # the other read found the bad byte and deleted the copy meanwhile
        return real_read(path, *a, **kw)

    monkeypatch.setattr(checksums, "read_verified", read_verified)
    src = reader.StepSource(1, [tmp_path / "0"], drop_bad=True, own_rank=0)
    errors: dict[str, BaseException] = {}

    def read(path: str, index) -> None:
        try:
            src.read_shard(src.arrays[path], index)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors[path] = e
        finally:
            if path == "['a']":
                dropped.set()

    second = threading.Thread(target=read, args=("['b']", good.index))
    second.start()
    read("['a']", bad.index)
    second.join(30)
    assert not step_dir.exists()
    assert isinstance(errors["['a']"], checksums.ChecksumError)
    assert isinstance(errors["['b']"], checksums.ChecksumError), repr(errors["['b']"])
    assert bad.file in str(errors["['b']"])



class RefillFetcher:
    """Brings this host's own step back whole from a pristine copy (as its replicator does from a peer or the
    bucket)."""

    def __init__(self, pristine, step_dir):
        self.pristine, self.step_dir = pristine, step_dir
        self.fetches: list[tuple[int, bool]] = []

    def fetch(self, owner, step, replace=False):
        import shutil

        self.fetches.append((owner, replace))
        tmp = commit.make_tmp_dir(self.step_dir.parent, step)
        for f in self.pristine.iterdir():
            shutil.copy(f, tmp / f.name)
        tmp.rename(self.step_dir)
        return self.step_dir


def test_a_read_that_finds_its_copy_dropped_as_bad_waits_for_the_heal_in_flight(tmp_path, monkeypatch):
    """Two threads read two shards of this host's own copy; the first finds a bad byte and drops the copy.
    The second finds the files gone before the first starts fetching a good copy: it gets the good copy (by
    waiting for that fetch, or doing it), and does not fail the shard while its heal is in flight."""
    import threading

    from sidecar import reader

    pristine = tmp_path / "pristine"
    x, step_dir, m, bad, good = _two_leaves_one_bad_byte(tmp_path, pristine)

    dropped, second_past_drop = threading.Event(), threading.Event()
    first = threading.current_thread()
    real_read, real_delete = checksums.read_verified, commit.delete_step
    real_drop, real_replace = reader.StepSource.drop_copy, reader.StepSource.replace_copy

    def read_verified(path, *a, **kw):
        if str(path).endswith(good.file) and not dropped.is_set():
            assert dropped.wait(30)  # the other read found the bad byte and deleted the copy meanwhile
        return real_read(path, *a, **kw)

    def delete_step(d, *a, **kw):
        out = real_delete(d, *a, **kw)
        dropped.set()
        return out

    def drop(self, step_dir, why, copy=0, gone=False):
        real_drop(self, step_dir, why, copy, gone)
        if gone:
            second_past_drop.set()

    def replace_copy(self, *a, **kw):
        if threading.current_thread() is first:  # the dropper: the other read reaches the gone copy first
            assert second_past_drop.wait(30)
        return real_replace(self, *a, **kw)

    monkeypatch.setattr(checksums, "read_verified", read_verified)
    monkeypatch.setattr(commit, "delete_step", delete_step)
    monkeypatch.setattr(reader.StepSource, "drop_copy", drop)
    monkeypatch.setattr(reader.StepSource, "replace_copy", replace_copy)
    fetcher = RefillFetcher(pristine, step_dir)
    src = reader.StepSource(1, [tmp_path / "0"], fetcher=fetcher, drop_bad=True, own_rank=0)
    got: dict[str, object] = {}

    def read(path: str, index) -> None:
        try:
            got[path] = src.read_shard(src.arrays[path], index)
        except BaseException as e:  # noqa: BLE001 - asserted below
            got[path] = e
            second_past_drop.set()  # never leave the other thread waiting

    second = threading.Thread(target=read, args=("['b']", good.index))
    second.start()
    read("['a']", bad.index)
    second.join(30)
    assert not isinstance(got["['b']"], BaseException), repr(got["['b']"])
    np.testing.assert_array_equal(got["['b']"], (x + 1)[:, slice(*good.index[1])])
    np.testing.assert_array_equal(got["['a']"], x[:, slice(*bad.index[1])])
    assert fetcher.fetches == [(0, True)]  # one fetch of the own copy, shared by both reads
    assert layout.read_manifest(step_dir).content_hash == m.content_hash


class PiecesFetcher(FilesFetcher):
    """Brings only the pieces asked for (each at its offset of a file of full size), as a peer does."""

    def fetch_files(self, owner, step, files, pieces=()):
        self.calls.append((owner, [(pc.name, pc.offset, pc.length) for pc in pieces] or [f.name for f in files]))
        dest = commit.make_tmp_dir(layout.fetch_dir(self.root), step)
        src = self.base / str(owner) / "steps" / str(step)
        for f in files:
            mine = [pc for pc in pieces if pc.name == f.name]
            if not mine:
                (dest / f.name).write_bytes((src / f.name).read_bytes())
                continue
            with open(src / f.name, "rb") as a, open(dest / f.name, "wb") as b:
                b.truncate(f.size)
                for pc in mine:
                    a.seek(pc.offset)
                    data = a.read(pc.length)
                    assert checksums.crc32c(data) == pc.crc32c  # the reader derived it from the block crc32cs
                    b.seek(pc.offset)
                    b.write(data)
        return dest


def test_a_read_outside_the_fetched_pieces_fetches_the_whole_file(tmp_path):
    # Rows 0-1024 of another rank's 2 MiB shard come as one piece (its first 1 MiB block); a later read of
    # rows the piece does not hold never reads the sparse file's zeros: it fetches the whole file.
    from sidecar import reader

    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    x = np.random.default_rng(2).standard_normal((4096, 1024)).astype(np.float32)
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P("data", "model")))}  # shards of 2048 x 256: 2 MiB
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    [arr] = layout.read_manifest(tmp_path / "1" / "steps" / "1").arrays
    shard = next(s for s in arr.shards if s.index == ((0, 2048), (512, 768)))  # one of rank 1's
    fetcher = PiecesFetcher(tmp_path, tmp_path / "0")
    src = reader.StepSource(1, [tmp_path / "0"], fetcher=fetcher, drop_bad=True, own_rank=0)
    top = ((0, 1024), (512, 768))
    needs = src.remote_needs(arr.path, top)
    assert needs == {1: {shard.file: {shard: (0, 1 << 20)}}}
    src.prefetch(1, needs[1])
    np.testing.assert_array_equal(src.assemble(arr.path, top), x[0:1024, 512:768])
    assert fetcher.calls == [(1, [(shard.file, 0, 1 << 20)])]  # the first block only
    np.testing.assert_array_equal(src.assemble(arr.path, ((1024, 2048), (512, 768))), x[1024:2048, 512:768])
    assert fetcher.calls[1:] == [(1, [shard.file])]  # then the whole file, once
    np.testing.assert_array_equal(src.assemble(arr.path, shard.index), x[0:2048, 512:768])
    assert len(fetcher.calls) == 2
    src.close()
    assert list(layout.fetch_dir(tmp_path / "0").iterdir()) == []
