"""`mtc manifests --restart in-place` running for real: the multi-controller native JobSet of test_scenarios.py with
JobSet's InPlaceRestart (its in-place-restart agent built from the pinned JobSet module, the node agent applying the
``RestartAllContainers`` restart rules as the kubelet does), against the default ``recreate`` on the same fault.

A trainer crashes on one host (its container SIGKILLed: exit 137): in place, both Pods keep their uid and node,
their containers restart behind the agents' barrier and the newest step every rank saved comes back bit for bit;
with ``recreate`` the JobSet deletes and re-creates every Pod. The seconds from the crash to the first training
step after it are recorded for both (``lifecycle``). A host lost entirely still recovers in place mode: its Pod's
``DisruptionTarget`` fails its Job and JobSet recreates the Jobs, uncounted, as in ``recreate``.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.cluster import test_scenarios as scenarios
from tests.cluster.node_agent import NodeAgent
from tests.cluster.test_decisions import wait_for
from tests.cluster.test_scenarios import Job, _slices

pytestmark = [pytest.mark.cluster, pytest.mark.scenario, pytest.mark.timeout(900)]

# The scenarios' fixtures: the node agent with the trainer's image rules, a rendered Job per test.
agent = scenarios.agent
job = scenarios.job
# After the crash, a save already under way may still finish on the healthy host; none can start after the
# restart sooner than this (containers, barrier, JAX start-up, restore, SAVE_EVERY steps).
SETTLE_SECONDS = 3.0


def _pools(agent: NodeAgent) -> tuple[str, str]:
    """Two single-host slices in node pools of this test's own: a Pod a previous test left terminating on a pool
    of the same name (its node agent gone) would keep JobSet's exclusive placement off that pool."""
    tag = uuid.uuid4().hex[:4]
    pools = (f"tpu-{tag}-a", f"tpu-{tag}-b")
    _slices(agent, *pools)
    return pools


def _uids(j: Job) -> dict[str, str]:
    return {p.metadata.name: p.metadata.uid for p in j.core.list_namespaced_pod(j.ns).items
            if p.metadata.deletion_timestamp is None}


def _newest_saved_before(j: Job, t: float) -> int:
    per_rank: dict[int, set[int]] = {}
    for e in j.events():
        if e["ev"] == "saved" and e["t"] < t:
            per_rank.setdefault(e["rank"], set()).add(e["step"])
    common = set.intersection(*per_rank.values()) if len(per_rank) == j.opts.nodes else set()
    return max(common) if common else -1


def _crash_trainer(j: Job, agent: NodeAgent, pool: str) -> tuple[float, int, dict[str, str]]:
    """SIGKILL the trainer on ``pool``'s host; (the crash's monotonic time, the step to come back, Pod uids)."""
    j.trained()
    before = _uids(j)
    victim = j.pod_on(pool)
    t0 = time.monotonic()
    agent.kill_container(j.ns, victim.metadata.name, "train", signal.SIGKILL)
    time.sleep(SETTLE_SECONDS)
    return t0, _newest_saved_before(j, t0 + SETTLE_SECONDS), before


def test_in_place_a_trainer_crash(job: Callable[..., Job], agent: NodeAgent, lifecycle: dict[str, float]) -> None:
    """In place: the same two Pods (uid, node) restart their containers, no Pod is deleted, the JobSet's in-place
    attempt moves on and no JobSet restart is counted; the newest step every rank saved comes back bit for bit."""
    j, before = _crash_and_recover(job, agent, lifecycle, "in-place")
    after = _uids(j)
    assert after == before, f"in place, the Pods were replaced: {before} -> {after}"
    assert not j.deleted_at, f"in place, Pods were deleted: {sorted(j.deleted_at)}"
    st = j.jobset_status()
    assert st.get("currentInPlaceRestartAttempt", 0) >= 1, st
    assert j.restarts() == (0, 0), f"restarts (total, counted): {j.restarts()}"
    for p in j.core.list_namespaced_pod(j.ns).items:
        counts = {c.name: c.restart_count for c in (p.status.init_container_statuses or [])
                  + (p.status.container_statuses or [])}
        assert counts["train"] >= 1 and counts["mtc-replicator"] >= 1, (p.metadata.name, counts)


def test_recreate_a_trainer_crash(job: Callable[..., Job], agent: NodeAgent, lifecycle: dict[str, float]) -> None:
    """The default on the same fault: the crashed Pod fails its Job, JobSet deletes and re-creates every Pod and
    counts the restart; the same step comes back."""
    j, before = _crash_and_recover(job, agent, lifecycle, "recreate")
    after = _uids(j)
    assert not set(after.values()) & set(before.values()), f"recreate kept a Pod: {before} -> {after}"
    assert j.restarts() == (1, 1), f"restarts (total, counted): {j.restarts()}"


def _crash_and_recover(job: Callable[..., Job], agent: NodeAgent, lifecycle: dict[str, float],
                       restart: str) -> tuple[Job, dict[str, str]]:
    _, pool_b = _pools(agent)
    j = job(restart=restart)
    j.start()
    t0, step, before = _crash_trainer(j, agent, pool_b)
    lifecycle[f"trainer_crash_to_first_step_{restart.replace('-', '_')}"] = round(j.recovered(t0, step), 2)
    return j, before


def test_in_place_a_host_lost_recreates_and_recovers(job: Callable[..., Job], agent: NodeAgent,
                                                     lifecycle: dict[str, float]) -> None:
    """A machine is gone at once: its Pod is evicted (DisruptionTarget), which still fails its Job, and JobSet
    recreates the Jobs without counting; the replacement Pods meet at the agents' barrier (attempt + 1) and
    the replacement host gets the newest complete step from its peer."""
    pool_a, pool_b = _pools(agent)
    j = job(restart="in-place")
    j.start()
    step = j.trained()
    survivor = j.pod_on(pool_a)
    (node,) = agent.node_names(pool_b)
    t0 = time.monotonic()
    agent.lose_host(node)
    _slices(agent, pool_b)
    lifecycle["host_lost_to_first_step_in_place"] = round(j.recovered(t0, step), 2)
    # The surviving Pod goes as soon as it is deleted: without controller_client/exit_guard.py, in half the runs
    # its trainer's failed collective left it at JAX's shutdown barrier, deaf to SIGTERM, until its SIGKILL at
    # the end of the 40 s grace (52-57 s to the first step instead of 9 s).
    name, uid = survivor.metadata.name, survivor.metadata.uid
    wait_for("the surviving Pod removed", lambda: f"{name}/{uid}" in j.pod_watch.removed_at, 60)
    took = j.pod_watch.removed_at[f"{name}/{uid}"] - j.deleted_at[name]
    assert took < 20, f"the surviving Pod took {took:.1f} s from its deletion to its removal (grace 40 s)"
    assert j.restarts() == (1, 0), f"restarts (total, counted): {j.restarts()}"
    wait_for("the barrier lifted at the new attempt",
             lambda: j.jobset_status().get("currentInPlaceRestartAttempt", 0) >= 1, 30)


def test_rendered_in_place_objects_are_accepted(job: Callable[..., Job], agent: NodeAgent) -> None:
    """The agent's Role and the admission policy: the job's ServiceAccount may set the attempt annotation of its
    Pods and nothing else (a label change by that identity is refused by the policy, not by RBAC)."""
    _pools(agent)
    j = job(restart="in-place")
    j.start()
    wait_for("both Pods annotated by their agents", lambda: len([
        p for p in j.core.list_namespaced_pod(j.ns).items
        if (p.metadata.annotations or {}).get("jobset.sigs.k8s.io/in-place-restart-attempt") == "0"]) == 2, 120)
    _check_policy(j)


def _check_policy(j: Job) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    pod = next(p for p in j.core.list_namespaced_pod(j.ns).items)
    as_sa = client.CoreV1Api(_impersonating(j.api, f"system:serviceaccount:{j.ns}:{j.opts.service_account}"))
    ok: Any = as_sa.patch_namespaced_pod(pod.metadata.name, j.ns, {"metadata": {"annotations": {
        "jobset.sigs.k8s.io/in-place-restart-attempt": pod.metadata.annotations[
            "jobset.sigs.k8s.io/in-place-restart-attempt"]}}})
    assert ok.metadata.uid == pod.metadata.uid
    for change in ({"labels": {"x": "y"}}, {"annotations": {"x": "y"}},
                   {"annotations": {"jobset.sigs.k8s.io/in-place-restart-attempt": "-1"}}):
        with pytest.raises(ApiException) as e:
            as_sa.patch_namespaced_pod(pod.metadata.name, j.ns, {"metadata": change})
        assert e.value.status in (403, 422) and "denied request" in str(e.value.body), e.value.body


def _impersonating(api: Any, user: str) -> Any:
    from kubernetes import client

    out = client.ApiClient(api.configuration)
    out.set_default_header("Impersonate-User", user)
    out.set_default_header("Impersonate-Group", "system:serviceaccounts")
    return out
