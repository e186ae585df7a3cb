"""`mtc export` streams a native step into a standard Orbax checkpoint: bit-exact under plain Orbax for every
layout a save makes, the same files Orbax writes, corrupt copies skipped, nothing at the destination after a
failure, and peak memory that does not grow with the state (tests/kits/export_state.py builds the steps)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from controller_client.admin import bucket as admin_bucket
from controller_client.export import CHUNK_BYTES, ExportOptions, export_step, working_set_bytes
from sidecar import checksums, layout, writer
from tests.kits.admin import mtc
from tests.kits.export_state import (
    JOB,
    Spec,
    digest,
    expected,
    orbax_restore,
    write_bucket,
    write_roots,
)

REPO = Path(__file__).resolve().parents[2]
ARRAYS = {
    "['w']": Spec((64, 48), "float32", (4, 2)),  # 2-D grid: chunks of 16 rows nest in each shard
    "['b']": Spec((10,), "bfloat16", (4,)),  # ragged last shard
    "['opt'][0]['mu']": Spec((7, 5, 3), "int8"),  # one replicated shard
    "['opt'][1]['nu']": Spec((1000, 33), "float32", (3, 1)),  # chunks straddle shards (334-row shards)
    "['s']": Spec((), "float32"),  # a 0-d array
    "['rng']": Spec((2,), "uint32", key_impl="threefry2x32"),  # a typed key's data
}
VALUES = {"['step']": 7, "['lr']": 0.5, "['flag']": True, "['none']": None}
SMALL_CHUNK = 8192  # small enough that every array above is cut into several chunks


def _check_restored(got: dict, arrays: dict[str, Spec], values: dict, seed: int = 0) -> None:
    for path, spec in arrays.items():
        rec = got[path]
        want = expected(seed, path, spec, tuple((0, n) for n in spec.shape))
        assert (rec["type"], rec["dtype"], tuple(rec["shape"])) == ("ArrayImpl", want.dtype.name, spec.shape), path
        assert rec["sha256"] == digest(want), f"{path} differs"
    for path, v in values.items():
        assert got[path]["value"] == v and type(v).__name__ == got[path]["type"], path
    assert set(got) == set(arrays) | set(values)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_native_step_restores_bit_exact_with_plain_orbax(tmp_path: Path, replicas: int) -> None:
    roots = write_roots(tmp_path / "dl", 7, ARRAYS, VALUES, ranks=4, replicas=replicas)
    info = export_step(7, roots, tmp_path / "out", ExportOptions(chunk_bytes=SMALL_CHUNK))
    assert info["leaves"] == len(ARRAYS) + len(VALUES) and info["assembled_arrays"] == [] and not info["bad_copies"]
    assert info["bytes"] == sum(s.nbytes for s in ARRAYS.values())
    assert info["prng_key_leaves"] == {"['rng']": "threefry2x32"}
    _check_restored(orbax_restore(tmp_path / "out"), ARRAYS, VALUES)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_a_deep_ocdbt_tree_restores_too(tmp_path: Path) -> None:
    """Nodes of 512 bytes: the export's b-tree has several levels (ours are of 64 KiB; Orbax's one root node)."""
    arrays = {"['w']": Spec((512, 64), "float32", (4, 1)), "['v']": Spec((300, 7), "int8", (3, 1))}
    roots = write_roots(tmp_path / "dl", 2, arrays, {}, ranks=2)
    export_step(2, roots, tmp_path / "out", ExportOptions(chunk_bytes=4096, ocdbt_node_bytes=512))
    _check_restored(orbax_restore(tmp_path / "out"), arrays, {})


def test_the_files_are_the_ones_orbax_writes_for_the_same_tree(tmp_path: Path) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    import tensorstore as ts

    arrays = {k: v for k, v in ARRAYS.items() if v.key_impl is None}
    roots = write_roots(tmp_path / "dl", 7, arrays, VALUES, ranks=2)
    export_step(7, roots, tmp_path / "ours", ExportOptions(chunk_bytes=SMALL_CHUNK))
    tree = {"w": 0, "b": 0, "opt": [{"mu": 0}, {"nu": 0}], "s": 0, "step": 7, "lr": 0.5, "flag": True, "none": None}
    for path, spec in arrays.items():
        keys = [int(k) if k.isdigit() else k for k in re.findall(r"\['?([^'\]]+)'?\]", path)]
        node = tree
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = jnp.asarray(expected(0, path, spec, tuple((0, n) for n in spec.shape)))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "orbax", tree)
    ckptr.wait_until_finished()
    ckptr.close()

    def read(name: str) -> dict:
        return {d: json.loads((tmp_path / d / name).read_text()) for d in ("ours", "orbax")}

    for name in ("_METADATA", "_sharding"):
        got = read(name)
        assert got["ours"] == got["orbax"], name
    metas = read("array_metadatas/process_0")
    for m in (metas["ours"], metas["orbax"]):
        for a in m["array_metadatas"]:
            a["array_metadata"].pop("chunk_shape")  # ours are smaller: the unit of streaming
    assert metas["ours"] == metas["orbax"]
    assert read("_CHECKPOINT_METADATA")["ours"]["item_handlers"] == read("_CHECKPOINT_METADATA")["orbax"][
        "item_handlers"]

    def zarrays(d: str) -> dict:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path / d}/"}).result()
        out = {}
        for key in kv.list().result():
            if key.endswith(b"/.zarray"):
                meta = json.loads(kv.read(key).result().value)
                meta.pop("chunks")
                out[key.decode()] = meta
        return out

    assert zarrays("ours") == zarrays("orbax")


def test_a_corrupt_copy_is_skipped_for_a_replica_and_none_left_fails_leaving_nothing(tmp_path: Path) -> None:
    roots = write_roots(tmp_path / "dl", 3, {"['w']": Spec((256, 64), "float32", (2, 1))}, {}, ranks=2,
                        replicas=2)
    manifest = layout.read_manifest(layout.steps_dir(roots[0]) / "3")
    entry = manifest.arrays[0].shards[0]
    victim = layout.resolve_under(layout.steps_dir(roots[0]) / "3", entry.file)
    raw = bytearray(victim.read_bytes())
    raw[entry.offset + entry.length - 1] ^= 0xFF  # the shard's last byte: caught after every piece was written
    victim.write_bytes(bytes(raw))
    info = export_step(3, roots, tmp_path / "out", ExportOptions(chunk_bytes=SMALL_CHUNK))
    assert len(info["bad_copies"]) == 1 and str(victim) in info["bad_copies"][0]
    _check_restored(orbax_restore(tmp_path / "out"), {"['w']": Spec((256, 64), "float32", (2, 1))}, {})

    # The same shard corrupt in the other replica too: the export fails and leaves nothing behind.
    other = next(r for r in roots if r != roots[0])
    d = layout.steps_dir(other) / "3"
    twin = next(s for a in layout.read_manifest(d).arrays for s in a.shards if s.index == entry.index)
    path = layout.resolve_under(d, twin.file)
    raw = bytearray(path.read_bytes())
    raw[twin.offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(checksums.ChecksumError):
        export_step(3, roots, tmp_path / "out2", ExportOptions(chunk_bytes=SMALL_CHUNK))
    assert not (tmp_path / "out2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_shards_in_no_regular_grid_are_assembled_chunk_by_chunk(tmp_path: Path) -> None:
    spec = Spec((100, 64), "float32")
    full = expected(0, "['w']", spec, ((0, 100), (0, 64)))
    cuts = [((0, 33), (0, 64)), ((33, 100), (0, 64))]  # no grid: 33 rows, then 67
    for rank, region in enumerate(cuts):
        data = np.ascontiguousarray(full[region[0][0]:region[0][1]])
        writer.write_step(writer.HostStep(tmp_path / "dl" / str(rank), JOB, 5, rank, 2, [writer.ArrayCopy(
            "['w']", spec.shape, spec.dtype, None, [writer.ShardCopy(region, data)])], []))
    info = export_step(5, [tmp_path / "dl" / "0", tmp_path / "dl" / "1"], tmp_path / "out",
                       ExportOptions(chunk_bytes=4096))  # chunks of 10 rows: one straddles the cut
    assert info["assembled_arrays"] == ["['w']"]
    got = orbax_restore(tmp_path / "out")
    assert got["['w']"]["sha256"] == digest(full)


def test_refusals(tmp_path: Path) -> None:
    roots = write_roots(tmp_path / "dl", 2, {"['w']": Spec((4,), "float32")}, {"['name']": "run-1"}, ranks=1)
    with pytest.raises(ValueError, match="str value"):
        export_step(2, roots, tmp_path / "out")
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError):
        export_step(2, roots, tmp_path / "exists")
    with pytest.raises(FileNotFoundError):
        export_step(3, roots, tmp_path / "out")
    with pytest.raises(ValueError):
        ExportOptions(chunk_bytes=10)
    assert not (tmp_path / "out").exists()


def test_mtc_export_from_a_bucket(tmp_path: Path) -> None:
    arrays = {"['w']": ARRAYS["['w']"], "['b']": ARRAYS["['b']"]}
    write_bucket(tmp_path / "bucket", tmp_path / "build", 4, arrays, {"['step']": 4}, ranks=2)
    url = f"file://{tmp_path / 'bucket'}"
    out = tmp_path / "exported"
    r = mtc("export", "4", "--backup-url", url, "--dest", str(out), "--scratch", str(tmp_path), "-o", "json",
            "--chunk-mib", "1")
    assert r.code == 0, r
    doc = r.json()
    assert doc["chunk_bytes"] == 1 << 20 and doc["working_set_bytes"] == working_set_bytes(ExportOptions(1 << 20))
    _check_restored(orbax_restore(out), arrays, {"['step']": 4})
    r = mtc("export", "4", "--backup-url", url, "--dest", str(out))
    assert r.code == 1 and "exists" in r.err, r
    r = mtc("export", "4", "--backup-url", url, "--dest", str(tmp_path / "x"), "--chunk-mib", "0")
    assert r.code == 2, r
    r = mtc("export", "--help")
    assert r.code == 0 and "whatever the step's size" in r.out and "--chunk-mib" in r.out
    assert admin_bucket.CHUNK_BYTES == CHUNK_BYTES


# One export in a fresh interpreter: prints its peak resident memory (VmHWM: this process's own, from its exec on).
_MEASURE = r"""
import json, sys
from pathlib import Path
from controller_client.export import ExportOptions, export_step
info = export_step(int(sys.argv[1]), [Path(p) for p in sys.argv[4:]], Path(sys.argv[2]),
                   ExportOptions(chunk_bytes=int(sys.argv[3])))
hwm = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:'))
print(json.dumps({'peak_bytes': hwm * 1024, 'bytes': info['bytes'], 'seconds': info['seconds']}))
"""


def _peak(tmp_path: Path, total_bytes: int, chunk_bytes: int) -> dict:
    """Build a step of ``total_bytes`` (4 arrays of 4 shards, 4 ranks) and export it in a fresh interpreter."""
    name = f"{total_bytes >> 20}-{chunk_bytes >> 20}"
    rows = total_bytes // 4 // (1024 * 4)
    arrays = {f"['layer{i}']": Spec((rows, 1024), "float32", (4, 1)) for i in range(4)}
    roots = write_roots(tmp_path / name, 9, arrays, {"['step']": 9}, ranks=4)
    out = tmp_path / f"{name}-out"
    proc = subprocess.run([sys.executable, "-c", _MEASURE, "9", str(out), str(chunk_bytes), *map(str, roots)],
                          capture_output=True, text=True, timeout=240, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_peak_memory_does_not_grow_with_the_state(tmp_path: Path) -> None:
    """With 4 MiB chunks a 32 MiB state (8 chunks) and a 256 MiB one (64 chunks) peak alike: the state grows
    by 224 MiB, the peak by far less. At the defaults (16 MiB chunks) a 256 MiB state peaks within the stated
    working set plus the interpreter's (144 + ~70 MiB)."""
    small = _peak(tmp_path, 32 << 20, 4 << 20)
    big = _peak(tmp_path, 256 << 20, 4 << 20)
    default = _peak(tmp_path, 256 << 20, CHUNK_BYTES)
    assert big["bytes"] == default["bytes"] == 256 << 20
    print(f"export peak memory with 4 MiB chunks: {small['peak_bytes'] >> 20} MiB at 32 MiB, "
          f"{big['peak_bytes'] >> 20} MiB at 256 MiB; with {CHUNK_BYTES >> 20} MiB chunks "
          f"{default['peak_bytes'] >> 20} MiB at 256 MiB ({default['seconds']:.1f}s)")
    assert big["peak_bytes"] - small["peak_bytes"] < 32 << 20, (small, big)  # the state grew by 224 MiB
    assert default["peak_bytes"] < working_set_bytes(ExportOptions()) + (96 << 20), default
