"""The erasure-coding host tests' job of real hosts (tests/kits/ec_hosts.py), stopped after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits.ec_hosts import Job


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    made: list[Job] = []

    def make(k: int, m: int, **kw: Any) -> Job:
        j = Job(tmp_path / f"job{len(made)}", k, m, **kw)
        made.append(j)
        return j

    yield make
    for j in made:
        j.stop()
