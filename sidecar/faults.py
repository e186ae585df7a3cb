"""Named crash points for the crash-point matrix: off unless ``MTC_FAULT_POINT`` names one.

Code marks each step of save, commit, notify, replicate, GC, backup and restore with a one-line
``faults.point("save.before_commit")``. A test starts a process with ``MTC_FAULT_POINT=<name>`` (optionally
``<name>@<k>``: fire at the k-th time the point is reached, default 1) and the process kills itself with
SIGKILL when it gets there: no ``finally``, no ``atexit``, no flush -- exactly what a preempted host does.
Before dying it appends ``<name> <pid>`` to ``MTC_FAULT_FIRED_FILE`` when that variable is set, so the test
knows the point was reached rather than the process dying for another reason.

The variables are read once, at import: when unset, :func:`point` is one comparison of a module global.
"""

from __future__ import annotations

import os
import signal
import threading

ENV_POINT = "MTC_FAULT_POINT"
ENV_FIRED_FILE = "MTC_FAULT_FIRED_FILE"

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
    # Orbax: ingesting a step Orbax committed, and the handshake
    "orbax.ingest.after_move",
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
_hits = 0
_lock = threading.Lock()


def point(name: str) -> None:
    """Crash here (SIGKILL) when ``MTC_FAULT_POINT`` names this point; otherwise do nothing."""
    if _ARMED is None or name != _ARMED:
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
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # not reached: SIGKILL cannot be caught
