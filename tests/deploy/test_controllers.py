"""What the Job and JobSet controllers decide for every rendered JobSet, Pod timeline by Pod timeline.

The controllers are modelled in controllers_model.py from their upstream source (Kubernetes
pkg/controller/job/job_controller.go at 6ae037f1db84 and pod_failure_policy.go at 2b02db1be88b; JobSet v0.12.0
pkg/controllers/failure_policy.go, jobset_controller.go, pkg/webhooks/jobset_webhook.go, pkg/features):
no kube-apiserver or controller can run here. Each case plays a preemption notice (one worker Pod, a whole
slice, the head), an eviction, a hardware failure or a lost node, with a spare slice free or not, against
the JobSets `mtc manifests` renders (native and Orbax front doors, elastic or not) and the ones under
deploy/, and asserts what the JobSet ends as, how many restarts count against maxRestarts, whether the
trainer's save window held and how long a restart waits for healthy Pods (hot-swap).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import k8s_kit as kit  # noqa: E402
from controllers_model import Cluster, Event, Rejected, Trainer, admit  # noqa: E402

from controller_client import manifests as mf  # noqa: E402
from controller_client import preemption_exit  # noqa: E402
from controller_client.manifests_jobsets import preemption_budget  # noqa: E402

B = "gs://b/ckpt"
RENDERED = {
    "pathways-native": mf.ManifestOptions(job="demo", backup_url=B),
    "pathways-orbax": mf.ManifestOptions(job="demo", front_door="orbax", backup_url=B),
    "pathways-native-elastic": mf.ManifestOptions(job="demo", backup_url=B, elastic_slices=2),
    "pathways-orbax-elastic": mf.ManifestOptions(job="demo", front_door="orbax", backup_url=B, elastic_slices=2),
    "pathways-native-memory": mf.ManifestOptions(job="demo", backup_url=B, ramdisk="memory"),
    "pathways-orbax-hostpath": mf.ManifestOptions(job="demo", front_door="orbax", backup_url=B, ramdisk="hostpath"),
    "multi-controller-orbax": mf.ManifestOptions(mode="multi-controller", job="orb", backup_url=B),
    "multi-controller-native": mf.ManifestOptions(mode="multi-controller", front_door="native", job="orb",
                                                  backup_url=B),
}
DEPLOYED = ["pathways", "pathways-orbax", "multi-controller", "multi-controller-native"]
T0 = 100  # the event, once every Pod runs
# What a restart may cost on a healthy Pod: its hook's API lookup and the containers' exit (seconds).
FAST_DRAIN_SECONDS = 5


def _jobsets() -> dict[str, tuple[dict[str, Any], mf.ManifestOptions | None]]:
    out: dict[str, tuple[dict[str, Any], mf.ManifestOptions | None]] = {
        name: (mf.objects(o)["jobset.yaml"], o) for name, o in RENDERED.items()}
    for base in DEPLOYED:
        doc = yaml.safe_load((REPO / "deploy" / base / "jobset.yaml").read_text())
        out[f"deploy/{base}"] = (doc, None)
    return out


JOBSETS = _jobsets()


def _kind(js: dict[str, Any]) -> tuple[bool, bool]:
    """(Pathways, elastic) read from the JobSet itself, so deploy/ files are judged on what they say."""
    rjs = {rj["name"]: rj for rj in js["spec"]["replicatedJobs"]}
    pathways = "head" in rjs
    elastic = pathways and any(a.startswith("--num_elastic_slices") for c in
                               rjs["head"]["template"]["spec"]["template"]["spec"]["initContainers"]
                               for a in c.get("args", []))
    return pathways, elastic


def _hosts(js: dict[str, Any]) -> int:
    return next(int(rj["template"]["spec"]["completions"]) for rj in js["spec"]["replicatedJobs"]
                if rj["name"] == "workers")


def _ramdisk_outlives_pod(js: dict[str, Any]) -> bool:
    pod = next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == "workers")["template"]["spec"]["template"]["spec"]
    vol = next(v for v in pod["volumes"] if v["name"] == "ramdisk")
    return "emptyDir" not in vol


def _trainer(js: dict[str, Any]) -> Trainer:
    # The documented loops (docs/elastic.md): save after a notice, then exit as preemption_exit says; elastic
    # training carries on when a worker slice goes.
    _, elastic = _kind(js)
    return Trainer(save_seconds=5, exit_after_notice=preemption_exit.exit_code(preempted=True),
                   keeps_going_on_slice_loss=elastic)


def _play(js: dict[str, Any], events: list[Event], *, spares: int = 1, delay_terminal: bool = True,
          crash_seconds: int = 20) -> Any:
    trainer = dataclasses.replace(_trainer(js), crash_seconds=crash_seconds)
    return Cluster(js, trainer, spares=spares, delay_terminal_condition=delay_terminal).run(events)


def _main(js: dict[str, Any]) -> str:
    return "pathways-worker" if _kind(js)[0] else "train"


# --------------------------------------------------------------------------- admission and CEL


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_a_default_jobset_and_kubernetes_accept_it(name: str) -> None:
    js, _ = JOBSETS[name]
    admit(js)  # JobSet webhook (RestartJob gate off, rule names) and Job validation (podFailurePolicy)
    assert kit.cel_violations(js) == [], "the JobSet CRD's CEL rules"
    # The CRD makes failurePolicy, successPolicy, network and startupPolicy immutable: applying the same
    # rendering again passes; changing the failure policy of a live JobSet does not.
    assert kit.cel_violations(js, old=js) == []
    changed = yaml.safe_load(yaml.safe_dump(js))
    changed["spec"]["failurePolicy"]["maxRestarts"] += 1
    assert kit.cel_violations(changed, old=js) == ["spec.failurePolicy: Value is immutable"]


def test_admission_and_cel_can_fail() -> None:
    js = yaml.safe_load(yaml.safe_dump(JOBSETS["pathways-native"][0]))
    bad = yaml.safe_load(yaml.safe_dump(js))
    bad["spec"]["failurePolicy"]["rules"][0]["name"] = "worker-failed"  # hyphens: the webhook's regex refuses
    with pytest.raises(Rejected, match="rule name"):
        admit(bad)
    bad = yaml.safe_load(yaml.safe_dump(js))
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartJob"
    with pytest.raises(Rejected, match="feature gate is disabled"):
        admit(bad)
    admit(bad, frozenset({"RestartJob"}))
    bad = yaml.safe_load(yaml.safe_dump(js))
    bad["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    with pytest.raises(Rejected, match="restartPolicy Never"):
        admit(bad)
    bad = yaml.safe_load(yaml.safe_dump(js))
    bad["spec"]["replicatedJobs"][1]["dependsOn"] = [{"name": "head", "status": "Ready"}]
    assert kit.cel_violations(bad) == ["spec: StartupPolicy and DependsOn APIs are mutually exclusive"]


# --------------------------------------------------------------------------- every failure-policy value


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_every_failure_policy_value(name: str) -> None:
    js, opts = JOBSETS[name]
    pathways, elastic = _kind(js)
    fp = js["spec"]["failurePolicy"]
    assert fp["restartStrategy"] == "Recreate"
    assert fp["maxRestarts"] == (opts.max_restarts if opts else 5)
    assert fp["rules"] == [
        {"name": "preempted_or_saved_restart_uncounted", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "failed_restart_counted", "action": "RestartJobSet"}]
    rjs = {rj["name"]: rj["template"]["spec"] for rj in js["spec"]["replicatedJobs"]}
    disrupted = {"type": "DisruptionTarget", "status": "True"}
    saved = {"operator": "In", "values": [preemption_exit.PREEMPTED_EXIT_CODE]}
    w = rjs["workers"]
    assert w["template"]["spec"]["restartPolicy"] == "Never"
    if elastic:
        assert w["backoffLimit"] == _hosts(js) * 1_000_000
        assert w["podFailurePolicy"] == {"rules": [{"action": "Ignore", "onPodConditions": [disrupted]}]}
    elif pathways:
        assert w["backoffLimit"] == 0
        assert w["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onPodConditions": [disrupted]}]}
    else:
        assert w["backoffLimit"] == 0
        assert w["podFailurePolicy"] == {"rules": [
            {"action": "FailJob", "onPodConditions": [disrupted]},
            {"action": "FailJob", "onExitCodes": {"containerName": "train", **saved}}]}
    if pathways:
        h = rjs["head"]
        assert (h["backoffLimit"], h["template"]["spec"]["restartPolicy"]) == (0, "Never")
        assert h["podFailurePolicy"] == {"rules": [
            {"action": "FailJob", "onPodConditions": [disrupted]},
            {"action": "FailJob", "onExitCodes": {"containerName": "controller", **saved}}]}
        assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["head"]}
        g = h["template"]["spec"]["terminationGracePeriodSeconds"]
        assert g == w["template"]["spec"]["terminationGracePeriodSeconds"], "the head saves in the same grace"
    else:
        assert "successPolicy" not in js["spec"]


# --------------------------------------------------------------------------- timelines


def _notice_cases(js: dict[str, Any]) -> dict[str, list[Event]]:
    hosts = tuple(range(_hosts(js)))
    cases = {"notice-one-worker": [Event(T0, "notice", "workers", 0, (0,))],
             "notice-whole-slice": [Event(T0, "notice", "workers", 1, hosts)],
             "eviction-one-worker": [Event(T0, "evict", "workers", 0, (1,))]}
    if _kind(js)[0]:
        cases["notice-head"] = [Event(T0, "notice", "head", 0, (0,))]
    return cases


@pytest.mark.parametrize("delay_terminal", [True, False], ids=["k8s>=1.31", "k8s<=1.30"])
@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_a_notice_is_no_failure_keeps_the_save_window_and_never_completes_the_job(name: str, delay_terminal: bool) -> None:
    js, _ = JOBSETS[name]
    pathways, elastic = _kind(js)
    for case, events in _notice_cases(js).items():
        out = _play(js, events, delay_terminal=delay_terminal)
        where = f"{name} {case}: {out}"
        assert out.state == "Running", where  # never Completed with steps left, never Failed
        assert out.restarts_counted == 0, where  # a preemption or an eviction does not use up maxRestarts
        assert out.save_window_held, where
        assert out.resumed, where  # on the spare slice when the slice's node pool went away
        if elastic and case != "notice-head":
            assert out.restarts == 0, where  # the other slices keep running; the slice's Pods come back
        else:
            assert out.restarts == 1, where  # the whole job resumes from its save


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_a_slice_notice_without_a_spare_waits_for_capacity_without_failing(name: str) -> None:
    js, _ = JOBSETS[name]
    out = _play(js, _notice_cases(js)["notice-whole-slice"], spares=0)
    assert (out.state, out.restarts_counted, out.save_window_held, out.resumed) == ("Running", 0, True, False), out


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_a_genuine_failure_still_restarts_and_counts(name: str) -> None:
    js, _ = JOBSETS[name]
    _, elastic = _kind(js)
    out = _play(js, [Event(T0, "crash", "workers", 0, (0,), container=_main(js))])
    if elastic:  # the slice's Job re-creates the Pod (its backoffLimit), Pathways carries on
        assert (out.state, out.restarts, out.restarts_counted, out.resumed) == ("Running", 0, 0, True), out
    else:
        assert (out.state, out.restarts, out.restarts_counted, out.resumed) == ("Running", 1, 1, True), out


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_a_lost_node(name: str) -> None:
    """A node that stops answering: the program sees it first (non-elastic: exit 1, counted); the taint
    manager's eviction after 300 s marks the Pod DisruptionTarget, which elastic Jobs ignore (docs/deploy.md)."""
    js, _ = JOBSETS[name]
    _, elastic = _kind(js)
    out = _play(js, [Event(T0, "node-lost", "workers", 0, (0,))])
    want = ("Running", 0, 0, True) if elastic else ("Running", 1, 1, True)
    assert (out.state, out.restarts, out.restarts_counted, out.resumed) == want, out


@pytest.mark.parametrize("name", sorted(JOBSETS))
def test_a_restart_or_hot_swap_does_not_take_the_preemption_path(name: str) -> None:
    """Healthy Pods deleted by a JobSet restart end in seconds: no save window, no flush where the RAM disk
    outlives the Pod (with an emptyDir RAM disk the replicator's SIGTERM flush is kept: its data dies).

    One wait is left on Pathways workers: pathways-worker's own preStop ``sleep`` (the save share of the
    grace), which keeps it serving the trainer's last save after a notice; Google's server image gives a
    hook no way to tell a restart from a notice (docs/deploy.md, "Hot-swap timeline"). Multi-controller:
    the training program's own SIGTERM handling."""
    js, _ = JOBSETS[name]
    pathways, elastic = _kind(js)
    events = (_notice_cases(js)["notice-head"] if elastic else [Event(T0, "crash", "workers", 0, (0,), container=_main(js))])
    # The other programs notice the lost peer late (JAX's heartbeat timeout): the restart finds them healthy.
    out = _play(js, events, crash_seconds=200)
    assert out.restarts == 1, out
    grace = next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == "workers")["template"]["spec"][
        "template"]["spec"]["terminationGracePeriodSeconds"]
    flush = preemption_budget(mf.ManifestOptions(termination_grace_seconds=grace)).flush
    save = preemption_budget(mf.ManifestOptions(termination_grace_seconds=grace)).save
    # Multi-controller: the program's own SIGTERM handling (its save, as JAX's preemption sync) is its own.
    own = save if pathways else _trainer(js).save_seconds
    bound = FAST_DRAIN_SECONDS + own + (0 if _ramdisk_outlives_pod(js) else flush)
    assert 0 < out.restart_drain_seconds <= bound, out


def test_the_model_can_fail() -> None:
    """The model tells the old decisions apart: a terminating Pod counted at once, a counted restart, a
    completed job, RestartJob stalled with the gate off."""
    js = yaml.safe_load(yaml.safe_dump(JOBSETS["pathways-native"][0]))
    for rj in js["spec"]["replicatedJobs"]:
        del rj["template"]["spec"]["podFailurePolicy"]
    out = _play(js, [Event(T0, "notice", "workers", 0, (0,))])
    assert out.restarts_counted == 1, out  # BackoffLimitExceeded: the default rule counts
    out = _play(js, [Event(T0, "notice", "workers", 0, (0,))], delay_terminal=False)
    assert not out.save_window_held, out  # the head goes while the notice's flush runs
    quits = Cluster(JOBSETS["pathways-native"][0], Trainer(exit_after_notice=0)).run([Event(T0, "notice", "workers", 0, (0,))])
    assert quits.state == "Completed", quits
    gated = yaml.safe_load(yaml.safe_dump(JOBSETS["pathways-native"][0]))
    gated["spec"]["failurePolicy"]["rules"] = [{"name": "r", "action": "RestartJob"}]
    out = Cluster(gated, Trainer(), jobset_gates=frozenset()).run([])
    assert out.state == "Rejected" and "feature gate" in out.why[0], out


def test_preemption_exit_codes() -> None:
    assert preemption_exit.exit_code(preempted=True) == preemption_exit.PREEMPTED_EXIT_CODE == 75
    assert preemption_exit.exit_code(preempted=False) == 0
    assert preemption_exit.exit_code(preempted=True, steps_left=False) == 0


def test_rendered_options_reach_the_model() -> None:
    """The model reads the hooks and the grace from the rendering: the budget's shares fit any allowed grace;
    a grace cut below the hook's save + flush shows as a broken save window."""
    o = dataclasses.replace(RENDERED["pathways-native"], termination_grace_seconds=20)
    js = mf.objects(o)["jobset.yaml"]
    out = _play(js, [Event(T0, "notice", "workers", 0, (0,))])
    assert (out.state, out.restarts, out.restarts_counted, out.save_window_held) == ("Running", 1, 0, True), out
    cut = yaml.safe_load(yaml.safe_dump(js))
    cut["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10
    out = _play(cut, [Event(T0, "notice", "workers", 0, (0,))])
    assert out.state == "Running" and not out.save_window_held, out
