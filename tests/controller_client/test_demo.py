"""`mtc demo` (what `make demo` runs) passes end to end: replicators on loopback, peer and bucket restores."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mtc_demo_passes(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "controller_client.cli", "demo", "--workdir", str(tmp_path / "d")],
                       capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for line in ("restore: own RAM disk", "restore: host 3 from its peer", "restore: all hosts from bucket"):
        assert line in out
    assert out.count("OK  ") == 4 and "FAIL" not in out
