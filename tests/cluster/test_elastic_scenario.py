"""The rendered elastic Pathways JobSet running for real: a notice to one slice stops only that slice.

The real control plane decides; the node agent runs every Pod: our replicator sidecars and ``mtc preempt``
hooks as rendered, Google's Pathways images as the simulated Pathways across Pods
(``tests/cluster/pathways_images.py``: the head's resource manager hosts the workers' recoverable
``jax.distributed`` service, each worker Pod's ``pathways-worker`` dials the controller in the head Pod by the
names the manifests give), and the controller container runs the shipped elastic loop
(``tests/cluster/app/train_elastic.py``: ``preemption_scope="slices"``, ``noticed_slices()``,
``LeavingSlices``, scale-up by restore).

2 slices x 1 host x 2 devices, the head on a CPU node pool, the bucket a folder (``file://``) bound into the
replicators at ``/bucket``.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller_client import manifests as mf
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from tests.cluster import pathways_images
from tests.cluster.controlplane import ControlPlane
from tests.cluster.job_watch import PodWatch, deploy
from tests.cluster.node_agent import NodeAgent
from tests.cluster.pod_spec import VENV_BIN, ImageRule
from tests.cluster.test_decisions import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.scenario, pytest.mark.timeout(900)]

APP = Path(__file__).resolve().parent / "app"
REPO = Path(__file__).resolve().parents[2]
GRACE_SECONDS = 40
MONITOR_POLL_SECONDS = 1  # train_elastic.py's elastic_retry(poll_interval=...)
STEP_SECONDS = 0.25
SAVE_EVERY = 4
START_TIMEOUT_SECONDS = 300.0
REJOIN_TIMEOUT_SECONDS = 300.0
CONTROLLER_IMAGE = "REGISTRY/mtc-controller:0.1.0"
WORKERS = "workers"
POOLS = ("tpu-a", "tpu-b")  # one node pool per slice


class ElasticJob:
    """The rendered elastic Pathways JobSet in namespace ``ns`` (also its name), what its Pods did and when,
    the controller's events and when each step first appeared in the bucket."""

    def __init__(self, api: Any, agent: NodeAgent, results: Path, bucket: Path, ns: str) -> None:
        self.api, self.agent, self.ns, self.results, self.bucket = api, agent, ns, results, bucket
        self.opts = mf.ManifestOptions(
            mode="pathways", job=ns, slices=2, hosts_per_slice=1, tpu_topology="2x2", elastic_slices=2,
            backup_url="file:///bucket", backup_interval_minutes=30, termination_grace_seconds=GRACE_SECONDS,
            max_restarts=3, network_policy=False, pathways_scratch="gs://b/tmp", controller_image=CONTROLLER_IMAGE,
            controller_command=("python", "/app/train_elastic.py"))
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.pod_watch = PodWatch(self.core, ns)
        self.removed_at = self.pod_watch.removed_at  # "name/uid" -> monotonic time its object was seen removed
        self.in_bucket: dict[int, float] = {}  # step -> monotonic time it was first seen committed in the bucket
        self._stop = threading.Event()
        self._bucket_poll = threading.Thread(target=self._poll_bucket, daemon=True)

    def start(self) -> None:
        deploy(self.api, self.core, self.opts, self.ns)
        self.pod_watch.start()
        self._bucket_poll.start()

    def close(self) -> None:
        self._stop.set()
        self.pod_watch.stop()
        self._bucket_poll.join(timeout=10)
        self.core.delete_namespace(self.ns)

    def _poll_bucket(self) -> None:
        store = BackupStore(open_store(f"file://{self.bucket}"), self.ns)
        while not self._stop.wait(0.2):
            try:
                steps = store.committed_steps()
            except (FileNotFoundError, OSError):
                continue
            for s in steps:
                self.in_bucket.setdefault(s, time.monotonic())

    # ------------------------------------------------------------------ what happened
    def events(self) -> list[dict[str, Any]]:
        path = self.results / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def after(self, t: float, *evs: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["ev"] in evs and e["t"] > t]

    def restarts(self) -> tuple[int, int]:
        st = self.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets",
                                                      self.ns).get("status", {})
        return int(st.get("restarts", 0)), int(st.get("restartsCountTowardsMax", 0))

    def pods(self) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(self.ns).items if p.metadata.deletion_timestamp is None]

    def worker_of_slice(self, index: int) -> Any:
        return next(p for p in self.pods() if p.metadata.labels["jobset.sigs.k8s.io/replicatedjob-name"] == WORKERS
                    and p.metadata.labels["jobset.sigs.k8s.io/job-index"] == str(index))

    def head(self) -> Any:
        return next(p for p in self.pods() if p.metadata.labels["jobset.sigs.k8s.io/replicatedjob-name"] == "head")

    def diagnostics(self) -> str:
        out = [f"events: {self.events()[-15:]}", f"in bucket: {self.in_bucket}", f"removed: {self.removed_at}"]
        for p in self.core.list_namespaced_pod(self.ns).items:
            out.append(f"pod {p.metadata.name} {p.status.phase} on {p.spec.node_name}")
            for c in ("controller", "pathways-rm", "pathways-worker", "mtc-replicator", "preemption-notice"):
                try:
                    out.append(f"--- {c}:\n" + self.agent.logs(p.metadata.name, c, self.ns)[-2500:])
                except FileNotFoundError:
                    pass
        return "\n".join(out)

    def wait(self, what: str, cond: Any, timeout: float) -> Any:
        try:
            return wait_for(what, cond, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None


@pytest.fixture
def elastic_job(control_plane: ControlPlane, tmp_path: Path) -> Iterator[ElasticJob]:
    results, bucket = tmp_path / "results", tmp_path / "bucket"
    results.mkdir()
    bucket.mkdir()
    authkey = secrets.token_hex(16)
    env = {"PYTHONPATH": str(REPO), "MTC_SIM_AUTHKEY": authkey}
    controller_env = {**env, "MTC_TEST_RESULTS": "/results", "MTC_TEST_STEP_SECONDS": str(STEP_SECONDS),
                      "MTC_TEST_SAVE_EVERY": str(SAVE_EVERY), "MTC_TEST_SLICES": "2", "MTC_TEST_HOSTS_PER_SLICE": "1",
                      "MTC_TEST_DEVICES_PER_HOST": "2",
                      # LeavingSlices: terminationGracePeriodSeconds + the monitor's poll (docs/elastic.md)
                      "MTC_TEST_NOTICE_HOLD_SECONDS": str(GRACE_SECONDS + MONITOR_POLL_SECONDS)}
    images = {CONTROLLER_IMAGE: ImageRule(binds={"/app": str(APP), "/results": str(results)}, path=[str(VENV_BIN)],
                                          env=controller_env),
              "REGISTRY/mtc-sidecar:*": ImageRule(path=[str(VENV_BIN)], env=env,
                                                  command=pathways_images.sidecar_command()),
              "REGISTRY/mtc-replicator:*": ImageRule(binds={"/bucket": str(bucket)}, path=[str(VENV_BIN)]),
              **pathways_images.images(authkey)}
    with control_plane.client() as api, NodeAgent(api, control_plane.server, tmp_path / "agent",
                                                 images=images) as agent:
        agent.add_cpu_pool("cpu-np", cpu="32", memory="256Gi")  # the head asks for ~24 vCPU and 132 GB
        for pool in POOLS:
            agent.add_slice(pool, hosts=1, topology="2x2")
        j = ElasticJob(api, agent, results, bucket, "elastic-notice")
        try:
            yield j
        finally:
            j.close()


def _steps_on(events: list[dict[str, Any]], slices: list[int]) -> list[dict[str, Any]]:
    return [e for e in events if e["ev"] in ("first_step", "step") and e["slices"] == slices]


def test_elastic_a_notice_to_one_slice(elastic_job: ElasticJob, lifecycle: dict[str, float]) -> None:
    """Slice 1's node gets a notice: the controller drops slice 1 in place and slice 0 trains on; the step saved
    after the notice is in the bucket before slice 1's Pod is removed; only that Pod is replaced (no JobSet
    restart, the head and slice 0's Pod keep running), on the node that comes back; slice 1 rejoins: the next
    attempt restores the step saved at the scale-up onto both slices, bit for bit, and trains on both."""
    j, agent = elastic_job, elastic_job.agent
    j.start()
    j.wait("two saves on both slices", lambda: len([e for e in j.events() if e["ev"] == "saved"
                                                    and e["slices"] == [0, 1]]) >= 2, START_TIMEOUT_SECONDS)
    head, survivor, victim = j.head(), j.worker_of_slice(0), j.worker_of_slice(1)
    node = victim.spec.node_name  # JobSet places each slice's Job on a node pool of its own, either one
    pool = next(p for p in POOLS if node in agent.node_names(p))

    t0 = time.monotonic()
    agent.preempt(node, disruption_target=True)
    (notice,) = j.wait("the controller's notice", lambda: j.after(t0, "notice"), GRACE_SECONDS)
    assert notice["noticed"] == [1] and notice["slices"] == [0, 1], notice
    dropped = j.wait("slice 1 dropped in place", lambda: j.after(t0, "dropped"), GRACE_SECONDS)[0]
    assert dropped["slices"] == [0], dropped
    (new_node,) = agent.add_slice(pool, hosts=1, topology="2x2")  # the preempted VM comes back as a new node

    victim_key = f"{victim.metadata.name}/{victim.metadata.uid}"
    removed = j.wait("the noticed slice's Pod removed", lambda: j.removed_at.get(victim_key), GRACE_SECONDS + 30)
    saved_after = [e["step"] for e in j.after(notice["t"], "saved")]
    assert saved_after and all(e["slices"] == [0] for e in j.after(notice["t"], "saved")), saved_after
    durable = {s: t for s, t in j.in_bucket.items() if s >= saved_after[0] and t < removed}
    assert durable, (f"no step >= {saved_after[0]} (the first saved after the notice) was in the bucket before "
                     f"slice 1's Pod was removed: {j.in_bucket}, removed at {removed}")

    scale_up = j.wait("slice 1 rejoins", lambda: j.after(t0, "scale_up"), REJOIN_TIMEOUT_SECONDS)[0]
    assert scale_up["new"] == [1] and scale_up["slices"] == [0], scale_up
    down = _steps_on([e for e in j.events() if removed < e["t"] < scale_up["t"]], [0])
    assert down, "slice 0 did not train while slice 1 was down"
    restored = j.wait("the restore onto both slices", lambda: [
        e for e in j.after(scale_up["t"], "restored") if e["slices"] == [0, 1]], START_TIMEOUT_SECONDS)[0]
    assert restored["step"] == scale_up["step"], (restored, scale_up)
    assert restored["differences"] == [], restored
    rejoined = j.wait("a step on both slices", lambda: _steps_on(j.after(restored["t"], "first_step", "step"),
                                                                 [0, 1]), 60)[0]

    # The controllers' decisions: only slice 1's Pod replaced, no JobSet restart.
    assert j.restarts() == (0, 0), "one slice's notice restarted the elastic JobSet"
    now = {p.metadata.uid for p in j.pods()}
    assert {head.metadata.uid, survivor.metadata.uid} <= now, "the head or slice 0's Pod was replaced"
    for p in (j.head(), j.worker_of_slice(0)):
        assert all(c.restart_count == 0 for c in (p.status.container_statuses or [])
                   + (p.status.init_container_statuses or [])), f"{p.metadata.name} restarted a container"
    replacement = j.worker_of_slice(1)
    assert replacement.metadata.uid != victim.metadata.uid and replacement.spec.node_name == new_node

    # Lifecycle: from the notice to the first step on both slices; slice 0's longest pause in between.
    lifecycle["elastic_notice_to_rejoin"] = round(rejoined["t"] - t0, 2)
    times = [e["t"] for e in _steps_on(j.events(), [0]) if t0 < e["t"] < scale_up["t"]]
    steps_before = [e["t"] for e in j.events() if e["ev"] in ("first_step", "step") and e["t"] <= t0]
    gaps = [b - a for a, b in zip([steps_before[-1], *times], times, strict=False)]
    lifecycle["elastic_survivor_max_pause"] = round(max(gaps), 2)
    lifecycle["elastic_scale_up_pause"] = round(rejoined["t"] - scale_up["t"], 2)
