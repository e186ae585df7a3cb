"""One Pod on one node, from sandbox to removal, as the kubelet's pod worker runs it.

:meth:`PodWorker.step` is called over and over by the agent's sync thread and never blocks for long: it
makes the sandbox (network namespace, volumes, /etc/hosts), runs init containers to completion, starts native
sidecars in order (each once started: its startup probe passed), then the main containers; restarts
containers per ``restartPolicy`` (the container's own, and its ``restartPolicyRules``) with back-off; restarts
every container in place when one exits with a code a ``RestartAllContainers`` rule names (the Pod, its sandbox
and volumes stay; :meth:`PodWorker._begin_reset`); runs probes; and on deletion runs ``preStop`` hooks, sends
SIGTERM and SIGKILLs at the end of the grace period (timed from when the deletion was seen), main containers
first, then sidecars in reverse order. :meth:`PodWorker.status` is the Pod status to report.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster import pod_spec
from tests.cluster.kube import Kube, now_rfc3339, parse_time
from tests.cluster.pod_network import PodNetwork
from tests.cluster.pod_runtime import Container, init_argv, restart_action, write_spec
from tests.cluster.pod_spec import ImageRule, PodSetupError, Volumes
from tests.cluster.probes import Prober

log = logging.getLogger(__name__)

OWNED_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready", "AllContainersRestarting")
FORCED_GRACE_SECONDS = 2.0  # the kubelet's minimum grace for a Pod removed from the API under it
# The kubelet kills the containers of a RestartAllContainers with grace 0 (no preStop hook), which its runtime
# raises to its minimum of 2 s: SIGTERM, SIGKILL 2 s later, one container after the other
# (kuberuntime_manager.go SyncPod, minimumGracePeriodInSeconds).
RESET_GRACE_SECONDS = 2.0
RESTART_ALL = "RestartAllContainers"


@dataclass
class Runtime:
    """What all Pod workers of an agent share."""

    kube: Kube
    network: PodNetwork
    prober: Prober
    state_dir: Path
    images: Mapping[str, ImageRule]
    api_host: str
    api_port: int
    restart_backoff: tuple[float, float] = (1.0, 10.0)  # first and longest back-off (kubelet: 10 s, 300 s)
    hosts_changed: Callable[[], None] = lambda: None
    python: str = sys.executable


@dataclass
class NodeInfo:
    name: str
    ip: str
    allocatable: dict[str, str]
    dir: Path
    lost: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def hostname_of(pod: Mapping[str, Any]) -> str:
    return (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]


class PodWorker:
    def __init__(self, rt: Runtime, node: NodeInfo, pod: dict[str, Any]) -> None:
        self.rt = rt
        self.node = node
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.dir = rt.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        self.log_dir = rt.state_dir / "logs" / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        spec = pod["spec"]
        self.init = [Container(c, "sidecar" if c.get("restartPolicy") == "Always" else "init", c.get("image", ""))
                     for c in spec.get("initContainers") or []]
        self.main = [Container(c, "main", c.get("image", "")) for c in spec.get("containers") or []]
        self.netns = ""
        self.pod_ip = ""
        self.volumes: Volumes | None = None
        self.initialized = False
        self.was_initialized = False  # the kubelet keeps Initialized once true, through in-place restarts
        self.resetting: list[Container] | None = None  # a RestartAllContainers under way: what is left to stop
        self.restart_all_rules = any(r.get("action") == RESTART_ALL for c in self.init + self.main
                                     for r in c.spec.get("restartPolicyRules") or [])
        self.start_time = ""
        self.setup_error = ""
        self.terminal_phase = ""  # "Succeeded" or "Failed" once decided
        self.terminal_reason = ""
        self.deadline: float | None = None  # monotonic: the grace of a deletion or completion ends
        self.deleting = False  # deletionTimestamp seen (or the object is gone)
        self.gone = False  # the object was removed from the API
        self.torn_down = False
        self.finished = False  # nothing left to do: the agent may forget this worker
        self.lost = False  # the host died with it: nothing is reported any more
        self._since: dict[str, tuple[str, str]] = {}  # condition type -> (status, lastTransitionTime)

    # ------------------------------------------------------------------ inputs

    def update(self, pod: dict[str, Any]) -> None:
        if self.pod_ip and not pod.get("status", {}).get("podIP"):  # not reported yet: the Downward API needs it
            pod.setdefault("status", {}).update(podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp") and not self.deleting:
            self._begin_delete(pod)

    def removed(self) -> None:
        """The object was removed from the API (force deletion): stop within the kubelet's minimum grace."""
        self.gone = True
        if not self.deleting:
            self.deleting = True
            self.deadline = time.monotonic() + FORCED_GRACE_SECONDS
        elif self.deadline is not None:
            self.deadline = min(self.deadline, time.monotonic() + FORCED_GRACE_SECONDS)

    def _begin_delete(self, pod: Mapping[str, Any]) -> None:
        self.deleting = True
        meta = pod["metadata"]
        grace = float(meta.get("deletionGracePeriodSeconds", pod["spec"].get("terminationGracePeriodSeconds", 30)))
        # Timed from the deletion: deletionTimestamp is (deletion time + grace), to the second.
        late = max(0.0, time.time() - (parse_time(meta["deletionTimestamp"]) - grace))
        remaining = grace - late if late > 1.5 else grace
        self.deadline = time.monotonic() + max(0.0, remaining)
        log.info("pod %s: deleted, grace %.0fs", self.key, grace)

    def kill_all(self) -> None:
        """The host is gone: SIGKILL every process of the Pod now; nothing is reported any more."""
        self.lost = True
        for c in self.init + self.main:
            c.kill_now()

    # ------------------------------------------------------------------ the loop

    def step(self, now: float) -> None:
        for c in self.init + self.main:
            if c.poll():
                self._exited(c, now)
        if self.lost:
            if all(not c.running for c in self.init + self.main):
                self._teardown()
                self.finished = self.gone
            return
        if self.terminal_phase or self.deleting:
            self._terminate(now)
            return
        if self.resetting is not None:
            self._advance_reset(now)
            return
        if not self.netns:
            if not self._sandbox():
                return
        if not self._run_init(now):
            return
        self._run_main(now)

    def _sandbox(self) -> bool:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            for c in self.init + self.main:
                pod_spec.match_image(self.rt.images, c.image)
            vols = Volumes(self.rt.kube, self.pod, self.dir, self.node.dir)
            vols.build()
        except PodSetupError as e:
            if str(e) != self.setup_error:
                log.warning("pod %s: %s", self.key, e)
            self.setup_error = str(e)
            for c in self.init + self.main:
                c.waiting_reason, c.waiting_message = str(e).split(":")[0], str(e)
            return False
        self.volumes = vols
        self.setup_error = ""
        self.netns, self.pod_ip = self.rt.network.add_pod()
        self.start_time = self.start_time or now_rfc3339()
        (self.dir / "hosts").write_text(f"127.0.0.1\tlocalhost\n{self.pod_ip}\t{hostname_of(self.pod)}\n")
        ns = self.pod["metadata"]["namespace"]
        (self.dir / "resolv.conf").write_text(
            f"search {ns}.svc.{pod_spec.CLUSTER_DOMAIN} svc.{pod_spec.CLUSTER_DOMAIN} {pod_spec.CLUSTER_DOMAIN}\n"
            "nameserver 127.0.0.1\noptions ndots:5 attempts:1 timeout:1\n")
        self.pod.setdefault("status", {})["podIP"] = self.pod_ip  # for the Downward API
        self.pod["status"]["podIPs"] = [{"ip": self.pod_ip}]
        self.pod["status"]["hostIP"] = self.node.ip
        for c in self.init + self.main:
            c.waiting_reason = "PodInitializing" if c.kind == "main" and self.init else "ContainerCreating"
        self.rt.hosts_changed()
        log.info("pod %s: sandbox %s at %s", self.key, self.netns, self.pod_ip)
        return True

    def _start(self, c: Container, now: float) -> None:
        if now < c.next_start or self.volumes is None:
            return
        try:
            rule = pod_spec.match_image(self.rt.images, c.image)
            hostname = hostname_of(self.pod)
            base = pod_spec.default_base_env(rule, hostname, self.rt.api_host, self.rt.api_port)
            env = pod_spec.container_env(self.volumes, c.spec, base, self.node.allocatable)
            files = {"/etc/hosts": str(self.dir / "hosts"), "/etc/resolv.conf": str(self.dir / "resolv.conf")}
            spec = pod_spec.launch_spec(self.volumes, c.spec, rule, env, self.rt.state_dir / "rootfs",
                                        hostname, files)
        except PodSetupError as e:
            c.waiting_reason, c.waiting_message = str(e).split(":")[0], str(e)
            c.next_start = now + self.rt.restart_backoff[0]
            return
        path = write_spec(self.dir / "specs" / f"{c.name}.json", spec)
        argv = init_argv(self.rt.network.command(self.netns, []), path, self.rt.python)
        c.start(argv, self.log_dir / f"{c.name}.log", env)
        log.info("pod %s: started %s container %s (pid %s)", self.key, c.kind, c.name, c.proc.pid if c.proc else 0)

    def _exited(self, c: Container, now: float) -> None:
        code = c.last_exit["exitCode"] if c.last_exit else -1
        log.info("pod %s: container %s exited %s", self.key, c.name, code)
        if self.resetting is not None:  # stopped by a restart of every container: started again by it
            return
        action = restart_action(c.spec, code) if not (self.deleting or self.terminal_phase) else ""
        if action == RESTART_ALL:
            self._begin_reset(c)
            return
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if c.kind == "main" and c.spec.get("restartPolicy"):
            policy = c.spec["restartPolicy"]  # ContainerRestartRules: the container's own policy first
        again = (c.kind == "sidecar" or policy == "Always" or (policy == "OnFailure" and code != 0)
                 or (c.kind == "init" and code != 0 and policy != "Never") or action == "Restart")
        if again and not self.deleting and not self.terminal_phase:
            lo, hi = self.rt.restart_backoff
            c.backoff = min(hi, c.backoff * 2) if c.backoff else lo
            c.next_start = now + c.backoff
        else:
            c.next_start = float("inf")

    def _begin_reset(self, source: Container) -> None:
        """``source`` exited with a RestartAllContainers code: stop every other container (main containers, then
        init and sidecar containers, each in reverse order; no preStop hook), then start them all again in order.
        The Pod keeps its uid, node, sandbox and volumes (kubelet: ContainersToReset)."""
        log.info("pod %s: container %s asked to restart every container in place", self.key, source.name)
        self.resetting = [*reversed(self.main), *reversed(self.init)]
        self.initialized = False

    def _advance_reset(self, now: float) -> None:
        for c in self.resetting or []:
            if c.running:
                c.stop(now + RESET_GRACE_SECONDS, False, self.log_dir / f"{c.name}.log")
                c.advance_stop(now)
                return  # one container after the other
        for c in self.init + self.main:
            c.reset("PodInitializing" if c.kind == "main" and self.init else "ContainerCreating")
        self.resetting = None
        log.info("pod %s: every container stopped; starting them again in place", self.key)

    def _probe(self, c: Container, now: float) -> None:
        failed = c.run_probes(now, self.rt.prober, self.pod_ip)
        if failed:
            log.info("pod %s: container %s failed its %s; restarting", self.key, c.name, failed)
            spec = c.spec.get(failed) or {}
            grace = float(spec.get("terminationGracePeriodSeconds",
                                   self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
            c.stop(now + grace, True, self.log_dir / f"{c.name}.log")
        if c.stop_deadline is not None:
            c.advance_stop(now)

    def _run_init(self, now: float) -> bool:
        """Advance the init sequence; True once every init container is done or started."""
        for c in self.init:
            if c.kind == "sidecar":
                if c.running:
                    self._probe(c, now)
                elif c.next_start != float("inf"):
                    self._start(c, now)
                if not self.initialized and not (c.running and c.started):
                    return False
                continue
            if self.initialized or c.succeeded:
                continue
            if not c.running:
                if c.last_exit is not None and c.next_start == float("inf"):
                    self._finish("Failed", now, "init container failed")
                    return False
                self._start(c, now)
            return False
        if not self.initialized:
            log.info("pod %s: initialized", self.key)
        self.initialized = self.was_initialized = True
        return True

    def _run_main(self, now: float) -> None:
        for c in self.main:
            if c.running:
                self._probe(c, now)
            elif c.next_start != float("inf"):
                self._start(c, now)
        if all(not c.running and c.next_start == float("inf") for c in self.main):
            ok = all(c.succeeded for c in self.main)
            self._finish("Succeeded" if ok else "Failed", now, "")

    def _finish(self, phase: str, now: float, reason: str) -> None:
        """The Pod is complete: stop the sidecars (reverse order) within the grace, then report ``phase``."""
        self.terminal_phase = phase
        self.terminal_reason = reason
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.deadline = now + grace
        log.info("pod %s: %s", self.key, phase)

    def _terminate(self, now: float) -> None:
        """Stop everything (main containers first, then sidecars in reverse order), then tear down."""
        deadline = self.deadline if self.deadline is not None else now
        hook = not self.terminal_phase or self.deleting
        for c in self.main + [c for c in self.init if c.kind == "init"]:
            c.stop(deadline, hook, self.log_dir / f"{c.name}.log")
            c.advance_stop(now)
        if all(not c.running for c in self.main + self.init if c.kind != "sidecar"):
            for c in reversed([c for c in self.init if c.kind == "sidecar"]):
                if c.running:
                    c.stop(deadline, hook, self.log_dir / f"{c.name}.log")
                    c.advance_stop(now)
                    break
        if any(c.running for c in self.init + self.main):
            return
        if not self.terminal_phase:
            ok = self.initialized and all(c.succeeded for c in self.main)
            self.terminal_phase = "Succeeded" if ok else "Failed"
        self._teardown()

    def _teardown(self) -> None:
        if self.torn_down:
            return
        self.torn_down = True
        if self.netns:
            self.rt.network.remove_pod(self.netns)
        shutil.rmtree(self.dir, ignore_errors=True)  # emptyDirs, configMap copies, tokens
        self.rt.hosts_changed()
        log.info("pod %s: sandbox torn down", self.key)

    # ------------------------------------------------------------------ reporting

    @property
    def serving(self) -> bool:
        """Whether the Pod has a network namespace in use (for the other Pods' /etc/hosts)."""
        return bool(self.netns) and not self.torn_down and not self.lost

    @property
    def done(self) -> bool:
        """Every container exited and the sandbox is gone."""
        return self.torn_down

    def status(self) -> dict[str, Any]:
        """The Pod status the kubelet would report now (the conditions it owns only)."""
        mains_ready = all(c.ready for c in self.main + self.init if c.kind != "init")
        terminal = bool(self.terminal_phase) and self.torn_down
        if terminal:
            phase = self.terminal_phase
        elif not self.was_initialized:
            phase = "Pending"
        else:
            phase = "Running"
        ready = mains_ready and not terminal and not self.deleting
        for gate in self.pod["spec"].get("readinessGates") or []:
            ready = ready and any(c.get("type") == gate["conditionType"] and c.get("status") == "True"
                                  for c in self.pod.get("status", {}).get("conditions") or [])
        not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
        conds = {
            "PodReadyToStartContainers": (bool(self.netns) and not self.torn_down, ""),
            "Initialized": (self.was_initialized or (terminal and not self.init), "" if self.was_initialized
                            else "ContainersNotInitialized"),
            "ContainersReady": (ready, "" if ready else not_ready_reason),
            "Ready": (ready, "" if ready else not_ready_reason),
        }
        if self.restart_all_rules:
            conds["AllContainersRestarting"] = (self.resetting is not None and not terminal, "")
        old = {c["type"]: c for c in self.pod.get("status", {}).get("conditions") or []}
        conditions = [c for t, c in old.items() if t not in OWNED_CONDITIONS]
        for t, (ok, reason) in conds.items():
            status = "True" if ok else "False"
            if self._since.get(t, ("", ""))[0] != status:
                self._since[t] = (status, now_rfc3339())
            since = self._since[t][1]
            cond = {"type": t, "status": status, "lastTransitionTime": since}
            if reason:
                cond["reason"] = reason
            conditions.append(cond)
        out: dict[str, Any] = {"phase": phase, "conditions": conditions, "hostIP": self.node.ip,
                               "hostIPs": [{"ip": self.node.ip}],
                               "initContainerStatuses": [c.status() for c in self.init],
                               "containerStatuses": [c.status() for c in self.main]}
        if self.pod_ip:
            out["podIP"], out["podIPs"] = self.pod_ip, [{"ip": self.pod_ip}]
        if self.start_time:
            out["startTime"] = self.start_time
        if self.terminal_reason and terminal:
            out["message"] = self.terminal_reason
        return out


def write_hosts(workers: Iterable[PodWorker]) -> None:
    """Rewrite every running Pod's /etc/hosts in place (its inode is bind-mounted into the containers): its
    own names, and ``hostname.subdomain[.<ns>.svc.cluster.local]`` of every other Pod with a subdomain."""
    serving = [w for w in workers if w.serving]
    for w in serving:
        ns = w.pod["metadata"]["namespace"]
        lines = ["# Kubernetes-managed hosts file (node agent).", "127.0.0.1\tlocalhost",
                 "::1\tlocalhost ip6-localhost ip6-loopback"]
        for o in [w] + [o for o in serving if o is not w]:
            host, sub = hostname_of(o.pod), o.pod["spec"].get("subdomain")
            ons = o.pod["metadata"]["namespace"]
            names = []
            if sub:
                names.append(f"{host}.{sub}.{ons}.svc.{pod_spec.CLUSTER_DOMAIN}")
                if ons == ns:
                    names.append(f"{host}.{sub}")
            if o is w:
                names.append(host)
            if names:
                lines.append(f"{o.pod_ip}\t{' '.join(names)}")
        data = ("\n".join(lines) + "\n").encode()
        try:
            fd = os.open(w.dir / "hosts", os.O_WRONLY)
        except FileNotFoundError:
            continue
        try:
            os.write(fd, data)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

