"""Collects the crash-point matrix (point -> outcome) and prints it at the end of the run."""

from __future__ import annotations

import pytest

_MATRIX: dict[str, dict] = {}


@pytest.fixture
def crash_matrix() -> dict[str, dict]:
    return _MATRIX


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    point = getattr(item, "callspec", None) and item.callspec.params.get("point")
    if not point or item.originalname != "test_crash_point":
        return
    entry = _MATRIX.setdefault(point, {})
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfail (known defect)" if report.skipped else "XPASS(strict): FAILED"
        else:
            entry["outcome"] = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[report.outcome]
        entry["seconds"] = round(report.duration, 1)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _MATRIX:
        return
    tr = terminalreporter
    tr.section("crash-point matrix (point -> outcome)")
    for point, e in _MATRIX.items():
        line = f"{point:32s} {e.get('group', '?'):8s} {e.get('outcome', 'not run'):22s} {e.get('seconds', 0):5.1f}s"
        if e.get("xfail"):
            line += f"  [{e['xfail'][:90]}]"
        tr.write_line(line)
    ok = sum(1 for e in _MATRIX.values() if e.get("outcome") == "ok")
    tr.write_line(f"{len(_MATRIX)} points: {ok} ok, "
                  f"{sum(1 for e in _MATRIX.values() if str(e.get('outcome', '')).startswith('xfail'))} known defects")
