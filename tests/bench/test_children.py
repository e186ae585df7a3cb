"""bench/children.py: a harness's children and scratch directories do not outlive it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench import children


def _gone(p: subprocess.Popen, timeout: float) -> bool:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


@pytest.mark.skipif(children.SETPRIV is None, reason="no setpriv (util-linux) here")
def test_a_bound_child_dies_with_the_thread_that_started_it() -> None:
    started: list[subprocess.Popen] = []
    code = "import time; time.sleep(120)"

    def start() -> None:
        bound = subprocess.Popen(children.bound_to_us([sys.executable, "-c", code]), start_new_session=True)
        started.append(bound)
        started.append(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))  # unbound
        # setpriv sets the signal after Popen returns, then executes python: a thread that ends before that
        # leaves no parent to die (make test saw it under load). The harnesses' main threads outlive that.
        deadline = time.monotonic() + 30
        while Path(f"/proc/{bound.pid}/exe").resolve().name == "setpriv" and time.monotonic() < deadline:
            time.sleep(0.01)

    t = threading.Thread(target=start)
    t.start()
    t.join(timeout=30)
    bound, unbound = started
    try:
        assert _gone(bound, 10), "the bound child outlived the thread that started it"
        assert bound.returncode == -9
        assert not _gone(unbound, 0.5), "the check bites: an unbound child lives on"
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_scratch_dirs_of_a_gone_harness_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(children, "SHM", tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"mtc-t-{dead.pid}-abc"
    live = tmp_path / f"mtc-t-{os.getpid()}-def"
    other = tmp_path / "mtc-t-x-9"
    for d in (stale, live, other):
        (d / "sub").mkdir(parents=True)
    made = children.scratch_dir("mtc-t-")
    assert made.parent == tmp_path and made.name.startswith(f"mtc-t-{os.getpid()}-") and made.is_dir()
    assert not stale.exists()
    assert live.exists() and other.exists()
