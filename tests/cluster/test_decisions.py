"""What the real Job and JobSet controllers decide for the JobSets `mtc manifests` renders.

As Kubernetes' own Job integration tests do, the Pods' fate is written through the status subresource (the
kubelet's part; no process runs here, tests/cluster/test_scenarios.py runs them): a preemption notice (the
``DisruptionTarget`` condition and phase Failed), a genuine failure (exit 1), the trainer's "saved after a
notice" exit 75, success. The controllers are the real ones (tests/cluster/controlplane.py). Every rendered
Pod gets an extra nodeSelector no node has, so that no Pod is ever bound and the API server deletes unbound
Pods at once: only the controllers act here. Without nodes JobSet's exclusive placement would hold back every
Pod but each Job's leader (its webhook admits followers once the leader is scheduled), so the annotation is
dropped here; placement is the scenarios' part (test_scenarios.py, with nodes).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from controller_client import manifests as mf
from controller_client.preemption_exit import PREEMPTED_EXIT_CODE
from tests.cluster.controlplane import REPO, ControlPlane
from tests.cluster.test_apply import apply

pytestmark = [pytest.mark.cluster, pytest.mark.scenario, pytest.mark.timeout(300)]

WAIT_SECONDS = 30.0
MTC = REPO / ".venv" / "bin" / "mtc"
UNSCHEDULABLE = {"mtc.test/no-such-node": "true"}
EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"

MULTI_NATIVE = mf.ManifestOptions(mode="multi-controller", front_door="native", job="mcn", max_restarts=2,
                                  backup_url="gs://b/ckpt")
MULTI_ORBAX = mf.ManifestOptions(mode="multi-controller", front_door="orbax", job="mco", max_restarts=2,
                                 backup_url="gs://b/ckpt")
PATHWAYS = mf.ManifestOptions(mode="pathways", job="pw", max_restarts=2, backup_url="gs://b/ckpt",
                              pathways_scratch="gs://b/tmp")
PATHWAYS_ELASTIC = dataclasses.replace(PATHWAYS, job="pwe", elastic_slices=2)
NON_ELASTIC = {"multi-controller-native": MULTI_NATIVE, "multi-controller-orbax": MULTI_ORBAX, "pathways": PATHWAYS}


def wait_for(what: str, cond: Callable[[], Any], timeout: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


class Deployed:
    """One rendered JobSet in a namespace of its own, its Pods' fate written by hand."""

    def __init__(self, api: Any, opts: mf.ManifestOptions, ns: str) -> None:
        self.api, self.opts, self.ns = api, opts, ns
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.core.create_namespace({"metadata": {"name": self.ns}})
        apply(api, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mtc-token"},
                    "stringData": {"token": "0123456789abcdef"}}, self.ns)
        for name, doc in mf.objects(opts).items():
            if name == "jobset.yaml":
                for rj in doc["spec"]["replicatedJobs"]:
                    pod = rj["template"]["spec"]["template"]
                    pod["spec"].setdefault("nodeSelector", {}).update(UNSCHEDULABLE)
                    pod.get("metadata", {}).get("annotations", {}).pop(EXCLUSIVE, None)
            apply(api, doc, self.ns)

    def close(self) -> None:
        self.core.delete_namespace(self.ns)

    def jobset(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets",
                                                        self.opts.job)

    def status(self) -> dict[str, Any]:
        return self.jobset().get("status", {})

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.status().get("conditions", []) if c["type"] == kind and c["status"] == "True"),
                    None)

    def pods(self, rjob: str = "", attempt: int | None = None) -> list[Any]:
        out = []
        for p in self.core.list_namespaced_pod(self.ns).items:
            labels = p.metadata.labels or {}
            if rjob and labels.get("jobset.sigs.k8s.io/replicatedjob-name") != rjob:
                continue
            if attempt is not None and labels.get("jobset.sigs.k8s.io/restart-attempt") != str(attempt):
                continue
            if p.metadata.deletion_timestamp is None and p.status.phase in ("Pending", "Running"):
                out.append(p)
        return out

    def start(self, attempt: int = 0) -> list[Any]:
        """Every Pod of restart attempt ``attempt`` Running and Ready (Pathways: the head first: the JobSet
        creates the workers once it is ready, startupPolicy InOrder)."""
        rjobs = [rj["name"] for rj in mf.objects(self.opts)["jobset.yaml"]["spec"]["replicatedJobs"]]
        want = {rj["name"]: rj["replicas"] * rj["template"]["spec"]["parallelism"]
                for rj in mf.objects(self.opts)["jobset.yaml"]["spec"]["replicatedJobs"]}
        for rjob in rjobs:
            pods = wait_for(f"{want[rjob]} {rjob} Pods of attempt {attempt}",
                            lambda r=rjob: (p := self.pods(r, attempt)) and len(p) == want[r] and p)
            for p in pods:
                self.run_ready(p)
        return self.pods(attempt=attempt)

    def run_ready(self, pod: Any) -> None:
        now = _now()
        cs = [{"name": c.name, "image": c.image, "imageID": "", "ready": True, "restartCount": 0, "started": True,
               "state": {"running": {"startedAt": now}}} for c in pod.spec.containers]
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.ns, {"status": {
            "phase": "Running", "containerStatuses": cs, "startTime": now,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                           for t in ("Initialized", "ContainersReady", "Ready")]}})

    def end(self, pod: Any, exit_code: int, disruption: bool = False) -> None:
        """The Pod's containers exited with ``exit_code`` (phase Succeeded for 0, else Failed); with
        ``disruption`` the Pod first got ``DisruptionTarget`` as a preemption gives it."""
        now = _now()
        conditions = [{"type": "Ready", "status": "False", "lastTransitionTime": now}]
        if disruption:
            conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                               "message": "Pod was terminated in response to imminent node shutdown.",
                               "lastTransitionTime": now})
        cs = [{"name": c.name, "image": c.image, "imageID": "", "ready": False, "restartCount": 0, "started": False,
               "state": {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                        "startedAt": now, "finishedAt": now}}} for c in pod.spec.containers]
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.ns, {"status": {
            "phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": cs,
            "conditions": conditions}})

    def restarts(self) -> tuple[int, int]:
        st = self.status()
        return int(st.get("restarts", 0)), int(st.get("restartsCountTowardsMax", 0))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@pytest.fixture
def deploy(control_plane: ControlPlane) -> Iterator[Callable[[mf.ManifestOptions], Deployed]]:
    """Each JobSet in a namespace of its own (a fresh name: no wait for the previous one's deletion)."""
    made: list[Deployed] = []
    with control_plane.client() as api:
        def make(opts: mf.ManifestOptions) -> Deployed:
            _SERIAL[0] += 1
            d = Deployed(api, opts, f"{opts.job}-{_SERIAL[0]}")
            made.append(d)
            return d
        yield make
        for d in made:
            d.close()


_SERIAL = [0]


def _worker(pods: list[Any]) -> Any:
    return next(p for p in pods if p.metadata.labels["jobset.sigs.k8s.io/replicatedjob-name"] == "workers")


@pytest.mark.parametrize("name", sorted(NON_ELASTIC))
def test_a_notice_restarts_the_jobset_without_counting(deploy: Callable[..., Deployed], name: str) -> None:
    d = deploy(NON_ELASTIC[name])
    d.end(_worker(d.start()), 143, disruption=True)
    wait_for("a JobSet restart", lambda: d.restarts()[0] == 1)
    assert d.restarts() == (1, 0), "a preemption notice counted against maxRestarts"
    d.start(attempt=1)  # every Job re-created
    assert d.condition("Failed") is None and d.condition("Completed") is None


def test_eight_notices_in_a_row_restart_at_once_without_counting(deploy: Callable[..., Deployed],
                                                                 lifecycle: dict[str, float]) -> None:
    """A JobSet restart re-creates every Job, so no Job controller backoff carries over from one notice to the
    next: each of eight notices in a row has its Pods back at once, and none counts against maxRestarts."""
    d = deploy(MULTI_NATIVE)
    waits = []
    for attempt in range(8):
        victim = _worker(d.start(attempt))
        t0 = time.monotonic()
        d.end(victim, 143, disruption=True)
        wait_for(f"notice {attempt + 1}: the restarted Pods", lambda a=attempt: len(d.pods(attempt=a + 1)) ==
                 d.opts.nodes, WAIT_SECONDS)
        waits.append(round(time.monotonic() - t0, 1))
    lifecycle["jobset_notice_recreate_seconds_max"] = max(waits)
    assert d.restarts() == (8, 0)
    assert max(waits) < 10, f"re-creation waits: {waits}"


def test_exit_75_after_the_notice_save_restarts_without_counting(deploy: Callable[..., Deployed]) -> None:
    d = deploy(MULTI_NATIVE)
    d.end(_worker(d.start()), PREEMPTED_EXIT_CODE)
    wait_for("a JobSet restart", lambda: d.restarts()[0] == 1)
    assert d.restarts() == (1, 0)


@pytest.mark.parametrize("name", sorted(NON_ELASTIC))
def test_a_genuine_failure_restarts_and_counts_until_max_restarts_fails_it(deploy: Callable[..., Deployed],
                                                                          control_plane: ControlPlane,
                                                                          name: str) -> None:
    d = deploy(NON_ELASTIC[name])
    for attempt in range(d.opts.max_restarts):
        d.end(_worker(d.start(attempt)), 1)
        wait_for(f"restart {attempt + 1}", lambda a=attempt: d.restarts() == (a + 1, a + 1))
    d.end(_worker(d.start(d.opts.max_restarts)), 1)
    failed = wait_for("the JobSet Failed", lambda: d.condition("Failed"))
    assert failed["reason"] == "ReachedMaxRestarts", failed
    assert d.restarts() == (d.opts.max_restarts, d.opts.max_restarts)
    # `mtc status` says why, from the JobSet's typed status (no replicator runs any more).
    out = subprocess.run([str(MTC), "status", "--jobset", d.opts.job, "--namespace", d.ns, "--kubeconfig",
                          str(control_plane.kubeconfig), "-o", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)
    doc = json.loads(out.stdout)["jobset"]
    assert (doc["state"], doc["reason"], doc["restarts_count_towards_max"], doc["max_restarts"]) == (
        "Failed", "ReachedMaxRestarts", d.opts.max_restarts, d.opts.max_restarts), doc


@pytest.mark.parametrize("name", sorted(NON_ELASTIC))
def test_the_job_completes_only_when_training_ends(deploy: Callable[..., Deployed], name: str) -> None:
    d = deploy(NON_ELASTIC[name])
    pods = d.start()
    trainers = [p for p in pods if name.startswith("multi") or
                p.metadata.labels["jobset.sigs.k8s.io/replicatedjob-name"] == "head"]
    for p in trainers[:-1]:
        d.end(p, 0)
    time.sleep(2)
    assert d.condition("Completed") is None, "Completed before every trainer ended"
    d.end(trainers[-1], 0)
    wait_for("the JobSet Completed", lambda: d.condition("Completed"))
    assert d.restarts() == (0, 0)


def test_elastic_a_notice_replaces_only_that_pod(deploy: Callable[..., Deployed]) -> None:
    d = deploy(PATHWAYS_ELASTIC)
    pods = d.start()
    victim = _worker(pods)
    index = victim.metadata.labels["batch.kubernetes.io/job-completion-index"]
    job = victim.metadata.labels["job-name"]
    others = {p.metadata.name for p in pods} - {victim.metadata.name}
    d.end(victim, 143, disruption=True)
    new = wait_for("the replacement Pod", lambda: [
        p for p in d.pods("workers") if p.metadata.labels["job-name"] == job and
        p.metadata.labels["batch.kubernetes.io/job-completion-index"] == index and p.metadata.name != victim.metadata.name])
    assert new
    assert d.restarts() == (0, 0), "one slice's notice restarted the elastic JobSet"
    assert others <= {p.metadata.name for p in d.pods()}, "other Pods were replaced"


def test_elastic_slice_notices_in_a_row_wait_only_their_hosts_backoff(
        deploy: Callable[..., Deployed], lifecycle: dict[str, float]) -> None:
    """The Job controller delays re-creating failed Pods: 10 s doubling per failure (notices included) from the
    previous failure, at most 6 min (pkg/controller/job/backoff_utils.go). Counted per host
    (backoffLimitPerIndex, as rendered), a notice to a whole slice of H hosts waits 10 s, not 10 s x 2^(H-1):
    three slice notices in a row, each as soon as the slice is back, must wait at most 10, 20 and 40 s
    (docs/deploy.md). (Eight in a row would take ~10 min of backoff: the formula is the same.)"""
    d = deploy(PATHWAYS_ELASTIC)
    d.start()
    job = _worker(d.pods("workers")).metadata.labels["job-name"]
    hosts = d.opts.hosts_per_slice
    waits = []
    for n in range(1, 4):
        victims = wait_for("the slice's Pods", lambda: (v := [p for p in d.pods("workers")
                                                                 if p.metadata.labels["job-name"] == job]) and
                           len(v) == hosts and v)
        for v in victims:
            d.run_ready(v)
        t0 = time.monotonic()
        for v in victims:
            d.end(v, 143, disruption=True)
        gone = {v.metadata.name for v in victims}
        wait_for(f"notice {n}: the slice's {hosts} replacement Pods", lambda j=job, g=gone: len([
            p for p in d.pods("workers") if p.metadata.labels["job-name"] == j and p.metadata.name not in g]) == hosts,
                 10 * 2 ** (n - 1) + 30)
        waits.append(round(time.monotonic() - t0, 1))
    lifecycle["elastic_slice_notice_recreate_seconds"] = waits  # type: ignore[assignment]
    for n, w in enumerate(waits, 1):
        assert w <= 10 * 2 ** (n - 1) + 3, f"notice {n} waited {w} s for its Pods (all: {waits})"
    assert d.restarts() == (0, 0)
