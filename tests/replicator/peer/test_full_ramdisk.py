"""A full RAM disk: copies and restores fail cleanly (no temporary directory left) and back off.

Uses a real 8 MiB tmpfs when this process may mount one (root in the test container), else injects
ENOSPC into the writes.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mtc_rpc import peer_pb2_grpc
from replicator.backup.bucket import BackupStore
from replicator.backup.storage.factory import open_store
from replicator.backup.storage.memory import MemoryStore
from replicator.net import retry, rpc
from replicator.peer import client as peer_client
from replicator.peer import server as peer_server
from sidecar import checksums, commit, layout, spares, writer

TOKEN = "tok"
SMALL_BYTES = 8 << 20
STEP_BYTES = 12 << 20  # more than the small RAM disk holds


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on an 8 MiB tmpfs (or, failing a mount, one whose writes past 8 MiB raise ENOSPC)."""
    mnt = Path("/tmp") / f"mtc-small-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_BYTES}", "tmpfs", str(mnt)], capture_output=True
    ).returncode == 0
    if not mounted:
        written = [0]
        real = os.pwrite

        def pwrite(fd: int, data: object, offset: int) -> int:
            n = len(memoryview(data).cast("B"))  # type: ignore[arg-type]
            if written[0] + n > SMALL_BYTES:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            written[0] += n
            return real(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", pwrite)
    try:
        yield mnt if mounted else mnt / "injected"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(mnt, ignore_errors=True)


def _commit(parent: Path, rank: int, step: int, size: int, files: int = 1) -> layout.StepManifest:
    tmp = commit.make_tmp_dir(parent, step)
    entries = []
    for i in range(files):
        data = np.random.default_rng(step * 100 + i).integers(0, 256, size // files, dtype=np.uint8)
        data.tofile(tmp / f"{i}.bin")
        entries.append(layout.FileEntry(f"{i}.bin", data.nbytes, checksums.crc32c(data)))
    m = layout.StepManifest("t", step, rank, 2, tuple(entries))
    commit.write_manifest(tmp, m)
    commit.commit_dir(tmp, parent / str(step))
    return m


def _leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir()] if d.exists() else []


@pytest.mark.parametrize("use_data_port", [True, False])
def test_peer_copy_into_full_ramdisk_leaves_nothing(tmp_path: Path, full_disk: Path, use_data_port: bool) -> None:
    src = tmp_path / "src"
    _commit(layout.steps_dir(src), 1, 5, STEP_BYTES)
    ts = peer_server.TransferServer()
    ts.start()
    servicer = peer_server.PeerServicer(src, 1, 2, transfer_server=ts)
    server, port = rpc.create_server("127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)],
                                     token=TOKEN)
    server.start()
    try:
        dest = full_disk / "peer" / "1"
        with pytest.raises(OSError) as ei:
            peer_client.fetch_step(f"127.0.0.1:{port}", 1, 5, dest, token=TOKEN, timeout_seconds=60,
                                   use_data_port=use_data_port)
        assert ei.value.errno == errno.ENOSPC or "No space" in str(ei.value)
        assert _leftovers(dest) == []  # no .tmp-*, no .mtc-part
        # The server is fine and a step that fits goes through afterwards.
        _commit(layout.steps_dir(src), 1, 6, 1 << 20)
        peer_client.fetch_step(f"127.0.0.1:{port}", 1, 6, dest, token=TOKEN, use_data_port=use_data_port)
        assert commit.committed_steps(dest) == [6]
        assert _leftovers(dest) == ["6"]
    finally:
        ts.stop()
        rpc.stop_server(server, 0.5)


@pytest.mark.parametrize("bucket", ["memory", "file"])
def test_bucket_restore_into_full_ramdisk_leaves_nothing(tmp_path: Path, full_disk: Path, bucket: str) -> None:
    src = tmp_path / "src"
    _commit(layout.steps_dir(src), 0, 5, STEP_BYTES)
    store = (MemoryStore(f"t-{uuid.uuid4().hex[:8]}") if bucket == "memory"
             else open_store(f"file://{tmp_path / 'bucket'}"))
    b = BackupStore(store, "t")
    staging = b.begin(5, 1)
    b.upload_rank(staging, 0, layout.steps_dir(src) / "5")
    b.commit(staging)
    dest = full_disk / "steps"
    dest.mkdir(parents=True)
    with pytest.raises(OSError):
        b.download_rank(5, 0, dest)
    assert _leftovers(dest) == []


def test_save_into_full_ramdisk_leaves_nothing(full_disk: Path) -> None:
    root = full_disk / "ram"
    data = np.ones(STEP_BYTES // 4, dtype=np.float32)
    hs = writer.HostStep(root, "t", 3, 0, 1,
                         [writer.ArrayCopy("['w']", data.shape, "float32", None,
                                           [writer.ShardCopy(((0, data.shape[0]),), data)])], [])
    with pytest.raises(OSError) as ei:
        writer.write_step(hs)
    assert ei.value.errno == errno.ENOSPC
    assert _leftovers(layout.steps_dir(root)) == []


def test_keyed_backoff_grows_with_jitter_and_resets() -> None:
    import random

    b = retry.KeyedBackoff(base_seconds=0.5, max_seconds=8.0, rng=random.Random(1))
    key = ("copy", 1, 5)
    now = 100.0
    assert b.ready(key, now)
    delays = [b.failed(key, now) for _ in range(8)]
    assert not b.ready(key, now) and b.ready(key, now + delays[-1])
    for i, d in enumerate(delays):
        nominal = min(8.0, 0.5 * 2**i)
        assert 0.5 * nominal <= d < 1.5 * nominal
    assert len(set(delays)) == len(delays)  # jittered
    b.succeeded(key)
    assert b.ready(key, now) and b.failures(key) == 0


def test_daemon_backs_off_a_failing_copy(tmp_path: Path) -> None:
    from replicator.daemon import Replicator
    from replicator.options import ReplicatorOptions

    opts = ReplicatorOptions(local_dir=tmp_path / "ram", listen="127.0.0.1:0", heartbeat_seconds=0.1)
    r = Replicator(opts, rank=0, nodes=1, job="t")
    calls: list[float] = []

    def failing() -> None:
        calls.append(time.monotonic())
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:  # what a heartbeat loop asking for the copy every 10 ms does
            r.tasks.submit("copy", 1, 5, failing)
            time.sleep(0.01)
    finally:
        r.tasks.shutdown(wait=True)
    # 0.05-0.15 s, 0.1-0.3, 0.2-0.6, 0.4-1.2 ...: a handful of attempts in 2 s, not hundreds.
    assert 2 <= len(calls) <= 8, calls
    assert r.counters.get("copy_failures") == len(calls)


def test_recycled_pages_are_given_back_when_the_disk_is_full(tmp_path: Path, full_disk: Path) -> None:
    if full_disk.name == "injected":
        pytest.skip("needs a real small tmpfs (mount refused)")
    src = tmp_path / "src"
    _commit(layout.steps_dir(src), 1, 5, 3 << 20)  # one 3 MiB file: recyclable
    _commit(layout.steps_dir(src), 1, 6, 6 << 20, files=12)  # 12 x 512 KiB: nothing to reuse
    ts = peer_server.TransferServer()
    ts.start()
    servicer = peer_server.PeerServicer(src, 1, 2, transfer_server=ts)
    server, port = rpc.create_server("127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)],
                                     token=TOKEN)
    server.start()
    try:
        root = full_disk / "root"
        dest, spare = root / "peer" / "1", spares.spare_dir(root)
        addr = f"127.0.0.1:{port}"
        peer_client.fetch_step(addr, 1, 5, dest, token=TOKEN, spare_dir=spare)
        commit.delete_step(dest / "5", spare=spare)
        assert spares.spare_bytes(spare) == 3 << 20
        with pytest.raises(OSError) as ei:  # 3 MiB of spares + 6 MiB of new pages > 8 MiB
            peer_client.fetch_step(addr, 1, 6, dest, token=TOKEN, spare_dir=spare)
        assert ei.value.errno == errno.ENOSPC
        assert spares.spare_bytes(spare) == 0 and _leftovers(dest) == []
        peer_client.fetch_step(addr, 1, 6, dest, token=TOKEN, spare_dir=spare)  # the retry fits
        checksums.verify_step_dir(dest / "6")
    finally:
        ts.stop()
        rpc.stop_server(server, 0.5)
