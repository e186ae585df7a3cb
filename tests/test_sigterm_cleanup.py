"""A run of the suite told to stop (SIGTERM) stops the processes its running test started (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_INNER = '''
import subprocess, sys, time
from pathlib import Path

def test_starts_a_child_in_its_own_session(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    Path({pid_file!r}).write_text(str(child.pid))
    try:
        time.sleep(120)
    finally:
        child.kill()
        child.wait(timeout=10)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_runs_the_running_tests_cleanup(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    inner = tmp_path / "test_inner.py"
    inner.write_text(_INNER.format(pid_file=str(pid_file)))
    # Our conftest loaded as a plugin into a run of the inner file (its rootdir has no conftest of its own).
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                            str(inner)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None, run.stdout.read().decode() if run.stdout else ""
            assert time.monotonic() < deadline, "the inner test never started its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the child outlived the run that SIGTERM stopped"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=10)
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
