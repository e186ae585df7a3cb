"""Orbax mode's SIGTERM: a notice flushes the newest complete step; a JobSet restart recorded by the preStop
hook (``mtc preempt --on-restart skip``) since the daemon started does not, as in native mode."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

from replicator import preemption
from replicator.orbax.mode import flush_on_sigterm


def _mode(local: Path) -> tuple[SimpleNamespace, list[float]]:
    flushed: list[float] = []
    daemon = SimpleNamespace(preemption=SimpleNamespace(flush=lambda s: flushed.append(s) or "flushed"))
    return SimpleNamespace(daemon=daemon, local=local), flushed


def test_a_notice_flushes(tmp_path: Path) -> None:
    mode, flushed = _mode(tmp_path)
    assert flush_on_sigterm(mode, 20.0, time.time()) == "flushed"
    assert flushed == [20.0]


def test_a_restart_recorded_since_the_start_does_not_flush(tmp_path: Path) -> None:
    mode, flushed = _mode(tmp_path)
    started = time.time()
    preemption.record_restart(tmp_path)
    assert flush_on_sigterm(mode, 20.0, started) is None
    assert flushed == []


def test_a_restart_record_of_an_earlier_pod_is_no_restart_of_this_one(tmp_path: Path) -> None:
    mode, flushed = _mode(tmp_path)
    preemption.record_restart(tmp_path)
    old = time.time() - 3600
    os.utime(tmp_path / preemption.RESTART_RECORD, (old, old))  # the RAM disk outlived an earlier Pod
    assert flush_on_sigterm(mode, 20.0, time.time()) == "flushed"
    assert flushed == [20.0]
