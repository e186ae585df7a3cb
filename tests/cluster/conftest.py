"""Fixtures of the cluster tests (``make test-cluster``): one real control plane per session, and the JSON
line the run ends with: how many scenarios ran and passed, the control plane's versions and the lifecycle
seconds the scenarios measured (from the failure to the trainer's first step after it)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane, missing_programs

_RESULTS: dict[str, Any] = {"scenarios": 0, "passed": 0, "control_plane": {}, "lifecycle_seconds": {}}


def _unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces for the Pods)"
    missing = missing_programs()
    return f"control-plane programs not built: {', '.join(missing)} (make cluster-bin)" if missing else ""


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    why = _unavailable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"make test-cluster cannot run here: {why}", pytrace=False)
        pytest.skip(why)
    with ControlPlane(tmp_path_factory.mktemp("control-plane")) as cp:
        _RESULTS["control_plane"] = cp.versions()
        _RESULTS["control_plane_start_seconds"] = round(cp.started_seconds, 1)
        yield cp


@pytest.fixture
def lifecycle() -> dict[str, float]:
    """A scenario records ``{key: seconds}`` here (e.g. ``notice_to_first_step``) for the run's JSON line."""
    return _RESULTS["lifecycle_seconds"]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    if "scenario" not in report.keywords:
        return
    _RESULTS["scenarios"] += 1
    _RESULTS["passed"] += report.outcome == "passed"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not any(i for i in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
               if "tests/cluster" in str(getattr(i, "nodeid", ""))):
        return
    terminalreporter.write_line(json.dumps(_RESULTS, sort_keys=False))
    out = os.environ.get("MTC_CLUSTER_REPORT")
    if out:
        Path(out).write_text(json.dumps(_RESULTS) + "\n")
