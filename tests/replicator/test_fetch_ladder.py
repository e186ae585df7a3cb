"""The one fetch ladder (replicator/fetch.py ``fetch_from``): each source in turn, errors collected."""

from __future__ import annotations

import pytest

from replicator.fetch import fetch_from
from replicator.net.rpc import Unavailable


class _Src:
    def __init__(self, where: str, fails: bool):
        self.where, self.fails = where, fails


def _attempt(src: _Src) -> str:
    if src.fails:
        raise OSError(f"{src.where} is down")
    return src.where


def test_first_source_that_serves_answers() -> None:
    tried = []

    def attempt(src: _Src) -> str:
        tried.append(src.where)
        return _attempt(src)

    srcs = [_Src("peer a", True), _Src("bucket", False), _Src("peer c", False)]
    assert fetch_from(srcs, attempt, what="x", missing="none") == "bucket"
    assert tried == ["peer a", "bucket"]  # the next is not tried once one served


def test_no_source_is_not_found_and_all_failing_is_unavailable() -> None:
    with pytest.raises(FileNotFoundError, match="on no tier"):
        fetch_from([], _attempt, what="x", missing="on no tier")
    with pytest.raises(Unavailable, match="peer a: OSError: peer a is down; bucket: OSError: bucket is down"):
        fetch_from([_Src("peer a", True), _Src("bucket", True)], _attempt, what="x", missing="none")
