"""`mtc export`'s pure parts: the chunk shape, the pieces of each saved shard, the tree Orbax stores."""

from __future__ import annotations

import itertools
import math

import pytest

from controller_client.export import build_tree, parse_path, plan
from controller_client.export.leaves import DICT_KEY, SEQUENCE_KEY, tree_leaves


def test_leaf_paths_become_a_tree() -> None:
    assert parse_path("['opt'][0].mu") == ["opt", 0, "mu"]
    tree = build_tree({"['a'][0]": 1, "['a'][1]": 2, "['b']['c']": 3})
    assert tree == {"a": [1, 2], "b": {"c": 3}}
    with pytest.raises(ValueError):
        parse_path("weird")


def test_leaves_carry_orbax_names_and_key_kinds() -> None:
    leaves = tree_leaves({"['opt'][0]['mu']": ((3,), "float32"), "['w']": ((2, 2), "bfloat16")},
                         {"['step']": 5, "['flag']": True, "['lr']": 0.5, "['none']": None, "[7]['x']": 1})
    by = {leaf.path: leaf for leaf in leaves}
    mu = by["['opt'][0]['mu']"]
    assert (mu.name, mu.keys, mu.key_types, mu.kind) == ("opt.0.mu", ("opt", "0", "mu"),
                                                         (DICT_KEY, SEQUENCE_KEY, DICT_KEY), "array")
    assert by["['step']"].dtype == "int64" and by["['flag']"].dtype == "bool" and by["['lr']"].dtype == "float64"
    assert by["['none']"].kind == "none"
    assert by["[7]['x']"].key_types == (DICT_KEY, DICT_KEY)  # an int key that is no list index: a dict key "7"
    with pytest.raises(ValueError, match="str value"):
        tree_leaves({}, {"['name']": "run-1"})
    with pytest.raises(ValueError, match="twice"):
        tree_leaves({"['w']": ((1,), "float32")}, {"['w']": 1})


def test_grid_shape_accepts_a_regular_grid_with_a_ragged_end_only() -> None:
    assert plan.grid_shape((10, 4), [((0, 3), (0, 4)), ((3, 6), (0, 4)), ((6, 9), (0, 4)), ((9, 10), (0, 4))]) == (3, 4)
    assert plan.grid_shape((10,), [((0, 10),)]) == (10,)
    assert plan.grid_shape((), [()]) == ()
    assert plan.grid_shape((10,), [((0, 3),), ((3, 10),)]) is None  # irregular
    assert plan.grid_shape((10,), [((0, 5),)]) is None  # half of it missing
    assert plan.grid_shape((10,), [((0, 4),), ((4, 8),), ((8, 10),), ((6, 10),)]) is None  # overlapping


@pytest.mark.parametrize(("shard", "itemsize", "limit", "want"), [
    ((64, 48), 4, 1 << 20, (64, 48)),  # fits whole
    ((64, 48), 4, 4096, (16, 48)),  # 21 rows fit; 16 divides 64 and is at least half of 21
    ((334, 33), 4, 8192, (62, 33)),  # 62 rows fit; 334's divisors near it are 2 and 167: straddle instead
    ((4, 3, 1000), 4, 4000, (1, 1, 1000)),  # a row of dims 1.. (12000 B) is over: ones, then one row
    ((4, 3, 1000), 4, 1000, (1, 1, 250)),
    ((5,), 8, 8, (1,)),
    ((0, 7), 4, 8, (1, 1)),  # zero extents become 1; 1 divides 7 and is half of the 2 that fit
])
def test_chunk_shape(shard: tuple[int, ...], itemsize: int, limit: int, want: tuple[int, ...]) -> None:
    got = plan.chunk_shape(shard, itemsize, limit)
    assert got == want
    assert math.prod(got) * itemsize <= max(limit, itemsize)


@pytest.mark.parametrize(("global_shape", "grid", "limit"), [
    ((64, 48), (4, 2), 4096), ((1000, 33), (3, 1), 8192), ((4, 3, 1000), (2, 1, 1), 1000), ((10,), (4,), 8),
    ((7, 5, 3), (1, 1, 1), 1 << 20),
])
def test_pieces_cover_each_shard_front_to_back_within_a_chunk(global_shape: tuple[int, ...],
                                                             grid: tuple[int, ...], limit: int) -> None:
    sizes = [-(-n // g) for n, g in zip(global_shape, grid, strict=True)]
    shard_shape = tuple(sizes)
    chunks = plan.chunk_shape(shard_shape, 4, limit)
    seen = 0
    for cell in itertools.product(*(range(g) for g in grid)):
        shard = tuple((i * s, min(n, (i + 1) * s)) for i, s, n in zip(cell, sizes, global_shape, strict=True))
        ps = list(plan.pieces(shard, chunks, 4))
        assert ps[0].offset == 0
        for a, b in zip(ps, ps[1:], strict=False):
            assert b.offset == a.offset + a.length
        assert sum(p.length for p in ps) == 4 * math.prod(b - a for a, b in shard)
        assert all(p.length <= max(limit, 4) for p in ps)
        seen += sum(math.prod(p.shape) for p in ps)
    assert seen == math.prod(global_shape)


def test_pieces_refuse_a_chunk_shape_that_does_not_nest() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        list(plan.pieces(((0, 4), (0, 4)), (2, 2), 4))


def test_chunk_regions_tile_the_array() -> None:
    regions = list(plan.chunk_regions((5, 3), (2, 2)))
    assert regions[0] == ((0, 2), (0, 2)) and regions[-1] == ((4, 5), (2, 3))
    assert sum(math.prod(b - a for a, b in r) for r in regions) == 15
    assert list(plan.chunk_regions((), ())) == [()]
    assert list(plan.chunk_regions((0, 3), (1, 3))) == []
