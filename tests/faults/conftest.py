"""The fault tests' summary: one JSON line at the end of the run (tests/kits/fault_history.py)."""

from __future__ import annotations

from tests.kits.fault_history import SUMMARY


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if SUMMARY.cases or SUMMARY.known_defects:
        for d in SUMMARY.details:
            kind = "known defect" if d.get("known_defect") else "fault case"
            took = d["seconds_to_progress"]
            terminalreporter.write_line(f"{kind} {d['case']}: "
                                        f"{'no progress' if took is None else f'{took:.1f}s to progress'}, "
                                        f"violations {d['violations']}")
        terminalreporter.write_line(SUMMARY.line())
