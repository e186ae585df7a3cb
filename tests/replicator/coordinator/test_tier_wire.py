"""Tier <-> wire enum, and no tier/kind compared as a string literal in product code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtc_rpc import tier_pb2
from replicator.tier_wire import from_wire, holder_to_wire, tier_name, to_wire
from replicator.tiers import BUCKET_HOLDER, Tier

REPO = Path(__file__).resolve().parents[3]
_NAMES = "local|peer|replica|bucket|parity"
_LITERAL_COMPARISON = re.compile(
    rf'(\b(tier|kind)\w*\s*(==|!=|\bin\b)\s*[(\[{{]?\s*"({_NAMES})")|("({_NAMES})"\s*(==|!=)\s*\w*\.(tier|kind)\b)')


def test_every_tier_round_trips_and_keeps_its_name() -> None:
    for t in Tier:
        assert from_wire(to_wire(t)) is t and tier_name(to_wire(t)) == str(t)
    assert to_wire("bucket") == tier_pb2.TIER_BUCKET


@pytest.mark.parametrize("value", [tier_pb2.TIER_UNSPECIFIED, 99, -1])
def test_unspecified_or_unknown_is_refused(value: int) -> None:
    with pytest.raises(ValueError, match="no tier"):
        from_wire(value)


def test_no_tier_or_kind_string_literal_comparisons() -> None:
    hits = []
    for pkg in ("replicator", "controller_client", "sidecar"):
        for path in (REPO / pkg).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _LITERAL_COMPARISON.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []


def test_the_bucket_as_a_holder_is_minus_one_on_the_wire_only() -> None:
    assert holder_to_wire(BUCKET_HOLDER) == -1
    assert holder_to_wire(0) == 0 and holder_to_wire(7) == 7
