"""The fault tests' rig fixture (tests/kits/fault_rig.py), their summary (one JSON line at the end of the run,
tests/kits/fault_history.py), and their clean-up when the run is stopped: SIGTERM (e.g. from ``timeout``) becomes KeyboardInterrupt, so pytest
still tears the fixtures down (daemons stopped by pid, namespaces deleted)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import faultnet
from tests.kits.fault_cluster import NODES
from tests.kits.fault_history import SUMMARY
from tests.kits.fault_rig import Rig


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


@pytest.fixture(scope="session", autouse=True)
def _sigterm_tears_down() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """The rig started (first steps redundant); stopped by pid and its namespaces deleted afterwards."""
    faultnet.reap_stale()
    with faultnet.FaultNetwork(NODES) as net:
        r = Rig(net, tmp_path)
        try:
            r.start()
            yield r
        finally:
            r.trainer.stop()
            r.cluster.stop()


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if SUMMARY.cases or SUMMARY.known_defects:
        for d in SUMMARY.details:
            kind = "known defect" if d.get("known_defect") else "fault case"
            took = d["seconds_to_progress"]
            terminalreporter.write_line(f"{kind} {d['case']}: "
                                        f"{'no progress' if took is None else f'{took:.1f}s to progress'}, "
                                        f"violations {d['violations']}")
        terminalreporter.write_line(SUMMARY.line())
