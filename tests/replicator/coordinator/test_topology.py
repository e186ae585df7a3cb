"""Tests for replicator.coordinator.topology: validation, replicas, Orbax peer ranks and copy targets."""

import itertools

import pytest

from replicator.coordinator.topology import JobTopology

SHAPES = [(1, 1), (4, 1), (4, 2), (4, 4), (6, 3), (6, 2), (8, 2), (12, 3), (16, 4), (9, 9)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"nodes": 0}, "nodes: must be >= 1"),
        ({"nodes": -3}, "nodes: must be >= 1"),
        ({"nodes": 4, "data_parallelism": 0}, "data_parallelism: must be >= 1"),
        ({"nodes": 6, "data_parallelism": 4}, "not a multiple"),
        ({"nodes": 4, "replicas": -1}, "replicas: must be >= 0"),
        ({"nodes": 4.0}, "nodes: expected an integer"),
        ({"nodes": True}, "nodes: expected an integer"),
        ({"nodes": "4"}, "nodes: expected an integer"),
    ],
)
def test_invalid_topology_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JobTopology(**kwargs)


def test_two_slices_of_two():
    t = JobTopology(4, data_parallelism=2)
    assert t.hosts_per_slice == 2
    assert [t.slice_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [t.index_in_slice(r) for r in range(4)] == [0, 1, 0, 1]
    assert [t.replicas_of(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert [t.peer_ranks(r) for r in range(4)] == [[2], [3], [0], [1]]
    # Other slice first, then the own slice.
    assert t.copy_preference(0) == [2, 3, 1]
    assert t.copy_preference(3) == [1, 0, 2]
    assert [t.copy_targets(r) for r in range(4)] == [[2], [3], [0], [1]]


def test_one_slice_is_a_ring_without_peer_ranks():
    t = JobTopology(4, replicas=1)
    assert [t.peer_ranks(r) for r in range(4)] == [[], [], [], []]
    assert [t.replicas_of(r) for r in range(4)] == [[], [], [], []]
    assert [t.copy_targets(r) for r in range(4)] == [[1], [2], [3], [0]]
    t2 = JobTopology(4, replicas=2)
    assert [t2.copy_targets(r) for r in range(4)] == [[1, 2], [2, 3], [3, 0], [0, 1]]


def test_replicas_are_capped_at_nodes_minus_one_and_never_self():
    t = JobTopology(4, replicas=10)
    for r in range(4):
        assert sorted(t.copy_targets(r)) == sorted(set(range(4)) - {r})
    assert JobTopology(1, replicas=3).copy_targets(0) == []
    assert JobTopology(4, replicas=0).copy_targets(2) == []


def test_four_slices_of_one():
    t = JobTopology(4, data_parallelism=4)
    assert t.hosts_per_slice == 1
    assert t.replicas_of(0) == [1, 2, 3]
    assert t.replicas_of(2) == [0, 1, 3]
    assert [t.copy_targets(r) for r in range(4)] == [[1], [2], [3], [0]]


def test_peer_ranks_follow_orbax_formula():
    # Orbax: for i in range(num_slices): i * nodes_per_slice + my_in_slice_index, excluding itself.
    for nodes, d in SHAPES:
        t = JobTopology(nodes, d)
        h = nodes // d
        for r in range(nodes):
            expected = [i * h + r % h for i in range(d) if i * h + r % h != r]
            assert t.peer_ranks(r) == expected


@pytest.mark.parametrize("nodes, d", SHAPES)
def test_copy_preference_is_balanced_and_prefers_other_slices(nodes, d):
    t = JobTopology(nodes, d, replicas=nodes)
    prefs = {r: t.copy_preference(r) for r in range(nodes)}
    for r, p in prefs.items():
        assert sorted(p) == [x for x in range(nodes) if x != r]
        slices = [t.slice_of(x) != t.slice_of(r) for x in p]
        # All other-slice hosts come before every same-slice host.
        assert slices == sorted(slices, reverse=True)
    # Position k is a permutation of ranks: every host receives as many copies as it sends.
    for k in range(nodes - 1):
        assert sorted(prefs[r][k] for r in range(nodes)) == list(range(nodes))
    # With at least as many slices as replicas, the first copies land in distinct slices.
    for r in range(nodes):
        first = prefs[r][: d - 1]
        assert len({t.slice_of(x) for x in first}) == len(first)


def test_rank_checks():
    t = JobTopology(4, 2)
    for bad in (-1, 4, 1.0, True, None):
        with pytest.raises(ValueError):
            t.slice_of(bad)
    with pytest.raises(ValueError):
        t.rank_of(2, 0)
    with pytest.raises(ValueError):
        t.rank_of(0, 2)
    assert [t.rank_of(s, i) for s, i in itertools.product(range(2), range(2))] == [0, 1, 2, 3]
    assert t.ring_distance(3, 1) == 2
    assert t.to_dict() == {"nodes": 4, "data_parallelism": 2, "replicas": 1}


def test_topology_is_immutable_and_hashable():
    t = JobTopology(4, 2)
    with pytest.raises(AttributeError):
        t.nodes = 8
    assert {t: 1}[JobTopology(4, 2)] == 1
