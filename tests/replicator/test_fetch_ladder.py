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


def test_only_abandoned_saves_is_its_own_answer_and_a_newer_copy_wins() -> None:
    """A source holding only an older save of the step (a rolled-back job saved it again) is passed over;
    when every source is such, the caller learns that (and may wait for the coordinator), not "unavailable"."""
    from replicator.fetch import AbandonedSave

    def attempt(src: _Src) -> str:
        if src.fails:
            raise AbandonedSave(f"{src.where} holds generation 1")
        return src.where

    assert fetch_from([_Src("peer a", True), _Src("peer b", False)], attempt, what="x", missing="none") == "peer b"
    with pytest.raises(AbandonedSave, match="peer a holds generation 1; peer b: peer b holds"):
        fetch_from([_Src("peer a", True), _Src("peer b", True)], attempt, what="x", missing="none")
    with pytest.raises(Unavailable):  # one abandoned, one down: not only abandoned
        fetch_from([_Src("peer a", True), _Src("bucket", True)],
                   lambda s: attempt(s) if s.where == "peer a" else _attempt(s), what="x", missing="none")
