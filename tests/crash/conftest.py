"""Collects the crash-point matrix (point -> outcome) and prints it at the end of the run.

Each test's row travels on its report (``user_properties``), so the table is complete also when the
suite runs in several worker processes (pytest-xdist): the controller sees every report.
"""

from __future__ import annotations

import pytest

_MATRIX: dict[str, dict] = {}
_KEY = "crash_matrix_row"


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
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry = dict(_MATRIX.get(point, {}))
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfail (known defect)" if report.skipped else "XPASS(strict): FAILED"
        else:
            entry["outcome"] = {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[report.outcome]
        entry["seconds"] = round(report.duration, 1)
        report.user_properties.append((_KEY, (point, entry)))


def pytest_runtest_logreport(report):
    for key, value in getattr(report, "user_properties", ()):
        if key == _KEY:
            point, entry = value
            _MATRIX.setdefault(point, {}).update(entry)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = {p: e for p, e in _MATRIX.items() if "outcome" in e}
    if not rows:
        return
    tr = terminalreporter
    tr.section("crash-point matrix (point -> outcome)")
    for point, e in sorted(rows.items()):
        line = f"{point:32s} {e.get('group', '?'):8s} {e.get('outcome', 'not run'):22s} {e.get('seconds', 0):5.1f}s"
        if e.get("xfail"):
            line += f"  [{e['xfail'][:90]}]"
        tr.write_line(line)
    ok = sum(1 for e in rows.values() if e.get("outcome") == "ok")
    tr.write_line(f"{len(rows)} points: {ok} ok, "
                  f"{sum(1 for e in rows.values() if str(e.get('outcome', '')).startswith('xfail'))} known defects")
