"""`mtc demo` (what `make demo` runs) passes end to end: replicators on loopback, peer and bucket restores."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mtc_demo_passes(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "controller_client.cli", "demo", "--keep", "--workdir",
                        str(tmp_path / "d")], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    out = r.stdout
    # --keep leaves the job's replicators running for the operator's commands, and says how to stop them.
    pids = [int(p) for p in re.search(r"stop them with: kill ([\d ]+)", out).group(1).split()] if "kill" in out else []
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert len(pids) == 4
        coord = re.search(r"mtc status --coordinator (\S+)", out).group(1)
        st = subprocess.run([sys.executable, "-m", "controller_client.cli", "status", "-o", "json", "--coordinator",
                             coord], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=60)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["newest_complete_step"] == 20
        for line in ("restore: own RAM disk", "restore: host 3 from its peer", "restore: all hosts from bucket"):
            assert line in out
        assert out.count("OK  ") == 4 and "FAIL" not in out
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
