"""A code group coded in rotations: any M members lost, every lost stream and parity shard rebuilt bit-exact;
a corrupt fragment detected and passed over; more losses than M refused."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.erasure import (
    GroupDecoder,
    GroupEncoder,
    GroupLayout,
    GroupManifest,
    NotEnoughFragmentsError,
    StripeCodec,
)

STRIPE = 256  # small stripes: many per shard, and a short last one


class Group:
    """Members' streams in memory, parity held in a dict keyed like a parity file: (holder, rotation, index)."""

    def __init__(self, k: int, m: int, lengths: list[int], seed: int = 0, members: tuple[int, ...] | None = None,
                 stripe_bytes: int = STRIPE):
        rng = random.Random(seed)
        self.layout = GroupLayout(k, m, members or tuple(range(10, 10 + len(lengths))))
        self.streams = {r: rng.randbytes(n) for r, n in zip(self.layout.members, lengths, strict=True)}
        self.codec = StripeCodec(k, m)
        enc = GroupEncoder(self.codec, self.layout, 7, lengths, [min(n, 5) for n in lengths], self.read_data,
                           stripe_bytes=stripe_bytes)
        self.parity: dict[tuple[int, int, int], bytearray] = {}
        for p in enc.stripes():
            buf = self.parity.setdefault((p.holder, p.rotation, p.index), bytearray())
            assert len(buf) == p.offset
            buf += p.data
        # what a holder keeps goes through JSON: the decoder works from the parsed copy
        self.manifest = GroupManifest.from_dict(json.loads(json.dumps(enc.manifest().to_dict())))
        assert self.manifest == enc.manifest()

    def read_data(self, rank: int, offset: int, length: int) -> bytes:
        return self.streams[rank][offset:offset + length]

    def read_parity(self, rank: int, rotation: int, index: int, offset: int, length: int) -> bytes:
        return bytes(self.parity[(rank, rotation, index)][offset:offset + length])

    def decoder(self, lost: tuple[int, ...] = (), read_data: Callable | None = None) -> GroupDecoder:
        return GroupDecoder(self.codec, self.manifest, read_data or self.read_data, self.read_parity, lost)

    def check_rebuilds(self, lost: tuple[int, ...]) -> None:
        dec = self.decoder(lost)
        for rank in lost:
            assert b"".join(dec.stream(rank)) == self.streams[rank]
            rebuilt: dict[tuple[int, int, int], bytearray] = {}
            for p in dec.parity(rank):
                rebuilt.setdefault((p.holder, p.rotation, p.index), bytearray()).extend(p.data)
            assert rebuilt == {key: v for key, v in self.parity.items() if key[0] == rank}
        assert dec.corrupt == [] and dec.unreadable == []


@pytest.mark.parametrize(("k", "m"), [(3, 1), (4, 2), (2, 1)])
@pytest.mark.parametrize("extra", [0, 2], ids=["n=K+M", "n=K+M+2"])
def test_any_m_members_lost_are_rebuilt_bit_exact(k: int, m: int, extra: int) -> None:
    n = k + m + extra
    lengths = [5000 + 37 * i for i in range(n)]
    lengths[1] = 5  # a step that is only its manifest
    g = Group(k, m, lengths, seed=k * 10 + m)
    assert len(g.parity) == n * m  # every member holds M parity shards
    for lost_count in range(1, m + 1):
        for lost in itertools.combinations(g.layout.members, lost_count):
            g.check_rebuilds(lost)


@pytest.mark.parametrize(("k", "m", "bound"), [(3, 1, 0.34), (4, 2, 0.5)])
def test_parity_costs_m_over_k_of_a_copy(k: int, m: int, bound: float) -> None:
    g = Group(k, m, [3 * 4096 * 8] * (k + m))
    assert g.manifest.ram_vs_copy <= bound
    assert sum(len(v) for v in g.parity.values()) == g.manifest.parity_bytes


def test_each_rotation_spans_k_plus_m_distinct_members() -> None:
    lay = GroupLayout(4, 2, tuple(range(8)))
    for r in range(lay.n):
        assert len(set(lay.holders(r))) == 6
    for rank in lay.members:  # each member gives K shards to K rotations and holds M parity shards
        assert sorted(lay.data_rotation(rank, j) for j in range(4)) == sorted({lay.data_rotation(rank, j) for j in range(4)})
        for r, j in lay.parity_held(rank):
            assert lay.holders(r)[4 + j] == rank


@pytest.mark.parametrize(("k", "m"), [(3, 1), (4, 2)])
def test_more_than_m_lost_is_refused(k: int, m: int) -> None:
    g = Group(k, m, [3000] * (k + m))
    lost = g.layout.members[: m + 1]
    with pytest.raises(NotEnoughFragmentsError, match=f"need {k}"):
        b"".join(g.decoder(lost).stream(lost[0]))


def test_a_corrupt_parity_fragment_is_detected_and_passed_over() -> None:
    g = Group(4, 2, [4000] * 6, seed=3)
    lost = g.layout.members[0]
    # corrupt one parity stripe that rebuilding member 0's shard 0 reads (rotation 0 holds parity at K, K+1)
    holder = g.layout.holders(0)[4]
    g.parity[(holder, 0, 0)][3] ^= 0x40
    # one member lost and one fragment corrupt: M = 2 covers both (data 1..3 and parity 1 rebuild it)
    dec = g.decoder((lost,))
    assert b"".join(dec.stream(lost)) == g.streams[lost]
    assert (holder, 0, 0, 4) in dec.corrupt


def test_a_corrupt_data_fragment_is_detected_and_too_few_left_is_an_error() -> None:
    g = Group(3, 1, [3000] * 4, seed=4)
    lost = g.layout.members[0]
    bad = g.layout.holders(0)[1]

    def flipped(rank: int, offset: int, length: int) -> bytes:
        data = bytearray(g.read_data(rank, offset, length))
        if rank == bad and data:
            data[0] ^= 1
        return bytes(data)

    dec = g.decoder((lost,), read_data=flipped)
    with pytest.raises(NotEnoughFragmentsError, match="corrupt"):
        b"".join(dec.stream(lost))
    assert any(c[0] == bad for c in dec.corrupt)


def test_an_unreadable_fragment_counts_as_lost() -> None:
    g = Group(4, 2, [2000] * 6, seed=5)
    lost = g.layout.members[0]
    gone = g.layout.holders(0)[1]

    def failing(rank: int, offset: int, length: int) -> bytes:
        if rank == gone:
            raise ConnectionResetError("peer went away")
        return g.read_data(rank, offset, length)

    dec = g.decoder((lost,), read_data=failing)
    assert b"".join(dec.stream(lost)) == g.streams[lost]
    assert any(u[0] == gone for u in dec.unreadable)


def test_manifest_is_validated() -> None:
    g = Group(2, 1, [500] * 3)
    d = g.manifest.to_dict()
    for key, value in [("format_version", 99), ("crc32c", d["crc32c"][:-1]), ("members", [10, 10, 11]),
                       ("stream_bytes", [500, 500]), ("k", 0), ("shard_bytes", 1), ("members", [10, 11, "12"]),
                       ("crc32c", [[[1.5] * 3] * len(d["crc32c"][0])] * 3), ("step", True),
                       ("manifest_bytes", [0, 5, 5])]:
        with pytest.raises(ValueError):
            GroupManifest.from_dict({**d, key: value})
    with pytest.raises(ValueError, match="malformed"):
        GroupManifest.from_dict({k: v for k, v in d.items() if k != "stripe_bytes"})
    with pytest.raises(ValueError, match="needs >= 3 hosts"):
        GroupLayout(2, 1, (1, 2))


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 5), m=st.integers(1, 3), extra=st.integers(0, 2), stripe=st.sampled_from([64, 100, 512]),
       data=st.data())
def test_any_loss_of_at_most_m_members_round_trips(k: int, m: int, extra: int, stripe: int,
                                                   data: st.DataObject) -> None:
    n = k + m + extra
    lengths = data.draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n))
    g = Group(k, m, lengths, seed=sum(lengths), stripe_bytes=stripe)
    lost = tuple(data.draw(st.lists(st.sampled_from(g.layout.members), min_size=1, max_size=m, unique=True)))
    g.check_rebuilds(lost)


def test_each_holder_encodes_its_own_rotations_and_their_manifests_merge() -> None:
    g = Group(4, 2, [3000 + 111 * i for i in range(6)], seed=9)
    lay = g.layout
    partial = {}
    for h in lay.members:  # per-holder encoding: only the rotations whose parity h holds, only h's stripes
        enc = GroupEncoder(g.codec, lay, 7, [len(g.streams[r]) for r in lay.members],
                           [min(len(g.streams[r]), 5) for r in lay.members], g.read_data, stripe_bytes=STRIPE)
        rotations = sorted(r for r, _ in lay.parity_held(h))
        mine: dict[tuple[int, int, int], bytearray] = {}
        for p in enc.stripes(rotations):
            if p.holder == h:
                mine.setdefault((p.holder, p.rotation, p.index), bytearray()).extend(p.data)
        assert mine == {key: v for key, v in g.parity.items() if key[0] == h}
        man = GroupManifest.from_dict(json.loads(json.dumps(enc.manifest(rotations).to_dict())))
        assert man.rotations == tuple(rotations)
        partial[h] = man
    first, *rest = partial.values()
    assert first.merged(rest) == g.manifest
    # without the rows of a rotation the decoder cannot verify its fragments: a clear error, not a guess
    lost = lay.members[0]
    needed = lay.data_rotation(lost, 0)
    holders_of_needed = set(lay.holders(needed)[lay.k:])
    some = [man for h, man in partial.items() if h not in holders_of_needed]
    dec = GroupDecoder(g.codec, some[0].merged(some[1:]), g.read_data, g.read_parity, (lost,))
    with pytest.raises(NotEnoughFragmentsError, match="no crc32c rows"):
        b"".join(dec.stream(lost))
    other = Group(4, 2, [3000] * 6, seed=10)
    with pytest.raises(ValueError, match="geometry"):
        first.merged([other.manifest])
    with pytest.raises(ValueError, match="covers no rotation"):
        GroupManifest.from_dict({**first.to_dict(), "crc32c": [[] for _ in range(6)]})
