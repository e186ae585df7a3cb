"""One system's run of bench.goodput: the harness plays Kubernetes for a job of 4 JAX processes.

The harness makes the restarts the rendered JobSets make (deploy/multi-controller-native, ``restartStrategy:
Recreate``), the same for every system: at each failure of the seeded schedule (:func:`schedule`, from the
first train step) every Pod of the job goes and comes back, ours with its replicator sidecar (bench/goodput_pods.py).
The RAM disk (``--ramdisk``, as ``mtc manifests --ramdisk``) decides what the new Pods find: ``csi`` (the
native front door's default, the node's RAM disk) keeps every surviving host's local folder, of every system;
``memory`` (an emptyDir) loses every host's at every restart.

- ``host_lost``: the host's worker (and its replicator) SIGKILLed, every other Pod deleted; the host is
  replaced: its local folder wiped;
- ``slice_lost``: the same for both hosts of a slice;
- ``preemption``: a notice for one slice (ours: ``mtc preempt`` on its hosts' replicators, as the Pods'
  preStop hook; Orbax: a file the workers poll each step); the job saves the step it is at and exits; after
  the workers exit (or ``--grace-seconds``) the slice's replicators get SIGTERM (they flush to the bucket
  within what is left of the grace), the other Pods are deleted as in a restart, the slice's hosts replaced;
- ``job_restart``: every Pod deleted, nothing replaced;
- ``corrupt_copy``: a job restart, and while the Pods are gone 64 bytes are flipped in the copy the system
  would restore first of one host's data of its newest step (bench/goodput_faults.py).

A deleted Pod's replicator gets SIGTERM; where the RAM disk outlives the Pod the preStop hook has recorded a
restart (no emergency backup), as ``mtc preempt --on-restart skip`` does. After ``--replace-seconds`` (new
Pods) every Pod starts. Ours, ``--trainer-start with-replicator`` (the rendered JobSet's): each host's replicator
and training process start together, and the training process's manager waits for its replicator itself
(inside ``plan``); ``after-probe`` (the rendered JobSet before, kept for comparison): the replicators first,
each host's training process once its replicator answers the startup probe (every ``--probe-seconds`` from the
Pod's start). A failure due while the job is still recovering is injected once it has taken its first step
(its delay is recorded).

A recovery that raises, or restores anything but what was saved (the harness's check), is recorded with its
error and followed by the operator's policy, its time charged: the copy found bad is removed (the corrupted
one when the harness knows it, else every copy of the step that failed) and the JobSet restarted, so the
system restores the newest intact step in any tier, or starts from scratch when none is left.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from bench import goodput_faults
from bench.emergency_common import PROCESSES, SLICES
from bench.goodput_pods import Job, Replicators

KINDS = ("host_lost", "slice_lost", "preemption", "job_restart", "corrupt_copy")
HOSTS_PER_SLICE = PROCESSES // SLICES
RECOVERY_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.02
DEPLOY_MODE = "multi-controller-native"
RAMDISKS = ("csi", "memory")
RAMDISK_OUTLIVES_PODS = ("csi",)
# How the training container starts beside its replicator sidecar (deploy/multi-controller-native/jobset.yaml):
# "with-replicator", as rendered now (no startupProbe: the manager waits for its replicator in-process);
# "after-probe", as rendered before: once the replicator passed its startupProbe (gRPC, every second).
TRAINER_STARTS = ("with-replicator", "after-probe")
STARTUP_PROBE_SECONDS = 1.0  # the startupProbe's periodSeconds (after-probe)
MAX_ROLLBACKS = 6


@dataclasses.dataclass(frozen=True)
class Failure:
    """One failure of the schedule: ``at_seconds`` after the first train step, of ``kind``, on ``hosts``."""

    at_seconds: float
    kind: str
    hosts: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"at_seconds": self.at_seconds, "kind": self.kind, "hosts": list(self.hosts)}


def schedule(seed: int, seconds: float, mtbf_seconds: float) -> list[Failure]:
    """The failures within ``seconds``: exponential gaps of mean ``mtbf_seconds``; kinds in a shuffled cycle
    (every kind once before any twice); hosts and slices drawn from the same seeded generator."""
    if seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("seconds and mtbf_seconds must be > 0")
    rng = random.Random(seed)
    out: list[Failure] = []
    cycle: list[str] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_seconds)
        if t >= seconds:
            return out
        if not cycle:
            cycle = list(KINDS)
            rng.shuffle(cycle)
        kind = cycle.pop(0)
        if kind in ("host_lost", "corrupt_copy"):
            hosts: tuple[int, ...] = (rng.randrange(PROCESSES),)
        elif kind in ("slice_lost", "preemption"):
            s = rng.randrange(SLICES)
            hosts = tuple(range(s * HOSTS_PER_SLICE, (s + 1) * HOSTS_PER_SLICE))
        else:
            hosts = ()
        out.append(Failure(round(t, 3), kind, hosts))


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """One system's run (validated by bench.goodput's ``main``)."""

    system: str
    mib: int
    seconds: float
    step_seconds: float
    mtbf_seconds: float
    replace_seconds: float
    grace_seconds: float
    bucket_seconds: float
    failures: tuple[Failure, ...]
    ramdisk: str = "csi"
    probe_seconds: float = STARTUP_PROBE_SECONDS
    trainer_start: str = TRAINER_STARTS[0]


def deploy(ramdisk: str, probe_seconds: float, trainer_start: str = TRAINER_STARTS[0]) -> dict[str, Any]:
    """The deploy mode measured, as the output names it."""
    out = {"mode": DEPLOY_MODE, "ramdisk": ramdisk, "ramdisk_outlives_pods": ramdisk in RAMDISK_OUTLIVES_PODS,
           "pod_restarts": "every Pod of the JobSet at every failure, our replicator sidecars included",
           "trainer_start": trainer_start}
    if trainer_start == "after-probe":
        out["startup_probe_seconds"] = probe_seconds
    return out


class Events:
    """Tails rank 0's ``events.jsonl``."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buf = path, 0, ""

    def new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line a killed process left half written, joined to the next
                continue
        return out


class Harness:
    """One system's run (see the module docstring); :meth:`run` returns its record."""

    def __init__(self, opts: RunOptions, scratch: Path):
        self.opts = opts
        self.base = scratch / opts.system
        shutil.rmtree(self.base, ignore_errors=True)
        self.storage, self.logs = self.base / "storage", self.base / "logs"
        self.storage.mkdir(parents=True)
        self.logs.mkdir()
        self.reps = Replicators(opts, self.storage, self.logs) if opts.system == "ours" else None
        self.job = Job(opts, self.base, self.logs, self.reps.ports if self.reps else [])
        self.events = Events(self.base / "events.jsonl")
        self.records: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.current: dict[str, Any] | None = None  # the failure being recovered from
        self.last_step = 0
        self.excluded = 0.0

    def wipe(self, hosts: tuple[int, ...] | range) -> None:
        if self.opts.system == "orbax_standard":
            return  # no local tier: a replaced host loses nothing
        for h in hosts:
            shutil.rmtree(self.storage / f"local{h}", ignore_errors=True)
            (self.storage / f"local{h}").mkdir(parents=True)

    # ------------------------------------------------------------------ the JobSet's lifecycle
    def _start_pods(self) -> float:
        """Every Pod of a new incarnation (ours: see ``--trainer-start`` in the module docstring). Returns the
        Pods' start."""
        t0 = time.monotonic()
        self.job.begin()
        if self.reps is None or self.opts.trainer_start == "with-replicator":
            for rank in range(PROCESSES):  # a Pod's native sidecar is started before its main container
                if self.reps is not None and rank not in self.reps.procs:
                    self.reps.start(rank)
                self.job.start_rank(rank)
            return t0
        for h in range(PROCESSES):
            if h not in self.reps.procs:
                self.reps.start(h)
        return self._start_after_probe(t0)

    def _start_after_probe(self, t0: float) -> float:
        """``after-probe``: each host's training process once its replicator passed the startup probe (probed
        every ``probe_seconds`` from the Pod's start, ``t0``). Returns ``t0``."""
        deadline = t0 + RECOVERY_TIMEOUT_SECONDS
        period = self.opts.probe_seconds
        served: dict[int, float] = {}  # host -> when its replicator was first seen serving
        while len(self.job.procs) < PROCESSES:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"replicators not serving within {RECOVERY_TIMEOUT_SECONDS:.0f} s")
            for h in range(len(self.job.procs), PROCESSES):  # started in rank order, each when its probe passed
                if h not in served and self.reps.serving(h):
                    served[h] = now
            h = len(self.job.procs)
            # The probe that passes: the first at or after the replicator began serving.
            if h in served and now >= (t0 if period <= 0 else t0 + math.ceil((served[h] - t0) / period) * period):
                self.job.start_rank(h)
                continue
            time.sleep(POLL_SECONDS)
        return t0

    def _stop_pods(self, hosts: list[int]) -> None:
        """``hosts``' Pods deleted by a JobSet restart: their replicators get SIGTERM; where the RAM disk
        outlives the Pod the preStop hook recorded a restart first (no emergency backup)."""
        if self.reps is None:
            return
        hosts = [h for h in hosts if h in self.reps.procs]
        if self.opts.ramdisk in RAMDISK_OUTLIVES_PODS:
            self.reps.record_restart(hosts)
        self.reps.stop(hosts, signal.SIGTERM, STOP_TIMEOUT_SECONDS)

    def _new_pods(self, rec: dict[str, Any], replaced: tuple[int, ...]) -> None:
        """After the old Pods went: the replaced hosts' RAM disks (every host's with an emptyDir) are gone,
        ``--replace-seconds`` pass, every Pod starts."""
        lost = range(PROCESSES) if self.opts.ramdisk not in RAMDISK_OUTLIVES_PODS else replaced
        self.wipe(lost)
        time.sleep(self.opts.replace_seconds)
        rec["t_spawn"] = self._start_pods()
        rec["incarnation"] = self.job.incarnation
        if self.reps:  # inside "restart": until the last training process could start (after-probe: its probe passed)
            rec["sidecars_seconds"] = round(time.monotonic() - rec["t_spawn"], 4)

    # ------------------------------------------------------------------ failures
    def inject(self, failure: Failure, due: float) -> None:
        now = time.monotonic()
        rec: dict[str, Any] = {"kind": failure.kind, "hosts": list(failure.hosts), "at_seconds": failure.at_seconds,
                               "delayed_seconds": round(now - due, 3), "t_fail": now}
        replaced: tuple[int, ...] = ()
        if failure.kind == "preemption":
            self._preempt(failure, rec)
            replaced = failure.hosts
        else:
            if self.reps and failure.kind in ("host_lost", "slice_lost"):
                self.reps.stop(failure.hosts)  # SIGKILL: the node is gone
            self.job.kill()
            self._read_events()
            rec["t_down"] = time.monotonic()
            if failure.kind in ("host_lost", "slice_lost"):
                replaced = failure.hosts
        rec["step_at_failure"] = self.last_step
        (self.base / "notice").unlink(missing_ok=True)
        self._stop_pods(list(range(PROCESSES)))
        if failure.kind == "corrupt_copy":
            self._corrupt(rec, failure.hosts[0])
        self._new_pods(rec, replaced)
        self.current = rec

    def _preempt(self, failure: Failure, rec: dict[str, Any]) -> None:
        """The notice, the job's last save and exit (or the grace's end), then the preempted slice's
        replicators' SIGTERM: they flush within what is left of the grace."""
        if self.reps:
            self.reps.notice(failure.hosts, self.opts.grace_seconds)
        else:
            (self.base / "notice").write_text("preempted\n")
        end = rec["t_fail"] + self.opts.grace_seconds
        while len(self.job.exited()) < PROCESSES and time.monotonic() < end:
            self._read_events()
            time.sleep(POLL_SECONDS)
        rec["exited_in_grace"] = len(self.job.exited()) == PROCESSES
        self.job.kill()
        self._read_events()
        rec["t_down"] = time.monotonic()
        if self.reps:  # a notice, not a restart: no restart record, the SIGTERM flushes
            self.reps.stop(failure.hosts, signal.SIGTERM, max(1.0, end - time.monotonic()))

    def _corrupt(self, rec: dict[str, Any], host: int) -> None:
        root = goodput_faults.restore_first_root(self.opts.system, self.storage, host)
        got = goodput_faults.corrupt_newest(root)
        rec["corrupted"] = got.describe(self.storage) if got else "no committed step to corrupt"
        rec["corrupt_step_dir"] = got.step_dir if got else None

    def roll_back(self, error: str) -> None:
        """A recovery failed or restored other bytes than were saved: recorded on the current failure (or as
        an error of its own), then the operator's policy (see the module docstring), its time charged."""
        if self.current is None:
            self.errors.append(error)
            self.current = {"kind": "unprovoked", "hosts": [], "t_fail": time.monotonic(),
                            "step_at_failure": self.last_step, "t_down": time.monotonic()}
        rec = self.current
        rec.setdefault("failed", error)
        if rec["kind"] == "corrupt_copy" and "corruption_detected" not in rec:
            # The system's own restore refused the bad copy (an error), or the harness's check found its bytes.
            rec["corruption_detected"] = not error.startswith("WrongRestore")
        rec.setdefault("t_failed_spawn", rec.get("t_spawn", rec["t_down"]))
        self.job.kill()
        self._stop_pods(list(range(PROCESSES)))
        rec.setdefault("rolled_back", []).append(self._remove_bad(rec))
        self._new_pods(rec, ())
        for k in ("t_up", "t_planned", "t_restored", "t_checked", "planned_step", "restored_step"):
            rec.pop(k, None)

    def _remove_bad(self, rec: dict[str, Any]) -> str:
        """The operator's removal: the corrupted copy if not yet removed, else every copy of the step the
        attempt tried; everything after MAX_ROLLBACKS attempts, or when no step was tried."""
        bad = rec.pop("corrupt_step_dir", None)
        if bad is not None:
            shutil.rmtree(bad, ignore_errors=True)
            return f"copy {Path(bad).relative_to(self.storage)}"
        tried = rec.get("restored_step", rec.get("planned_step"))
        attempts = len(rec.get("rolled_back", []))
        if tried is not None and attempts < MAX_ROLLBACKS:
            return f"step {tried}: " + (", ".join(goodput_faults.remove_step(self.storage, tried)) or "no copy")
        if tried is None and attempts < 2:  # it failed before planning a restore: nothing known bad
            return "nothing (a restart)"
        goodput_faults.remove_everything(self.storage)
        return "everything (from scratch)"

    # ------------------------------------------------------------------ the timeline
    def _read_events(self) -> None:
        for ev in self.events.new():
            kind = ev["ev"]
            if kind == "step" and ev["inc"] == self.job.incarnation:
                self.last_step = ev["step"]
            rec = self.current
            if rec is None or ev["inc"] != rec.get("incarnation"):
                continue
            if kind in ("up", "planned", "restored"):
                rec[f"t_{kind}"] = ev["t"]
                if kind in ("planned", "restored"):
                    rec[f"{kind}_step"] = ev["step"]
            elif kind == "checked":
                rec["t_checked"] = ev["t"]
                rec["check_seconds"] = round(ev["seconds"], 4)
                self.excluded += ev["seconds"]
            elif kind == "step" and "t_first_step" not in rec:
                rec["t_first_step"] = ev["t"]
                self._close(rec)

    def _close(self, rec: dict[str, Any]) -> None:
        s = self.opts.step_seconds
        # A failed recovery: "replace" ends at the failed attempt's start, which "failed_attempt" holds up to
        # the operator's restart.
        spawn = rec.get("t_failed_spawn", rec["t_spawn"])
        phases = {
            "detect": rec["t_down"] - rec["t_fail"],
            "replace": spawn - rec["t_down"],
            "failed_attempt": rec["t_spawn"] - spawn,
            "restart": rec["t_up"] - rec["t_spawn"],
            "plan": rec["t_planned"] - rec["t_up"],
            "restore": rec["t_restored"] - rec["t_planned"],
            "first_step": rec["t_first_step"] - rec["t_checked"] - s,
        }
        rec["phases"] = {k: round(v, 4) for k, v in phases.items() if k != "failed_attempt" or "failed" in rec}
        rec["downtime_seconds"] = round(sum(rec["phases"].values()), 4)
        # Fetch, verify and load wherever they ran: the restore call and (ours) the replicators' restores,
        # which may run while the job starts; the time any of them ran, since the Pods started.
        spans = [(rec["t_planned"], rec["t_restored"])]
        spans += self.reps.restore_spans(rec["t_spawn"]) if self.reps else []
        rec["fetch_verify_load_seconds"] = round(covered(spans, rec["t_spawn"]), 4)
        rec["steps_lost"] = rec["step_at_failure"] - rec["restored_step"]
        if rec["kind"] == "corrupt_copy":
            rec.setdefault("corruption_detected", True)  # its first restore gave back what was saved
        rec.pop("corrupt_step_dir", None)
        self.records.append(rec)
        self.current = None

    def run(self) -> dict[str, Any]:
        opts = self.opts
        try:
            self._start_pods()
            t_start = self._wait_start()
            pending = list(opts.failures)
            while True:
                now = time.monotonic()
                self._read_events()
                deadline = t_start + opts.seconds + self.excluded
                if now >= deadline and (self.current is None or "restored_step" in self.current):
                    break
                if now >= deadline + RECOVERY_TIMEOUT_SECONDS:
                    raise RuntimeError(f"no restore within {RECOVERY_TIMEOUT_SECONDS:.0f} s after the end: "
                                       f"{self.current.get('failed') if self.current else None}")
                error = self.job.error()
                if error is None and self.current is None and self.job.exited():
                    error = "a worker exited outside a failure"
                if error is not None:
                    self.roll_back(error)
                elif self.current is not None and now - self.current["t_fail"] > RECOVERY_TIMEOUT_SECONDS:
                    self.roll_back(f"no first step within {RECOVERY_TIMEOUT_SECONDS:.0f} s")
                elif self.current is None and pending and now >= t_start + pending[0].at_seconds and now < deadline:
                    failure = pending.pop(0)
                    self.inject(failure, t_start + failure.at_seconds)
                time.sleep(POLL_SECONDS)
        finally:
            self.job.kill()
            if self.reps:
                self.reps.stop(list(self.reps.procs))
        return self._result(t_start)

    def _wait_start(self) -> float:
        deadline = time.monotonic() + RECOVERY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            for ev in self.events.new():
                if ev["ev"] == "start":
                    self.last_step = ev["step"]
                    return ev["t"]
            error = self.job.error()
            if error is not None:
                raise RuntimeError(f"calibration: {error}")
            time.sleep(POLL_SECONDS)
        raise RuntimeError(f"calibration: no first step within {RECOVERY_TIMEOUT_SECONDS:.0f} s")

    def _result(self, t_start: float) -> dict[str, Any]:
        cal = json.loads((self.base / "calibration.json").read_text())
        cut = self.current  # a recovery the deadline cut: its steps count as lost, its downtime is partial
        # The clock started at step 1; a job started over from nothing is back at step 0.
        kept = max(0, (cut["restored_step"] if cut else self.last_step) - 1)
        out: dict[str, Any] = {k: round(v, 4) if isinstance(v, float) else v for k, v in cal.items()}
        out.update({"wall_seconds": self.opts.seconds, "excluded_check_seconds": round(self.excluded, 3),
                    "steps_kept": kept, "ettr": round(kept * self.opts.step_seconds / self.opts.seconds, 4),
                    "failures": [_public(r) for r in self.records]})
        if cut:
            out["cut_at_deadline"] = _public(cut) | {"steps_lost": cut["step_at_failure"] - cut["restored_step"]}
        if self.errors:
            out["errors"] = self.errors
        return out


def covered(spans: list[tuple[float, float]], since: float) -> float:
    """Seconds after ``since`` that at least one of ``spans`` (start, end) covers."""
    total, reach = 0.0, since
    for start, end in sorted(spans):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def _public(rec: dict[str, Any]) -> dict[str, Any]:
    """A failure's record without its raw clock readings."""
    return {k: v for k, v in rec.items() if not k.startswith("t_") and k not in ("incarnation", "corrupt_step_dir")}


def run(opts: RunOptions, scratch: Path) -> dict[str, Any]:
    """One system's run; its record (``{"error": ...}`` when it could not even start)."""
    try:
        return Harness(opts, scratch).run()
    except Exception as e:  # noqa: BLE001 - reported as this system's error, with its exact text
        return {"error": f"{type(e).__name__}: {e}"}
