"""A witness task that comes with a restore is recorded ahead of the restored bytes, as one that comes with a
copy (simulation seed 95210, issue #33). The host's rules (:func:`replicator.host_protocol.work`) decide; the
real RAM-disk store records it as the daemon's heartbeat asks it to."""

from __future__ import annotations

import random
from pathlib import Path

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator import host_protocol as hp
from replicator.local.store import RamDiskStore
from replicator.tiers import Tier
from sidecar import layout
from tests.kits.storage import make_step


def _files() -> dict[str, bytes]:
    rnd = random.Random(4)
    return {"meta.json": rnd.randbytes(64), "state/0.bin": rnd.randbytes(4096)}


def test_a_witness_task_that_comes_with_a_restore_is_recorded_before_the_bytes_land(tmp_path: Path) -> None:
    """Simulation seed 95210: host 2 (replaced) is told to restore its rank's data and to attest rank 0,
    whose data is identical. The coordinator (and host 0) may be gone when the restore lands: the record is
    kept at once and reported with the restored bytes."""
    store = RamDiskStore(tmp_path / "host2", 2)
    h = layout.read_manifest(make_step(tmp_path / "host0", 4, 2, 4, _files())).content_hash  # a copy on host 0
    src = pb.RestoreSource(kind=tier_pb2.TIER_PEER, holder_rank=0, owner_rank=2, content_hash=h)
    resp = pb.HeartbeatResponse(restore=pb.RestoreTask(step=4, sources=[src]),
                                copies=[pb.CopyTask(owner_rank=0, step=4, source_rank=2, content_hash=h)])
    work = hp.work(resp, 2, {}, ())
    assert work.copies == (hp.Attest(0, 4, h, coming=True),)  # the restore brings that content
    for a in work.copies:
        assert isinstance(a, hp.Attest)
        assert store.attest_replica(a.owner_rank, a.step, a.content_hash, coming=a.coming)
    assert store.inventory() == []  # nothing reported before the bytes are here
    make_step(layout.steps_dir(tmp_path / "host2"), 4, 2, 4, _files())  # the restore lands
    assert {(x.owner_rank, x.tier, x.content_hash) for x in store.inventory()} == {
        (2, Tier.LOCAL, h), (0, Tier.REPLICA, h)}


def test_a_witness_task_alone_is_not_recorded_ahead() -> None:
    """Without a copy or a restore of that content in the answer, the store records it only if the bytes are
    here (``coming`` False)."""
    resp = pb.HeartbeatResponse(copies=[pb.CopyTask(owner_rank=0, step=4, source_rank=2, content_hash="H")])
    assert hp.work(resp, 2, {}, ()).copies == (hp.Attest(0, 4, "H", coming=False),)
