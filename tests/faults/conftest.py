"""The fault tests' summary: one JSON line at the end of the run (tests/kits/fault_history.py)."""

from __future__ import annotations

from tests.kits.fault_history import SUMMARY


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if SUMMARY.cases:
        for d in SUMMARY.details:
            terminalreporter.write_line(f"fault case {d['case']}: {d['seconds_to_progress']}s to progress, "
                                        f"violations {d['violations']}")
        terminalreporter.write_line(SUMMARY.line())
