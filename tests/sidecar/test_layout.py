"""The on-disk layout: names, manifest validation, commit and verification."""

import json
import os

import numpy as np
import pytest

from sidecar import checksums, commit, layout, spares


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
    tmp = commit.make_tmp_dir(parent, 7)
    (tmp / "a").write_bytes(b"x")
    # No manifest: refuses to commit, and nothing is listed.
    with pytest.raises(layout.ManifestError):
        commit.commit_dir(tmp, parent / "7")
    assert commit.committed_steps(parent) == []
    size, crc = checksums.file_crc32c(tmp / "a")
    commit.write_manifest(tmp, _manifest(step=7, files=(layout.FileEntry("a", size, crc),), arrays=()))
    commit.commit_dir(tmp, parent / "7")
    assert commit.committed_steps(parent) == [7]
    # A committed step is never replaced.
    tmp2 = commit.make_tmp_dir(parent, 7)
    commit.write_manifest(tmp2, _manifest(step=7, files=(), arrays=()))
    with pytest.raises(FileExistsError):
        commit.commit_dir(tmp2, parent / "7")
    assert commit.remove_tmp_dirs(parent) == []  # still owned (locked) by this live writer
    commit._release_owned(tmp2)  # as if the writer died
    assert commit.remove_tmp_dirs(parent) == [tmp2]
    assert sorted(os.listdir(parent)) == ["7"]
    checksums.verify_step_dir(parent / "7")
    (parent / "7" / "a").write_bytes(b"y")
    with pytest.raises(checksums.ChecksumError, match="a"):
        checksums.verify_step_dir(parent / "7")


def test_read_verified_detects_flip(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    p = tmp_path / "f"
    p.write_bytes(data.tobytes())
    crc = checksums.crc32c(data)
    assert (checksums.read_verified(p, 1000, crc) == data).all()
    raw = bytearray(p.read_bytes())
    raw[500] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(checksums.ChecksumError, match=str(p)):
        checksums.read_verified(p, 1000, crc)
    with pytest.raises(EOFError):
        checksums.read_verified(p, 2000, crc)


def test_crc32c_accepts_buffers():
    b = bytes(range(256))
    assert checksums.crc32c(b) == checksums.crc32c(bytearray(b)) == checksums.crc32c(np.frombuffer(b, np.uint8))
    assert checksums.crc32c_extend(checksums.crc32c(b[:100]), b[100:]) == checksums.crc32c(b)


def test_map_verified_detects_flip_and_writes_stay_private(tmp_path):
    data = np.random.default_rng(1).integers(0, 255, size=3 << 20, dtype=np.uint8)
    p = tmp_path / "big"
    p.write_bytes(data.tobytes())
    crc = checksums.crc32c(data)
    m = checksums.map_verified(p, data.nbytes, crc)
    assert (m == data).all() and m.ctypes.data % 4096 == 0
    m[0] ^= 0xFF  # copy-on-write: the committed file never changes
    assert p.read_bytes()[:1] == data[:1].tobytes()
    raw = bytearray(p.read_bytes())
    raw[2 << 20] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(checksums.ChecksumError, match=str(p)):
        checksums.map_verified(p, data.nbytes, crc)
    with pytest.raises(EOFError):
        checksums.map_verified(p, data.nbytes + 1, crc)


# --------------------------------------------------------------------------- manifest checksum (#12.1)


def _committed(parent, step, files=None):
    """Commit ``step`` under ``parent`` with small files {name: bytes}; returns the manifest."""
    files = files if files is not None else {"a": b"alpha", "b": b"beta"}
    tmp = commit.make_tmp_dir(parent, step)
    entries = []
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        entries.append(layout.FileEntry(name, len(data), checksums.crc32c(data)))
    m = _manifest(step=step, files=tuple(entries), arrays=(),
                  values=(layout.ValueEntry("['step']", 3), layout.ValueEntry("['lr']", 0.5)))
    commit.write_manifest(tmp, m)
    commit.commit_dir(tmp, parent / str(step))
    return m


def test_manifest_carries_its_checksum_and_version():
    d = json.loads(_manifest().to_json())
    assert d["format_version"] == layout.FORMAT_VERSION == 2
    assert d[layout.MANIFEST_CHECKSUM_KEY] == layout.manifest_checksum(d)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d["values"][0].update(value=7),  # values[step] 3 -> 7
        lambda d: d["values"][1].update(value=0.25),
        lambda d: d["files"][0].update(crc32c=d["files"][0]["crc32c"] ^ 1),
        lambda d: d.update(job="other"),
        lambda d: d.pop(layout.MANIFEST_CHECKSUM_KEY),
        lambda d: d.update(extra=1),
    ],
)
def test_tampered_manifest_is_a_corrupt_copy(tmp_path, tamper):
    parent = tmp_path / "steps"
    _committed(parent, 4)
    path = parent / "4" / layout.MANIFEST_NAME
    d = json.loads(path.read_bytes())
    tamper(d)
    path.write_text(json.dumps(d))
    with pytest.raises(layout.ManifestChecksumError, match="checksum"):
        layout.read_manifest(parent / "4")
    with pytest.raises(layout.ManifestError):
        checksums.verify_step_dir(parent / "4")


def test_one_flipped_byte_in_a_manifest_value_is_detected(tmp_path):
    parent = tmp_path / "steps"
    _committed(parent, 4)
    path = parent / "4" / layout.MANIFEST_NAME
    raw = path.read_bytes()
    needle = b'"value":3'
    assert raw.count(needle) == 1
    path.write_bytes(raw.replace(needle, b'"value":7'))
    with pytest.raises(layout.ManifestChecksumError):
        layout.read_manifest(parent / "4")


def test_version_1_manifest_refused():
    d = _manifest().to_dict()
    d.pop(layout.MANIFEST_CHECKSUM_KEY)
    d["format_version"] = 1
    with pytest.raises(layout.ManifestError, match="format_version 1"):
        layout.StepManifest.from_json(json.dumps(d).encode())


def test_sealed_hand_made_manifest_is_accepted():
    d = _manifest().to_dict()
    d["values"][0]["value"] = 0.125
    m = layout.StepManifest.from_json(json.dumps(layout.seal_manifest_dict(d)).encode())
    assert m.values[0].value == 0.125


# --------------------------------------------------------------------------- ownership, GC, re-save (#12.3)


def test_cleanup_leaves_owned_tmp_dirs_and_removes_orphans(tmp_path):
    parent = tmp_path / "steps"
    owned = commit.make_tmp_dir(parent, 5)
    (owned / "x").write_bytes(b"1")
    orphan = parent / f"{layout.TMP_PREFIX}6-deadbeef"  # what a killed writer leaves: no lock holder
    orphan.mkdir()
    trash = parent / f"{layout.TRASH_PREFIX}3-cafe"
    (trash / "sub").mkdir(parents=True)
    assert commit.tmp_dir_is_owned(owned) and not commit.tmp_dir_is_owned(orphan)
    removed = commit.remove_tmp_dirs(parent)
    assert sorted(p.name for p in removed) == sorted([orphan.name, trash.name])
    assert (owned / "x").read_bytes() == b"1"
    # Once published the lock is gone with the temporary name.
    size, crc = checksums.file_crc32c(owned / "x")
    commit.write_manifest(owned, _manifest(step=5, files=(layout.FileEntry("x", size, crc),), arrays=()))
    commit.commit_dir(owned, parent / "5")
    assert commit.committed_steps(parent) == [5]
    assert not commit._OWNED


def test_cleanup_in_another_process_spares_owned_tmp_dir(tmp_path):
    import subprocess
    import sys

    parent = tmp_path / "steps"
    owned = commit.make_tmp_dir(parent, 5)
    orphan = parent / f"{layout.TMP_PREFIX}6-deadbeef"
    orphan.mkdir()
    code = "import sys; from sidecar import commit; commit.remove_tmp_dirs(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(parent)], check=True, timeout=60)
    assert owned.is_dir() and not orphan.exists()
    commit.delete_step(owned)


def test_commit_refuses_missing_or_short_listed_file(tmp_path):
    parent = tmp_path / "steps"
    tmp = commit.make_tmp_dir(parent, 2)
    (tmp / "a").write_bytes(b"12345")
    m = _manifest(step=2, files=(layout.FileEntry("a", 5, 1), layout.FileEntry("b", 3, 2)), arrays=())
    commit.write_manifest(tmp, m)
    with pytest.raises(checksums.ChecksumError, match="missing"):
        commit.commit_dir(tmp, parent / "2")
    (tmp / "b").write_bytes(b"1")
    with pytest.raises(checksums.ChecksumError, match="size"):
        commit.commit_dir(tmp, parent / "2")
    assert commit.committed_steps(parent) == []


def test_delete_is_rename_first_and_debris_does_not_block_resave(tmp_path):
    parent = tmp_path / "steps"
    _committed(parent, 4)
    commit.delete_step(parent / "4")
    assert sorted(os.listdir(parent)) == []
    # Debris of an old-style half-deleted step (no manifest) under the step's name.
    (parent / "4").mkdir()
    (parent / "4" / "a").write_bytes(b"old")
    _committed(parent, 4)
    checksums.verify_step_dir(parent / "4")
    assert [p for p in os.listdir(parent) if p != "4"] == []


def test_replace_committed_step_atomically(tmp_path):
    parent = tmp_path / "steps"
    _committed(parent, 4, {"a": b"old"})
    tmp = commit.make_tmp_dir(parent, 4)
    (tmp / "a").write_bytes(b"new!")
    m = _manifest(step=4, files=(layout.FileEntry("a", 4, checksums.crc32c(b"new!")),), arrays=())
    commit.write_manifest(tmp, m)
    with pytest.raises(FileExistsError):
        commit.commit_dir(tmp, parent / "4")
    commit.commit_dir(tmp, parent / "4", replace=True)
    assert (parent / "4" / "a").read_bytes() == b"new!"
    assert layout.read_manifest(parent / "4") == m
    assert sorted(os.listdir(parent)) == ["4"]  # the old copy is gone, no trash left


_GC_CHILD = r"""
import os, sys, time
from pathlib import Path
from sidecar import checksums, commit, layout, spares
real_unlink = os.unlink
count = [0]
def slow_unlink(path, *a, **kw):
    count[0] += 1
    if count[0] == 5:
        print("deleting", flush=True)
    if count[0] >= 5:
        time.sleep(0.05)
    return real_unlink(path, *a, **kw)
os.unlink = slow_unlink
commit.delete_step(Path(sys.argv[1]))
print("done", flush=True)
"""


def test_sigkill_during_gc_leaves_no_half_deleted_step_and_step_is_resavable(tmp_path):
    import signal
    import subprocess
    import sys

    parent = tmp_path / "steps"
    _committed(parent, 9, {f"f{i}": bytes([i]) * 100 for i in range(200)})
    _committed(parent, 10)
    proc = subprocess.Popen([sys.executable, "-c", _GC_CHILD, str(parent / "9")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "deleting"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # Not listed, not under its name: only trash, which start-up cleanup removes.
    assert commit.committed_steps(parent) == [10]
    assert not (parent / "9").exists()
    leftovers = [p for p in os.listdir(parent) if p != "10"]
    assert len(leftovers) == 1 and leftovers[0].startswith(layout.TRASH_PREFIX)
    _committed(parent, 9)  # re-savable before any cleanup
    checksums.verify_step_dir(parent / "9")
    commit.remove_tmp_dirs(parent)
    assert sorted(os.listdir(parent)) == ["10", "9"]


# --------------------------------------------------------------------------- page recycling (#9.6)


def test_deleted_step_pages_are_recycled_into_the_next_write(tmp_path):
    import numpy as np

    root = tmp_path / "ram"
    parent = layout.steps_dir(root)
    big = bytes(range(256)) * (spares.RECYCLE_MIN_BYTES // 256 + 17)
    _committed(parent, 1, {"big": big, "small": b"s"})
    ino = os.stat(parent / "1" / "big").st_ino
    commit.delete_step(parent / "1", spare=spares.spare_dir(root))
    assert commit.committed_steps(parent) == []
    assert spares.spare_bytes(spares.spare_dir(root)) == len(big)  # the small file was just deleted
    pool = spares.SparePool(spares.spare_dir(root))
    tmp = commit.make_tmp_dir(parent, 2)
    new = np.full(spares.RECYCLE_MIN_BYTES + 5, 7, dtype=np.uint8)
    assert pool.take(tmp / "x", new.nbytes)
    assert os.stat(tmp / "x").st_ino == ino and os.stat(tmp / "x").st_size == new.nbytes
    assert not pool.take(tmp / "y", new.nbytes)  # the pool is empty now
    assert spares.spare_bytes(spares.spare_dir(root)) == 0
    commit.delete_step(tmp)


def test_pool_holds_one_step_and_mapped_files_are_never_recycled(tmp_path):
    import gc

    root = tmp_path / "ram"
    parent = layout.steps_dir(root)
    size = spares.RECYCLE_MIN_BYTES
    data = bytes([5]) * size
    _committed(parent, 1, {"a": data, "b": data})
    _committed(parent, 2, {"c": data})
    # A restored array maps step 1's file "a" (zero copy): its bytes must never change under it.
    mapped = checksums.map_verified(parent / "1" / "a", size, checksums.crc32c(data))
    commit.delete_step(parent / "1", spare=spares.spare_dir(root))
    assert spares.spare_bytes(spares.spare_dir(root)) == size  # only "b"; "a" is leased
    commit.delete_step(parent / "2", spare=spares.spare_dir(root))
    assert spares.spare_bytes(spares.spare_dir(root)) == size  # one step's worth: "c" replaced "b"
    pool = spares.SparePool(spares.spare_dir(root))
    tmp = commit.make_tmp_dir(parent, 3)
    assert pool.take(tmp / "x", size)
    with open(tmp / "x", "r+b") as f:
        f.write(bytes([9]) * size)
    assert bytes(mapped[:16]) == bytes([5]) * 16 and checksums.crc32c(mapped) == checksums.crc32c(data)
    del mapped
    gc.collect()
    commit.delete_step(tmp)


def test_check_fetch_dir_accepts_only_a_scratch_dir_under_fetch(tmp_path):
    root = tmp_path / "ram"
    scratch = commit.make_tmp_dir(layout.fetch_dir(root), 3)
    rel = scratch.relative_to(root).as_posix()
    assert layout.check_fetch_dir(root, rel) == scratch.resolve()
    (root / "steps" / "3").mkdir(parents=True)
    (layout.fetch_dir(root) / "plain").mkdir()
    os.symlink(root / "steps", layout.fetch_dir(root) / ".tmp-9-link")
    for bad in ("steps/3", "fetch/plain", "fetch", f"{rel}/..", "/etc", "../x", "fetch/.tmp-9-link/3",
                "fetch/.tmp-9-link", "fetch/.tmp-1-missing"):
        with pytest.raises(ValueError):
            layout.check_fetch_dir(root, bad)
    commit.remove_owned_dir(scratch)
    assert not scratch.exists()


def test_write_file_atomic_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "small.json"
    commit.write_file_atomic(path, b"old")
    commit.write_file_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["small.json"]


def test_write_file_atomic_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "small.json"
    commit.write_file_atomic(path, b"old")
    with pytest.raises(TypeError):
        commit.write_file_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["small.json"]


def test_a_2000_component_name_is_refused_not_walked(tmp_path):
    """Issue #19: a peer's 2,000-component file name reached Path.mkdir(parents=True) -> RecursionError."""
    deep = "/".join(["a"] * 2000)
    with pytest.raises(ValueError, match="2000 path components"):
        layout.safe_relpath(deep)
    with pytest.raises(ValueError, match="path components"):
        layout.resolve_under(tmp_path, deep)
    ok = "/".join(["a"] * layout.MAX_NAME_COMPONENTS)
    assert layout.resolve_under(tmp_path, ok) == tmp_path.resolve() / ok
