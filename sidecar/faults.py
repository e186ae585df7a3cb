"""Named crash points for the crash-point matrix: off unless ``MTC_FAULT_POINT`` names one.

Code marks each step of save, commit, notify, replicate, GC, backup and restore with a one-line
``faults.point("save.before_commit")``. A test starts a process with ``MTC_FAULT_POINT=<name>`` (optionally
``<name>@<k>``: fire at the k-th time the point is reached, default 1) and the process kills itself with
SIGKILL when it gets there: no ``finally``, no ``atexit``, no flush -- exactly what a preempted host does.
Before dying it appends ``<name> <pid>`` to ``MTC_FAULT_FIRED_FILE`` when that variable is set, so the test
knows the point was reached rather than the process dying for another reason.

With ``MTC_FAULT_PAUSE_SECONDS=<s>`` the armed point does not kill: it records itself the same way and
then holds the calling thread for ``s`` seconds, so that an operation stays in flight while a test replaces
a host around it (the in-flight fault matrix, tests/crash/test_inflight.py). With ``MTC_FAULT_ARM_FILE=<path>``
the point counts (and fires) only while that file exists, so a test arms running processes at the moment of
its choosing. :func:`arm` does the same for code running in the test's own process.

The variables are read once, at import: when unset, :func:`point` is one comparison of a module global.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV_POINT = "MTC_FAULT_POINT"
ENV_FIRED_FILE = "MTC_FAULT_FIRED_FILE"
ENV_PAUSE_SECONDS = "MTC_FAULT_PAUSE_SECONDS"
ENV_ARM_FILE = "MTC_FAULT_ARM_FILE"

# Every point placed in the code. tests/crash checks that each one is placed exactly once and exercised.
POINTS: tuple[str, ...] = (
    # sidecar save (writer, host)
    "save.after_host_copy",
    "save.after_tmp_dir",
    "save.mid_file",
    "save.after_files",
    "save.before_manifest",
    "save.after_manifest",
    "save.before_commit",
    "save.after_commit",
    "save.before_local_gc",
    "save.before_notify",
    "save.after_notify",
    # replicator: commit notification and heartbeat
    "notify.received",
    "heartbeat.after_response",
    # peer replication (fetching side, serving side)
    "copy.before_fetch",
    "peer.fetch.after_tmp_dir",
    "peer.fetch.mid_transfer",
    "peer.fetch.before_manifest",
    "peer.fetch.before_commit",
    "peer.fetch.after_commit",
    "peer.serve.mid_send",
    # garbage collection (replicator store, layout)
    "gc.before_delete",
    "gc.mid_delete",
    "gc.after_delete",
    # restore fetch (peer and bucket)
    "restore.peer.before_fetch",
    "restore.bucket.mid_download",
    "restore.bucket.before_commit",
    # backup upload and commit
    "backup.upload.mid_upload",
    "backup.upload.before_manifest",
    "backup.upload.after_manifest",
    "backup.commit.before_record",
    "backup.commit.after_record",
    "backup.commit.after_rename",
    "backup.retention.mid_delete",
    # erasure coding (replicator/erasure/host.py, rebuild.py): a parity task just before its commit, a rebuild
    # mid-stream
    "ec.parity.before_commit",
    "ec.rebuild.mid",
    # Orbax: ingesting a step Orbax committed, and the handshake
    "orbax.ingest.after_link",
    "orbax.ingest.before_commit",
    "orbax.after_ingest",
    "orbax.before_marker",
    "orbax.after_marker",
    "orbax.after_ack",
)


def _parse(value: str | None) -> tuple[str | None, int]:
    if not value:
        return None, 0
    name, _, count = value.partition("@")
    return name, int(count) if count else 1


_ARMED, _FIRE_AT = _parse(os.environ.get(ENV_POINT))
_FIRED_FILE = os.environ.get(ENV_FIRED_FILE, "")
_PAUSE_SECONDS = float(os.environ.get(ENV_PAUSE_SECONDS) or 0)
_ARM_FILE = os.environ.get(ENV_ARM_FILE, "")
_hits = 0
_lock = threading.Lock()


def arm(name: str | None, at: int = 1, pause_seconds: float = 0.0, fired_file: str = "",
        arm_file: str = "") -> None:
    """Arm ``name`` in this process (``None`` disarms): the in-process form of the environment variables."""
    global _ARMED, _FIRE_AT, _FIRED_FILE, _PAUSE_SECONDS, _ARM_FILE, _hits
    with _lock:
        _ARMED, _FIRE_AT, _FIRED_FILE, _PAUSE_SECONDS, _ARM_FILE, _hits = (
            name, at, fired_file, pause_seconds, arm_file, 0)


def point(name: str) -> None:
    """Crash here (SIGKILL) when ``MTC_FAULT_POINT`` names this point (or pause, see the module docstring);
    otherwise do nothing."""
    if _ARMED is None or name != _ARMED:
        return
    if _ARM_FILE and not os.path.exists(_ARM_FILE):
        return
    _fire(name)


def _fire(name: str) -> None:
    global _hits
    with _lock:
        _hits += 1
        if _hits != _FIRE_AT:
            return
        if _FIRED_FILE:
            fd = os.open(_FIRED_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, f"{name} {os.getpid()}\n".encode())
            finally:
                os.close(fd)
        pause = _PAUSE_SECONDS
        if not pause:
            os.kill(os.getpid(), signal.SIGKILL)
            os._exit(137)  # not reached: SIGKILL cannot be caught
    time.sleep(pause)  # outside the lock: other threads pass the point meanwhile
