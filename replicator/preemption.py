"""This host's preemption: its state, a notice ahead of SIGTERM, the flush, and the records of both.

A preemption notice reaches the replicator before its own SIGTERM (``mtc preempt`` in a preStop hook). In a
worker Pod the replicator is a native sidecar: Kubernetes sends it SIGTERM only after the main containers
(``pathways-worker``, ``colocated-python-sidecar``, the trainer) have exited, which is too late for the
training loop to learn of the notice and save. The Pod's main containers therefore run ``mtc preempt`` as
their preStop hook; it calls ``LocalControl.Preempt`` over the control socket, and :class:`Preemption` does
what SIGTERM would, while the daemon keeps serving:

1. mark the host ``preempting`` (the next heartbeat, woken at once, tells the coordinator, which starts an
   emergency backup of the newest complete step and tells every host, hence ``reached_preemption()``);
2. wait up to ``save_window_seconds`` for a step newer than the one complete at the notice (the training
   loop's last save);
3. :meth:`Preemption.flush` for up to ``flush_seconds``: the newest complete step into the bucket, recorded
   in ``<local>/preemption.json`` (:class:`PreemptionRecord`).

The later SIGTERM runs the same flush again (quick once the step is in the bucket) and stops the daemon.
This module is the one home of both records in the host's local directory: ``preemption.json`` (the
flush's outcome, which ``mtc preempt --wait`` waits for) and ``restart.json`` (``mtc preempt --on-restart
skip``: the Pod is deleted because its Job is going away, so the SIGTERM skips the emergency backup).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import grpc

from mtc_rpc import control_pb2
from mtc_rpc import coordinator_pb2 as cpb
from replicator.net import rpc

log = logging.getLogger(__name__)


class ShutdownLatch:
    """SIGTERM and SIGINT caught from the moment :meth:`install` runs.

    Installed before the daemon is built and started: a signal that comes while it starts (a Pod deleted
    during start-up) is acted on once it serves, with the same flush rule, never Python's default kill.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self.got: list[tuple[int, float]] = []  # (signal, monotonic time it came)

    def install(self) -> ShutdownLatch:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        self.got.append((signum, time.monotonic()))
        self._done.set()

    def wait(self) -> None:
        """Until the first signal (waits in short slices: the main thread must run the handler)."""
        while not self._done.wait(1.0):
            pass

    @property
    def sigterm(self) -> bool:
        """The first signal was SIGTERM (a kubelet's stop, with a notice's flush), not SIGINT."""
        return bool(self.got) and self.got[0][0] == signal.SIGTERM


# Written into the host's local directory when a preemption flush ends (the notice's, then SIGTERM's).
PREEMPTION_RECORD = "preemption.json"
# Written by `mtc preempt --on-restart skip` when the Pod is deleted because its Job is going away (a JobSet
# restart, a hot-swap): the daemon's SIGTERM then skips the emergency backup.
RESTART_RECORD = "restart.json"
# Written by every `mtc preempt` (the trainer's preStop hook) before anything else: a Pod deletion, not an
# in-place restart, which the kubelet makes without preStop hooks (``--sigterm-flush after-hook``).
PRESTOP_RECORD = "prestop.json"
# The coordinator's host, its flush done, stays at least this long for the other preempting hosts to ask
# (Preemption._linger), looking every LINGER_POLL_SECONDS whether each was told.
MIN_LINGER_SECONDS = 1.0
LINGER_POLL_SECONDS = 0.05


# ---------------------------------------------------------------------- the records
@dataclasses.dataclass(frozen=True)
class PreemptionRecord:
    """The outcome of a preemption flush: ``step`` (the newest complete one, -1 none) is in the bucket when
    ``finished``; ``reason`` says why the flush ended; ``seconds`` it took."""

    step: int
    finished: bool
    reason: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "finished": self.finished, "reason": self.reason, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: Any) -> PreemptionRecord:
        """Raises ValueError for anything but a record's dict."""
        try:
            return cls(step=int(d["step"]), finished=bool(d["finished"]), reason=str(d["reason"]),
                       seconds=float(d["seconds"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a preemption record: {d!r}") from e


def write_record(root: Path, rec: PreemptionRecord) -> None:
    """``<root>/preemption.json``: the flush's outcome."""
    (root / PREEMPTION_RECORD).write_text(json.dumps(rec.to_dict()))


def read_record(root: Path) -> PreemptionRecord:
    """The flush's record; FileNotFoundError before one is written, ValueError while it is being written."""
    return PreemptionRecord.from_dict(json.loads((root / PREEMPTION_RECORD).read_text()))


def clear_record(root: Path) -> None:
    """Forget an earlier flush's record (an earlier incarnation's must not be taken for this one's)."""
    (root / PREEMPTION_RECORD).unlink(missing_ok=True)


def record_restart(root: Path) -> None:
    """``<root>/restart.json``: this Pod's deletion is a restart, not a notice (``mtc preempt``)."""
    (root / RESTART_RECORD).write_text(json.dumps({"restart": True}) + "\n")


def restart_recorded(root: Path, since_wall: float) -> bool:
    """A restart record written since ``since_wall`` (``time.time()`` at this daemon's start)."""
    return _recorded_since(root / RESTART_RECORD, since_wall)


def record_prestop(root: Path) -> None:
    """``<root>/prestop.json``: a preStop hook ran for this Pod (``mtc preempt``, first thing)."""
    (root / PRESTOP_RECORD).write_text(json.dumps({"prestop": True}) + "\n")


def _recorded_since(path: Path, since_wall: float) -> bool:
    try:
        return path.stat().st_mtime >= since_wall
    except FileNotFoundError:
        return False


def sigterm_skips_flush(root: Path, since_wall: float, *, noticed: bool, sigterm_flush: str) -> str:
    """Why this daemon's SIGTERM (``since_wall``: its start) takes no emergency backup; "" when it flushes.

    The one rule of both front doors: a restart recorded by the preStop hook (``--on-restart skip``: the RAM
    disk outlives the Pod) never flushes; with ``sigterm_flush`` "after-hook" neither does a SIGTERM that no
    preStop hook and no notice came before (an in-place restart: the Pod, its RAM disk and the step stay).
    """
    if restart_recorded(root, since_wall):
        return "SIGTERM of a JobSet restart: no emergency backup"
    if sigterm_flush == "after-hook" and not noticed and not _recorded_since(root / PRESTOP_RECORD, since_wall):
        return ("SIGTERM without a preStop hook (an in-place restart keeps this Pod and its RAM disk): "
                "no emergency backup")
    return ""


# ---------------------------------------------------------------------- the state
class PreemptionState:
    """Whether this host got a notice (``preempting``: every heartbeat says so; set once, for this process's
    life) and whether the job did (``noticed``: this host, or the coordinator's last answer says some host's
    current process did). The coordinator's part ends when the preempted hosts are replaced or declared
    lost, so a job restarted after a preemption, beside replicators that kept running, is not told again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._preempting = False
        self._coordinator = False

    @property
    def preempting(self) -> bool:
        return self._preempting

    @property
    def noticed(self) -> bool:
        return self._preempting or self._coordinator

    def begin(self) -> None:
        """This host got the notice."""
        with self._lock:
            self._preempting = True

    def coordinator_says(self, noticed: bool) -> bool:
        """The coordinator's answer says whether the job has a notice; True when that changes :attr:`noticed`."""
        with self._lock:
            before = self._preempting or self._coordinator
            self._coordinator = noticed
            return (self._preempting or noticed) != before


class PreemptionLink(Protocol):
    """What a flush asks of the heartbeat (:class:`replicator.heartbeat.Heartbeat`): the coordinator link
    and what the last answer said."""

    @property
    def interval(self) -> float: ...
    @property
    def newest_complete(self) -> int: ...
    def call(self, method: str, request: Any, timeout: float) -> Any: ...


class Backup(Protocol):
    """The part of this host's backup tier a flush uses (:class:`replicator.backup.agent.BackupAgent`)."""

    def unthrottle(self) -> None: ...


# ---------------------------------------------------------------------- the handling
class Preemption:
    """A notice (``LocalControl.Preempt``) and the flush of the newest complete step into the bucket."""

    def __init__(self, state: PreemptionState, link: PreemptionLink, *, root: Path, wake: Callable[[], None],
                 bucket: Backup | None, rpc_timeout_seconds: float, heartbeat_seconds: float,
                 tells_others: bool, rank: int = -1, others_told: Callable[[int], bool] | None = None):
        """``tells_others``: this host serves a coordinator candidate and the job has other hosts, which
        learn a flush's outcome from it (so it stays, once the step is in the bucket, until ``others_told(step)``
        says every other preempting host was told, at least :data:`MIN_LINGER_SECONDS` and at most a few
        heartbeats; without ``others_told`` those few heartbeats). ``rank``: this host's, sent with the flush's
        GetSteps (``asker_rank``) so that the coordinator knows who was told."""
        self.state = state
        self._link = link
        self._root = root
        self._wake = wake
        self._bucket = bucket
        self._rpc_timeout_seconds = rpc_timeout_seconds
        self._heartbeat_seconds = heartbeat_seconds
        self._tells_others = tells_others
        self._rank = rank
        self._others_told = others_told
        self._lock = threading.Lock()
        self._notice_thread: threading.Thread | None = None

    def status(self) -> control_pb2.GetPreemptionResponse:
        """Whether the job got a notice, whether this host did, and the newest complete step then (-1 without
        a notice)."""
        noticed = self.state.noticed
        return control_pb2.GetPreemptionResponse(noticed=noticed, this_host=self.state.preempting,
                                                 notice_step=self._link.newest_complete if noticed else -1)

    def on_notice(self, request: control_pb2.PreemptRequest) -> control_pb2.PreemptResponse:
        """Start handling a notice (once per daemon); returns at once."""
        with self._lock:
            notice_step = int(self._link.newest_complete)
            if self._notice_thread is not None:
                return control_pb2.PreemptResponse(notice_step=notice_step, started=False)
            clear_record(self._root)
            self.state.begin()
            self._wake()
            window = max(0.0, float(request.save_window_seconds))
            flush = max(1.0, float(request.flush_seconds))
            t = threading.Thread(target=self._handle, args=(notice_step, window, flush), name="mtc-preempt",
                                 daemon=True)
            self._notice_thread = t
        log.warning("preemption notice (preStop): newest complete step %d; waiting up to %.1fs for a newer save, "
                    "then up to %.1fs for the bucket", notice_step, window, flush)
        t.start()
        return control_pb2.PreemptResponse(notice_step=notice_step, started=True)

    def _handle(self, notice_step: int, window: float, flush: float) -> None:
        deadline = time.monotonic() + window
        while time.monotonic() < deadline and self._link.newest_complete <= notice_step:
            self._wake()
            time.sleep(0.1)
        if self._link.newest_complete > notice_step:
            log.info("step %d saved after the notice: flushing it", self._link.newest_complete)
        try:
            self.flush(flush)
        except Exception:  # the SIGTERM path flushes again
            log.exception("preemption flush failed")

    def _linger(self, step: int, deadline: float) -> None:
        """The other hosts learn the outcome from this coordinator: stay until each preempting one was told
        (a fixed few heartbeats held every Pod of a JobSet restart 7 s at the default 2 s heartbeat, and the
        JobSet re-creates its Jobs only once their Pods are gone), but at least MIN_LINGER_SECONDS: a host
        whose notice this coordinator has not heard yet is not waited for otherwise."""
        now = time.monotonic()
        end = min(deadline, now + 3 * self._heartbeat_seconds + 1.0)
        least = min(end, now + MIN_LINGER_SECONDS)
        while now < end and (now < least or self._others_told is None or not self._others_told(step)):
            time.sleep(LINGER_POLL_SECONDS)
            now = time.monotonic()

    def flush(self, grace_seconds: float) -> PreemptionRecord:
        """A preemption notice: within ``grace_seconds`` get the newest complete step into the bucket.

        The heartbeat tells the coordinator at once; it starts an emergency backup of the newest complete
        step (no interval), which every host uploads unthrottled at normal priority. The outcome is logged
        and written to ``<local>/preemption.json`` (``finished`` false when the grace ran out first).
        """
        t0 = time.monotonic()
        deadline = t0 + max(0.0, grace_seconds - 1.0)  # leave a second to stop cleanly
        self.state.begin()
        bucket = self._bucket
        if bucket is not None:
            bucket.unthrottle()  # emergency: no upload throttle
        step, finished, why = -1, bucket is None, "no backup tier configured" if bucket is None else ""
        # The bucket commit is the coordinator's: once no candidate has answered for a while (long enough
        # for a standby to take over), waiting out the rest of the grace cannot help and only delays exit.
        unreachable_limit = max(3.0, 4 * self._link.interval)
        unreachable_since: float | None = None
        while not finished and time.monotonic() < deadline:
            self._wake()
            try:
                ask = cpb.GetStepsRequest(wait_seconds=0)
                if self._rank >= 0:
                    ask.asker_rank = self._rank
                resp = self._link.call("GetSteps", ask,
                                       timeout=max(0.5, min(self._rpc_timeout_seconds, deadline - time.monotonic())))
                unreachable_since = None
                step = resp.newest_complete_step
                if step < 0:
                    finished, why = True, "no complete step to back up"
                elif step in resp.backed_up_steps:
                    finished, why = True, f"step {step} is in the bucket"
            except grpc.RpcError as e:
                why = f"coordinator unreachable: {rpc.details(e)}"
                now = time.monotonic()
                unreachable_since = now if unreachable_since is None else unreachable_since
                if now - unreachable_since >= unreachable_limit:
                    why += f" for {now - unreachable_since:.1f}s: gave up"
                    break
            if not finished:
                time.sleep(0.1)
        if not finished and not why:
            why = f"grace of {grace_seconds}s ran out before step {step} was committed in the bucket"
        rec = PreemptionRecord(step=step, finished=finished, reason=why, seconds=round(time.monotonic() - t0, 3))
        if finished and self._tells_others and bucket is not None:
            self._linger(step, deadline)
        (log.info if finished else log.warning)("preemption flush: %s", rec.to_dict())
        try:
            write_record(self._root, rec)
        except OSError as e:
            log.warning("cannot record the preemption flush: %s", e)
        return rec
