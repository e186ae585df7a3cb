"""Spread rebuilds on real hosts (real Peer gRPC servers on loopback): the other parity holders decode a wiped
host's data and the wiped host receives each rebuilt byte about once (a plain rebuild pulls K fragments per
byte); bit-exact; any helper that refuses, is busy or sends bytes that do not verify makes the rebuild fall
back to decoding here; every RebuildFragments request is checked before anything is read."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import grpc
import pytest

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.erasure import rebuild as ec_rebuild
from replicator.erasure import spread
from replicator.erasure.rebuild import rebuild_own
from replicator.net import rpc
from tests.kits.ec_hosts import STEP, TOKEN, Job, assert_rebuilt


@pytest.fixture
def received(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Bytes each host's links of rebuild.py's tasks received (the rebuilding host's in rebuild_own; not its
    helpers', whose links are spread.py's)."""
    got: dict[int, int] = {}
    real = ec_rebuild.task_links

    @contextlib.contextmanager
    def counted(host):  # type: ignore[no-untyped-def]
        with real(host) as links:
            try:
                yield links
            finally:
                got[host.rank] = got.get(host.rank, 0) + links.bytes

    monkeypatch.setattr(ec_rebuild, "task_links", counted)
    return got


def _stream_bytes(job: Job, rank: int) -> int:
    return job.manifests[rank].total_bytes


@pytest.mark.parametrize("mode", ["spread", "pipelined"])
@pytest.mark.parametrize(("k", "m", "lost", "data_port"), [(3, 1, [0], True), (4, 2, [0], False),
                                                           (4, 2, [2, 5], True)],
                         ids=["3+1-tcp", "4+2-grpc-stream", "4+2-two-lost"])
def test_a_helped_rebuild_brings_each_byte_about_once_bit_exact(job_factory, received, caplog, k: int, m: int,
                                                                lost: list[int], data_port: bool, mode: str) -> None:
    """Spread (each other member decodes a share) or pipelined (chains of them, replicator.erasure.pipeline)."""
    job = job_factory(k, m, data_port=data_port)
    job.encode_all()
    for r in lost:
        job.hosts[r].wipe()
    spec = job.spec()
    with caplog.at_level(logging.INFO, logger="replicator.erasure"):
        for r in lost:
            assert rebuild_own(job.hosts[r].ec(pipeline=mode == "pipelined"), STEP, spec) == job.manifests[r]
            assert_rebuilt(job, r)
    msgs = [rec.getMessage() for rec in caplog.records]
    modes = [rec.rebuild_mode for rec in caplog.records if hasattr(rec, "rebuild_mode")]
    assert modes == [mode] * len(lost), msgs
    assert sum(f"rebuild mode {mode} over ranks" in s for s in msgs) == len(lost), msgs
    assert not any("failed" in s for s in msgs), msgs
    for r in lost:
        # its stream once, plus the parity records and manifests (small); a plain rebuild reads K times it
        assert received[r] < 1.2 * _stream_bytes(job, r) + 200_000, (received, _stream_bytes(job, r))


def test_without_spreading_the_rebuilding_host_reads_k_fragments_per_byte(job_factory, received) -> None:
    """The measurement above can fail: decoded here, the host reads up to K times its stream (less where the
    others' streams are shorter than its own: padding is not read)."""
    job = job_factory(3, 1)
    job.encode_all()
    job.hosts[1].wipe()
    rebuild_own(job.hosts[1].ec(spread=False), STEP, job.spec())
    assert_rebuilt(job, 1)
    assert received[1] > 2 * _stream_bytes(job, 1), (received, _stream_bytes(job, 1))


def test_a_helper_that_does_not_serve_rebuilds_means_decoding_here(job_factory, caplog) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    helper = job.hosts[2]
    helper.stop()
    job.hosts[2] = type(helper)(helper.root, 2, helper.nodes, rebuilds=False)  # an older replicator: UNIMPLEMENTED
    job.hosts[0].wipe()
    with caplog.at_level(logging.INFO, logger="replicator.erasure"):
        rebuild_own(job.hosts[0].ec(pipeline=True), STEP, job.spec())
    assert_rebuilt(job, 0)
    msgs = [rec.getMessage() for rec in caplog.records]
    for mode in ("pipelined", "spread"):  # the chain through it fails first, then the spread
        assert any(f"{mode} rebuild of rank 0 step 5 failed" in s and "UNIMPLEMENTED" in s for s in msgs), msgs
    assert any("rebuild mode here" in s for s in msgs), msgs


def test_a_helper_sending_bytes_that_do_not_verify_means_decoding_here(job_factory, caplog,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper whose memory flipped a bit after its own check: the rebuilding host's check catches it."""
    job = job_factory(4, 2)
    job.encode_all()
    real = spread.serve
    bad = job.hosts[3].rank

    def serve(host, request, **kw):  # type: ignore[no-untyped-def]
        for i, frag in enumerate(real(host, request, **kw)):
            if host.rank == bad and i == 1:
                frag = bytearray(frag)
                frag[7] ^= 1
            yield frag

    monkeypatch.setattr(spread, "serve", serve)
    job.hosts[0].wipe()
    with caplog.at_level(logging.INFO, logger="replicator.erasure"):
        rebuild_own(job.hosts[0].ec(pipeline=False), STEP, job.spec())
    assert_rebuilt(job, 0)
    msgs = [rec.getMessage() for rec in caplog.records]
    assert any("spread rebuild of rank 0 step 5 failed" in s and f"rebuilt by rank {bad}" in s for s in msgs), msgs


def _request(job: Job, **kw: Any) -> Any:
    spec = job.spec()
    req = peer_pb2.RebuildFragmentsRequest(step=kw.pop("step", STEP), rank=kw.pop("rank", 0),
                                           fragments=kw.pop("fragments", [peer_pb2.FragmentRef(rotation=0, stripe=0,
                                                                                               index=0)]),
                                           lost=kw.pop("lost", []))
    kw.pop("spec", spec).to_proto(req.group)
    assert not kw
    return req


def _call(address: str, req: Any, token: str | None = TOKEN) -> list[Any]:
    channel = rpc.make_channel(address, token=token)
    try:
        return list(peer_pb2_grpc.PeerStub(channel).RebuildFragments(req, timeout=30))
    finally:
        channel.close()


def test_rebuild_fragments_checks_every_request(job_factory) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    job.hosts[0].wipe()
    helper = job.hosts[1].address
    ok = _call(helper, _request(job))
    assert len(ok) == 1 and ok[0].file_index == 0 and len(ok[0].data) > 0
    spec = job.spec()
    other = type(spec)(spec.k, spec.m, spec.members, ("f" * 64,) + spec.content_hashes[1:], spec.addresses)
    bad = {
        "no parity of that group held here": (_request(job, spec=other), grpc.StatusCode.NOT_FOUND),
        "no parity of that step held here": (_request(job, step=STEP + 1), grpc.StatusCode.NOT_FOUND),
        "rank not a member": (_request(job, rank=9), grpc.StatusCode.INVALID_ARGUMENT),
        "its own rank": (_request(job, rank=1), grpc.StatusCode.INVALID_ARGUMENT),
        "no fragment": (_request(job, fragments=[]), grpc.StatusCode.INVALID_ARGUMENT),
        "rotation out of the group": (_request(job, fragments=[peer_pb2.FragmentRef(rotation=4, stripe=0, index=0)]),
                                      grpc.StatusCode.INVALID_ARGUMENT),
        "index out of the code": (_request(job, fragments=[peer_pb2.FragmentRef(rotation=0, stripe=0, index=4)]),
                                  grpc.StatusCode.INVALID_ARGUMENT),
        "stripe out of the step": (_request(job, fragments=[peer_pb2.FragmentRef(rotation=0, stripe=10**6,
                                                                                  index=0)]),
                                   grpc.StatusCode.INVALID_ARGUMENT),
        "lost rank not a member": (_request(job, lost=[7]), grpc.StatusCode.INVALID_ARGUMENT),
        "negative step": (_request(job, step=-1), grpc.StatusCode.INVALID_ARGUMENT),
    }
    for what, (req, code) in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            _call(helper, req)
        assert e.value.code() == code, (what, e.value.code(), e.value.details())
    with pytest.raises(grpc.RpcError) as e:
        _call(helper, _request(job), token=None)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_busy_helper_refuses_and_the_rebuild_decodes_here(job_factory, caplog,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_factory(3, 1, max_rebuilds=1)
    job.encode_all()
    job.hosts[0].wipe()
    real, release, started = spread.serve, threading.Event(), threading.Semaphore(0)
    held = [0]

    def serve(host, request, **kw):  # type: ignore[no-untyped-def]
        if held[0] < 2:  # the first two calls hold helpers 1 and 2's only slot each
            held[0] += 1
            started.release()
            assert release.wait(60)
        yield from real(host, request, **kw)

    monkeypatch.setattr(spread, "serve", serve)

    def hold(address: str) -> None:
        with contextlib.suppress(grpc.RpcError):
            _call(address, _request(job))

    holders = [threading.Thread(target=hold, args=(job.hosts[r].address,)) for r in (1, 2)]
    for t in holders:
        t.start()
    try:
        assert started.acquire(timeout=30) and started.acquire(timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            _call(job.hosts[1].address, _request(job))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with caplog.at_level(logging.INFO, logger="replicator.erasure"):
            rebuild_own(job.hosts[0].ec(pipeline=False), STEP, job.spec())
        assert_rebuilt(job, 0)
        msgs = [rec.getMessage() for rec in caplog.records]
        assert any("failed" in s and "RESOURCE_EXHAUSTED" in s for s in msgs), msgs
    finally:
        release.set()
        for t in holders:
            t.join(60)
