"""The on-disk layout: names, manifest validation, commit and verification."""

import json
import os

import numpy as np
import pytest

from sidecar import layout


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a\\b", "a\x00b", "a/."])
def test_safe_relpath_rejects(bad):
    with pytest.raises(ValueError):
        layout.safe_relpath(bad)


def test_safe_relpath_accepts_nested():
    assert str(layout.safe_relpath("state/ocdbt.process_0/d/abc")) == "state/ocdbt.process_0/d/abc"


def test_resolve_under_rejects_symlink_escape(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="escapes"):
        layout.resolve_under(root, "link/secret")
    assert layout.resolve_under(root, "a/b") == root.resolve() / "a" / "b"


def test_step_names():
    assert layout.parse_step_name("0") == 0
    assert layout.parse_step_name("120") == 120
    for bad in ["-1", "01", "1.0", "x", ""]:
        assert layout.parse_step_name(bad) is None
    with pytest.raises(ValueError):
        layout.step_name(-1)
    with pytest.raises(ValueError):
        layout.step_name(True)


def _manifest(**kw):
    base = dict(
        job="j", step=3, rank=1, nodes=2,
        files=(layout.FileEntry("0.0.bin", 8, 123),),
        arrays=(layout.ArrayEntry("['w']", (2,), "float32",
                                  (layout.ShardEntry(((0, 2),), "0.0.bin", 0, 8, 123),)),),
        values=(layout.ValueEntry("['lr']", 0.5),),
    )
    base.update(kw)
    return layout.StepManifest(**base)


def test_manifest_round_trip_and_content_hash():
    m = _manifest()
    again = layout.StepManifest.from_json(m.to_json())
    assert again == m
    # The content hash ignores job and rank: a data-parallel replica has the same one.
    assert _manifest(rank=0, job="other").content_hash == m.content_hash
    changed = _manifest(values=(layout.ValueEntry("['lr']", 0.25),))
    assert changed.content_hash != m.content_hash


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(format_version=99), "format_version"),
        (lambda d: d["files"][0].update(name="../evil"), "not allowed"),
        (lambda d: d.update(rank=5), "bad step/rank"),
        (lambda d: d["arrays"][0]["shards"][0].update(file="other.bin"), "unlisted"),
        (lambda d: d["arrays"][0]["shards"][0].update(index=[[0, 9]]), "outside shape"),
        (lambda d: d.pop("files"), "malformed"),
    ],
)
def test_manifest_rejects_malformed(mutate, match):
    d = _manifest().to_dict()
    mutate(d)
    with pytest.raises(layout.ManifestError, match=match):
        layout.StepManifest.from_json(json.dumps(d).encode())


def test_manifest_rejects_non_json():
    with pytest.raises(layout.ManifestError):
        layout.StepManifest.from_json(b"\xff\x00not json")
    with pytest.raises(layout.ManifestError):
        layout.StepManifest.from_json(b"[1, 2]")


def test_commit_is_atomic_and_no_manifest_means_no_step(tmp_path):
    parent = tmp_path / "steps"
    tmp = layout.make_tmp_dir(parent, 7)
    (tmp / "a").write_bytes(b"x")
    # No manifest: refuses to commit, and nothing is listed.
    with pytest.raises(layout.ManifestError):
        layout.commit_dir(tmp, parent / "7")
    assert layout.committed_steps(parent) == []
    size, crc = layout.file_crc32c(tmp / "a")
    layout.write_manifest(tmp, _manifest(step=7, files=(layout.FileEntry("a", size, crc),), arrays=()))
    layout.commit_dir(tmp, parent / "7")
    assert layout.committed_steps(parent) == [7]
    # A committed step is never replaced.
    tmp2 = layout.make_tmp_dir(parent, 7)
    layout.write_manifest(tmp2, _manifest(step=7, files=(), arrays=()))
    with pytest.raises(FileExistsError):
        layout.commit_dir(tmp2, parent / "7")
    assert layout.remove_tmp_dirs(parent) == [tmp2]
    assert sorted(os.listdir(parent)) == ["7"]
    layout.verify_step_dir(parent / "7")
    (parent / "7" / "a").write_bytes(b"y")
    with pytest.raises(layout.ChecksumError, match="a"):
        layout.verify_step_dir(parent / "7")


def test_read_verified_detects_flip(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    p = tmp_path / "f"
    p.write_bytes(data.tobytes())
    crc = layout.crc32c(data)
    assert (layout.read_verified(p, 1000, crc) == data).all()
    raw = bytearray(p.read_bytes())
    raw[500] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(layout.ChecksumError, match=str(p)):
        layout.read_verified(p, 1000, crc)
    with pytest.raises(EOFError):
        layout.read_verified(p, 2000, crc)


def test_crc32c_accepts_buffers():
    b = bytes(range(256))
    assert layout.crc32c(b) == layout.crc32c(bytearray(b)) == layout.crc32c(np.frombuffer(b, np.uint8))
    assert layout.crc32c_extend(layout.crc32c(b[:100]), b[100:]) == layout.crc32c(b)


def test_map_verified_detects_flip_and_writes_stay_private(tmp_path):
    data = np.random.default_rng(1).integers(0, 255, size=3 << 20, dtype=np.uint8)
    p = tmp_path / "big"
    p.write_bytes(data.tobytes())
    crc = layout.crc32c(data)
    m = layout.map_verified(p, data.nbytes, crc)
    assert (m == data).all() and m.ctypes.data % 4096 == 0
    m[0] ^= 0xFF  # copy-on-write: the committed file never changes
    assert p.read_bytes()[:1] == data[:1].tobytes()
    raw = bytearray(p.read_bytes())
    raw[2 << 20] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(layout.ChecksumError, match=str(p)):
        layout.map_verified(p, data.nbytes, crc)
    with pytest.raises(EOFError):
        layout.map_verified(p, data.nbytes + 1, crc)
