"""A container as a process, and its probes and hooks, as the kubelet and a container runtime handle them.

Each container is ``ip netns exec <pod namespace> unshare --mount --uts --propagation private python
container_init.py <spec>`` (``ip``, ``unshare`` and the init all exec, so the pid is the container's), in a
session of its own and bound to the starting thread (SIGKILL if it ends). A container stopped or gone has its
whole process group SIGKILLed before it is reaped, as a runtime kills a container's cgroup (a process that
started a session of its own escapes that; nothing here does). Exec probes and ``preStop`` hooks run in the
container's namespaces and root with ``nsenter``. Everything here is driven from the agent's sync thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.children import bound_to_us
from tests.cluster.kube import now_rfc3339
from tests.cluster.probes import Prober

INIT_SCRIPT = Path(__file__).resolve().parent / "container_init.py"
WAIT_SECONDS = 5.0  # a reaped or killed process is waited for at most this long


def exit_code(returncode: int) -> int:
    """A Popen return code as the runtime reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def has_exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it (so its pid, and so its group id, stay ours)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def spawn(argv: Sequence[str], log_path: Path | None, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """``argv`` in a session of its own, SIGKILLed when the starting thread ends; output to ``log_path``."""
    if log_path is None:
        out: Any = subprocess.DEVNULL
    else:
        out = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed below
    try:
        return subprocess.Popen(bound_to_us(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(env) if env is not None else None)
    finally:
        if log_path is not None:
            out.close()


def reap(proc: subprocess.Popen) -> int:
    """Kill what is left of ``proc``'s process group, reap ``proc``; its return code."""
    kill_group(proc.pid)
    try:
        return proc.wait(WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(WAIT_SECONDS)


@dataclass
class ProbeState:
    """One probe of one container: when it runs next, what is in flight, consecutive results."""

    spec: dict[str, Any]
    next_due: float
    pending: Any = None  # a Prober id or an exec probe's Popen
    pending_since: float = 0.0
    successes: int = 0
    failures: int = 0
    passed: bool | None = None  # the last verdict after the thresholds

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))


@dataclass
class Container:
    """A container of a Pod and its current process (one at a time; restarts make new ones)."""

    spec: dict[str, Any]
    kind: str  # "init", "sidecar" or "main"
    image: str = ""
    proc: subprocess.Popen | None = None
    container_id: str = ""
    restart_count: int = -1  # 0 after the first start
    started_at: str = ""
    last_exit: dict[str, Any] | None = None  # the state.terminated of the last process
    previous_exit: dict[str, Any] | None = None  # lastState.terminated
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    probes: dict[str, ProbeState] = field(default_factory=dict)
    next_start: float = 0.0  # monotonic: restart back-off
    backoff: float = 0.0
    hook: subprocess.Popen | None = None
    hook_deadline: float = 0.0
    stop_deadline: float | None = None  # monotonic: a stop is under way, SIGKILL then
    term_sent: bool = False
    env: dict[str, str] = field(default_factory=dict)
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.proc is not None

    @property
    def succeeded(self) -> bool:
        return self.proc is None and self.last_exit is not None and self.last_exit["exitCode"] == 0

    def start(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.container_id = f"mtck://{uuid.uuid4().hex}"
        self.proc = spawn(argv, log_path)
        self.restart_count += 1
        self.started_at = now_rfc3339()
        if self.last_exit is not None:
            self.previous_exit = self.last_exit
        self.last_exit = None
        self.started = "startupProbe" not in self.spec
        self.ready = False
        self.stop_deadline = None
        self.term_sent = False
        now = time.monotonic()
        self.probes = {k: ProbeState(self.spec[k], now + float(self.spec[k].get("initialDelaySeconds", 0)))
                       for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in self.spec}

    def poll(self) -> bool:
        """Reap the process if it exited (killing what is left of its group); True when it did now."""
        if self.proc is None or not has_exited(self.proc.pid):
            return False
        code = exit_code(reap(self.proc))
        self.proc = None
        self.last_exit = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                          "startedAt": self.started_at, "finishedAt": now_rfc3339(),
                          "containerID": self.container_id}
        self.ready = False
        self._end_hook()
        for p in self.probes.values():
            if isinstance(p.pending, subprocess.Popen):
                reap(p.pending)
        self.probes.clear()
        self.stop_deadline = None
        return True

    def reset(self, waiting_reason: str) -> None:
        """Removed in a restart of every container of the Pod (``RestartAllContainers``): the next start is a new
        container (restartCount + 1, the last exit as ``lastState``), with no back-off; init containers run again."""
        if self.last_exit is not None:
            self.previous_exit = self.last_exit
        self.last_exit = None
        self.next_start, self.backoff = 0.0, 0.0
        self.started = self.ready = False
        self.waiting_reason, self.waiting_message = waiting_reason, ""

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this container's namespaces and root (for an exec probe or hook)."""
        if self.proc is None:
            raise RuntimeError(f"container {self.name} is not running")
        return ["nsenter", "-t", str(self.proc.pid), "-m", "-u", "-n", "-r", "-w", "--", *argv]

    def stop(self, deadline: float, run_hook: bool, log_path: Path) -> None:
        """Begin stopping: the preStop hook (exec or sleep) if ``run_hook``, then SIGTERM, SIGKILL at
        ``deadline`` (monotonic). Calling it again only moves the deadline earlier."""
        if self.proc is None:
            return
        if self.stop_deadline is not None:
            self.stop_deadline = min(self.stop_deadline, deadline)
            return
        self.stop_deadline = deadline
        pre = ((self.spec.get("lifecycle") or {}).get("preStop") or {}) if run_hook else {}
        if "exec" in pre:
            self.hook = spawn(self.exec_argv(pre["exec"]["command"]), log_path, self.env)
            self.hook_deadline = deadline
        elif "sleep" in pre:
            self.hook_deadline = min(deadline, time.monotonic() + float(pre["sleep"]["seconds"]))

    def advance_stop(self, now: float) -> None:
        """The next move of a stop under way (hook done -> SIGTERM; deadline -> SIGKILL)."""
        if self.proc is None or self.stop_deadline is None:
            return
        if now >= self.stop_deadline:
            self._end_hook()
            kill_group(self.proc.pid)
            return
        if self.hook is not None and not has_exited(self.hook.pid) and now < self.hook_deadline:
            return
        if self.hook is None and now < self.hook_deadline:
            return  # a sleep hook
        self._end_hook()
        if not self.term_sent:
            self.term_sent = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def _end_hook(self) -> None:
        if self.hook is not None:
            reap(self.hook)
            self.hook = None
        self.hook_deadline = 0.0

    def kill_now(self) -> None:
        """SIGKILL the container's process group and hook at once (not reaped: :meth:`poll` does that)."""
        for p in (self.proc, self.hook):
            if p is not None:
                kill_group(p.pid)

    # ------------------------------------------------------------------ probes

    def run_probes(self, now: float, prober: Prober, pod_ip: str) -> str | None:
        """Advance this container's probes; the name of a probe that crossed its failure threshold (the
        container is to be restarted), else None. Startup runs first; liveness and readiness after it."""
        if self.proc is None or self.stop_deadline is not None:
            return None
        for kind, p in self.probes.items():
            if kind != "startupProbe" and not self.started:
                continue
            if kind == "startupProbe" and self.started:
                continue
            verdict = self._probe_result(p, now, prober)
            if verdict is not None:
                threshold = "successThreshold" if verdict else "failureThreshold"
                if verdict:
                    p.successes, p.failures = p.successes + 1, 0
                else:
                    p.failures, p.successes = p.failures + 1, 0
                count = p.successes if verdict else p.failures
                if count >= int(p.spec.get(threshold, 1 if verdict else 3)):
                    p.passed = verdict
                    if kind == "startupProbe" and verdict:
                        self.started = True
                    if not verdict and kind in ("startupProbe", "livenessProbe"):
                        return kind
            if p.pending is None and now >= p.next_due:
                p.next_due = now + p.period
                p.pending_since = now
                p.pending = self._probe_start(p.spec, prober, pod_ip)
        rp = self.probes.get("readinessProbe")
        self.ready = self.started and (rp is None or bool(rp.passed))
        return None

    def _probe_start(self, spec: Mapping[str, Any], prober: Prober, pod_ip: str) -> Any:
        timeout = float(spec.get("timeoutSeconds", 1))
        if "exec" in spec:
            return spawn(self.exec_argv(spec["exec"]["command"]), None, self.env)
        if "grpc" in spec:
            return prober.submit("grpc", pod_ip, self._port(spec["grpc"]["port"]), timeout,
                                 service=spec["grpc"].get("service") or "")
        if "tcpSocket" in spec:
            t = spec["tcpSocket"]
            return prober.submit("tcp", t.get("host") or pod_ip, self._port(t["port"]), timeout)
        if "httpGet" in spec:
            h = spec["httpGet"]
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
            return prober.submit("http", h.get("host") or pod_ip, self._port(h["port"]), timeout,
                                 path=h.get("path") or "/", scheme=h.get("scheme") or "HTTP", headers=headers)
        raise ValueError(f"container {self.name}: unsupported probe {sorted(spec)}")

    def _probe_result(self, p: ProbeState, now: float, prober: Prober) -> bool | None:
        if p.pending is None:
            return None
        if isinstance(p.pending, subprocess.Popen):
            if has_exited(p.pending.pid):
                code = reap(p.pending)
                p.pending = None
                return code == 0
            if now - p.pending_since > p.timeout:
                reap(p.pending)
                p.pending = None
                return False
            return None
        res = prober.result(p.pending)
        if res is None:
            if now - p.pending_since > p.timeout + 5.0:  # the helper answers after its own timeout
                p.pending = None
                return False
            return None
        p.pending = None
        return res[0]

    def _port(self, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for cp in self.spec.get("ports") or []:
            if cp.get("name") == port:
                return int(cp["containerPort"])
        raise ValueError(f"container {self.name} has no port named {port}")

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """This container's entry in ``containerStatuses`` / ``initContainerStatuses``."""
        if self.proc is not None:
            state: dict[str, Any] = {"running": {"startedAt": self.started_at}}
        elif self.last_exit is not None and (self.next_start == float("inf") or self.next_start <= time.monotonic()):
            state = {"terminated": dict(self.last_exit)}
        elif self.last_exit is not None:
            state = {"waiting": {"reason": "CrashLoopBackOff",
                                 "message": f"back-off {self.backoff:.0f}s restarting failed container"}}
        else:
            state = {"waiting": {"reason": self.waiting_reason, **({"message": self.waiting_message}
                                                                   if self.waiting_message else {})}}
        last = self.previous_exit if self.proc is not None or "waiting" in state else None
        out = {"name": self.name, "image": self.image, "imageID": "", "ready": self.ready,
               "restartCount": max(self.restart_count, 0), "state": state,
               "lastState": {"terminated": dict(last)} if last else {},
               "started": self.proc is not None and self.started}
        if self.container_id:
            out["containerID"] = self.container_id
        return out


def restart_action(spec: Mapping[str, Any], code: int) -> str:
    """The action of the first of the container's ``restartPolicyRules`` matching exit ``code`` ("" if none), as
    the kubelet's FindMatchingContainerRestartRule (operators In and NotIn)."""
    for rule in spec.get("restartPolicyRules") or []:
        codes = rule.get("exitCodes") or {}
        if (codes.get("operator") == "In") == (code in (codes.get("values") or [])):
            return str(rule.get("action", ""))
    return ""


def init_argv(netns_command: Sequence[str], spec_path: Path, python: str) -> list[str]:
    """What starts a container: its namespaces, then ``container_init.py`` with its spec."""
    return [*netns_command, "unshare", "--mount", "--uts", "--propagation", "private", "--",
            python, str(INIT_SCRIPT), str(spec_path)]


def write_spec(path: Path, spec: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return path
