"""sidecar/faults.py: a point kills only when armed, at the k-th hit, and says so first."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from sidecar import faults
from tests.crash import kit

SCRIPT = """
from sidecar import faults
for i in range(5):
    faults.point("save.before_commit")
    faults.point("save.after_commit")
    print(i, flush=True)
"""


def _run(point: str | None, fired_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], env=kit.fault_env(point, fired_file), cwd=str(kit.REPO),
                          capture_output=True, text=True, timeout=60)


def test_unarmed_and_other_points_do_nothing(tmp_path: Path) -> None:
    for point in (None, "backup.commit.after_rename", "no.such.point"):
        out = _run(point, tmp_path / "fired")
        assert out.returncode == 0 and out.stdout.split() == ["0", "1", "2", "3", "4"], out
    assert not (tmp_path / "fired").exists()
    faults.point("save.before_commit")  # unarmed in the test process: returns


def test_armed_point_sigkills_at_the_kth_hit_and_records_it(tmp_path: Path) -> None:
    out = _run("save.after_commit@3", tmp_path / "fired")
    assert out.returncode == -signal.SIGKILL and out.stdout.split() == ["0", "1"], out
    assert kit.fired(tmp_path / "fired") == ["save.after_commit"]
    out = _run("save.before_commit", tmp_path / "fired2")
    assert out.returncode == -signal.SIGKILL and out.stdout == "", out
