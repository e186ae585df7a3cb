"""A fetch's watermark (``FetchProgress``) and a reader that consumes the copy while it lands
(``sidecar.landing.Landing``): a real Peer server and data port on 127.0.0.1, real files, a throttled client
so that the copy takes a while."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from replicator.peer import client as peer_client
from replicator.peer import protocol as peer_protocol
from replicator.peer.progress import FetchProgress
from sidecar import checksums, commit, layout
from sidecar.checksums import ChecksumError
from sidecar.landing import Landing
from tests.replicator.peer.test_transfer import TOKEN, PeerHost, make_step

SIZES = {"w/0.bin": 6 << 20, "w/1.bin": (5 << 20) + 12345, "small.bin": 4000}


def _shards(m: layout.StepManifest, src: Path) -> dict[str, layout.ShardEntry]:
    """One shard per file (the native layout), with the block crc32cs the writer records."""
    out = {}
    for f in m.files:
        data = np.fromfile(src / f.name, dtype=np.uint8)
        crc, blocks = checksums.block_crc32cs(data, layout.BLOCK_BYTES) if f.size > layout.BLOCK_BYTES else (
            checksums.crc32c(data), ())
        out[f.name] = layout.ShardEntry(((0, f.size),), f.name, 0, f.size, crc,
                                        layout.BLOCK_BYTES if blocks else 0, blocks)
    return out


def _follow(progress: FetchProgress, root: Path, landing_box: list, stop: threading.Event) -> None:
    """What the daemon's StreamStep and the sidecar's follower do, in one thread: feed a Landing."""
    version, landing = -1, None
    while not stop.is_set():
        snap = progress.wait(version, 0.2)
        version = snap.version
        if landing is None and snap.manifest is not None:
            landing = Landing(root, snap.manifest, snap.tmp_dir.relative_to(root).as_posix(),
                              snap.final_dir.relative_to(root).as_posix(), peer_protocol.PART_SUFFIX,
                              timeout_seconds=60)
            landing_box.append(landing)
        if landing is not None:
            landing.update(dict(enumerate(snap.landed)), snap.committed)
            if snap.error:
                landing.fail(snap.error)
        if snap.finished:
            return


@pytest.mark.parametrize("use_data_port", [True, False], ids=["tcp", "grpc-stream"])
def test_a_copy_is_read_verified_while_it_lands(tmp_path: Path, use_data_port: bool) -> None:
    host = PeerHost(tmp_path / "src")
    try:
        m = make_step(layout.steps_dir(host.root), 1, 7, SIZES)
        src = layout.steps_dir(host.root) / "7"
        shards = _shards(m, src)
        root = tmp_path / "dst"
        dest = root / "peer" / "1"
        progress = FetchProgress()
        seen: list[tuple[int, ...]] = []
        box: list[Landing] = []
        stop = threading.Event()
        follower = threading.Thread(target=_follow, args=(progress, root, box, stop))
        follower.start()
        out: dict = {}

        def fetch() -> None:
            try:
                # 4 MiB/s after the 8 MiB burst: the last ~3 MiB take most of a second.
                out["m"] = peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN, timeout_seconds=60,
                                                  use_data_port=use_data_port, progress=progress,
                                                  throttle=peer_protocol.Throttle(bytes_per_second=4 << 20))
            except BaseException as e:  # reported below
                out["error"] = e

        t = threading.Thread(target=fetch)
        t.start()
        first = None
        try:
            deadline = 30
            follower.join(0.01)
            while not box and deadline > 0:
                follower.join(0.05)
                deadline -= 0.05
            landing = box[0]
            first = landing.read(shards["w/0.bin"])
            committed_after_first = landing.committed
            np.testing.assert_array_equal(first, np.fromfile(src / "w/0.bin", dtype=np.uint8))
            for name in ("w/1.bin", "small.bin"):
                np.testing.assert_array_equal(landing.read(shards[name]), np.fromfile(src / name, dtype=np.uint8))
            seen.append(progress.snapshot().landed)
        finally:
            t.join(60)
            stop.set()
            follower.join(10)
        assert "error" not in out, out.get("error")
        assert not committed_after_first, "the first file was read only after the whole copy committed"
        snap = progress.snapshot()
        assert snap.committed and snap.landed == tuple(f.size for f in m.files)
        # The committed copy is complete and verified; nothing of the landing is left over.
        assert commit.committed_steps(dest) == [7]
        checksums.verify_step_dir(dest / "7")
        assert not list(dest.glob(".tmp-*"))
        # A file opened after the commit is found in the committed directory.
        np.testing.assert_array_equal(landing.read(shards["small.bin"]),
                                      np.fromfile(src / "small.bin", dtype=np.uint8))
    finally:
        host.stop()


def test_a_bad_block_is_rejected_while_landing_and_nothing_commits(tmp_path: Path) -> None:
    host = PeerHost(tmp_path / "src")
    try:
        m = make_step(layout.steps_dir(host.root), 1, 7, SIZES)
        src = layout.steps_dir(host.root) / "7"
        shards = _shards(m, src)
        with open(src / "w/1.bin", "r+b") as f:  # bit rot in block 3 of the second file, after the manifest
            f.seek(3 * layout.BLOCK_BYTES + 5)
            b = f.read(1)
            f.seek(3 * layout.BLOCK_BYTES + 5)
            f.write(bytes([b[0] ^ 1]))
        root = tmp_path / "dst"
        dest = root / "peer" / "1"
        progress = FetchProgress()
        box: list[Landing] = []
        stop = threading.Event()
        follower = threading.Thread(target=_follow, args=(progress, root, box, stop))
        follower.start()
        with pytest.raises(ChecksumError):
            peer_client.fetch_step(host.address, 1, 7, dest, token=TOKEN, timeout_seconds=60, progress=progress)
        follower.join(10)
        stop.set()
        snap = progress.snapshot()
        assert snap.error and "ChecksumError" in snap.error and not snap.committed
        landing = box[0]
        with pytest.raises(OSError):  # the copy failed: nothing of it reads any more
            landing.read(shards["w/1.bin"])
        assert commit.committed_steps(dest) == []
    finally:
        host.stop()


def test_the_reader_checks_each_block_as_it_lands(tmp_path: Path) -> None:
    """The reader's own check (whatever the replicator does): a block whose crc32c differs is never returned,
    the blocks before it are verified as soon as they have landed."""
    root = tmp_path / "root"
    tmp = root / "peer" / "0" / ".tmp-3-abc"
    tmp.mkdir(parents=True)
    size = 4 * layout.BLOCK_BYTES + 100
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    crc, blocks = checksums.block_crc32cs(data, layout.BLOCK_BYTES)
    entry = layout.ShardEntry(((0, size),), "x.bin", 0, size, crc, layout.BLOCK_BYTES, blocks)
    bad = data.copy()
    bad[2 * layout.BLOCK_BYTES + 7] ^= 0x40
    bad.tofile(tmp / f"x.bin{peer_protocol.PART_SUFFIX}")
    m = layout.StepManifest(job="t", step=3, rank=0, nodes=2, files=(layout.FileEntry("x.bin", size, crc),))
    landing = Landing(root, m, "peer/0/.tmp-3-abc", "peer/0/3", peer_protocol.PART_SUFFIX, timeout_seconds=30)
    landing.update({0: 2 * layout.BLOCK_BYTES})  # two good blocks landed
    got: dict = {}

    def read() -> None:
        try:
            got["buf"] = landing.read(entry)
        except BaseException as e:  # checked below
            got["error"] = e

    t = threading.Thread(target=read)
    t.start()
    t.join(0.3)
    assert t.is_alive(), "the reader returned before the rest had landed"
    landing.update({0: size})  # the rest lands, with the bad block
    t.join(10)
    assert "buf" not in got
    assert isinstance(got["error"], ChecksumError) and "block 2" in str(got["error"])
    # The same bytes, intact: returned once all have landed.
    data.tofile(tmp / f"x.bin{peer_protocol.PART_SUFFIX}")
    np.testing.assert_array_equal(landing.read(entry), data)
    # A failed copy wakes a waiting reader with ConnectionError.
    other = Landing(root, m, "peer/0/.tmp-3-abc", "peer/0/3", peer_protocol.PART_SUFFIX, timeout_seconds=30)
    other.update({0: layout.BLOCK_BYTES})
    threading.Timer(0.2, other.fail, args=("peer lost",)).start()
    with pytest.raises(ConnectionError, match="peer lost"):
        other.read(entry)
