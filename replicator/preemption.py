"""A preemption notice that reaches the replicator before its own SIGTERM (``mtc preempt`` in a preStop hook).

In a worker Pod the replicator is a native sidecar: Kubernetes sends it SIGTERM only after the main
containers (``pathways-worker``, ``colocated-python-sidecar``, the trainer) have exited, which is too late
for the training loop to learn of the notice and save. The Pod's main containers therefore run
``mtc preempt`` as their preStop hook; it calls ``LocalControl.Preempt`` over the control socket, and this
module does what SIGTERM would, while the daemon keeps serving:

1. mark the host ``preempting`` (the next heartbeat, woken at once, tells the coordinator, which starts an
   emergency backup of the newest complete step and tells every host, hence ``reached_preemption()``);
2. wait up to ``save_window_seconds`` for a step newer than the one complete at the notice (the training
   loop's last save);
3. :meth:`Replicator.flush_on_preemption` for up to ``flush_seconds``: the newest complete step into the
   bucket, recorded in ``<local>/preemption.json``.

The later SIGTERM runs the same flush again (quick once the step is in the bucket) and stops the daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from mtc_rpc import control_pb2

log = logging.getLogger(__name__)

PREEMPTION_RECORD = "preemption.json"
# Written by `mtc preempt --on-restart skip` when the Pod is deleted because its Job is going away (a JobSet
# restart, a hot-swap): the daemon's SIGTERM then skips the emergency backup.
RESTART_RECORD = "restart.json"
_lock = threading.Lock()


def on_notice(daemon: Any, request: control_pb2.PreemptRequest) -> control_pb2.PreemptResponse:
    """Start handling a notice (once per daemon); returns at once."""
    with _lock:
        notice_step = int(daemon.newest_complete)
        if getattr(daemon, "_mtc_preempt_thread", None) is not None:
            return control_pb2.PreemptResponse(notice_step=notice_step, started=False)
        # A record of an earlier incarnation's flush must not be taken for this one's.
        (daemon.store.root / PREEMPTION_RECORD).unlink(missing_ok=True)
        daemon.preempting = daemon.preemption_noticed = True
        daemon.wake()
        window = max(0.0, float(request.save_window_seconds))
        flush = max(1.0, float(request.flush_seconds))
        t = threading.Thread(target=_handle, args=(daemon, notice_step, window, flush), name="mtc-preempt",
                             daemon=True)
        daemon._mtc_preempt_thread = t
    log.warning("preemption notice (preStop): newest complete step %d; waiting up to %.1fs for a newer save, "
                "then up to %.1fs for the bucket", notice_step, window, flush)
    t.start()
    return control_pb2.PreemptResponse(notice_step=notice_step, started=True)


def _handle(daemon: Any, notice_step: int, window: float, flush: float) -> None:
    deadline = time.monotonic() + window
    while time.monotonic() < deadline and daemon.newest_complete <= notice_step:
        daemon.wake()
        time.sleep(0.1)
    if daemon.newest_complete > notice_step:
        log.info("step %d saved after the notice: flushing it", daemon.newest_complete)
    try:
        daemon.flush_on_preemption(flush)
    except Exception:  # the SIGTERM path flushes again
        log.exception("preemption flush failed")


def restart_recorded(root: Path, since_wall: float) -> bool:
    """A restart record written since ``since_wall`` (``time.time()`` at this daemon's start)."""
    try:
        return (root / RESTART_RECORD).stat().st_mtime >= since_wall
    except FileNotFoundError:
        return False
