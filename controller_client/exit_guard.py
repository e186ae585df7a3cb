"""A multi-controller training process that is ending does not wait for peers that are gone.

At exit JAX shuts its distributed runtime down behind a barrier of every process (``jax.distributed``'s
``shutdown_timeout_seconds``, 300 s by default), and its preemption notifier catches SIGTERM for the whole
life of the process. So a trainer whose collective failed because a host was lost (gloo's "Connection closed
by peer" raised as a Python exception) waited at that barrier for the lost host, and the Pod's deletion did
not end it: it was SIGKILLed at the end of its grace period (40 s in the rendered JobSets; on a cluster where
the lost node's Pod is failed only after the taint manager's 300 s, the survivors' own exit 1 is what
restarts the job, and it came 300 s late). Seen on the real control plane (tests/cluster/test_in_place_restart.py):
a host lost cost 52-57 s to the first step after it in half the runs, 9 s in the others.

:func:`install` (the multi-controller ``CheckpointManager`` calls it) registers an exit hook that runs before
JAX's own (``atexit`` runs the newest first):

- SIGTERM gets its default action back: the process is ending, nothing is left for the notifier to save, and
  the kubelet's SIGTERM ends it at once instead of its SIGKILL a grace period later;
- a process ending on an uncaught exception gives the barrier :data:`FAILED_SHUTDOWN_SECONDS` and then exits 1
  without it: its job is failing anyway, and peers still training see it gone at once rather than after 300 s.

A process that exits normally (0, or 75 after a preemption notice) keeps JAX's barrier: its peers are ending too.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import types

FAILED_SHUTDOWN_SECONDS = 5.0  # a failing process's wait for the others at JAX's shutdown barrier

_installed = False
_failed = False  # the main thread ended on an uncaught exception (not SystemExit)


def install() -> None:
    """Register the exit hook and note uncaught exceptions (once per process; later calls do nothing)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def note_failure(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        global _failed
        _failed = True
        previous(kind, value, tb)

    sys.excepthook = note_failure
    atexit.register(_at_exit)


def _at_exit() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _failed and _distributed_running():
        _shutdown_within(FAILED_SHUTDOWN_SECONDS)


def _distributed_running() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _shutdown_within(seconds: float) -> None:
    """JAX's distributed shutdown, given ``seconds``; past them the process exits 1 without it."""
    import jax

    done = threading.Thread(target=jax.distributed.shutdown, name="mtc-distributed-shutdown", daemon=True)
    done.start()
    done.join(seconds)
    if done.is_alive():
        print(f"mtc: the distributed runtime's shutdown waited {seconds:.0f} s for the other processes after "
              f"this one failed (one may be gone); exiting 1 without it", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
