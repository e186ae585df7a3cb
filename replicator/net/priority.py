"""CPU priority of the daemon's bulk work, so that copies and uploads yield the CPU to training.

Measured on a 2-core box (``python -m bench.backup``): a synthetic training loop ran 1.2-1.4x slower while
a backup uploaded at normal priority or niceness 10, and 0.96-1.1x with the uploader idle-scheduled.
Only the threads that move bulk bytes are lowered; heartbeats and RPCs keep the normal priority, so a busy
host still answers its peers and the coordinator.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

MODES = ("idle", "low", "normal")


def lower_current_thread(mode: str) -> None:
    """``idle``: SCHED_IDLE (runs only on otherwise idle CPU time; Linux); ``low``: niceness 19 for this
    thread; ``normal``: unchanged. Falls back to ``low`` where SCHED_IDLE is unavailable."""
    if mode not in MODES:
        raise ValueError(f"bulk priority must be one of {MODES}, got {mode!r}")
    if mode == "normal":
        return
    if mode == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0 = the calling thread on Linux
            return
        except OSError as e:
            log.debug("SCHED_IDLE unavailable (%s); using niceness 19", e)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError) as e:
        log.debug("cannot lower the priority of bulk threads: %s", e)
