"""Per-block crc32c of large shard files: a read of part of a saved shard reads and verifies only the
blocks covering it; a bad needed block is a bad copy (healed), an unneeded one is never read."""

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import checksums, layout, reader

BS = layout.BLOCK_BYTES


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), block=st.integers(1, 700), cut=st.integers(0, 5000))
def test_block_crcs_and_combine_match_google_crc32c(data, block, cut):
    whole, blocks = checksums.block_crc32cs(data, block)
    assert whole == checksums.crc32c(data)
    assert blocks == tuple(checksums.crc32c(data[i : i + block]) for i in range(0, len(data), block))
    a, b = data[:cut], data[cut:]
    assert checksums.crc32c_combine(checksums.crc32c(a), checksums.crc32c(b), len(b)) == checksums.crc32c(data)


def _entry(data: bytes, name="0.0.bin", block=BS) -> layout.ShardEntry:
    whole, blocks = checksums.block_crc32cs(data, block)
    return layout.ShardEntry(((0, len(data)),), name, 0, len(data), whole, block, blocks)


def test_shard_entry_blocks_round_trip_and_validation():
    e = _entry(bytes(range(256)) * 40, block=1000)  # 10240 bytes: 11 blocks, the last one short
    assert len(e.block_crc32c) == 11
    assert layout.ShardEntry.from_dict(e.to_dict()) == e
    bad = e.to_dict()
    bad["block_crc32c"] = bad["block_crc32c"][:-1]
    with pytest.raises(layout.ManifestError, match="block"):
        layout.ShardEntry.from_dict(bad)
    old = {k: v for k, v in e.to_dict().items() if not k.startswith("block")}
    assert layout.ShardEntry.from_dict(old).block_size == 0  # an older manifest: no blocks, read whole


def test_manifest_checksum_covers_block_crcs(tmp_path):
    e = _entry(b"x" * 3000, block=1000)
    m = layout.StepManifest(job="t", step=1, rank=0, nodes=1, files=(layout.FileEntry(e.file, e.length, e.crc32c),),
                            arrays=(layout.ArrayEntry("w", (3000,), "uint8", (e,)),))
    d = json.loads(m.to_json())
    assert layout.StepManifest.from_dict(d).arrays[0].shards[0].block_crc32c == e.block_crc32c
    d["arrays"][0]["shards"][0]["block_crc32c"][1] ^= 1
    with pytest.raises(layout.ManifestChecksumError):
        layout.StepManifest.from_dict(d)


@pytest.mark.parametrize("mapped", [True, False])
def test_read_blocks_verified_reads_only_the_covering_blocks(tmp_path, mapped):
    block = 1 << 16  # page-aligned, so the mapped path maps
    data = np.random.default_rng(0).integers(0, 256, 5 * block + 123, dtype=np.uint8).tobytes()
    e = _entry(data, block=block)
    path = tmp_path / e.file
    path.write_bytes(data)
    assert checksums.blocks_covering(e, block + 5, 3 * block) == (1, 3)
    assert checksums.blocks_covering(e, 0, len(data)) is None  # all of it: read whole
    got = checksums.read_blocks_verified(path, e, 1, 3, mapped=mapped)
    assert bytes(got) == data[block : 3 * block]
    got = checksums.read_blocks_verified(path, e, 5, 6, mapped=mapped)  # the short last block
    assert bytes(got) == data[5 * block :]
    bad = bytearray(data)
    bad[4 * block + 7] ^= 0x01  # a byte of block 4: outside the blocks read below
    path.write_bytes(bytes(bad))
    assert bytes(checksums.read_blocks_verified(path, e, 1, 3, mapped=mapped)) == data[block : 3 * block]
    with pytest.raises(checksums.ChecksumError, match="block 4"):
        checksums.read_blocks_verified(path, e, 3, 5, mapped=mapped)


# ---------------------------------------------------------------- the reader, with real JAX saves

ROWS, COLS = 512, 8192  # float32: 16 MiB; saved shards are column quarters of 4 MiB = 4 blocks of 1 MiB


def _save(tmp_path, strip_blocks=False):
    assert BS == 1 << 20
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    x = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32)
    # Replicated over the two slices (one host each): each host holds all four column shards.
    tree = {"w": jax.device_put(x, NamedSharding(mesh, P(None, "model")))}
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 1))
    mgr.save(1, tree)
    mgr.wait_until_finished()
    for h in (0, 1):
        d = tmp_path / str(h) / "steps" / "1"
        m = json.loads((d / layout.MANIFEST_NAME).read_bytes())
        for s in m["arrays"][0]["shards"]:
            assert len(s["block_crc32c"]) == 4  # the writer recorded the blocks
            if strip_blocks:  # as an older writer would have written it
                del s["block_size"], s["block_crc32c"]
        if strip_blocks:
            (d / layout.MANIFEST_NAME).write_text(json.dumps(layout.seal_manifest_dict(m)))
    return mgr, mesh, x


@pytest.fixture
def spy(monkeypatch):
    calls: dict[str, list] = {"blocks": [], "whole": []}
    real_blocks, real_map = checksums.read_blocks_verified, checksums.map_verified

    def blocks(path, entry, first, last, mapped=True):
        calls["blocks"].append((str(path), first, last))
        return real_blocks(path, entry, first, last, mapped)

    def whole(path, length, crc, offset=0, blocks=None):
        if blocks is None:
            calls["whole"].append(str(path))
        return real_map(path, length, crc, offset, blocks)

    monkeypatch.setattr(checksums, "read_blocks_verified", blocks)
    monkeypatch.setattr(checksums, "map_verified", whole)
    return calls


def test_restore_onto_another_sharding_reads_only_the_needed_blocks(tmp_path, spy):
    mgr, mesh, x = _save(tmp_path)
    target = NamedSharding(mesh, P("model", None))  # row quarters: one block of each saved shard
    out = mgr.restore(1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)})
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert spy["whole"] == []
    assert spy["blocks"] and all(last - first == 1 for _, first, last in spy["blocks"])
    # Same-sharding restores still read whole shards (one crc32c pass each).
    out = mgr.restore(1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, "model")))})
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert spy["whole"]


def test_manifest_without_blocks_still_restores_reading_whole_files(tmp_path, spy):
    mgr, mesh, x = _save(tmp_path, strip_blocks=True)
    target = NamedSharding(mesh, P("model", None))
    out = mgr.restore(1, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)})
    np.testing.assert_array_equal(np.asarray(out["w"]), x)
    assert spy["blocks"] == [] and spy["whole"]


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


def test_bad_needed_block_is_a_bad_copy_healed_from_the_replica(tmp_path, spy):
    _save(tmp_path)
    d0 = tmp_path / "0" / "steps" / "1"
    m = layout.read_manifest(d0)
    victim = m.arrays[0].shards[0]
    _flip(d0 / victim.file, 10)  # block 0: rows 0..127 of that shard, which the read below needs
    src = reader.StepSource(1, [tmp_path / "0", tmp_path / "1"], drop_bad=True)
    got = src.assemble(m.arrays[0].path, ((0, 128), (0, COLS)))
    np.testing.assert_array_equal(got, np.asarray(_expected(tmp_path))[0:128])
    assert not d0.exists()  # the bad copy was dropped, host 1's copy used
    assert any("/1/steps/1/" in p for p, _, _ in spy["blocks"])


def test_bad_unneeded_block_is_not_read(tmp_path, spy):
    _save(tmp_path)
    d0 = tmp_path / "0" / "steps" / "1"
    m = layout.read_manifest(d0)
    for s in m.arrays[0].shards:
        _flip(d0 / s.file, 3 * BS + 5)  # block 3 of every shard: rows 384..511
    src = reader.StepSource(1, [tmp_path / "0"], drop_bad=True)
    got = src.assemble(m.arrays[0].path, ((0, 128), (0, COLS)))
    np.testing.assert_array_equal(got, np.asarray(_expected(tmp_path))[0:128])
    assert d0.exists()
    assert sorted((f, la) for _, f, la in spy["blocks"]) == [(0, 1)] * 4
    with pytest.raises(checksums.ChecksumError, match="block 3"):  # no other copy: a clear checksum error
        reader.StepSource(1, [tmp_path / "0"]).assemble(m.arrays[0].path, ((384, 512), (0, COLS)))


def _expected(tmp_path):
    return np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32)


def test_any_region_assembles_from_verified_blocks(tmp_path, monkeypatch):
    """Property: any target region reads back exactly, and reads at most the covering blocks."""
    from sidecar import writer

    monkeypatch.setattr(layout, "BLOCK_BYTES", 4096)
    x = np.random.default_rng(4).standard_normal((64, 100)).astype(np.float32)  # rows of 400 bytes
    halves = [((0, 64), (0, 50)), ((0, 64), (50, 100))]  # 12800 bytes each: 4 blocks, the last short
    hs = writer.HostStep(tmp_path, "t", 1, 0, 1, [writer.ArrayCopy(
        "w", x.shape, "float32", None, [writer.ShardCopy(i, np.ascontiguousarray(x[layout.index_to_slices(i)]))
                                        for i in halves])], [])
    m = writer.write_step(hs)
    assert all(len(s.block_crc32c) == 4 for s in m.arrays[0].shards)
    read: list[int] = []
    real = checksums.read_blocks_verified

    def spy_blocks(path, entry, first, last, mapped=True):
        read.append((last - first) * 4096)
        return real(path, entry, first, last, mapped)

    monkeypatch.setattr(checksums, "read_blocks_verified", spy_blocks)
    src = reader.StepSource(1, [tmp_path])

    @settings(max_examples=80, deadline=None)
    @given(r=st.tuples(st.integers(0, 63), st.integers(1, 64)), c=st.tuples(st.integers(0, 99), st.integers(1, 100)))
    def check(r, c):
        (r0, r1), (c0, c1) = sorted(r), sorted(c)
        if r0 == r1 or c0 == c1:
            return
        read.clear()
        src.drop_cache()
        got = src.assemble("w", ((r0, r1), (c0, c1)))
        np.testing.assert_array_equal(got, x[r0:r1, c0:c1])
        shards = sum(1 for (_, (a, b)) in halves if a < c1 and c0 < b)
        assert sum(read) <= shards * ((r1 - r0) * 200 + 2 * 4096)

    check()


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 9000), block=st.integers(1, 600), blocks_per_chunk=st.integers(1, 5))
def test_a_written_file_has_the_bytes_and_crcs_of_its_data_at_any_chunking(tmp_path_factory, size, block,
                                                                           blocks_per_chunk):
    # The writer takes each chunk's block crc32cs just before writing it: any chunk (a multiple of the block
    # size) and any file size, a last block short or not, gives the same file and crcs as one pass.
    from sidecar import writer

    data = np.frombuffer(np.random.default_rng(size).bytes(size), dtype=np.uint8)
    path = tmp_path_factory.mktemp("w") / "f.bin"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layout, "BLOCK_BYTES", block)
        mp.setattr(writer, "WRITE_CHUNK_BYTES", block * blocks_per_chunk)
        whole, blocks = writer._write_file(path, data)
    assert path.read_bytes() == data.tobytes()
    if size > block:
        assert (whole, blocks) == checksums.block_crc32cs(data, block)
    else:
        assert (whole, blocks) == (checksums.crc32c(data), ())
