"""Code groups from the job's topology: every host in one group, other slices first, deterministic; any M
losses in a group leave >= K fragments of every rotation."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicator.erasure import code_groups, group_of, max_fragments_in_a_slice


def test_one_slice_of_four_at_3_plus_1_is_one_group() -> None:
    (g,) = code_groups(1, 4, 3, 1)
    assert g.members == (0, 1, 2, 3)
    assert g.holders(0) == (0, 1, 2, 3) and g.holders(1) == (1, 2, 3, 0)


def test_members_alternate_slices() -> None:
    (g,) = code_groups(2, 3, 4, 2)
    assert g.members == (0, 3, 1, 4, 2, 5)
    groups = code_groups(6, 2, 4, 2)  # 12 hosts: two groups of 6, each one host per slice
    assert [g.members for g in groups] == [(0, 2, 4, 6, 8, 10), (1, 3, 5, 7, 9, 11)]
    assert all(max_fragments_in_a_slice(g, 2) == 1 for g in groups)  # a whole slice lost costs one fragment


def test_too_few_hosts_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs at least 6 hosts"):
        code_groups(1, 5, 4, 2)
    with pytest.raises(ValueError):
        code_groups(0, 4, 3, 1)
    with pytest.raises(ValueError, match="in no code group"):
        group_of(code_groups(1, 4, 3, 1), 4)


@settings(max_examples=200, deadline=None)
@given(slices=st.integers(1, 6), hosts=st.integers(1, 8), k=st.integers(1, 5), m=st.integers(1, 3),
       data=st.data())
def test_groups_cover_every_host_and_survive_any_m_losses(slices: int, hosts: int, k: int, m: int,
                                                          data: st.DataObject) -> None:
    nodes = slices * hosts
    if nodes < k + m:
        with pytest.raises(ValueError):
            code_groups(slices, hosts, k, m)
        return
    groups = code_groups(slices, hosts, k, m)
    assert groups == code_groups(slices, hosts, k, m)  # deterministic
    assert sorted(r for g in groups for r in g.members) == list(range(nodes))
    for g in groups:
        assert k + m <= g.n <= 2 * (k + m) - 1
        per_slice = [sum(1 for r in g.members if r // hosts == s) for s in range(slices)]
        assert max(per_slice) <= math.ceil(g.n / slices)  # spread over slices as evenly as possible
        if g.n <= slices:
            assert max_fragments_in_a_slice(g, hosts) == 1
        for rank in g.members:
            assert group_of(groups, rank) is g
        # any M losses (drawn, and every combination for small groups) leave >= K fragments of each rotation
        losses = [tuple(data.draw(st.lists(st.sampled_from(g.members), min_size=m, max_size=m, unique=True)))]
        if math.comb(g.n, m) <= 50:
            losses = list(itertools.combinations(g.members, m))
        for lost in losses:
            for r in range(g.n):
                holders = g.holders(r)
                assert len(set(holders)) == k + m
                assert sum(1 for h in holders if h not in lost) >= k
