"""sidecar/faults.py: a point kills only when armed, at the k-th hit, and says so first."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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


def test_a_paused_point_records_itself_holds_then_goes_on(tmp_path: Path) -> None:
    env = dict(kit.fault_env("save.after_commit@2", tmp_path / "fired"), MTC_FAULT_PAUSE_SECONDS="0.5")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=str(kit.REPO), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["0", "1", "2", "3", "4"], out
    assert time.monotonic() - t0 >= 0.5
    assert kit.fired(tmp_path / "fired") == ["save.after_commit"]  # once: the 2nd hit only


def test_an_arm_file_gates_the_point_and_its_count(tmp_path: Path) -> None:
    arm = tmp_path / "armed"
    try:
        faults.arm("save.before_commit", 2, pause_seconds=0.01, fired_file=str(tmp_path / "fired"),
                   arm_file=str(arm))
        for _ in range(3):
            faults.point("save.before_commit")  # not counted: the file is absent
        assert kit.fired(tmp_path / "fired") == []
        arm.touch()
        faults.point("save.before_commit")
        assert kit.fired(tmp_path / "fired") == []
        faults.point("save.before_commit")  # the 2nd counted hit
        assert kit.fired(tmp_path / "fired") == ["save.before_commit"]
    finally:
        faults.arm(None)
