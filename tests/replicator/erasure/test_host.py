"""Erasure coding on real hosts: every member of a code group computes its parity from the others' data over
real Peer gRPC servers (data port and gRPC stream) on loopback, lost hosts are rebuilt from it bit-exact and
committed; corrupt parity is detected, a stale task writes nothing, a crash mid-encode leaves nothing visible."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.erasure import NotEnoughFragmentsError
from replicator.erasure import remote as ec_remote
from replicator.erasure.holder import RECORD_NAME, ParityStore, shard_name
from replicator.erasure.host import compute_parity
from replicator.erasure.rebuild import rebuild_own
from replicator.erasure.remote import StaleGroupError
from replicator.erasure.stream import StepStream
from replicator.net import rpc
from sidecar import layout
from tests.kits.ec_hosts import STEP, TOKEN, EcPeer, Job, assert_rebuilt

REPO = Path(__file__).resolve().parents[3]
@pytest.mark.parametrize(("k", "m", "data_port"), [(3, 1, True), (4, 2, False)], ids=["3+1-tcp", "4+2-grpc-stream"])
def test_every_host_encodes_and_m_wiped_hosts_are_rebuilt_bit_exact(job_factory, k: int, m: int,
                                                                     data_port: bool) -> None:
    job = job_factory(k, m, data_port=data_port)
    records = job.encode_all()
    spec = job.spec()
    shard = records[0].manifest.shard_bytes
    for h, rec in zip(job.hosts, records, strict=True):
        assert rec.digest == spec.digest() and rec.holder == h.rank
        (held,) = h.parity.holdings()
        assert (held.step, held.digest, held.size) == (STEP, spec.digest(), m * shard)
        assert held.group.members == spec.members and not any(held.group.addresses)
        assert sorted(rec.manifest.rotations) == sorted(r for r, _ in spec.layout.parity_held(h.rank))
    # parity held by the whole group: about M/K of the data (plus padding to the longest stream)
    assert sum(r.parity_bytes for r in records) == (k + m) * m * shard
    assert compute_parity(job.hosts[0].ec(), STEP, spec) == records[0]  # a repeated task: held already
    for h in job.hosts:  # the data port carried the reads (its fallback, the gRPC stream, the other case)
        assert (h.ts.transfers_completed > 0) if data_port else h.ts is None
    lost = list(range(m))
    for r in lost:
        job.hosts[r].wipe()
    spec = job.spec()
    for r in lost:
        got = rebuild_own(job.hosts[r].ec(), STEP, spec)
        assert got == job.manifests[r]
        assert_rebuilt(job, r)


def test_every_member_encodes_at_once_with_one_transfer_slot_each(job_factory) -> None:
    """As in a job: all members read from one another at the same time; one data-port slot per host. Each
    window is a whole transfer, so no host holds a slot while it waits for another's (no deadlock)."""
    job = job_factory(4, 2, max_streams=1)
    spec = job.spec()
    with concurrent.futures.ThreadPoolExecutor(len(job.hosts)) as pool:
        records = list(pool.map(lambda h: compute_parity(h.ec(), STEP, spec), job.hosts))
    assert [r.holder for r in records] == [h.rank for h in job.hosts]
    job.hosts[3].wipe()
    job.hosts[5].wipe()
    for r in (3, 5):
        rebuild_own(job.hosts[r].ec(), STEP, job.spec())
        assert_rebuilt(job, r)


def test_windows_smaller_than_a_stripe_and_larger(job_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ec_remote, "WINDOW_BYTES", 1000)  # every stripe is its own transfer, cut across files
    job = job_factory(3, 1)
    job.encode_all()
    job.hosts[2].wipe()
    rebuild_own(job.hosts[2].ec(stripe_bytes=64 << 10), STEP, job.spec())
    assert_rebuilt(job, 2)


def _corrupt_parity_used_by(job: Job, rank: int) -> tuple[int, int, int]:
    """Flip one byte of a parity shard that rebuilding ``rank``'s first shard reads: (holder, rotation, index)."""
    lay = job.spec().layout
    r = lay.data_rotation(rank, 0)
    holder = lay.holders(r)[lay.k]
    path = job.hosts[holder].parity.parity_dir(STEP, job.spec().digest()) / shard_name(r, 0)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x20
    path.write_bytes(bytes(data))
    return holder, r, 0


def test_corrupt_parity_is_passed_over_when_enough_fragments_remain(job_factory, caplog) -> None:
    job = job_factory(4, 2)
    job.encode_all()
    _corrupt_parity_used_by(job, 0)
    job.hosts[0].wipe()
    with caplog.at_level(logging.WARNING, logger="replicator.erasure"):
        rebuild_own(job.hosts[0].ec(), STEP, job.spec())
    assert_rebuilt(job, 0)
    assert any("crc32c" in r.getMessage() and "expected" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("data_port", [True, False], ids=["data-port", "grpc-stream"])
def test_corrupt_parity_is_dropped_by_its_holder_and_computed_again(job_factory, caplog, data_port) -> None:
    """The holder checks parity against its record before serving it: bit rot is answered DATA_LOSS (the
    rebuild passes over it, the link stays usable) and the holder drops that parity, so it no longer reports
    it and the coordinator's next ParityTask computes it again; the rebuild is bit-exact meanwhile."""
    job = job_factory(4, 2, data_port=data_port)
    job.encode_all()
    holder, _, _ = _corrupt_parity_used_by(job, 0)
    digest = job.spec().digest()
    job.hosts[0].wipe()
    with caplog.at_level(logging.WARNING):
        rebuild_own(job.hosts[0].ec(), STEP, job.spec())
    assert_rebuilt(job, 0)
    held = job.hosts[holder].parity
    assert held.record(STEP, digest) is None and not held.holdings(), "the corrupt parity is still held"
    assert any(f"bad parity of step {STEP}" in r.getMessage() and "dropping it" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert not any("failed earlier" in r.getMessage() for r in caplog.records)  # the holder's data still read
    old = job.hosts[0]
    job.hosts[0] = EcPeer(old.root, 0, old.nodes, data_port=data_port)  # the replaced host serves again
    rec = compute_parity(job.hosts[holder].ec(), STEP, job.spec())  # what the coordinator's ParityTask does
    assert rec.digest == digest and held.record(STEP, digest) is not None
    caplog.clear()
    job.hosts[0].wipe()
    with caplog.at_level(logging.WARNING):
        rebuild_own(job.hosts[0].ec(), STEP, job.spec())
    assert_rebuilt(job, 0)
    assert not any("corrupt" in r.getMessage() or "bad parity" in r.getMessage() for r in caplog.records)


def test_corrupt_parity_with_too_few_fragments_left_fails_and_commits_nothing(job_factory) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    _corrupt_parity_used_by(job, 1)
    job.hosts[1].wipe()
    with pytest.raises(NotEnoughFragmentsError, match="corrupt"):
        rebuild_own(job.hosts[1].ec(), STEP, job.spec())
    sd = layout.steps_dir(job.hosts[1].root)
    assert not sd.exists() or list(sd.iterdir()) == []


def test_more_than_m_lost_is_not_enough_fragments(job_factory) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    job.hosts[0].wipe()
    job.hosts[1].wipe()
    with pytest.raises(NotEnoughFragmentsError):
        rebuild_own(job.hosts[0].ec(), STEP, job.spec())


def test_a_stale_task_writes_nothing(job_factory) -> None:
    job = job_factory(3, 1)
    spec = job.spec()
    job.manifests[2] = job.hosts[2].save(STEP, [123_456])  # rank 2 saved the step again since
    for h in job.hosts:  # a member's data (another's, or its own) is not the group's
        with pytest.raises(StaleGroupError):
            compute_parity(h.ec(), STEP, spec)
        assert h.parity.holdings() == []
        assert not (h.root / "parity").exists()  # not even a temporary directory
    records = job.encode_all()  # the task for the new data works
    assert all(r.digest == job.spec().digest() != spec.digest() for r in records)


def test_a_crash_mid_encode_leaves_nothing_visible(job_factory, tmp_path: Path) -> None:
    job = job_factory(3, 1)
    spec = job.spec()
    victim = job.hosts[1]
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from replicator.erasure import remote
        from replicator.erasure.holder import ParityStore
        from replicator.erasure.host import EcHost, compute_parity
        from replicator.erasure.wire import CodeGroupSpec
        root = Path({str(victim.root)!r})
        real = remote.RemoteStream.read
        def read(self, offset, length):  # on a reader thread, a stripe or two ahead of the parity written
            if any(any(t.iterdir()) for t in (root / "parity" / "{STEP}").glob(".tmp-*")):
                os.kill(os.getpid(), signal.SIGKILL)  # parity files are open in the temporary directory
            return real(self, offset, length)
        remote.RemoteStream.read = read
        spec = CodeGroupSpec({spec.k}, {spec.m}, {spec.members!r}, {spec.content_hashes!r}, {spec.addresses!r})
        compute_parity(EcHost({victim.rank}, root, ParityStore(root, {victim.rank}), token={TOKEN!r},
                              stripe_bytes=64 << 10, ahead_stripes=2), {STEP}, spec)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    step_dir = victim.root / "parity" / str(STEP)
    left = [p.name for p in step_dir.iterdir()]
    assert len(left) == 1 and left[0].startswith(".tmp-"), left  # written, never published
    assert any((step_dir / left[0]).iterdir())
    assert victim.parity.holdings() == []
    assert ParityStore(victim.root, victim.rank).holdings() == []  # a restart drops the leftovers
    assert not step_dir.exists()
    compute_parity(victim.ec(), STEP, spec)  # and the task then succeeds
    assert len(victim.parity.holdings()) == 1


def test_parity_is_deleted_by_step_and_digest(job_factory) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    h = job.hosts[0]
    digest = job.spec().digest()
    assert not h.parity.delete(STEP, "ec1-" + "0" * 32)  # another group's digest: kept
    assert len(h.parity.holdings()) == 1
    assert h.parity.delete(STEP, digest)
    assert h.parity.holdings() == [] and not (h.root / "parity" / str(STEP)).exists()


def test_the_peer_service_checks_every_parity_request(job_factory, tmp_path: Path) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    h = job.hosts[0]
    digest = job.spec().digest()
    ch = rpc.make_channel(h.address, token=TOKEN)
    stub = peer_pb2_grpc.PeerStub(ch)

    def ask(**kw) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
        req = peer_pb2.ReadFilesRequest(**{"rank": 0, "step": STEP, "parity": digest, **kw})
        try:
            list(stub.ReadFiles(req, timeout=10))
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    try:
        assert ask(files=[RECORD_NAME]) == grpc.StatusCode.OK
        assert ask(rank=1) == grpc.StatusCode.INVALID_ARGUMENT  # parity is read from its own holder
        assert ask(parity="../../steps") == grpc.StatusCode.INVALID_ARGUMENT
        assert ask(parity="ec1-" + "0" * 32) == grpc.StatusCode.NOT_FOUND
        assert ask(files=["../../../steps/5/MANIFEST.json"]) == grpc.StatusCode.INVALID_ARGUMENT
        assert ask(files=["r0-p0"]) == grpc.StatusCode.NOT_FOUND  # a shard this host does not hold
        # a symlink escaping the parity directory is refused, not followed
        d = h.parity.parity_dir(STEP, digest)
        (r, j), = job.spec().layout.parity_held(0)
        outside = tmp_path / "outside"
        outside.write_bytes(bytes((d / shard_name(r, j)).stat().st_size))
        (d / shard_name(r, j)).unlink()
        (d / shard_name(r, j)).symlink_to(outside)
        assert ask(files=[shard_name(r, j)]) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        ch.close()


def test_a_corrupt_data_file_and_an_unreachable_member_are_passed_over(job_factory, caplog) -> None:
    """4+2, host 0 wiped. First host 1's data has a flipped byte on disk in a stripe that host 0's rebuild reads:
    detected by its crc32c and passed over. Then host 2 is down although the coordinator still names its
    address: its data and its parity record count as unreadable (asked once, not per stripe)."""
    job = job_factory(4, 2)
    records = job.encode_all()
    lay = job.spec().layout
    # host 1's shard 1 is a data fragment of rotation 0, which rebuilding host 0's shard 0 reads
    assert lay.data_rotation(1, 1) == lay.data_rotation(0, 0) == 0
    stream = StepStream.open(job.hosts[1].step_dir(STEP))
    ((part, at, _),) = stream.ranges(records[0].manifest.shard_bytes + 10, 1)
    bad = job.hosts[1].step_dir(STEP) / stream.parts[part].name
    good = bad.read_bytes()
    data = bytearray(good)
    data[at] ^= 0x01
    bad.write_bytes(bytes(data))
    job.hosts[0].wipe()
    with caplog.at_level(logging.WARNING, logger="replicator.erasure"):
        rebuild_own(job.hosts[0].ec(), STEP, job.spec())
    assert_rebuilt(job, 0)
    assert any("(1, 0, 0, 1)" in r.getMessage() and "expected" in r.getMessage() for r in caplog.records)
    bad.write_bytes(good)
    caplog.clear()
    spec = job.spec()
    job.hosts[0].wipe()
    job.hosts[2].stop()  # down, its address still in the group the coordinator sent
    spec = spec.__class__(spec.k, spec.m, spec.members, spec.content_hashes, ("",) + spec.addresses[1:])
    with caplog.at_level(logging.WARNING, logger="replicator.erasure"):
        rebuild_own(job.hosts[0].ec(), STEP, spec)
    assert_rebuilt(job, 0)
    assert sum("rank 2" in r.getMessage() for r in caplog.records) == 2  # its parity record, its data: once each
