"""The fault runs' summary and prerequisites (tests/faults/conftest.py), checked on runs of small fault modules
inside this test (pytester), with the machine's prerequisites replaced: under CI=true a missing one fails the run
naming it, elsewhere the tests skip and the run says why; the JSON line is printed by every fault run and counts
skips, failures and errors; a run that is not a fault run (``make test``) neither prints it nor checks anything.
Part of ``make test`` (no ``faults`` marker: it starts no network, mount or cgroup of its own)."""

from __future__ import annotations

import json

import pytest

from tests.faults import conftest as faults_conftest

pytest_plugins = ["pytester"]

INI = "[pytest]\nmarkers =\n    faults: fault tests\n"
# A module like tests/faults/*.py: the faults marker, skipped when a prerequisite is missing.
MODULE = """
import pathlib

import pytest
from tests.faults import conftest

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(conftest.missing_prerequisites()), reason="prerequisites missing")]

def test_one():
    (pathlib.Path.cwd() / "ran").write_text("yes")  # pytester runs in its own directory
"""
MISSING = "fusermount3 (Debian fuse3)"


def _json_line(result: pytest.RunResult) -> dict:
    lines = [ln for ln in result.outlines if ln.startswith('{"cases": ')]
    assert len(lines) == 1, result.stdout.str()
    return json.loads(lines[0])


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, missing: list[str], ci: bool,
         *args: str) -> pytest.RunResult:
    monkeypatch.setattr(faults_conftest, "missing_prerequisites", lambda: list(missing))
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    pytester.makeini(INI)
    return pytester.runpytest_inprocess("-p", "tests.faults.conftest", "-p", "no:cacheprovider", *args)


def test_under_ci_a_missing_prerequisite_fails_the_run_naming_it(pytester: pytest.Pytester,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_fault=MODULE)
    result = _run(pytester, monkeypatch, ["/dev/fuse", MISSING], True, "-m", "faults")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines([f"*make test-faults cannot run here (CI=true): missing /dev/fuse; {MISSING}*"])
    line = _json_line(result)
    assert (line["errors"], line["skipped"], line["cases"]) == (1, 0, 0), line
    assert not (pytester.path / "ran").exists(), "a test ran although the run had failed"


def test_outside_ci_a_missing_prerequisite_skips_and_says_so(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_fault=MODULE)
    result = _run(pytester, monkeypatch, [MISSING], False, "-m", "faults")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines([f"fault tests skipped where they need: {MISSING} (under CI=true this fails the run)"])
    line = _json_line(result)
    assert (line["skipped"], line["errors"], line["failed"]) == (1, 0, 0), line


def test_the_json_line_counts_failures_and_errors_and_keeps_its_keys(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_fault=MODULE + """
@pytest.fixture
def broken():
    raise OSError("no such namespace")

def test_setup_error(broken):
    pass

def test_fails():
    assert False

@pytest.mark.xfail(strict=True, reason="a known defect")
def test_known_defect():
    assert False

def test_skips_itself():
    pytest.skip("not on this kernel")
""")
    result = _run(pytester, monkeypatch, [], True, "-m", "faults")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    line = _json_line(result)
    assert list(line)[:5] == ["cases", "passed", "violations", "worst_seconds_to_progress", "known_defects"]
    assert (line["failed"], line["errors"], line["skipped"]) == (1, 1, 1), line
    assert (pytester.path / "ran").exists(), "the fault test did not run with nothing missing"


def test_a_run_that_selects_no_fault_test_still_prints_the_line(pytester: pytest.Pytester,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_fault=MODULE)
    result = _run(pytester, monkeypatch, [MISSING], True, "-m", "faults", "-k", "no_such_test")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout.str()
    assert _json_line(result)["errors"] == 0


def test_a_run_without_fault_tests_prints_nothing_and_checks_nothing(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test` (`-m "... not faults"`) under CI=true on a machine without root passes."""
    pytester.makepyfile(test_fault=MODULE, test_plain="def test_plain():\n    pass\n")
    result = _run(pytester, monkeypatch, [MISSING], True, "-m", "not faults")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert not [ln for ln in result.outlines if ln.startswith('{"cases": ')], result.stdout.str()
    assert "cannot run here" not in result.stdout.str()
