"""A model of what the Job and JobSet controllers decide for a rendered JobSet, driven by Pod timelines.

No kube-apiserver, Job or JobSet controller runs on these machines (DESIGN.md §10), so the decisions are
written here from the upstream source; facts carry over, code does not. Sources read:

- Kubernetes ``pkg/controller/job/job_controller.go`` (commit 6ae037f1db843e99547258d7dd292301a74ba0eb):
  ``isPodFailed`` (a Pod with a deletion timestamp that has not succeeded counts as failed at once unless
  ``onlyReplaceFailedPods``: a podFailurePolicy or podReplacementPolicy Failed), ``delayTerminalCondition``
  (JobManagedBy / JobPodReplacementPolicy on, the default since 1.31: FailureTarget / SuccessCriteriaMet
  first, Failed / Complete once no Pod is terminating), ``deleteActivePods`` on FailureTarget,
  ``pastBackoffLimitOnFailure`` (restartPolicy OnFailure: container restarts count; backoffLimit 0 = any).
- Kubernetes ``pkg/controller/job/pod_failure_policy.go`` (commit 2b02db1be88b09193d96585c4b6dd796d6b2e06c):
  ``matchPodFailurePolicy``: rules in order, onExitCodes over terminated non-zero container and init
  container statuses, onPodConditions by type and status; FailJob = reason ``PodFailurePolicy``, Ignore =
  not counted. ``pkg/apis/batch/validation``: a podFailurePolicy needs restartPolicy Never; ``In`` values
  must not hold 0.
- JobSet v0.12.0 ``pkg/controllers/jobset_controller.go`` (``reconcile``: a finished JobSet deletes its
  active Jobs; Jobs of an earlier restart attempt are deleted with foreground propagation; failed Jobs are
  handled before successful ones; ``shouldCreateJob``: a Job is re-created once its namesake is gone),
  ``pkg/controllers/failure_policy.go`` (first rule matching a failed Job by onJobFailureReasons and
  targetReplicatedJobs wins, else RestartJobSet; RestartJobSet fails the JobSet once RestartsCountTowardsMax
  reached maxRestarts; RestartJobSetAndIgnoreMaxRestarts does not count; RestartJob's applier returns an
  error while the RestartJob gate is off), ``pkg/webhooks/jobset_webhook.go`` (``validateFailurePolicy``:
  rule names ``^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$``, RestartJob / RestartJobAndIgnoreMaxRestarts refused
  while the gate is off) and ``pkg/features/features.go`` (RestartJob: alpha, default false).

What the model does not know is stated where it is assumed (pathways-worker's exit status on SIGTERM: 0,
the worst case; a lost node's Pods: evicted by the taint manager after the default 300 s toleration).
Times are whole seconds.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

DISRUPTION = "DisruptionTarget"
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
GATED_ACTIONS = {"RestartJob", "RestartJobAndIgnoreMaxRestarts"}
TAINT_TOLERATION_SECONDS = 300  # DefaultTolerationSeconds admission: not-ready / unreachable
PODGC_AFTER_EVICTION_SECONDS = 40  # the lost node's object removed, PodGC marks its Pods Failed
KILLED = 137


class Rejected(ValueError):
    """The API server (JobSet webhook, Job validation) refuses the object."""


# --------------------------------------------------------------------------- admission


def admit(jobset: dict[str, Any], jobset_gates: frozenset[str] = frozenset()) -> None:
    """Raise Rejected as the JobSet webhook and the Job validation of its templates would."""
    spec = jobset["spec"]
    names = {rj["name"] for rj in spec["replicatedJobs"]}
    fp = spec.get("failurePolicy") or {}
    for rule in fp.get("rules", []):
        if rule["action"] in GATED_ACTIONS and "RestartJob" not in jobset_gates:
            raise Rejected("RestartJob and RestartJobAndIgnoreMaxRestarts failure policy actions are not allowed "
                           "when RestartJob feature gate is disabled")
        if not RULE_NAME.match(rule.get("name", "")):
            raise Rejected(f"invalid failure policy rule name {rule.get('name')!r}")
        for t in rule.get("targetReplicatedJobs", []):
            if t not in names:
                raise Rejected(f"rule {rule['name']} targets unknown replicated job {t}")
    for rj in spec["replicatedJobs"]:
        job = rj["template"]["spec"]
        pod = job["template"]["spec"]
        if pod.get("restartPolicy") not in ("Never", "OnFailure"):
            raise Rejected(f"{rj['name']}: a Job's restartPolicy must be Never or OnFailure")
        pfp = job.get("podFailurePolicy")
        if pfp is None:
            continue
        if pod["restartPolicy"] != "Never":
            raise Rejected(f"{rj['name']}: podFailurePolicy needs restartPolicy Never")
        containers = {c["name"] for c in pod.get("containers", []) + pod.get("initContainers", [])}
        for r in pfp["rules"]:
            if r["action"] not in ("FailJob", "Ignore", "Count"):
                raise Rejected(f"{rj['name']}: podFailurePolicy action {r['action']}")
            ec = r.get("onExitCodes")
            if ec:
                if ec.get("containerName") and ec["containerName"] not in containers:
                    raise Rejected(f"{rj['name']}: onExitCodes.containerName {ec['containerName']} is no container")
                if ec["operator"] == "In" and 0 in ec["values"]:
                    raise Rejected("must not be 0 for the In operator")
                if list(ec["values"]) != sorted(set(ec["values"])):
                    raise Rejected("onExitCodes values must be ordered and unique")


# --------------------------------------------------------------------------- objects


@dataclasses.dataclass
class Pod:
    job: Job
    index: int
    created: int
    name: str
    phase: str = "Running"  # Pending (no node pool), Running, Succeeded, Failed
    pool: str = ""
    deleted_at: int | None = None
    deleted_by: str = ""  # notice, restart, job-failing, node-lost, ...
    ends_at: int | None = None
    conditions: set[str] = dataclasses.field(default_factory=set)
    exit_codes: dict[str, int] = dataclasses.field(default_factory=dict)
    restarts: int = 0
    stuck: bool = False  # a main container ended, another never will (restartPolicy Never)
    node_lost: bool = False
    counted: bool = False
    counts_against_backoff: bool = True
    notice_at: int | None = None
    hook_done_at: int | None = None

    @property
    def spec(self) -> dict[str, Any]:
        return self.job.spec["template"]["spec"]

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclasses.dataclass
class Job:
    rjob: str
    index: int
    attempt: int
    spec: dict[str, Any]
    pods: list[Pod] = dataclasses.field(default_factory=list)
    failure_target: str = ""
    condition: str = ""  # Complete | Failed
    reason: str = ""
    condition_at: int = 0
    deleting_at: int | None = None
    success_criteria: bool = False

    @property
    def name(self) -> str:
        return f"{self.rjob}-{self.index}"

    def only_replace_failed(self) -> bool:
        return self.spec.get("podFailurePolicy") is not None or self.spec.get("podReplacementPolicy") == "Failed"

    def is_pod_failed(self, p: Pod) -> bool:
        """job_controller.go isPodFailed."""
        if p.phase == "Failed":
            return True
        if self.only_replace_failed():
            return False
        return p.deleted_at is not None and p.phase != "Succeeded"


def match_pod_failure_policy(pfp: dict[str, Any] | None, p: Pod) -> tuple[str, bool]:
    """pod_failure_policy.go matchPodFailurePolicy: (action or "", counts against backoffLimit)."""
    if pfp is None:
        return "", True
    for rule in pfp["rules"]:
        ec = rule.get("onExitCodes")
        if ec is not None:
            hit = any(code != 0 and (ec.get("containerName") in (None, name))
                      and ((code in ec["values"]) == (ec["operator"] == "In"))
                      for name, code in p.exit_codes.items())
        else:
            hit = any(c["type"] in p.conditions and c["status"] == "True" for c in rule["onPodConditions"])
        if hit:
            return rule["action"], rule["action"] != "Ignore"
    return "", True


# --------------------------------------------------------------------------- scenario


@dataclasses.dataclass(frozen=True)
class Trainer:
    """The training program, as the documented loops behave (docs/elastic.md).

    ``save_seconds``: its last save after a notice. ``exit_after_notice``: its exit status once saved
    (controller_client.preemption_exit). ``keeps_going_on_slice_loss``: elastic training carries on when a
    worker slice goes (Pathways forwards the failure to the workload); otherwise a lost worker ends the
    program with exit 1 after ``crash_seconds``.
    """

    save_seconds: int = 5
    exit_after_notice: int = 75
    keeps_going_on_slice_loss: bool = False
    crash_seconds: int = 20


@dataclasses.dataclass(frozen=True)
class Event:
    at: int
    kind: str  # notice | evict | crash | node-lost
    rjob: str
    job_index: int = 0
    pod_indexes: tuple[int, ...] = (0,)
    container: str = ""  # crash: which container exits 1


@dataclasses.dataclass
class Outcome:
    state: str  # Rejected | Running | Completed | Failed
    restarts: int = 0
    restarts_counted: int = 0
    save_window_held: bool = True
    resumed: bool = False  # every Pod of the current attempt Running at the horizon
    restart_drain_seconds: int = 0  # longest deletion-to-end of a Pod deleted by a restart (not a notice)
    why: list[str] = dataclasses.field(default_factory=list)


def _arg(cmd: list[str], flag: str, default: float = 0.0) -> float:
    return float(cmd[cmd.index(flag) + 1]) if flag in cmd else default


class Cluster:
    """One JobSet on node pools (one slice each, plus ``spares``), stepped a second at a time."""

    def __init__(self, jobset: dict[str, Any], trainer: Trainer, *, spares: int = 1,
                 jobset_gates: frozenset[str] = frozenset(), delay_terminal_condition: bool = True) -> None:
        self.js = jobset
        self.spec = jobset["spec"]
        self.trainer = trainer
        self.gates = jobset_gates
        # Kubernetes >= 1.31 (JobPodReplacementPolicy / JobManagedBy on): a Job is Failed once no Pod of it is
        # terminating; 1.30 and earlier: at once (then the JobSet acts while its Pods still run their hooks).
        self.delay_terminal = delay_terminal_condition
        self.t = 0
        self.restarts = 0
        self.counted = 0
        self.state = "Running"
        self.jobs: list[Job] = []
        workers = next(rj for rj in self.spec["replicatedJobs"] if rj["name"] == "workers")
        self.pools = {f"pool-{i}": "" for i in range(workers["replicas"] + spares)}
        self.down_pools: set[str] = set()
        self.notices: list[tuple[int, list[Pod]]] = []
        self.trainer_notice_at: int | None = None
        self.trainer_exit_at: int | None = None
        self.save_broken: list[str] = []
        self.drain: list[int] = []
        self.pod_seq = 0
        self.stalled: list[str] = []

    # ------------------------------------------------------------------ helpers

    def rjob(self, name: str) -> dict[str, Any]:
        return next(rj for rj in self.spec["replicatedJobs"] if rj["name"] == name)

    def current(self) -> list[Job]:
        return [j for j in self.jobs if j.attempt == self.restarts]

    def pods(self) -> list[Pod]:
        return [p for j in self.jobs for p in j.pods]

    def _new_pod(self, job: Job, index: int) -> None:
        self.pod_seq += 1
        p = Pod(job, index, self.t, f"{job.name}-{index}-{self.pod_seq}")
        if job.rjob == "workers":
            pool = next((n for n, owner in self.pools.items() if owner in ("", job.name) and n not in self.down_pools
                         and not any(q.pool == n and not q.terminal for q in self.pods() if q.job is not job)), "")
            if pool:
                self.pools[pool] = job.name
                p.pool = pool
            else:
                p.phase = "Pending"
        job.pods.append(p)

    def _trainer_pods(self) -> list[Pod]:
        """The Pods running the training program: the head (Pathways) or every worker (multi-controller)."""
        rj = "head" if any(r["name"] == "head" for r in self.spec["replicatedJobs"]) else "workers"
        return [p for j in self.current() if j.rjob == rj for p in j.pods if not p.terminal and p.deleted_at is None]

    def trainer_container(self) -> str:
        return "controller" if any(r["name"] == "head" for r in self.spec["replicatedJobs"]) else "train"

    # ------------------------------------------------------------------ the kubelet

    def _hook_seconds(self, p: Pod, restart_evidence: bool) -> int:
        """How long the preStop hooks of the main containers run (in parallel) before SIGTERM."""
        longest = 0
        for c in p.spec["containers"]:
            pre = c.get("lifecycle", {}).get("preStop", {})
            if "sleep" in pre:
                d = int(pre["sleep"]["seconds"])
            elif "exec" in pre:
                cmd = pre["exec"]["command"]
                if restart_evidence and "--kube-api-dir" in cmd:
                    d = 1
                elif "--wait" in cmd:
                    d = int(_arg(cmd, "--save-window-seconds") + _arg(cmd, "--flush-seconds"))
                else:
                    d = 1
            else:
                d = 0
            longest = max(longest, d)
        return longest

    def _replicator_flush_seconds(self, p: Pod, restart_evidence: bool, hook_flushed: bool) -> int:
        """The replicator's own SIGTERM path (a native sidecar: after the main containers ended)."""
        hooks = [c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", []) for c in p.spec["containers"]]
        skip = restart_evidence and any("--kube-api-dir" in h and _arg_str(h, "--on-restart") == "skip" for h in hooks)
        if skip or hook_flushed:
            return 1
        for c in p.spec.get("initContainers", []):
            if c["name"] == "mtc-replicator":
                return int(_arg(c.get("args", []), "--preemption-grace-seconds", 25.0))
        return 1

    def delete_pod(self, p: Pod, by: str) -> None:
        if p.deleted_at is not None or p.terminal:
            return
        p.deleted_at, p.deleted_by = self.t, by
        trainer_pod = any(c["name"] == self.trainer_container() for c in p.spec["containers"])
        if by in ("restart", "job-failing") and trainer_pod and p.notice_at is None:
            for t0, noticed in self.notices:
                deadline = max([t0 + self.trainer.save_seconds] + [q.hook_done_at or 0 for q in noticed])
                if t0 <= self.t < deadline:
                    self.save_broken.append(f"t={self.t}: {p.name} (the trainer) deleted by {by} {self.t - t0}s "
                                            f"after a notice, before the save and the flush ended ({deadline - t0}s)")
        if p.phase == "Pending":
            p.phase, p.ends_at = "Failed", self.t
            return
        if p.node_lost:
            p.ends_at = self.t + PODGC_AFTER_EVICTION_SECONDS  # no kubelet: PodGC marks it Failed
            return
        job = p.job
        evidence = job.deleting_at is not None or bool(job.failure_target) or job.condition == "Failed"
        grace = int(p.spec.get("terminationGracePeriodSeconds", 30))
        hook = self._hook_seconds(p, evidence)
        hook_flushed = any("--wait" in c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                           for c in p.spec["containers"]) and not (evidence and self._fast_hook(p))
        trainer_here = any(c["name"] == self.trainer_container() for c in p.spec["containers"])
        main_end = hook + 1
        if trainer_here and self.trainer_exit_at is None:
            main_end = max(main_end, hook + self.trainer.save_seconds)  # its SIGTERM is its notice: it saves
        end = main_end + self._replicator_flush_seconds(p, evidence, hook_flushed)
        p.ends_at = self.t + min(grace, end)
        if p.deleted_by in ("notice", "evict"):
            p.hook_done_at = self.t + hook
            if hook > grace:
                self.save_broken.append(f"{p.name}: its hook needs {hook}s of a {grace}s grace")
        codes: dict[str, int] = {}
        killed = end > grace
        for c in p.spec["containers"]:
            name = c["name"]
            if name == self.trainer_container():
                codes[name] = KILLED if killed else (self.trainer.exit_after_notice if p.deleted_by in
                                                     ("notice", "evict") or self.trainer_notice_at is not None else 143)
            elif "--hold-while-port" in c.get("command", []):
                codes[name] = 143
            elif any("trap 'exit " in part for part in c.get("command", [])):
                cmd = " ".join(c["command"])
                codes[name] = int(cmd.split("trap 'exit ", 1)[1].split("'", 1)[0])
            else:
                codes[name] = 0  # pathways-worker on SIGTERM: assumed 0 (the worst case: the Pod could succeed)
        p.exit_codes.update(codes)

    def _fast_hook(self, p: Pod) -> bool:
        return any("--kube-api-dir" in c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                   for c in p.spec["containers"])

    def _kubelet(self) -> None:
        for p in self.pods():
            if p.terminal:
                continue
            if p.ends_at is not None and self.t >= p.ends_at:
                p.phase = "Failed" if (p.node_lost or any(v != 0 for v in p.exit_codes.values())) else "Succeeded"
            elif p.phase == "Pending" and p.job.rjob == "workers":
                self._place(p)

    def _place(self, p: Pod) -> None:
        for n, owner in self.pools.items():
            busy = any(q.pool == n and not q.terminal and q.job is not p.job for q in self.pods())
            if n not in self.down_pools and owner in ("", p.job.name) and not busy:
                self.pools[n], p.pool, p.phase = p.job.name, n, "Running"
                return

    def _container_exit(self, p: Pod, container: str, code: int) -> None:
        """A main container ends on its own (no deletion)."""
        if p.spec.get("restartPolicy") == "OnFailure" and code != 0:
            p.restarts += 1  # restarted in place by the kubelet
            return
        p.exit_codes[container] = code
        others = [c for c in p.spec["containers"] if c["name"] not in p.exit_codes]
        for c in others:
            if "--hold-while-port" in c.get("command", []):
                p.exit_codes[c["name"]] = 1  # the worker's port closed: the notice container ends too
        if all(c["name"] in p.exit_codes for c in p.spec["containers"]):
            p.ends_at = self.t + 15 if others else self.t
            self._kubelet_end_later(p)
        else:
            p.stuck = True

    def _kubelet_end_later(self, p: Pod) -> None:
        if p.ends_at is not None and p.ends_at <= self.t:
            p.phase = "Failed" if any(v != 0 for v in p.exit_codes.values()) else "Succeeded"

    # ------------------------------------------------------------------ the Job controller

    def _job_controller(self) -> None:
        for job in self.jobs:
            if job.condition:
                continue
            if job.deleting_at is not None:
                continue
            pfp = job.spec.get("podFailurePolicy")
            backoff = int(job.spec.get("backoffLimit", 6))
            newly = []
            for p in list(job.pods):
                if p.counted or not job.is_pod_failed(p):
                    continue
                p.counted = True
                newly.append(p)
                action, counts = match_pod_failure_policy(pfp, p) if p.phase == "Failed" else ("", True)
                if action == "FailJob" and not job.failure_target:
                    job.failure_target = "PodFailurePolicy"
                p.counts_against_backoff = counts
            failed = sum(1 for p in job.pods if p.counted and p.counts_against_backoff)
            on_failure = job.spec["template"]["spec"].get("restartPolicy") == "OnFailure"
            restarts = sum(p.restarts for p in job.pods if p.phase in ("Running", "Pending"))
            if not job.failure_target and (failed > backoff or (on_failure and (restarts > 0 if backoff == 0
                                                                                  else restarts >= backoff))):
                job.failure_target = "BackoffLimitExceeded"
            if not job.failure_target:  # manageJob: replacements only for a Job that goes on
                for p in newly:
                    if not self._index_done(job, p.index):
                        self._new_pod(job, p.index)
            if job.failure_target:
                for p in job.pods:
                    if not p.terminal and p.deleted_at is None:
                        self.delete_pod(p, "job-failing")
                if not self.delay_terminal or all(p.terminal for p in job.pods):  # delayTerminalCondition
                    job.condition, job.reason, job.condition_at = "Failed", job.failure_target, self.t
                continue
            if all(self._index_done(job, i) for i in range(int(job.spec["completions"]))):
                job.success_criteria = True
                if not self.delay_terminal or all(p.terminal for p in job.pods):
                    job.condition, job.condition_at = "Complete", self.t

    def _index_done(self, job: Job, i: int) -> bool:
        return any(p.index == i and p.phase == "Succeeded" for p in job.pods)

    # ------------------------------------------------------------------ the JobSet controller

    def _jobset_controller(self) -> None:
        # Jobs of an earlier attempt: foreground deletion, the Pods first, the Job once they are gone.
        for job in list(self.jobs):
            if job.attempt < self.restarts or self.state != "Running":
                if job.deleting_at is None and (job.attempt < self.restarts or not job.condition):
                    job.deleting_at = self.t
                for p in job.pods:
                    if not p.terminal and p.deleted_at is None:
                        self.delete_pod(p, "restart")
                        if p.deleted_by == "restart" and p.notice_at is None:
                            self.drain.append(p.ends_at - self.t if p.ends_at is not None else 10**6)
                if job.deleting_at is not None and all(p.terminal for p in job.pods):
                    self.jobs.remove(job)
                    for n, owner in self.pools.items():
                        if owner == job.name:
                            self.pools[n] = ""
        if self.state != "Running":
            return
        cur = self.current()
        failed = [j for j in cur if j.condition == "Failed"]
        if failed:
            self._failure_policy(failed)
            return
        done = [j for j in cur if j.condition == "Complete"]
        if done and self._success_policy(done):
            self.state = "Completed"
            return
        for rj in self.spec["replicatedJobs"]:
            for i in range(int(rj["replicas"])):
                name = f"{rj['name']}-{i}"
                if any(j.name == name for j in self.jobs):
                    continue
                job = Job(rj["name"], i, self.restarts, rj["template"]["spec"])
                self.jobs.append(job)
                for k in range(int(job.spec["completions"])):
                    self._new_pod(job, k)

    def _success_policy(self, done: list[Job]) -> bool:
        sp = self.spec.get("successPolicy") or {"operator": "All"}
        targets = sp.get("targetReplicatedJobs") or [rj["name"] for rj in self.spec["replicatedJobs"]]
        want = sum(int(self.rjob(t)["replicas"]) for t in targets) if sp["operator"] == "All" else 1
        return sum(1 for j in done if j.rjob in targets) >= want

    def _failure_policy(self, failed: list[Job]) -> None:
        fp = self.spec.get("failurePolicy")
        if fp is None:
            self.state = "Failed"
            return
        action = "RestartJobSet"
        for rule in fp.get("rules", []):
            hits = [j for j in failed if (not rule.get("onJobFailureReasons") or j.reason in rule["onJobFailureReasons"])
                    and (not rule.get("targetReplicatedJobs") or j.rjob in rule["targetReplicatedJobs"])]
            if hits:
                action = rule["action"]
                break
        if action in GATED_ACTIONS and "RestartJob" not in self.gates:
            self.stalled.append(f"{action}: the applier errors while the RestartJob gate is off")
            return
        if action == "FailJobSet":
            self.state = "Failed"
        elif action == "RestartJobSet":
            if self.counted >= int(fp.get("maxRestarts", 0)):
                self.state = "Failed"
                return
            self.restarts += 1
            self.counted += 1
        elif action == "RestartJobSetAndIgnoreMaxRestarts":
            self.restarts += 1
        else:  # RestartJob with the gate on: not modelled (our manifests never render it)
            raise NotImplementedError(action)

    # ------------------------------------------------------------------ the training program

    def _trainer(self) -> None:
        if self.trainer_notice_at is None or self.trainer_exit_at is not None:
            return
        if self.t >= self.trainer_notice_at + self.trainer.save_seconds:
            self.trainer_exit_at = self.t
            for p in self._trainer_pods():
                self._container_exit(p, self.trainer_container(), self.trainer.exit_after_notice)

    # ------------------------------------------------------------------ events and the run

    def apply(self, ev: Event) -> None:
        job = next(j for j in self.current() if j.rjob == ev.rjob and j.index == ev.job_index)
        pods = [p for p in job.pods if p.index in ev.pod_indexes and not p.terminal]
        if ev.kind in ("notice", "evict"):
            for p in pods:
                p.conditions.add(DISRUPTION)
                p.notice_at = self.t
                self.delete_pod(p, ev.kind)
                if ev.rjob == "workers" and ev.kind == "notice":
                    self.down_pools.add(p.pool)  # the node pool goes away with a whole-slice notice
            self.notices.append((self.t, pods))
            elastic = self.trainer.keeps_going_on_slice_loss and ev.rjob == "workers"
            if self.trainer_notice_at is None and not elastic:
                self.trainer_notice_at = self.t  # reached_preemption(): the coordinator tells every host
        elif ev.kind == "crash":
            for p in pods:
                self._container_exit(p, ev.container, 1)
            self._worker_lost(ev)
        elif ev.kind == "node-lost":
            for p in pods:
                p.node_lost = True
                self.down_pools.add(p.pool)
            self._worker_lost(ev)
        else:
            raise ValueError(ev.kind)

    def _worker_lost(self, ev: Event) -> None:
        """Non-elastic: the program sees the lost worker (Pathways' error, JAX's heartbeat) and exits 1."""
        if ev.rjob == "workers" and not self.trainer.keeps_going_on_slice_loss:
            self.pending_crash = (self.t + self.trainer.crash_seconds, self.restarts)

    def run(self, events: list[Event], horizon: int = 900) -> Outcome:
        try:
            admit(self.js, self.gates)
        except Rejected as e:
            return Outcome("Rejected", why=[str(e)])
        self.pending_crash: tuple[int, int] | None = None  # (when, the attempt whose worker was lost)
        lost: dict[int, list[Pod]] = {}
        for self.t in range(horizon):
            for ev in events:
                if ev.at == self.t:
                    self.apply(ev)
                    if ev.kind == "node-lost":
                        lost[self.t + TAINT_TOLERATION_SECONDS] = [p for p in self.pods() if p.node_lost]
            for p in lost.pop(self.t, []):  # the taint manager's eviction
                p.conditions.add(DISRUPTION)
                self.delete_pod(p, "node-lost")
            if self.pending_crash == (self.t, self.restarts):  # a restart since started programs afresh
                for p in self._trainer_pods():
                    self._container_exit(p, self.trainer_container(), 1)
            self._trainer()
            self._kubelet()
            self._job_controller()
            self._jobset_controller()
        cur = self.current()
        resumed = self.state == "Running" and bool(cur) and all(
            p.phase == "Running" for j in cur for p in j.pods if not p.terminal) and all(
            any(p.index == i and p.phase == "Running" for p in j.pods) for j in cur for i in range(int(j.spec["completions"])))
        return Outcome(self.state, self.restarts, self.counted, not self.save_broken, resumed,
                       max(self.drain, default=0), self.save_broken + self.stalled)


def _arg_str(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1] if flag in cmd else ""
