"""Reading a code group's fragments ahead, each holder on its own thread: the same parity and the same
rebuilt bytes as reading them one after another; members read at once, each in order; a member that fails
while the others' reads are in flight is passed over; no reader thread outlives the encoder or decoder."""

from __future__ import annotations

import random
import threading
import time

import pytest

from replicator.erasure import GroupDecoder, GroupEncoder, GroupLayout, NotEnoughFragmentsError, StripeCodec
from replicator.erasure.ahead import HolderThreads, lookahead

STRIPE = 256
AHEAD = 3


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("ec-rebuild", "ec-encode"))]


class Members:
    """Members' streams in memory, read slowly; records who reads what and how many reads overlap."""

    def __init__(self, k: int, m: int, lengths: list[int], seed: int = 0, delay: float = 0.0):
        rng = random.Random(seed)
        self.layout = GroupLayout(k, m, tuple(range(20, 20 + len(lengths))))
        self.lengths = lengths
        self.streams = {r: rng.randbytes(n) for r, n in zip(self.layout.members, lengths, strict=True)}
        self.codec = StripeCodec(k, m)
        self.delay = delay
        self.fail: dict[int, int] = {}  # rank -> its reads after this many fail (ConnectionError)
        self.reads: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._busy = 0
        self.most_at_once = 0

    def read_data(self, rank: int, offset: int, length: int) -> bytes:
        with self._lock:
            self._busy += 1
            self.most_at_once = max(self.most_at_once, self._busy)
            done = self.reads.setdefault(rank, [])
            done.append(offset)
            failing = rank in self.fail and len(done) > self.fail[rank]
        try:
            time.sleep(self.delay)
            if failing:
                raise ConnectionError(f"rank {rank} went away")
            return self.streams[rank][offset:offset + length]
        finally:
            with self._lock:
                self._busy -= 1

    def encode(self, ahead: int) -> tuple[dict, object]:
        enc = GroupEncoder(self.codec, self.layout, 7, self.lengths, [5] * len(self.lengths), self.read_data,
                           stripe_bytes=STRIPE, ahead_stripes=ahead)
        parity: dict[tuple[int, int, int], bytearray] = {}
        for p in enc.stripes():
            parity.setdefault((p.holder, p.rotation, p.index), bytearray()).extend(p.data)
        return parity, enc.manifest()


def _decoder(g: Members, parity: dict, manifest: object, lost: tuple[int, ...], ahead: int) -> GroupDecoder:
    def read_parity(rank: int, rotation: int, index: int, offset: int, length: int) -> bytes:
        g.read_data(rank, -1, 0)  # counted (and slowed, and failed) like a data read of that member
        return bytes(parity[(rank, rotation, index)][offset:offset + length])

    return GroupDecoder(g.codec, manifest, g.read_data, read_parity, lost, ahead_stripes=ahead)


@pytest.mark.parametrize(("k", "m"), [(3, 1), (4, 2)])
def test_read_ahead_codes_and_rebuilds_the_same_bytes(k: int, m: int) -> None:
    g = Members(k, m, [4000 + 301 * i for i in range(k + m)], seed=k)
    plain = g.encode(0)
    assert g.encode(AHEAD) == plain
    parity, manifest = plain
    for lost in [(20,), tuple(range(20, 20 + m))]:
        dec = _decoder(g, parity, manifest, lost, AHEAD)
        for rank in lost:
            assert b"".join(dec.stream(rank)) == g.streams[rank]
            held = {}
            for p in dec.parity(rank):
                held.setdefault((p.holder, p.rotation, p.index), bytearray()).extend(p.data)
            assert held == {key: v for key, v in parity.items() if key[0] == rank}
        assert dec.corrupt == [] and dec.unreadable == []
    assert _reader_threads() == []


def test_members_are_read_at_once_each_in_order() -> None:
    g = Members(3, 1, [6000] * 4)
    parity, manifest = g.encode(0)
    g.delay, g.reads = 0.002, {}
    dec = _decoder(g, parity, manifest, (20,), AHEAD)
    assert b"".join(dec.stream(20)) == g.streams[20]
    assert g.most_at_once >= 2  # reads of different members overlapped
    for rank, offsets in g.reads.items():
        data = [o for o in offsets if o >= 0]
        # within a rotation a member gives one fragment index: its reads of it ascend
        by_shard: dict[int, list[int]] = {}
        for o in data:
            by_shard.setdefault(o // manifest.shard_bytes, []).append(o)
        assert all(v == sorted(v) for v in by_shard.values()), (rank, data)
    assert _reader_threads() == []


def test_a_member_failing_mid_rebuild_is_passed_over_and_no_thread_is_left() -> None:
    g = Members(3, 2, [9000] * 5, seed=3)  # 20 lost and 21 failing: K of ec:3+2 left
    parity, manifest = g.encode(0)
    g.delay, g.reads = 0.001, {}
    g.fail = {21: 4}  # rank 21 answers 4 reads, then fails while the others' reads are in flight
    dec = _decoder(g, parity, manifest, (20,), AHEAD)
    assert b"".join(dec.stream(20)) == g.streams[20]
    assert dec.unreadable and {w[0] for w in dec.unreadable} == {21}
    assert dec.corrupt == []
    assert _reader_threads() == []


def test_too_many_failing_is_an_error_and_no_thread_is_left() -> None:
    g = Members(3, 1, [9000] * 4, seed=4)
    parity, manifest = g.encode(0)
    g.delay, g.fail = 0.001, {21: 3}
    dec = _decoder(g, parity, manifest, (20,), AHEAD)
    with pytest.raises(NotEnoughFragmentsError):
        b"".join(dec.stream(20))
    assert _reader_threads() == []


def test_a_consumer_that_stops_early_leaves_no_thread() -> None:
    g = Members(3, 1, [9000] * 4, seed=5)
    parity, manifest = g.encode(0)
    g.delay = 0.002
    stream = _decoder(g, parity, manifest, (20,), AHEAD).stream(20)
    next(stream)
    assert _reader_threads() != []
    stream.close()
    assert _reader_threads() == []


def test_lookahead_starts_at_most_depth_items_ahead() -> None:
    started: list[int] = []
    seen = []
    for x in lookahead(range(10), lambda i: started.append(i) or i, 2):
        assert len(started) <= x + 3
        seen.append(x)
    assert seen == list(range(10)) and started == list(range(10))
    with HolderThreads("ec-rebuild") as threads:
        assert [threads.submit(h, pow, h, 2).result() for h in (1, 2, 1)] == [1, 4, 1]
    assert _reader_threads() == []
    with pytest.raises(RuntimeError):
        threads.submit(1, pow, 1, 2)
