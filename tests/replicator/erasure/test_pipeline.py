"""Pipelined rebuilds (repair pipelining) on real hosts: the terms c_i·f_i taken from pyeclib add up (XOR) to a
plain decode; a wiped host's data is rebuilt along chains of the others, bit-exact, receiving each rebuilt byte
about once; a chain that fails (bad bytes, a helper that does not serve) falls back to spread, then to decoding
here, and the mode that ran is logged; fewer than two other parity holders is said, never a silent "here"."""

from __future__ import annotations

import logging
import os
import random
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from mtc_rpc import peer_pb2
from replicator.erasure import pipeline
from replicator.erasure.codec import StripeCodec
from replicator.erasure.rebuild import _helped_modes, rebuild_own
from tests.kits.ec_hosts import STEP, assert_rebuilt
from tests.replicator.erasure.test_spread import _call, _request


@pytest.mark.parametrize(("k", "m"), [(3, 1), (4, 2)])
def test_terms_from_pyeclib_add_up_to_a_plain_decode(k: int, m: int) -> None:
    codec = StripeCodec(k, m)
    rng = random.Random(k * 10 + m)
    size = 4096 + 64
    data = [os.urandom(size) for _ in range(k)]
    frags = {i: bytes(c) for i, c in enumerate(data)} | {k + j: bytes(p) for j, p in enumerate(codec.encode(data))}
    for want in range(k + m):
        others = [i for i in range(k + m) if i != want]
        for survivors in {tuple(sorted(rng.sample(others, k))) for _ in range(4)} | {tuple(others[:k])}:
            tables = pipeline.term_tables(k, m, codec.backend, want, survivors)
            got = np.zeros(size, np.uint8)
            for i in survivors:
                got ^= tables[i][np.frombuffer(frags[i], np.uint8)]
            plain = codec.rebuild({i: frags[i] for i in survivors}, [want])[want]
            assert got.tobytes() == bytes(plain) == frags[want], (want, survivors)


def test_term_tables_refuse_what_is_not_k_other_fragments() -> None:
    for want, survivors in [(0, (0, 1, 2)), (3, (0, 1)), (4, (0, 1, 2)), (3, (0, 0, 1))]:
        with pytest.raises(ValueError):
            pipeline.term_tables(3, 1, "isa_l_rs_cauchy", want, survivors)


def test_chains_share_the_sending_out(job_factory) -> None:
    """No helper sends (is in the chains of) more than one step's worth: ec:4+2 has 5 helpers for 4 shards."""
    job = job_factory(4, 2)
    job.encode_all()
    man = job.hosts[1].ec().parity.record(STEP, job.spec().digest()).manifest
    full = man.merged([h.ec().parity.record(STEP, job.spec().digest()).manifest for h in job.hosts[2:]])
    lanes = [lane for run in pipeline.chain_runs(full, 0, [1, 2, 3, 4, 5], lanes=2) for lane in run]
    sent: dict[int, int] = {}
    for chain, items in lanes:
        assert len(chain) == 4 and 0 not in chain
        for h in chain:
            sent[h] = sent.get(h, 0) + len(items)
    assert max(sent.values()) <= sum(len(items) for _, items in lanes), sent
    assert len({chain[-1] for chain, _ in lanes}) > 2  # who sends to the rebuilding host moves


def test_a_chain_sending_bytes_that_do_not_verify_falls_back_to_spread(job_factory, caplog,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    real = pipeline._own_fragment

    def flipped(host, *args):  # type: ignore[no-untyped-def]
        data = bytearray(real(host, *args))
        if host.rank == 2:  # after its own check: a bit flipped in memory
            data[5] ^= 1
        return bytes(data)

    monkeypatch.setattr(pipeline, "_own_fragment", flipped)
    job.hosts[0].wipe()
    with caplog.at_level(logging.INFO, logger="replicator.erasure"):
        rebuild_own(job.hosts[0].ec(pipeline=True), STEP, job.spec())
    assert_rebuilt(job, 0)
    msgs = [rec.getMessage() for rec in caplog.records]
    assert any("pipelined rebuild of rank 0 step 5 failed" in s and "crc32c" in s for s in msgs), msgs
    assert [rec.rebuild_mode for rec in caplog.records if hasattr(rec, "rebuild_mode")] == ["spread"]


def test_fewer_than_two_other_parity_holders_is_said(caplog) -> None:
    host = SimpleNamespace(rank=0, spread=True, pipeline=True)
    with caplog.at_level(logging.WARNING, logger="replicator.erasure"):
        assert _helped_modes(host, STEP, SimpleNamespace(holders=(2,))) == []  # type: ignore[arg-type]
    assert any("1 other parity holder(s) answered" in r.getMessage() and "decoding it here" in r.getMessage()
               for r in caplog.records)
    two = SimpleNamespace(holders=(1, 2))
    assert [m for m, _ in _helped_modes(host, STEP, two)] == ["pipelined", "spread"]  # type: ignore[arg-type]


def test_chain_requests_are_checked(job_factory) -> None:
    job = job_factory(3, 1)
    job.encode_all()
    helper = job.hosts[1].address
    spec = job.spec()
    # rotation 0: fragment 0 on rank 0 (lost), 1..3 on ranks 1..3
    crcs = [0] * 3

    def req(chain: list[int], at: int, crc: list[int] = crcs):  # type: ignore[no-untyped-def]
        r = _request(job, fragments=[peer_pb2.FragmentRef(rotation=0, stripe=0, index=0)])
        r.chain.extend(chain)
        r.chain_at = at
        r.chain_crc32c.extend(crc)
        return r

    bad = {
        "chain not K long": req([2, 1], 1, [0, 0]),
        "lost rank in the chain": req([0, 2, 1], 2),
        "not this host's place": req([3, 2, 1], 1),
        "repeated member": req([1, 1, 2], 0),
        "crc count": req([3, 2, 1], 2, [0]),
    }
    for what, r in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            _call(helper, r)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.value.details())
    with pytest.raises(grpc.RpcError) as e:  # its own fragment does not match the crc32c sent: refused
        _call(helper, req([3, 2, 1], 2))
    assert e.value.code() != grpc.StatusCode.OK
    assert spec.k == 3
