"""The history checker's rules that make a network case able to fail (issue #45, tests/kits/fault_history.py),
checked on made-up histories: a restore that fetched nothing across the network, a slow or lossy case whose
coordinator answered nothing or whose copies did not keep up, and the per-case bytes in the JSON line.
Part of ``make test`` (no ``faults`` marker: it starts nothing)."""

from __future__ import annotations

import json

from tests.kits.fault_history import Case, Summary, judge_cut_restore

FAULT_SECONDS = 18.0


def _saves() -> list[dict]:
    return [{"t": float(t), "step": t, "ok": True, "seconds": 0.1, "error": "", "notified": True}
            for t in range(int(FAULT_SECONDS) + 2)]


def _answers(newest_lag: int = 0) -> list[dict]:
    """The controller's client: an answer every 0.5 s, newest complete step ``newest_lag`` behind the trainer."""
    return [{"who": "client", "code": "OK", "t": t / 2, "newest": max(-1, int(t / 2) - 1 - newest_lag),
             "epoch": 1, "steps_epoch": 1, "lost": ""} for t in range(2 * int(FAULT_SECONDS))]


def _copies(owners: tuple[int, ...], lag: int = 0) -> list[dict]:
    return [{"t": float(t) + 0.5, "owner": o, "step": t - 1 - lag} for t in range(int(FAULT_SECONDS)) for o in owners]


def _slow_case(answers: list[dict], copies: list[dict], fetched: int | None = 65536) -> Case:
    return Case("slow", 0.0, FAULT_SECONDS, [answers], [], _saves(), 45.0, t_progress=FAULT_SECONDS + 1,
                restored={"step": int(FAULT_SECONDS), "t_end": FAULT_SECONDS + 3}, slow_only=True,
                keep_up_ranks=(0, 2), copies=copies, fetch_required=True, bytes_fetched=fetched)


def test_a_healthy_slow_case_passes() -> None:
    assert _slow_case(_answers(), _copies((0, 2))).check() == []


def test_a_coordinator_that_answers_nothing_fails_a_slow_case() -> None:
    v = _slow_case([], _copies((0, 2))).check()
    assert any("0 answers within the bounds" in x for x in v), v


def test_answers_outside_the_bounds_do_not_count() -> None:
    v = _slow_case(_answers(newest_lag=5), _copies((0, 2))).check()
    assert any("answers within the bounds" in x for x in v), v


def test_copies_that_fall_behind_or_are_never_read_fail_a_slow_case() -> None:
    behind = _slow_case(_answers(), _copies((0, 2), lag=4)).check()
    assert any("rank 0's newest peer copy" in x for x in behind), behind
    unread = _slow_case(_answers(), _copies((0,))).check()
    assert any("rank 2's copies sampled 0 times" in x for x in unread), unread


def test_a_restore_that_fetched_nothing_across_the_network_fails() -> None:
    for fetched in (0, None):
        v = _slow_case(_answers(), _copies((0, 2)), fetched=fetched).check()
        assert any("fetched" in x and "across the network" in x for x in v), (fetched, v)


def test_the_json_line_carries_the_bytes_fetched_per_case() -> None:
    s = Summary()
    s.add("a", [], 1.0, bytes_fetched=65536)
    s.add("b", [], 2.0)
    line = json.loads(s.line(skipped=0, failed=0, errors=0))
    assert line["bytes_fetched"] == {"a": 65536}, line


def test_a_cut_restore_completes_or_fails_clearly() -> None:
    assert judge_cut_restore({"step": 4, "seconds": 9.3}) == []
    assert judge_cut_restore({"error": "TimeoutError: step 4 not ready on ranks 3 within 60s"}) == []
    assert judge_cut_restore({}) != []
    assert judge_cut_restore({"error": "Traceback"}) != []
