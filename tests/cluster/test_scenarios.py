"""The rendered multi-controller native JobSet running for real: the real control plane decides, the node agent
runs every Pod (replicator sidecars, the trainer ``tests/cluster/app/train.py`` with real multi-process JAX),
and each scenario checks the controllers' decisions and the data together: the newest step the trainer
reported saved comes back, bit for bit (the trainer compares every restored shard with the state that step
must hold), and the lifecycle seconds from the fault to the first training step after it are recorded.

2 slices x 1 host (one node pool per slice, JobSet's exclusive placement), the bucket a folder (``file://``)
bound into every Pod at ``/bucket``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller_client import manifests as mf
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from tests.cluster.controlplane import ControlPlane
from tests.cluster.job_watch import PodWatch, deploy
from tests.cluster.node_agent import NodeAgent
from tests.cluster.pod_spec import VENV_BIN, ImageRule
from tests.cluster.test_decisions import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.scenario, pytest.mark.timeout(900)]

APP = Path(__file__).resolve().parent / "app"
GRACE_SECONDS = 40
STEP_SECONDS = 0.25
SAVE_EVERY = 4
START_TIMEOUT_SECONDS = 240.0
RECOVERY_TIMEOUT_SECONDS = 300.0


class Job:
    """One rendered JobSet in namespace ``ns``, its Pods on the agent's nodes, its trainer's events."""

    def __init__(self, api: Any, agent: NodeAgent, tmp: Path, ns: str, **overrides: Any) -> None:
        self.api, self.agent, self.ns = api, agent, ns
        self.results = tmp / "results"
        self.bucket = tmp / "bucket"
        self.results.mkdir(parents=True)
        self.bucket.mkdir(parents=True)
        opts: dict[str, Any] = dict(mode="multi-controller", front_door="native", job=ns, slices=2,
                                    hosts_per_slice=1, tpu_topology="2x2", backup_url="file:///bucket",
                                    backup_interval_minutes=30, termination_grace_seconds=GRACE_SECONDS,
                                    max_restarts=3, network_policy=False)
        self.opts = mf.ManifestOptions(**{**opts, **overrides})
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.pod_watch = PodWatch(self.core, ns)
        self.deleted_at = self.pod_watch.deleted_at  # pod name -> monotonic time its deletion was first seen

    def start(self) -> None:
        deploy(self.api, self.core, self.opts, self.ns)
        self.pod_watch.start()

    def close(self) -> None:
        """Delete the JobSet, then its Pods at once while this test's node agent still runs them, then the
        namespace. The next test's agent registers nodes and pools of the same names: a Pod of this job left
        terminating (a trainer that trains on ignores SIGTERM: JAX's preemption notifier) was bound to one of
        them and kept JobSet's exclusive placement off its pool for its 40 s grace (the hot-swap test's
        replacement Pod waited 42 s for one)."""
        self.pod_watch.stop()
        self.custom.delete_collection_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets")
        deadline = time.monotonic() + 30
        while self.core.list_namespaced_pod(self.ns).items and time.monotonic() < deadline:
            self.core.delete_collection_namespaced_pod(self.ns, grace_period_seconds=0)
            time.sleep(0.5)
        self.core.delete_namespace(self.ns)

    # ------------------------------------------------------------------ what happened
    def events(self) -> list[dict[str, Any]]:
        path = self.results / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def after(self, t: float, ev: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["ev"] == ev and e["t"] > t]

    def saved_by_all(self, since: float = 0.0) -> int:
        """The newest step every rank reported saved (after ``since``), or -1."""
        per_rank: dict[int, set[int]] = {}
        for e in self.events():
            if e["ev"] == "saved" and e["t"] > since:
                per_rank.setdefault(e["rank"], set()).add(e["step"])
        if len(per_rank) < self.opts.nodes:
            return -1
        common = set.intersection(*per_rank.values())
        return max(common) if common else -1

    def jobset_status(self) -> dict[str, Any]:
        js = self.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets", self.ns)
        return js.get("status", {})

    def restarts(self) -> tuple[int, int]:
        st = self.jobset_status()
        return int(st.get("restarts", 0)), int(st.get("restartsCountTowardsMax", 0))

    def bucket_steps(self) -> list[int]:
        return BackupStore(open_store(f"file://{self.bucket}"), self.ns).committed_steps()

    def pod_on(self, nodepool: str) -> Any:
        nodes = set(self.agent.node_names(nodepool))
        return next(p for p in self.core.list_namespaced_pod(self.ns).items
                    if p.spec.node_name in nodes and p.metadata.deletion_timestamp is None)

    def diagnostics(self) -> str:
        out = [f"events: {self.events()[-12:]}"]
        for p in self.core.list_namespaced_pod(self.ns).items:
            out.append(f"pod {p.metadata.name} {p.status.phase} on {p.spec.node_name}")
            for c in ("train", "mtc-replicator"):
                try:
                    out.append(f"--- {c}:\n" + self.agent.logs(p.metadata.name, c, self.ns)[-3000:])
                except FileNotFoundError:
                    pass
        return "\n".join(out)

    # ------------------------------------------------------------------ waits
    def trained(self, saves: int = 2, since: float = 0.0) -> int:
        """Wait until every rank saved ``saves`` steps after ``since``; the newest step saved by all."""
        want = SAVE_EVERY * saves
        try:
            return wait_for(f"every rank saved {saves} steps", lambda: (
                s := self.saved_by_all(since)) >= 0 and len({e["step"] for e in self.events() if e["ev"] == "saved"
                                                           and e["t"] > since}) >= saves and s >= want and s,
                START_TIMEOUT_SECONDS)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None

    def recovered(self, t_fault: float, step: int) -> float:
        """Wait until every rank restored ``step`` (bit-exact: the trainer checks) and trained on; the seconds
        from ``t_fault`` to the first step after the restore."""
        try:
            restored = wait_for("every rank restored and stepped", lambda: (
                r := self.after(t_fault, "restored")) and len({e["rank"] for e in r}) == self.opts.nodes and
                len({e["rank"] for e in self.after(t_fault, "first_step")}) == self.opts.nodes and r,
                RECOVERY_TIMEOUT_SECONDS)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.diagnostics()}") from None
        steps = {e["step"] for e in restored}
        assert steps == {step}, f"restored {steps}, the newest step every rank saved was {step}"
        assert all(e["differences"] == [] for e in restored), restored
        first = max(e["t"] for e in self.after(t_fault, "first_step"))
        return first - t_fault


@pytest.fixture
def agent(control_plane: ControlPlane, tmp_path: Path) -> Iterator[NodeAgent]:
    results, bucket = tmp_path / "job" / "results", tmp_path / "job" / "bucket"
    env = {"MTC_TEST_RESULTS": "/results", "MTC_TEST_STEP_SECONDS": str(STEP_SECONDS),
           "MTC_TEST_SAVE_EVERY": str(SAVE_EVERY), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    images = {"REGISTRY/mtc-sidecar:*": ImageRule(binds={"/app": str(APP), "/results": str(results), "/bucket": str(bucket)},
                                           path=[str(VENV_BIN)], env=env),
              "REGISTRY/mtc-replicator:*": ImageRule(binds={"/bucket": str(bucket)}, path=[str(VENV_BIN)])}
    with control_plane.client() as api, NodeAgent(api, control_plane.server, tmp_path / "agent",
                                                 images=images) as a:
        yield a


@pytest.fixture
def job(control_plane: ControlPlane, agent: NodeAgent, tmp_path: Path,
        request: pytest.FixtureRequest) -> Iterator[Callable[..., Job]]:
    made: list[Job] = []
    with control_plane.client() as api:
        def make(**overrides: Any) -> Job:
            j = Job(api, agent, tmp_path / "job", request.node.name.split("[")[0].replace("_", "-")[5:40].strip("-"),
                    **overrides)
            made.append(j)
            return j
        yield make
        for j in made:
            j.close()


def _slices(agent: NodeAgent, *pools: str, hosts: int = 1) -> None:
    for pool in pools:
        agent.add_slice(pool, hosts=hosts, topology="2x2" if hosts == 1 else "2x4")


def test_a_notice_to_one_slice(job: Callable[..., Job], agent: NodeAgent, lifecycle: dict[str, float]) -> None:
    """One slice's nodes are preempted: the step saved after the notice is in the bucket before the healthy
    slice's Pods are deleted, the JobSet restarts without counting, and that step comes back."""
    _slices(agent, "tpu-a", "tpu-b")
    j = job()
    j.start()
    j.trained()
    victim = j.pod_on("tpu-b")
    healthy = j.pod_on("tpu-a")
    t0 = time.monotonic()
    (node,) = agent.node_names("tpu-b")
    agent.preempt(node, disruption_target=True)
    notice = wait_for("the trainer's notice save", lambda: j.after(t0, "backed_up"), GRACE_SECONDS)
    _slices(agent, "tpu-b")  # the preempted VM comes back as a new node
    step = max(e["step"] for e in notice)
    assert step in j.bucket_steps(), f"step {step} saved after the notice is not in the bucket: {j.bucket_steps()}"
    lifecycle["notice_to_first_step"] = round(j.recovered(t0, step), 2)
    backed = max(e["t"] for e in notice)
    # The healthy slice's Pod ends after the flush: deleted by the JobSet's restart, or, told of the notice too (its
    # scope is the job), its trainer exits 75 first; a terminal Pod is then removed with no grace by the garbage
    # collector, possibly after the new Pods trained (so its removal is waited for, not assumed).
    name = healthy.metadata.name
    exits = [e["t"] for e in j.after(t0, "exit") if name.startswith(e["pod"] + "-")]
    ended = min(exits + [j.deleted_at[name]] if name in j.deleted_at else exits, default=None)
    assert ended is not None, "the healthy slice's Pod was neither deleted nor ended by its trainer"
    assert backed < ended, "the healthy Pods were deleted before the flush"
    wait_for("the healthy slice's old Pod removed", lambda: f"{name}/{healthy.metadata.uid}" in j.pod_watch.removed_at,
             60)
    assert victim.metadata.name in j.deleted_at
    assert j.restarts() == (1, 0), "a notice counted against maxRestarts"


def test_a_host_lost(job: Callable[..., Job], agent: NodeAgent, lifecycle: dict[str, float]) -> None:
    """A machine is gone at once (no notice): the node-lifecycle controller evicts its Pod, the JobSet
    restarts, the replacement host (an empty RAM disk) gets the newest complete step from its peer."""
    _slices(agent, "tpu-a", "tpu-b")
    j = job()
    j.start()
    step = j.trained()
    (node,) = agent.node_names("tpu-b")
    t0 = time.monotonic()
    agent.lose_host(node)
    _slices(agent, "tpu-b")
    lifecycle["host_lost_to_first_step"] = round(j.recovered(t0, step), 2)
    assert j.restarts()[0] == 1


def test_a_slice_lost_hot_swaps_onto_the_spare(job: Callable[..., Job], agent: NodeAgent,
                                               lifecycle: dict[str, float]) -> None:
    """A whole slice is lost for good; a spare slice is Ready: JobSet's placement moves the slice's Job there
    (hot-swap) and its host refills from the other slice."""
    _slices(agent, "tpu-a", "tpu-b", "tpu-spare")
    j = job()
    j.start()
    step = j.trained()
    lost = j.pod_on("tpu-b") if any(p.spec.node_name in agent.node_names("tpu-b")
                                    for p in j.core.list_namespaced_pod(j.ns).items) else j.pod_on("tpu-spare")
    pool = next(p for p in ("tpu-a", "tpu-b", "tpu-spare") if lost.spec.node_name in agent.node_names(p))
    t0 = time.monotonic()
    agent.lose_slice(pool)
    lifecycle["hot_swap_to_first_step"] = round(j.recovered(t0, step), 2)
    placed = {p.spec.node_name for p in j.core.list_namespaced_pod(j.ns).items if p.metadata.deletion_timestamp is None}
    assert not placed & set(agent.node_names(pool)), "a Pod was placed on the lost slice"




def test_a_slice_lost(job: Callable[..., Job], agent: NodeAgent, lifecycle: dict[str, float]) -> None:
    """Both hosts of a slice are gone at once and no spare is ready: the JobSet restarts, its Pods wait for
    the slice's replacement nodes, and the replacement hosts (empty RAM disks) get the newest complete step
    from the other slice's peers; the surviving slice's RAM disks outlive the restart."""
    _slices(agent, "tpu-a", "tpu-b", hosts=2)
    j = job(hosts_per_slice=2, tpu_topology="2x4")
    j.start()
    step = j.trained()
    t0 = time.monotonic()
    agent.lose_slice("tpu-b")
    wait_for("the lost slice's Pods deleted or failed", lambda: not any(
        p.spec.node_name in agent.node_names("tpu-b") and p.status.phase == "Running"
        and p.metadata.deletion_timestamp is None for p in j.core.list_namespaced_pod(j.ns).items), 60)
    _slices(agent, "tpu-b", hosts=2)  # the slice's replacement nodes
    lifecycle["slice_lost_to_first_step"] = round(j.recovered(t0, step), 2)
    assert j.restarts()[0] == 1, f"restarts (total, counted): {j.restarts()}"
