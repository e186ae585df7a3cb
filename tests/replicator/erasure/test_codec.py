"""One stripe through pyeclib (ISA-L): payload-only fragments, any M lost rebuilt bit-exact, too few refused."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.erasure import NotEnoughFragmentsError, StripeCodec

CODES = [(3, 1), (4, 2), (2, 1)]


@pytest.mark.parametrize(("k", "m"), CODES)
def test_pyeclib_headers_do_not_depend_on_the_data(k: int, m: int) -> None:
    """What lets us ship payloads only: a fragment's header is a function of (K, M, backend, length)."""
    from pyeclib.ec_iface import ECDriver

    d = ECDriver(k=k, m=m, ec_type="isa_l_rs_cauchy")
    for size in (1, 63, 64, 4096 + 5):
        data = os.urandom(k * size)
        a, b = d.encode(data), d.encode(bytes(k * size))
        hlen = len(a[0]) - size
        assert [f[:hlen] for f in a] == [f[:hlen] for f in b]
        assert b"".join(f[hlen:] for f in a[:k]) == data  # systematic: data fragments are the data


@pytest.mark.parametrize(("k", "m"), CODES)
def test_any_m_lost_fragments_are_rebuilt_bit_exact(k: int, m: int) -> None:
    codec = StripeCodec(k, m)
    size = 4096 + 64
    data = [os.urandom(size) for _ in range(k)]
    parity = codec.encode(data)
    assert len(parity) == m and all(len(p) == size for p in parity)
    frags = dict(enumerate(data + parity))
    for lost_count in range(1, m + 1):
        for lost in itertools.combinations(range(k + m), lost_count):
            have = {i: f for i, f in frags.items() if i not in lost}
            assert codec.rebuild(have, lost) == {i: frags[i] for i in lost}


@pytest.mark.parametrize(("k", "m"), CODES)
def test_more_than_m_lost_is_not_enough(k: int, m: int) -> None:
    codec = StripeCodec(k, m)
    data = [os.urandom(128) for _ in range(k)]
    frags = dict(enumerate(data + codec.encode(data)))
    lost = list(range(m + 1))
    with pytest.raises(NotEnoughFragmentsError, match=f"need {k}"):
        codec.rebuild({i: f for i, f in frags.items() if i not in lost}, lost)


def test_bad_input_is_refused() -> None:
    codec = StripeCodec(3, 1)
    with pytest.raises(ValueError, match="3 data chunks"):
        codec.encode([b"ab", b"cd"])
    with pytest.raises(ValueError, match="one length"):
        codec.encode([b"ab", b"cd", b"e"])
    with pytest.raises(ValueError, match="one length"):
        codec.encode([b"", b"", b""])
    with pytest.raises(ValueError, match="indexes"):
        codec.rebuild({0: b"a", 1: b"b", 2: b"c"}, [4])
    with pytest.raises(ValueError, match="one length"):
        codec.rebuild({0: b"a", 1: b"b", 2: b"cc"}, [3])
    with pytest.raises(ValueError):
        StripeCodec(0, 1)
    with pytest.raises(ValueError):
        StripeCodec(30, 3)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 6), m=st.integers(1, 3), size=st.integers(1, 300), seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_rebuild_from_any_k(k: int, m: int, size: int, seed: int, data: st.DataObject) -> None:
    import random

    rng = random.Random(seed)
    chunks = [rng.randbytes(size) for _ in range(k)]
    codec = StripeCodec(k, m)
    frags = dict(enumerate(chunks + codec.encode(chunks)))
    lost = data.draw(st.lists(st.integers(0, k + m - 1), min_size=1, max_size=m, unique=True))
    got = codec.rebuild({i: f for i, f in frags.items() if i not in lost}, lost)
    assert got == {i: frags[i] for i in lost}
