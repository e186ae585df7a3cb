"""BackupStore: staged upload with content-hash dedup, atomic commit, verified restore, retention, faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from replicator.backup.bucket import (
    BackupOptions,
    BackupStore,
    IncompleteBackupError,
    Staging,
    UnsupportedBucketError,
)
from replicator.backup.storage import Store
from replicator.backup.storage.memory import MemoryStore
from sidecar.checksums import ChecksumError, verify_step_dir
from sidecar.layout import ManifestError, read_manifest
from tests.kits.storage import EXPECTED_STRATEGY, FakeStorageControl, HnsGcsStore, make_step

REPO = Path(__file__).resolve().parents[3]


def files_for(seed: int, n: int = 3, size: int = 50_000) -> dict[str, bytes]:
    rnd = __import__("random").Random(seed)
    return {f"state/{i}.bin" if i else "meta.json": rnd.randbytes(size + i) for i in range(n)}


def data_objects(store: Store, job: str = "job") -> list[str]:
    return [o.name for o in store.list(job) if "/data/" in o.name]


def test_round_trip_dedup_commit_download(backup_target: Store, backup_backend: str, tmp_path: Path) -> None:
    b = BackupStore(backup_target, "job")
    assert b.check_capabilities().strategy == EXPECTED_STRATEGY[backup_backend]
    same, other = files_for(1), files_for(2)
    dirs = [
        make_step(tmp_path / "h0", 7, 0, 3, same),
        make_step(tmp_path / "h1", 7, 1, 3, same),  # data-parallel replica of rank 0
        make_step(tmp_path / "h2", 7, 2, 3, other),
    ]
    staging = b.begin(7, 3)
    r0 = b.upload_rank(staging, 0, dirs[0])
    r1 = b.upload_rank(staging, 1, dirs[1])
    r2 = b.upload_rank(staging, 2, dirs[2])
    assert (r0.files_uploaded, r0.files_reused) == (3, 0)
    assert (r1.files_uploaded, r1.bytes_uploaded, r1.files_reused) == (0, 0, 3)  # only its manifest
    assert r2.files_uploaded == 3
    assert len(data_objects(backup_target)) == 6  # each distinct piece once
    assert b.committed_steps() == []  # everything uploaded, nothing visible before commit
    with pytest.raises(FileNotFoundError):
        b.read_manifest(7, 0)
    assert b.commit(staging) == 7
    assert b.committed_steps() == [7]
    for rank, d in enumerate(dirs):
        assert b.read_manifest(7, rank) == read_manifest(d)
        out = b.download_rank(7, rank, tmp_path / f"restore{rank}")
        assert out == tmp_path / f"restore{rank}" / "7"
        verify_step_dir(out)
        for f in read_manifest(d).files:
            assert (out / f.name).read_bytes() == (d / f.name).read_bytes()
        assert sorted(p.name for p in out.parent.iterdir()) == ["7"]  # no temp dir left
    with pytest.raises(FileExistsError):
        b.download_rank(7, 0, tmp_path / "restore0")


def test_download_replaces_debris_without_a_manifest(backup_target: Store, tmp_path: Path) -> None:
    """A leftover step directory without MANIFEST.json (a killed writer, or a deleter that walked through
    a symlink into it) never blocks a restore from the bucket: the commit replaces it."""
    b = BackupStore(backup_target, "job")
    d = make_step(tmp_path / "h0", 7, 0, 1, files_for(2))
    s = b.begin(7, 1)
    b.upload_rank(s, 0, d)
    b.commit(s)
    parent = tmp_path / "restore"
    debris = parent / "7" / "state"
    debris.mkdir(parents=True)
    (debris / "stale.bin").write_bytes(b"half")
    out = b.download_rank(7, 0, parent)
    verify_step_dir(out)
    assert not (out / "state" / "stale.bin").exists()
    assert sorted(p.name for p in parent.iterdir()) == ["7"]


def test_commit_refuses_incomplete_staging(backup_target: Store, tmp_path: Path) -> None:
    b = BackupStore(backup_target, "job")
    staging = b.begin(3, 2)
    b.upload_rank(staging, 0, make_step(tmp_path / "h0", 3, 0, 2, files_for(1)))
    with pytest.raises(IncompleteBackupError, match="manifest of rank 1"):
        b.commit(staging)
    assert b.committed_steps() == []
    b.upload_rank(staging, 1, make_step(tmp_path / "h1", 3, 1, 2, files_for(2)))
    # a data object lost after its rank's manifest was written is caught too
    victim = next(n for n in data_objects(backup_target) if n.endswith("meta.json"))
    saved = backup_target.read(victim)
    backup_target.delete(victim)
    with pytest.raises(IncompleteBackupError, match="meta.json"):
        b.commit(staging)
    assert b.committed_steps() == []
    backup_target.write(victim, saved)
    assert b.commit(staging) == 3


def test_second_commit_of_same_step_fails(backup_target: Store, tmp_path: Path) -> None:
    b = BackupStore(backup_target, "job")
    d_a = make_step(tmp_path / "a", 4, 0, 1, files_for(1))
    d_b = make_step(tmp_path / "b", 4, 0, 1, files_for(2))
    s1, s2 = b.begin(4, 1), b.begin(4, 1)
    b.upload_rank(s1, 0, d_a)
    b.upload_rank(s2, 0, d_b)
    b.commit(s1)
    with pytest.raises(FileExistsError):
        b.commit(s2)
    assert b.read_manifest(4, 0) == read_manifest(d_a)


def test_newer_save_of_a_step_supersedes_its_backup(backup_target: Store, tmp_path: Path) -> None:
    """A rollback saved step 4 again (newer generation): its backup replaces the abandoned one whole."""
    b = BackupStore(backup_target, "job")
    old = [make_step(tmp_path / f"old{r}", 4, r, 2, files_for(r), generation=5) for r in range(2)]
    new = [make_step(tmp_path / f"new{r}", 4, r, 2, files_for(10 + r), generation=9) for r in range(2)]
    s1 = b.begin(4, 2)
    for r in range(2):
        b.upload_rank(s1, r, old[r])
    b.commit(s1)
    assert b.committed_generation(4) == 5
    s2 = b.begin(4, 2)
    for r in range(2):
        b.upload_rank(s2, r, new[r])
    assert b.read_manifest(4, 1) == read_manifest(old[1])  # the old backup stays whole until the commit
    assert b.commit(s2) == 4
    assert b.committed_steps() == [4] and b.committed_generation(4) == 9
    for r in range(2):
        assert b.read_manifest(4, r) == read_manifest(new[r])
        out = b.download_rank(4, r, tmp_path / f"restore{r}")
        for f in read_manifest(new[r]).files:
            assert (out / f.name).read_bytes() == (new[r] / f.name).read_bytes()
    # Nothing of the abandoned save is left in the bucket.
    keys = {name.split("/data/")[1].split("/")[0] for name in data_objects(backup_target)}
    assert keys == {read_manifest(d).content_hash for d in new}
    # The same or an older save never replaces a newer one.
    for dirs in (old, new):
        s = b.begin(4, 2)
        for r in range(2):
            b.upload_rank(s, r, dirs[r])
        with pytest.raises(FileExistsError, match="generation 9"):
            b.commit(s)
        b.abort(s)
    assert b.read_manifest(4, 0) == read_manifest(new[0])


def test_ranks_of_different_saves_are_never_committed_together(backup_target: Store, tmp_path: Path) -> None:
    b = BackupStore(backup_target, "job")
    s = b.begin(6, 2)
    b.upload_rank(s, 0, make_step(tmp_path / "a", 6, 0, 2, files_for(1), generation=5))
    b.upload_rank(s, 1, make_step(tmp_path / "b", 6, 1, 2, files_for(2), generation=9))
    with pytest.raises(ManifestError, match="different saves"):
        b.commit(s)
    assert b.committed_steps() == []


def test_concurrent_commits_exactly_one_wins_on_fake_gcs(fake_gcs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The create-only precondition (ifGenerationMatch=0 -> 412) decides a race of two committers."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    stores = [fake_gcs.store(prefix), fake_gcs.store(prefix)]
    backups = [BackupStore(s, "job") for s in stores]
    stagings = []
    for i, b in enumerate(backups):
        s = b.begin(9, 1)
        b.upload_rank(s, 0, make_step(tmp_path / f"h{i}", 9, 0, 1, files_for(i)))
        stagings.append(s)
    for b in backups:
        assert b.check_capabilities().strategy == "marker"
    # Both pass the "already committed?" pre-check; only the precondition can stop the second.
    for b in backups:
        b.committed_steps = lambda: []  # type: ignore[method-assign]
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = backups[i].commit(stagings[i])
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(type(r).__name__ for r in results) == ["FileExistsError", "int"]
    assert BackupStore(fake_gcs.store(prefix), "job").committed_steps() == [9]


def test_corrupt_object_gives_checksum_error_and_nothing_visible(
    backup_target: Store, tmp_path: Path
) -> None:
    b = BackupStore(backup_target, "job")
    d = make_step(tmp_path / "h", 5, 0, 1, files_for(3))
    s = b.begin(5, 1)
    b.upload_rank(s, 0, d)
    b.commit(s)
    victim = next(n for n in data_objects(backup_target) if n.endswith("state/1.bin"))
    good = backup_target.read(victim)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    backup_target.write(victim, bytes(bad))  # same size, one bit flipped, stored "validly"
    dest = tmp_path / "restore"
    with pytest.raises(ChecksumError):
        b.download_rank(5, 0, dest)
    assert list(dest.iterdir()) == []  # neither the step nor a temp dir


@pytest.mark.parametrize("size", [50_000, (3 << 20) + 5])  # one request; several resumable chunks (test GCS)
def test_corrupt_local_file_is_never_stored(backup_target: Store, tmp_path: Path, size: int) -> None:
    # No checksum pass reads the file before its upload: the store checks the bytes it sends against the
    # manifest's crc32c and keeps nothing that does not match, on every backend.
    b = BackupStore(backup_target, "job")
    d = make_step(tmp_path / "h", 2, 0, 1, files_for(4, size=size))
    p = d / "state" / "2.bin"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    s = b.begin(2, 1)
    with pytest.raises(ChecksumError):
        b.upload_rank(s, 0, d)
    assert not [o for o in backup_target.list("job") if "/ranks/" in o.name]
    assert not [o for o in backup_target.list("job") if o.name.endswith("2.bin")]


def test_short_local_file_is_refused_before_upload(tmp_path: Path) -> None:
    store = MemoryStore(f"t-{uuid.uuid4().hex[:8]}")
    b = BackupStore(store, "job")
    d = make_step(tmp_path / "h", 2, 0, 1, files_for(4))
    p = d / "state" / "2.bin"
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(ChecksumError, match="before upload"):
        b.upload_rank(b.begin(2, 1), 0, d)
    assert not [o for o in store.list("job") if "/ranks/" in o.name or o.name.endswith("2.bin")]
    MemoryStore.wipe(store.name)


def test_retention(backup_target: Store, tmp_path: Path) -> None:
    b = BackupStore(backup_target, "job")
    for step in range(1, 6):
        s = b.begin(step, 1)
        b.upload_rank(s, 0, make_step(tmp_path / "h", step, 0, 1, files_for(step, n=1, size=100)))
        b.commit(s)
    assert b.committed_steps() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        b.apply_retention(0)
    assert b.apply_retention(2, pinned=[2]) == [1, 3]
    assert b.committed_steps() == [2, 4, 5]
    remaining = {o.name for o in backup_target.list("job")}
    assert not any("/1-" in n or "/steps/1/" in n or "/3-" in n or "/steps/3/" in n for n in remaining)
    assert b.apply_retention(1) == [2, 4]
    assert b.committed_steps() == [5]
    assert b.apply_retention(1) == []
    b.download_rank(5, 0, tmp_path / "r")


def test_clean_stale_staging_spares_committed_and_fresh(backup_target: Store, tmp_path: Path) -> None:
    b = BackupStore(backup_target, "job")
    committed = b.begin(1, 1)
    b.upload_rank(committed, 0, make_step(tmp_path / "h", 1, 0, 1, files_for(1, n=1)))
    b.commit(committed)
    abandoned = b.begin(2, 1)
    b.upload_rank(abandoned, 0, make_step(tmp_path / "h", 2, 0, 1, files_for(2, n=1)))
    assert b.clean_stale_staging(3600) == []
    assert b.clean_stale_staging(0) == [abandoned.staging_id]
    assert b.committed_steps() == [1]
    b.download_rank(1, 0, tmp_path / "r")
    with pytest.raises(FileNotFoundError):
        b.open_staging(abandoned.staging_id)


def test_staging_handle_travels_between_processes(tmp_path: Path) -> None:
    store = MemoryStore(f"t-{uuid.uuid4().hex[:8]}")
    b = BackupStore(store, "job")
    s = b.begin(11, 4)
    assert Staging.from_dict(s.to_dict()) == s
    assert b.open_staging(s.staging_id) == s
    MemoryStore.wipe(store.name)


def test_bad_input_is_rejected_and_changes_nothing(tmp_path: Path) -> None:
    store = MemoryStore(f"t-{uuid.uuid4().hex[:8]}")
    with pytest.raises(ValueError):
        BackupStore(store, "../job")
    with pytest.raises(ValueError):
        BackupOptions(max_parallel_uploads=0)
    b = BackupStore(store, "job")
    with pytest.raises(ValueError):
        b.begin(-1, 1)
    with pytest.raises(ValueError):
        b.begin(1, 0)
    s = b.begin(6, 2)
    before = [o.name for o in store.list("")]
    d = make_step(tmp_path / "h", 6, 0, 2, files_for(1, n=1))
    with pytest.raises(ValueError):
        b.upload_rank(s, 2, d)  # rank outside 0..nodes-1
    with pytest.raises(ValueError):
        b.upload_rank(s, 1, d)  # manifest is rank 0's
    wrong_step = make_step(tmp_path / "h", 8, 0, 2, files_for(1, n=1))
    with pytest.raises(ValueError):
        b.upload_rank(s, 0, wrong_step)
    with pytest.raises(ValueError):
        b.open_staging("../../etc")
    with pytest.raises(FileNotFoundError):
        b.upload_rank(Staging(6, 2, "6-000000000000"), 0, d)  # no such staging
    assert [o.name for o in store.list("")] == before
    with pytest.raises(FileNotFoundError):
        b.download_rank(6, 0, tmp_path / "r")
    MemoryStore.wipe(store.name)


def test_capabilities_reported_clearly(gcp_emulator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # gcp-storage-emulator silently ignores ifGenerationMatch: the probe must notice and refuse.
    b = BackupStore(gcp_emulator.store(f"t-{uuid.uuid4().hex[:8]}"), "job")
    with pytest.raises(UnsupportedBucketError, match="create-only preconditions unavailable.*ignored"):
        b.check_capabilities()
    with pytest.raises(UnsupportedBucketError):
        b.commit(Staging(1, 1, "1-000000000000"))
    mem = MemoryStore(f"t-{uuid.uuid4().hex[:8]}")
    with pytest.raises(UnsupportedBucketError, match="atomic folder rename unavailable"):
        BackupStore(mem, "job", BackupOptions(commit_strategy="rename")).check_capabilities()
    assert [o.name for o in mem.list("")] == []  # the probe cleaned up after itself
    MemoryStore.wipe(mem.name)


def test_throttle_limits_rate(tmp_path: Path) -> None:
    store = MemoryStore(f"t-{uuid.uuid4().hex[:8]}")
    rate = 8 << 20
    b = BackupStore(store, "job", BackupOptions(max_bytes_per_second=rate, max_parallel_uploads=4))
    d = make_step(tmp_path / "h", 1, 0, 1, files_for(1, n=4, size=1 << 20))
    s = b.begin(1, 1)
    t0 = time.monotonic()
    r = b.upload_rank(s, 0, d)
    elapsed = time.monotonic() - t0
    # 4 MiB at 8 MiB/s with a 0.25 s burst allowance: at least 0.25 s.
    assert r.bytes_uploaded >= 4 << 20
    assert elapsed >= r.bytes_uploaded / rate - 0.25 - 0.05
    MemoryStore.wipe(store.name)


def test_hns_rename_path_uses_storage_control(fake_gcs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client = fake_gcs.client()
    ctl = FakeStorageControl(client, "mtc-test")
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    store = HnsGcsStore("mtc-test", prefix, client=client, control_client=ctl)
    b = BackupStore(store, "job")
    assert b.check_capabilities().strategy == "rename"
    s = b.begin(12, 1)
    b.upload_rank(s, 0, make_step(tmp_path / "h", 12, 0, 1, files_for(1)))
    b.commit(s)
    renames = [c for c in ctl.calls if c[0] == "rename_folder"]
    assert len(renames) == 1
    assert (
        renames[0][1]["name"] == f"projects/_/buckets/mtc-test/folders/{prefix}/job/staging/{s.staging_id}/"
    )
    assert renames[0][1]["destination_folder_id"] == f"{prefix}/job/steps/12/"
    assert ("create_folder", {"folder_id": f"{prefix}/job/steps/", "recursive": True}) in ctl.calls
    assert store.list(f"job/staging/{s.staging_id}") == []
    assert b.committed_steps() == [12]
    # the service refuses to rename onto an existing folder: mapped to FileExistsError
    store.write("job/staging/x-1/f", b"1")
    with pytest.raises(FileExistsError):
        store.rename_prefix("job/staging/x-1", "job/steps/12")
    with pytest.raises(FileNotFoundError):
        store.rename_prefix("job/staging/none", "job/steps/13")
    b.download_rank(12, 0, tmp_path / "r")
    # a real (non-HNS) fake-gcs bucket reports no hierarchical namespace from its metadata
    assert fake_gcs.store(prefix).capabilities.rename_prefix is False


@pytest.mark.slow
def test_sigkilled_uploader_never_yields_a_committed_backup(fake_gcs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    url = f"gs://mtc-test/{prefix}"
    b = BackupStore(fake_gcs.store(prefix), "job")
    s = b.begin(20, 2)
    b.upload_rank(s, 0, make_step(tmp_path / "h0", 20, 0, 2, files_for(1)))
    d1 = make_step(tmp_path / "h1", 20, 1, 2, files_for(2, n=4, size=2 << 20))
    env = dict(os.environ, STORAGE_EMULATOR_HOST=fake_gcs.url, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "kits" / "backup_uploader_proc.py"),
            url,
            "job",
            s.staging_id,
            str(d1),
            "1",
            str(2 << 20),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        base_count = len(data_objects(b.store))
        while len(data_objects(b.store)) <= base_count:  # wait until rank 1 has landed some data
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "uploader made no progress"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    assert b.committed_steps() == []
    with pytest.raises(IncompleteBackupError, match="rank 1"):
        b.commit(s)
    assert b.committed_steps() == []
    with pytest.raises(FileNotFoundError):
        b.download_rank(20, 1, tmp_path / "r")
    assert b.clean_stale_staging(0) == [s.staging_id]


def test_half_deleted_backup_is_invisible_and_cleaned(backup_target: Store, tmp_path: Path) -> None:
    """Retention deletes the commit record first; if it dies right after, nothing half-deleted shows."""
    b = BackupStore(backup_target, "job")
    s = b.begin(30, 1)
    b.upload_rank(s, 0, make_step(tmp_path / "h", 30, 0, 1, files_for(1, n=2)))
    b.commit(s)
    rec, base = b.commit_record(30)
    record_name = f"{base}/COMMIT.json" if base.startswith("job/steps/") else "job/commits/30.json"
    backup_target.delete(record_name)  # the first act of _delete_backup, then a "crash"
    assert b.committed_steps() == []
    with pytest.raises(FileNotFoundError):
        b.download_rank(30, 0, tmp_path / "r")
    # the same step can be backed up again, over the remains
    s2 = b.begin(30, 1)
    b.upload_rank(s2, 0, make_step(tmp_path / "h2", 30, 0, 1, files_for(2, n=2)))
    b.commit(s2)
    assert b.committed_steps() == [30]
    b.clean_stale_staging(0)
    names = {o.name for o in backup_target.list("job")}
    assert not any(s.staging_id in n for n in names)  # the remains are gone
    assert b.read_manifest(30, 0).files == read_manifest(tmp_path / "h2" / "30").files


@pytest.mark.slow
def test_hosts_upload_ranks_of_one_staging_concurrently(fake_gcs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Three uploader processes (ranks 0 and 1 are data-parallel replicas) share one staging."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    b = BackupStore(fake_gcs.store(prefix), "job")
    s = b.begin(40, 3)
    dirs = [
        make_step(tmp_path / "h0", 40, 0, 3, files_for(1, n=3, size=300_000)),
        make_step(tmp_path / "h1", 40, 1, 3, files_for(1, n=3, size=300_000)),
        make_step(tmp_path / "h2", 40, 2, 3, files_for(2, n=3, size=300_000)),
    ]
    env = dict(os.environ, STORAGE_EMULATOR_HOST=fake_gcs.url, PYTHONPATH=str(REPO))
    script = str(REPO / "tests" / "kits" / "backup_uploader_proc.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, f"gs://mtc-test/{prefix}", "job", s.staging_id, str(d), str(r), "0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r, d in enumerate(dirs)
    ]
    try:
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err.decode()
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    assert len(data_objects(b.store)) == 6  # two distinct contents x three files
    assert b.commit(s) == 40
    for r, d in enumerate(dirs):
        out = b.download_rank(40, r, tmp_path / f"r{r}")
        for f in read_manifest(d).files:
            assert (out / f.name).read_bytes() == (d / f.name).read_bytes()
