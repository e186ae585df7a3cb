"""``--redundancy`` values: ``copies:N`` and ``ec:K+M`` parsed, bad specs refused with a clear error."""

from __future__ import annotations

import pytest

from replicator.erasure import Redundancy
from replicator.erasure.redundancy import MAX_FRAGMENTS


@pytest.mark.parametrize(("spec", "factor", "survives", "hosts"), [
    ("copies:0", 0.0, 0, 1),
    ("copies:1", 1.0, 1, 2),
    ("copies:3", 3.0, 3, 4),
    ("ec:3+1", 1 / 3, 1, 4),
    ("ec:4+2", 0.5, 2, 6),
    ("ec:2+1", 0.5, 1, 3),
    ("ec:1+1", 1.0, 1, 2),
    (f"ec:{MAX_FRAGMENTS - 1}+1", 1 / (MAX_FRAGMENTS - 1), 1, MAX_FRAGMENTS),
])
def test_parse(spec: str, factor: float, survives: int, hosts: int) -> None:
    r = Redundancy.parse(spec)
    assert str(r) == spec
    assert r.ram_factor == pytest.approx(factor)
    assert r.losses_survived == survives
    assert r.min_hosts == hosts
    assert r.is_ec == spec.startswith("ec:")
    assert Redundancy.parse(f"  {spec} ") == r


@pytest.mark.parametrize("spec", [
    "", "copies", "copies:", "copies:-1", "copies:1.5", "copies:x", "ec:", "ec:3", "ec:3+", "ec:+1", "ec:0+1",
    "ec:3+0", "ec:3+1+1", "ec:3-1", "EC:3+1", "ec: 3+1", "ec:3+1x", f"ec:{MAX_FRAGMENTS}+1", "ec:30+3",
    "copies:1,ec:3+1", "mirror:2", None, 3,
])
def test_bad_specs_are_refused_saying_what_is_accepted(spec: object) -> None:
    with pytest.raises(ValueError, match=r"copies:N|ec:K\+M|K \+ M|K >= 1|M >= 1"):
        Redundancy.parse(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {"mode": "ec", "k": 0, "m": 1}, {"mode": "ec", "k": 2, "m": 0}, {"mode": "ec", "k": 30, "m": 3},
    {"mode": "ec", "k": 2, "m": 1, "copies": 1}, {"mode": "copies", "copies": -1},
    {"mode": "copies", "copies": 1, "k": 2}, {"mode": "raid", "copies": 1}, {"mode": "ec", "k": True, "m": 1},
])
def test_bad_values_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Redundancy(**kwargs)
