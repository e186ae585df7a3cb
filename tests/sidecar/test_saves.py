"""sidecar.saves: rank ranges and the one completeness/rollback rule (pure)."""

import pytest

from sidecar.saves import (
    RankRanges,
    StepSave,
    complete_steps,
    format_ranks,
    merge,
    parse_rank_span,
    rank_ranges,
    rolled_back,
)


def test_rank_ranges_compress_and_round_trip():
    r = RankRanges.of([5, 0, 1, 2, 7, 6, 9])
    assert r.ranges == ((0, 2), (5, 7), (9, 9))
    assert list(r) == [0, 1, 2, 5, 6, 7, 9] and len(r) == 7
    assert 6 in r and 3 not in r
    assert RankRanges.from_wire(r.to_wire()) == r
    assert RankRanges.every(10_000).ranges == ((0, 9999),)
    assert RankRanges.of([0, 1]).union(RankRanges.of([2, 5])) == RankRanges(((0, 2), (5, 5)))
    assert RankRanges.of([1, 2]).issubset(RankRanges.every(4))
    assert not RankRanges.of([1, 4]).issubset(RankRanges.every(4))
    with pytest.raises(ValueError):
        RankRanges(((0, 2), (3, 4)))  # adjacent: not canonical


def test_rank_ranges():
    assert rank_ranges([5, 0, 1, 2]) == ((0, 2), (5, 5))
    assert rank_ranges([]) == ()


def test_rank_ranges_as_people_read_and_type_them():
    assert format_ranks([5, 0, 1, 2, 2]) == "0-2,5"
    assert format_ranks([]) == ""
    assert format_ranks(range(10_000)) == "0-9999"
    assert parse_rank_span("3-7") == (3, 7)
    assert parse_rank_span("3-") == (3, -1)  # open end: to the last rank
    assert parse_rank_span("3") == (3, 3)
    for bad in ("", "-3", "a-b", "3-x", "3--4"):
        with pytest.raises(ValueError):
            parse_rank_span(bad)


def save(step, gen, savers, held):
    return StepSave(step, gen, RankRanges.of(savers), RankRanges.of(held))


def test_complete_when_every_saver_is_held_at_the_newest_generation():
    answers = [save(1, 10, [0, 1, 2], [0]), save(1, 10, [0, 1, 2], [1, 2]), save(2, 20, [0, 1], [0])]
    assert complete_steps(answers) == [1]
    # A newer save of step 1 (generation 30) held only by rank 0: the older copies no longer count.
    assert complete_steps([*answers, save(1, 30, [0, 1, 2], [0])]) == []
    assert merge(answers)[1].held == RankRanges.of([0, 1, 2])
    assert StepSave.from_wire(answers[0].to_wire()) == answers[0]


def test_rolled_back_step_is_not_complete():
    # Step 3 saved (gen 30), then the job restored step 2 and saved step 2 again later (gen 40).
    answers = [save(2, 40, [0], [0]), save(3, 30, [0], [0])]
    assert complete_steps(answers) == [2]
    assert rolled_back(3, 30, {2: 40, 3: 30}.items()) and not rolled_back(2, 40, {2: 40, 3: 30}.items())
