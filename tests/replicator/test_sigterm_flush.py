"""Which SIGTERM of a real replicator process takes the emergency backup (replicator/preemption.py's
``sigterm_skips_flush``): with ``--sigterm-flush after-hook`` (``mtc manifests --restart in-place``) only one that
a preStop hook (``mtc preempt``'s ``prestop.json``) came before; a kubelet's in-place restart runs no hooks, keeps
the Pod and its RAM disk, and must not hold the restart up for a flush the kill then cuts short."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replicator import preemption
from tests.kits.jax_procs import REPO, free_port

START_TIMEOUT_SECONDS = 60.0
EXIT_TIMEOUT_SECONDS = 30.0


@pytest.mark.parametrize(("sigterm_flush", "hook", "flushes"), [
    ("after-hook", False, False),  # an in-place restart: no hook, no flush
    ("after-hook", True, True),  # a Pod deletion: the hook ran first
    ("always", False, True),  # the default: every SIGTERM flushes
])
def test_sigterm_flushes_only_as_configured(tmp_path: Path, sigterm_flush: str, hook: bool, flushes: bool) -> None:
    ram, err = tmp_path / "ram", tmp_path / "err"
    proc = subprocess.Popen([sys.executable, "-m", "replicator.main", "--local-dir", str(ram), "--rank", "0",
                             "--nodes", "1", "--job", "t", "--listen", f"127.0.0.1:{free_port()}",
                             "--backup-url", f"file://{tmp_path / 'bucket'}", "--heartbeat-seconds", "0.1",
                             "--preemption-grace-seconds", "25", "--sigterm-flush", sigterm_flush, "--log-level", "info"],
                            stderr=err.open("w"), stdout=subprocess.DEVNULL, cwd=str(REPO))  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not (ram / "replicator.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.05)
        if hook:
            preemption.record_prestop(ram)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=EXIT_TIMEOUT_SECONDS) == 0, err.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    log = err.read_text()
    assert ("preemption flush:" in log) == flushes, log[-2000:]
    assert (ram / preemption.PREEMPTION_RECORD).exists() == flushes
    if not flushes:
        assert "SIGTERM without a preStop hook" in log, log[-2000:]
