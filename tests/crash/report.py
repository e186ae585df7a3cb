"""Collects the crash-point matrix (point -> outcome) and the in-flight fault matrix (operation x event ->
outcome) and prints both at the end of the run.

The hooks are imported into tests/conftest.py: that conftest is loaded at start-up also by the process that
only coordinates pytest-xdist's workers (which collects nothing), so the tables are printed there.

Each test's row travels on its report (``user_properties``), so the table is complete also when the
suite runs in several worker processes (pytest-xdist): the controller sees every report.
"""

from __future__ import annotations

import pytest

_MATRIX: dict[str, dict] = {}
_KEY = "crash_matrix_row"
_INFLIGHT: dict[tuple[str, str], dict] = {}
_INFLIGHT_KEY = "inflight_matrix_cell"


@pytest.fixture
def crash_matrix() -> dict[str, dict]:
    return _MATRIX


@pytest.fixture
def inflight_matrix() -> dict[tuple[str, str], dict]:
    return _INFLIGHT


def _outcome(report) -> str:
    return {"passed": "ok", "failed": "FAILED", "skipped": "skipped"}[report.outcome]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if item.originalname in ("test_inflight", "test_inflight_ec") and (
            report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
        cell = (params["op"], params["event"])
        entry = dict(_INFLIGHT.get(cell, {}), outcome=_outcome(report), seconds=round(report.duration, 1))
        report.user_properties.append((_INFLIGHT_KEY, (cell, entry)))
        return
    point = params.get("point")
    if not point or item.originalname != "test_crash_point":
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry = dict(_MATRIX.get(point, {}))
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfail (known defect)" if report.skipped else "XPASS(strict): FAILED"
        else:
            entry["outcome"] = _outcome(report)
        entry["seconds"] = round(report.duration, 1)
        report.user_properties.append((_KEY, (point, entry)))


def pytest_runtest_logreport(report):
    for key, value in getattr(report, "user_properties", ()):
        if key == _KEY:
            point, entry = value
            _MATRIX.setdefault(point, {}).update(entry)
        elif key == _INFLIGHT_KEY:
            cell, entry = value
            _INFLIGHT.setdefault(tuple(cell), {}).update(entry)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _print_inflight(terminalreporter)
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


def _print_inflight(tr) -> None:
    cells = {c: e for c, e in _INFLIGHT.items() if "outcome" in e}
    if not cells:
        return
    ops = list(dict.fromkeys(op for op, _ in sorted(cells)))
    events = list(dict.fromkeys(ev for _, ev in cells))
    tr.section("in-flight fault matrix (operation x event -> outcome)")
    tr.write_line(f"{'':10s}" + "".join(f"{ev:>16s}" for ev in events))
    for op in ops:
        row = ""
        for ev in events:
            e = cells.get((op, ev))
            row += f"{(e['outcome'] + ' ' + format(e['seconds'], '.0f') + 's') if e else 'not run':>16s}"
        tr.write_line(f"{op:10s}{row}")
    notes = [f"  {op} x {ev}: {e['note']}" for (op, ev), e in sorted(cells.items()) if e.get("note")]
    for line in notes:
        tr.write_line(line)
    ok = sum(1 for e in cells.values() if e["outcome"] == "ok")
    tr.write_line(f"{len(cells)} cells: {ok} ok")
