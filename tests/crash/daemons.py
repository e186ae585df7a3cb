"""Crash-matrix kit for real ``mtc replicator`` daemons: start one with a point armed, save a step on every
host the sidecar's way (write, commit, notify), wait for an armed one to die."""

from __future__ import annotations

import subprocess
from pathlib import Path

from controller_client.demo.cluster import LocalCluster
from sidecar.notify import notify_step_committed
from tests.crash import kit


def start(cl: LocalCluster, rank: int, point: str | None, fired_file: Path) -> None:
    """Start ``rank``'s replicator with ``point`` (``name@k``) armed to kill it, or unarmed (None)."""
    cl.env = kit.fault_env(point, fired_file)
    try:
        cl.start(rank)
    finally:
        cl.env = kit.fault_env(None, None)


def save_all(cl: LocalCluster, step: int) -> None:
    """Every host commits its (rank, step) data (:func:`kit.save_step`) and tells its replicator."""
    for r in range(cl.nodes):
        kit.save_step(cl.ram(r), r, cl.nodes, step)
        notify_step_committed(cl.ram(r), step)


def died(cl: LocalCluster, rank: int, timeout: float = 30.0) -> int:
    """``rank``'s replicator's exit status once it exits within ``timeout`` (0 when it is still running)."""
    p = cl.procs[rank].proc
    assert p is not None
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return 0
