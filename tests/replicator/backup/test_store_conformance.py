"""One conformance suite run against every storage backend (file, memory, two GCS emulators, fsspec)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replicator.backup.storage import Store, UnsupportedOperation, open_store
from replicator.backup.storage.filesystem import FileStore
from replicator.backup.storage.fsspec_store import FsspecStore
from replicator.backup.storage.gcs import GcsStore
from replicator.backup.storage.memory import MemoryStore
from sidecar import commit, spares
from sidecar.checksums import ChecksumError, crc32c
from tests.kits.storage import make_step


def test_write_read_stat_roundtrip(store: Store) -> None:
    data = os.urandom(100_000)
    info = store.write("a/b/c.bin", data)
    assert info.size == len(data)
    assert info.crc32c == crc32c(data)
    assert store.read("a/b/c.bin") == data
    st = store.stat("a/b/c.bin")
    assert st.name == "a/b/c.bin" and st.size == len(data)
    assert st.crc32c in (None, crc32c(data))  # file:// does not know a crc32c without reading
    # overwrite replaces the whole object
    store.write("a/b/c.bin", b"short")
    assert store.read("a/b/c.bin") == b"short"


def test_byte_ranges(store: Store) -> None:
    data = bytes(range(256)) * 40
    store.write("r.bin", data)
    assert store.read("r.bin", 10, 20) == data[10:30]
    assert store.read("r.bin", 5000) == data[5000:]
    assert store.read("r.bin", 10, 0) == b""
    assert store.read("r.bin", len(data) - 3, 100) == data[-3:]
    with pytest.raises(ValueError):
        store.read("r.bin", -1)


def test_large_object_from_file_and_download(store: Store, tmp_path: Path) -> None:
    # 3 MiB + 7: above the test GCS resumable threshold (1 MiB), several 256 KiB chunks, odd tail.
    data = os.urandom((3 << 20) + 7)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    info = store.write("big/obj", src, crc32c=crc32c(data))
    assert info.size == len(data)
    dest = tmp_path / "dest.bin"
    got = store.read_to_file("big/obj", dest)
    assert dest.read_bytes() == data
    assert got.size == len(data) and got.crc32c == crc32c(data)


def test_throttle_sees_every_byte(store: Store, tmp_path: Path) -> None:
    data = os.urandom((2 << 20) + 5)
    src = tmp_path / "t.bin"
    src.write_bytes(data)
    seen: list[int] = []
    store.write("thr", src, throttle=seen.append)
    assert sum(seen) >= len(data)  # a retried chunk may be counted twice, never fewer
    assert store.read("thr") == data


def test_wrong_crc32c_is_rejected_and_leaves_no_object(store: Store) -> None:
    with pytest.raises(ChecksumError):
        store.write("bad", b"payload", crc32c=crc32c(b"other"))
    with pytest.raises(FileNotFoundError):
        store.stat("bad")


def test_file_not_matching_its_crc32c_is_rejected_and_leaves_no_object(store: Store, tmp_path: Path) -> None:
    # 3 MiB + 7: several resumable chunks with the test GCS options; the flipped byte is in the last one.
    data = bytearray(os.urandom((3 << 20) + 7))
    good = crc32c(bytes(data))
    data[-2] ^= 0x10
    src = tmp_path / "bad.bin"
    src.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        store.write("bad/file", src, crc32c=good)
    with pytest.raises(FileNotFoundError):
        store.stat("bad/file")


def test_a_step_deleted_while_its_file_uploads_is_not_recycled_under_the_upload(
    store: Store, tmp_path: Path
) -> None:
    # The sidecar hands the files of a deleted step to its next writer to overwrite (sidecar/spares.py) unless
    # a reader holds a lease on them: an upload takes that lease, so the file is unlinked instead and the upload
    # sends the step's bytes.
    root = tmp_path / "ram"
    data = os.urandom((3 << 20) + 7)
    step = make_step(root, 4, 0, 1, {"state/0.bin": data})
    seen: list[int] = []

    def delete_step_midway(n: int) -> None:
        if not seen:
            assert commit.delete_step(step, spare=spares.spare_dir(root))
        seen.append(n)

    info = store.write("leased", step / "state" / "0.bin", crc32c=crc32c(data), throttle=delete_step_midway)
    assert info.size == len(data)
    assert store.read("leased") == data
    assert not list(spares.spare_dir(root).glob("*")), "the uploading file was recycled"


def test_missing_objects(store: Store, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        store.read("nope")
    with pytest.raises(FileNotFoundError):
        store.stat("nope/x")
    with pytest.raises(FileNotFoundError):
        store.read_to_file("nope", tmp_path / "x")
    assert store.list("nope") == []


def test_list_recursive_shallow_and_prefix_boundaries(store: Store) -> None:
    for name in ("p/a", "p/b/c", "p/b/d/e", "pq/x", "top"):
        store.write(name, name.encode())
    assert [o.name for o in store.list("p")] == ["p/a", "p/b/c", "p/b/d/e"]
    assert [o.name for o in store.list("p/")] == ["p/a", "p/b/c", "p/b/d/e"]
    shallow = store.list("p", shallow=True)
    assert [(o.name, o.is_dir) for o in shallow] == [("p/a", False), ("p/b", True)]
    everything = [o.name for o in store.list("")]
    assert everything == ["p/a", "p/b/c", "p/b/d/e", "pq/x", "top"]
    assert all(o.size == len(o.name) for o in store.list("p"))


def test_delete_single_and_recursive(store: Store) -> None:
    for name in ("d/1", "d/2/3", "d/2/4", "keep/5"):
        store.write(name, b"x")
    assert store.delete("d/1") == 1
    assert store.delete("d/1") == 0  # idempotent
    assert store.delete("d", recursive=True) == 2
    assert store.list("d") == []
    assert [o.name for o in store.list("")] == ["keep/5"]
    with pytest.raises(ValueError):
        store.delete("", recursive=True)


def test_create_only(store: Store, create_only_enforced: bool) -> None:
    store.write("c/once", b"first", create_only=True)
    if create_only_enforced:
        assert store.capabilities.create_only
        with pytest.raises(FileExistsError):
            store.write("c/once", b"second", create_only=True)
        assert store.read("c/once") == b"first"
    else:
        # The emulator's known gap: the second create-only write wins. BackupStore's probe catches this.
        store.write("c/once", b"second", create_only=True)
        assert store.read("c/once") == b"second"


@pytest.mark.parametrize("bad", ["", "../x", "/abs", "a/../b", "a//b", "./a", "a/.", "a\\b", ".mtc-tmp-x"])
def test_bad_names_rejected_and_nothing_written(store: Store, bad: str) -> None:
    with pytest.raises(ValueError):
        store.write(bad, b"x")
    with pytest.raises(ValueError):
        store.read(bad)
    assert store.list("") == []


def test_rename_prefix(store: Store, backend: str) -> None:
    store.write("src/a", b"1")
    store.write("src/b/c", b"2")
    if backend != "file":
        assert not store.capabilities.rename_prefix
        with pytest.raises(UnsupportedOperation):
            store.rename_prefix("src", "dst")
        return
    store.write("taken/x", b"3")
    with pytest.raises(FileExistsError):
        store.rename_prefix("src", "taken")
    with pytest.raises(FileNotFoundError):
        store.rename_prefix("nothing", "dst2")
    store.rename_prefix("src", "d/s/t")
    assert [o.name for o in store.list("")] == ["d/s/t/a", "d/s/t/b/c", "taken/x"]
    assert store.read("d/s/t/b/c") == b"2"


def test_memory_rename_variant(request: pytest.FixtureRequest) -> None:
    s = MemoryStore("rename-variant", rename=True)
    request.addfinalizer(lambda: MemoryStore.wipe("rename-variant"))
    s.write("a/x", b"1")
    s.write("b/y", b"2")
    with pytest.raises(FileExistsError):
        s.rename_prefix("a", "b")
    s.rename_prefix("a", "c")
    assert [o.name for o in s.list("")] == ["b/y", "c/x"]


def test_local_symlink_escape_rejected(tmp_path: Path) -> None:
    s = FileStore(tmp_path / "root")
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "root" / "link")
    with pytest.raises(ValueError):
        s.write("link/evil", b"x")
    assert list((tmp_path / "outside").iterdir()) == []


def test_factory_schemes(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), FileStore)
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    assert isinstance(open_store("memory://factory-test"), MemoryStore)
    MemoryStore.wipe("factory-test")
    g = open_store("gs://some-bucket/a/b")
    assert isinstance(g, GcsStore) and g.bucket_name == "some-bucket" and g.prefix == "a/b"
    assert isinstance(open_store(f"fsspec+file://{tmp_path}/f"), FsspecStore)
    with pytest.raises(ValueError, match="unknown storage scheme 'nosuch'.*supported"):
        open_store("nosuch://x")
    with pytest.raises(ValueError, match="absolute"):
        open_store("relative/path")
    with pytest.raises(ValueError):
        open_store("file://host/path")
