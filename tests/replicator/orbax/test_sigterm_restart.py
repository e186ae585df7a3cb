"""Orbax mode's SIGTERM: a notice flushes the newest complete step; a JobSet restart recorded by the preStop
hook (``mtc preempt --on-restart skip``) since the daemon started does not, as in native mode."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

from replicator import preemption
from replicator.orbax.mode import flush_on_sigterm


def _mode(local: Path, sigterm_flush: str = "always") -> tuple[SimpleNamespace, list[float]]:
    flushed: list[float] = []
    daemon = SimpleNamespace(preemption=SimpleNamespace(flush=lambda s: flushed.append(s) or "flushed",
                                                        state=preemption.PreemptionState()))
    return SimpleNamespace(daemon=daemon, local=local, opts=SimpleNamespace(sigterm_flush=sigterm_flush)), flushed


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


def test_in_place_only_a_sigterm_after_a_hook_flushes(tmp_path: Path) -> None:
    """``--sigterm-flush after-hook`` (rendered with ``--restart in-place``): the kubelet's in-place restart runs
    no preStop hook and keeps the RAM disk; a deletion runs ``mtc preempt`` first, which records it."""
    mode, flushed = _mode(tmp_path, "after-hook")
    started = time.time() - 1
    assert flush_on_sigterm(mode, 20.0, started) is None and flushed == []
    preemption.record_prestop(tmp_path)
    assert flush_on_sigterm(mode, 20.0, started) == "flushed" and flushed == [20.0]
