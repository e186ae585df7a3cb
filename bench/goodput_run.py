"""One system's run of bench.goodput: the harness plays Kubernetes for a job of 4 JAX processes.

It starts the job (4 ``bench.goodput_worker`` processes, each in its own session, stopped by its pid; for
``ours`` also one ``mtc replicator`` per host, a sidecar that outlives the training containers), and at the
times of the seeded failure schedule (:func:`schedule`, from the first train step) it fails the job:

- ``host_lost``: the host's worker (and its replicator) SIGKILLed; the whole job is restarted, as a JobSet
  does; the host is replaced: its RAM dir wiped, a new empty replicator;
- ``slice_lost``: the same for both hosts of a slice;
- ``preemption``: a notice for one slice (ours: ``mtc preempt`` on its hosts' replicators, as the Pods'
  preStop hook; Orbax: a file the workers poll each step); the job saves the step it is at and exits; after
  the workers exit (or ``--grace-seconds``) the slice's replicators get SIGTERM (they flush to the bucket
  within what is left of the grace), then the slice's hosts are replaced;
- ``job_restart``: every worker killed, every RAM dir kept;
- ``corrupt_copy``: bytes flipped in the largest file of one host's newest local step (orbax_standard has no
  local copy: its newest step in the bucket folder), then a job restart.

After each failure it waits ``--replace-seconds`` (the replacement Pods), then starts a new incarnation. A
failure due while the job is still recovering is injected once it has taken its first step (its delay is
recorded). A recovery that raises, or restores anything but what was saved, is recorded as failed with its
error, and the job starts over from nothing (every tier wiped), as an operator would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.children import bound_to_us
from bench.emergency_common import DEVICES_PER_PROCESS, PROCESSES, REPO, SLICES
from controller_client.demo.ports import free_port

KINDS = ("host_lost", "slice_lost", "preemption", "job_restart", "corrupt_copy")
HOSTS_PER_SLICE = PROCESSES // SLICES
RECOVERY_TIMEOUT_SECONDS = 300.0
STOP_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.02


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


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", GRPC_VERBOSITY="ERROR",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _stop(p: subprocess.Popen, sig: int, timeout: float) -> None:
    """``sig`` to ``p``'s own session (by its pid), SIGKILL after ``timeout``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def _waited(p: subprocess.Popen, timeout: float) -> bool:
    try:
        p.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


class Replicators:
    """ours: one real ``mtc replicator`` per host (host 0's serves the coordinator), backing up to a folder."""

    def __init__(self, opts: RunOptions, storage: Path, logs: Path):
        self.opts, self.storage, self.logs = opts, storage, logs
        self.ports = [free_port() for _ in range(PROCESSES)]
        self.procs: dict[int, subprocess.Popen] = {}

    def local(self, host: int) -> Path:
        return self.storage / f"local{host}"

    def start(self, host: int) -> None:
        self.local(host).mkdir(parents=True, exist_ok=True)
        args = ["--local-dir", str(self.local(host)), "--listen", f"127.0.0.1:{self.ports[host]}", "--job", "bench",
                "--rank", str(host), "--nodes", str(PROCESSES), "--data-parallelism", str(SLICES),
                "--heartbeat-seconds", "0.1", "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "300",
                "--backup-url", f"file://{self.storage / 'persistent'}",
                "--backup-interval-minutes", f"{self.opts.bucket_seconds / 60:.4f}",
                "--preemption-grace-seconds", str(self.opts.grace_seconds)]
        if host:
            args += ["--coordinator", f"127.0.0.1:{self.ports[0]}"]
        with open(self.logs / f"replicator-{host}.log", "ab") as log:
            self.procs[host] = subprocess.Popen(
                bound_to_us([sys.executable, "-m", "controller_client.cli", "-v", "replicator", *args]), stdout=log,
                stderr=subprocess.STDOUT, env=_env(), cwd=str(REPO), start_new_session=True)

    def stop(self, hosts: list[int] | tuple[int, ...], sig: int = signal.SIGKILL,
             timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        procs = [p for p in (self.procs.pop(h, None) for h in hosts) if p is not None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + timeout
        for p in procs:
            _stop(p, signal.SIGKILL, max(0.1, deadline - time.monotonic()))

    def notice(self, hosts: tuple[int, ...], grace_seconds: float) -> None:
        """A preemption notice, as the Pods' preStop hook gives it (``mtc preempt``)."""
        hooks = [subprocess.Popen([sys.executable, "-m", "controller_client.cli", "preempt", "--local-dir",
                                   str(self.local(h)), "--save-window-seconds", f"{grace_seconds * 0.5:.2f}",
                                   "--flush-seconds", f"{grace_seconds * 0.4:.2f}"],
                                  env=_env(), cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
                 for h in hosts]
        for hook in hooks:
            if not _waited(hook, 30):
                _stop(hook, signal.SIGKILL, 10)


class Job:
    """The 4 worker processes of the current incarnation."""

    def __init__(self, opts: RunOptions, base: Path, logs: Path, ports: list[int]):
        self.opts, self.base, self.logs, self.ports = opts, base, logs, ports
        self.incarnation = -1
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.incarnation += 1
        jax_port = free_port()
        self.procs = []
        for rank in range(PROCESSES):
            cmd = [sys.executable, "-m", "bench.goodput_worker", "--system", self.opts.system, "--rank", str(rank),
                   "--incarnation", str(self.incarnation), "--mib", str(self.opts.mib),
                   "--step-seconds", str(self.opts.step_seconds), "--mtbf-seconds", str(self.opts.mtbf_seconds),
                   "--bucket-seconds", str(self.opts.bucket_seconds), "--base", str(self.base),
                   "--jax-coordinator", f"127.0.0.1:{jax_port}", "--ports", ",".join(map(str, self.ports))]
            with open(self.logs / f"worker-{self.incarnation}-{rank}.log", "wb") as log:
                self.procs.append(subprocess.Popen(bound_to_us(cmd), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                                   cwd=str(REPO), start_new_session=True))

    def kill(self) -> None:
        for p in self.procs:
            _stop(p, signal.SIGKILL, 10)

    def exited(self) -> list[int]:
        return [p.returncode for p in self.procs if p.poll() is not None]

    def error(self) -> str | None:
        """The first error a worker of this incarnation wrote, if any."""
        errors = sorted((self.base / "errors").glob(f"{self.incarnation}-*.txt"))
        if errors:
            return errors[0].read_text().splitlines()[0][:600]
        codes = [c for c in self.exited() if c != 0]
        return f"a worker exited with {codes[0]} and no error" if codes else None


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


def corrupt_newest(root: Path) -> str:
    """Flip 64 bytes in the middle of the largest file of the newest committed step under ``root`` (a path
    component all digits is a step; temp dirs are not). Returns what was flipped, for the record."""
    best: tuple[int, int, Path] | None = None
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        steps = [int(c) for c in path.relative_to(root).parts[:-1] if c.isdigit()]
        if not steps:
            continue
        key = (max(steps), path.stat().st_size, path)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return "no committed step to corrupt"
    step, size, path = best
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return f"step {step}: {path.relative_to(root)} ({len(data)} bytes at {size // 2})"


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

    def local_root(self, host: int) -> Path:
        if self.opts.system == "orbax_standard":
            return self.storage / "persistent"
        return self.storage / f"local{host}"

    def wipe(self, hosts: tuple[int, ...]) -> None:
        if self.opts.system == "orbax_standard":
            return  # no local tier: a replaced host loses nothing
        for h in hosts:
            shutil.rmtree(self.storage / f"local{h}", ignore_errors=True)
            (self.storage / f"local{h}").mkdir(parents=True)

    # ------------------------------------------------------------------ failures
    def inject(self, failure: Failure, due: float) -> None:
        now = time.monotonic()
        rec: dict[str, Any] = {"kind": failure.kind, "hosts": list(failure.hosts), "at_seconds": failure.at_seconds,
                               "delayed_seconds": round(now - due, 3), "t_fail": now}
        replaced: tuple[int, ...] = ()
        if failure.kind == "preemption":
            if self.reps:
                self.reps.notice(failure.hosts, self.opts.grace_seconds)
            else:
                (self.base / "notice").write_text("preempted\n")
            end = now + self.opts.grace_seconds
            while len(self.job.exited()) < PROCESSES and time.monotonic() < end:
                self._read_events()
                time.sleep(POLL_SECONDS)
            rec["exited_in_grace"] = len(self.job.exited()) == PROCESSES
            self.job.kill()
            self._read_events()
            rec["t_down"] = time.monotonic()
            if self.reps:  # the sidecars' SIGTERM, once the main containers are gone; they flush in what is left
                self.reps.stop(failure.hosts, signal.SIGTERM, max(1.0, end - time.monotonic()))
            replaced = failure.hosts
        else:
            if failure.kind == "corrupt_copy":
                rec["corrupted"] = corrupt_newest(self.local_root(failure.hosts[0]))
            if self.reps and failure.kind in ("host_lost", "slice_lost"):
                self.reps.stop(failure.hosts)
            self.job.kill()
            self._read_events()
            rec["t_down"] = time.monotonic()
            if failure.kind in ("host_lost", "slice_lost"):
                replaced = failure.hosts
        rec["step_at_failure"] = self.last_step
        (self.base / "notice").unlink(missing_ok=True)
        self.wipe(replaced)
        time.sleep(self.opts.replace_seconds)
        if self.reps:
            for h in replaced:
                self.reps.start(h)
        self.job.start()
        rec["t_spawn"] = time.monotonic()
        rec["incarnation"] = self.job.incarnation
        self.current = rec

    def start_over(self, error: str) -> None:
        """A recovery failed: recorded on the current failure (or as an error of its own); the job starts
        from nothing, every tier wiped."""
        if self.current is None:
            self.errors.append(error)
            self.current = {"kind": "unprovoked", "hosts": [], "t_fail": time.monotonic(),
                            "step_at_failure": self.last_step, "t_down": time.monotonic()}
        self.current.setdefault("failed", error)
        self.current.setdefault("t_failed_spawn", self.current.get("t_spawn", self.current["t_down"]))
        self.job.kill()
        if self.reps:
            self.reps.stop(list(self.reps.procs))
        for child in self.storage.iterdir():
            shutil.rmtree(child, ignore_errors=True)
        if self.reps:
            for h in range(PROCESSES):
                self.reps.start(h)
        self.job.start()
        self.current["t_spawn"] = time.monotonic()
        self.current["incarnation"] = self.job.incarnation
        self.current.pop("t_up", None)
        self.current.pop("t_planned", None)

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
                if kind == "restored":
                    rec["restored_step"] = ev["step"]
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
        # the start over from nothing.
        spawn = rec.get("t_failed_spawn", rec["t_spawn"])
        phases = {
            "detect": rec["t_down"] - rec["t_fail"],
            "replace": spawn - rec["t_down"],
            "failed_attempt": rec["t_spawn"] - spawn,
            "restart": rec["t_up"] - rec["t_spawn"],
            "plan": rec["t_planned"] - rec["t_up"],
            "fetch_verify_load": rec["t_restored"] - rec["t_planned"],
            "first_step": rec["t_first_step"] - rec["t_checked"] - s,
        }
        rec["phases"] = {k: round(v, 4) for k, v in phases.items() if k != "failed_attempt" or "failed" in rec}
        rec["downtime_seconds"] = round(sum(rec["phases"].values()), 4)
        rec["steps_lost"] = rec["step_at_failure"] - rec["restored_step"]
        self.records.append(rec)
        self.current = None

    def run(self) -> dict[str, Any]:
        opts = self.opts
        try:
            if self.reps:
                for h in range(PROCESSES):
                    self.reps.start(h)
            self.job.start()
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
                    self.start_over(error)
                elif self.current is not None and now - self.current["t_fail"] > RECOVERY_TIMEOUT_SECONDS:
                    self.start_over(f"no first step within {RECOVERY_TIMEOUT_SECONDS:.0f} s")
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


def _public(rec: dict[str, Any]) -> dict[str, Any]:
    """A failure's record without its raw clock readings."""
    return {k: v for k, v in rec.items() if not k.startswith("t_") and k != "incarnation"}


def run(opts: RunOptions, scratch: Path) -> dict[str, Any]:
    """One system's run; its record (``{"error": ...}`` when it could not even start)."""
    try:
        return Harness(opts, scratch).run()
    except Exception as e:  # noqa: BLE001 - reported as this system's error, with its exact text
        return {"error": f"{type(e).__name__}: {e}"}
