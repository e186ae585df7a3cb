"""Coordinator client helpers: candidate parsing and the jittered backoff of failed calls."""

import pytest

from replicator.coordinator.client import parse_addresses
from replicator.net.retry import backoff_seconds


def test_candidates_parse_in_order_with_or_without_ranks():
    assert parse_addresses("h0:1,h2:1") == ["h0:1", "h2:1"]
    assert parse_addresses("0=h0:1, 2=h2:1") == ["h0:1", "h2:1"]
    assert parse_addresses(["a:1"]) == ["a:1"]
    with pytest.raises(ValueError):
        parse_addresses(" , ")


def test_backoff_grows_is_capped_and_jittered():
    for failures, factor in [(1, 1), (2, 2), (3, 4), (4, 8), (10, 8)]:
        xs = [backoff_seconds(failures, 2.0) for _ in range(200)]
        assert all(0.5 * 2.0 * factor <= x <= 1.5 * 2.0 * factor for x in xs)
        assert len(set(xs)) > 100  # jittered: callers that failed together do not retry together
