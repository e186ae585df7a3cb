"""The fault tests' rig fixture (tests/kits/fault_rig.py), their summary (one JSON line at the end of every run
that selects them, tests/kits/fault_history.py), what they need of the machine, and their clean-up when the run is
stopped: SIGTERM (e.g. from ``timeout``) becomes KeyboardInterrupt, so pytest still tears the fixtures down
(daemons stopped by pid, namespaces deleted).

Nothing skips in silence: each module skips when root, a tool, FUSE or a memory controller is missing, and the
run says what is missing and counts the skips in its JSON line; under ``CI=true`` a missing prerequisite fails
the run instead, before any test runs. The run also fails when its JSON line counts errors."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.kits import cgroup, faultfs, faultnet
from tests.kits.fault_cluster import NODES
from tests.kits.fault_history import SUMMARY
from tests.kits.fault_rig import Rig

# The programs the fault tests run, and the Debian package of each (`make test-faults` installs them).
TOOLS = (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables"), ("fusermount3", "fuse3"))


def missing_prerequisites() -> list[str]:
    """What the fault tests need and this machine lacks, each named ([]: every fault test can run here)."""
    root = os.geteuid() == 0
    missing = [] if root else ["root (network namespaces, iptables, FUSE mounts, cgroups)"]
    missing += [f"{tool} (Debian {package})" for tool, package in TOOLS if shutil.which(tool) is None]
    if not os.path.exists("/dev/fuse"):
        missing.append("/dev/fuse")
    elif root and (why := faultfs.available()):  # mfusepy and libfuse3 (their checks need root)
        missing.append(why)
    if root and (why := cgroup.available()):
        missing.append(why)
    return missing


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


@dataclass
class Outcomes:
    """One run's tests as the JSON line counts them (a known defect's xfail is neither skipped nor failed)."""

    selected: int = 0  # fault tests selected
    skipped: int = 0
    failed: int = 0
    errors: int = 0  # collection, set-up and teardown errors, and a missing prerequisite under CI=true
    missing: list[str] = field(default_factory=list)


_OUTCOMES = pytest.StashKey[Outcomes]()


def _outcomes(config: pytest.Config) -> Outcomes:
    # Per run (config), not per module: a pytester run inside a run counts its own tests.
    return config.stash.setdefault(_OUTCOMES, Outcomes())


def _fault_run(config: pytest.Config) -> bool:
    """Whether this is a fault run: fault tests selected, or asked for with ``-m faults`` (and none matched)."""
    asked = re.search(r"(?<!not )\bfaults\b", config.getoption("markexpr", "") or "") is not None
    return _outcomes(config).selected > 0 or asked


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


@pytest.fixture(scope="session", autouse=True)
def _sigterm_tears_down() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


def _started_rig(tmp_path: Path, redundancy: str = "") -> Iterator[Rig]:
    faultnet.reap_stale()
    with faultnet.FaultNetwork(NODES) as net:
        r = Rig(net, tmp_path, savers=True, fetch_restores=True, redundancy=redundancy)
        try:
            r.start()
            yield r
        finally:
            r.trainer.stop()
            r.cluster.stop()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    """The rig started (first steps redundant); stopped by pid and its namespaces deleted afterwards. Each
    host's rank is saved from inside its namespace through the sidecar's writer, and each case's restore after
    the heal must fetch across the network (tests/kits/fault_rig.py)."""
    yield from _started_rig(tmp_path)


@pytest.fixture
def ec_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    """:func:`rig` with the daemons at ``--redundancy`` ``request.param`` (e.g. "ec:3+1"; parametrize
    indirectly): the first steps redundant means every code group holds all its parity."""
    yield from _started_rig(tmp_path, request.param)


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselected what they do
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    o = _outcomes(config)
    o.selected = sum(1 for i in items if i.get_closest_marker("faults") is not None)
    if not o.selected:
        return
    o.missing = missing_prerequisites()
    if o.missing and in_ci():
        o.errors += 1
        pytest.exit(f"make test-faults cannot run here (CI=true): missing {'; '.join(o.missing)}",
                    returncode=pytest.ExitCode.TESTS_FAILED)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
        collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report: pytest.CollectReport = yield
    o = _outcomes(collector.config)
    o.errors += report.failed
    o.skipped += report.skipped
    return report


@pytest.hookimpl(wrapper=True)  # outermost: sees the report after the skipping plugin marked an xfail
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    o = _outcomes(item.config)
    if not hasattr(report, "wasxfail"):
        if report.when == "call":
            o.failed += report.failed
        else:
            o.errors += report.failed
        o.skipped += report.skipped
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _outcomes(session.config).errors and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _fault_run(config) or config.option.collectonly:
        return
    o = _outcomes(config)
    if o.missing and not in_ci():
        terminalreporter.write_line(f"fault tests skipped where they need: {'; '.join(o.missing)} "
                                    "(under CI=true this fails the run)")
    for d in SUMMARY.details:
        kind = "known defect" if d.get("known_defect") else "fault case"
        took = d["seconds_to_progress"]
        terminalreporter.write_line(f"{kind} {d['case']}: "
                                    f"{'no progress' if took is None else f'{took:.1f}s to progress'}, "
                                    f"violations {d['violations']}")
    terminalreporter.write_line(SUMMARY.line(skipped=o.skipped, failed=o.failed, errors=o.errors))
