"""`mtc manifests --restart in-place` (controller_client/manifests_restart.py): the rendered objects, the refusals,
and the default output untouched. The same objects run on a real control plane in
tests/cluster/test_in_place_restart.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml

from controller_client import manifests as mf
from controller_client import manifests_restart as mr
from controller_client.cli import main
from controller_client.preemption_exit import PREEMPTED_EXIT_CODE

BASE = mf.ManifestOptions(mode="multi-controller", job="ipr", backup_url="gs://b/ckpt")
IN_PLACE = dataclasses.replace(BASE, restart="in-place")
INT32_MAX = 2_147_483_647


def _workers(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (rj,) = objs["jobset.yaml"]["spec"]["replicatedJobs"]
    return rj["template"]["spec"]


def _by_name(containers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in containers}


@pytest.mark.parametrize("door", ["native", "orbax"])
def test_in_place_renders_the_strategy_the_job_budget_the_agent_and_the_rules(door: str) -> None:
    objs = mf.objects(dataclasses.replace(IN_PLACE, front_door=door))
    policy = objs["jobset.yaml"]["spec"]["failurePolicy"]
    assert policy["restartStrategy"] == "InPlaceRestart"
    assert policy["maxRestarts"] == IN_PLACE.max_restarts
    job = _workers(objs)
    # What JobSet's webhook requires of every replicated Job (pkg/webhooks/jobset_webhook.go).
    assert job["backoffLimit"] == INT32_MAX and job["podReplacementPolicy"] == "Failed"
    assert job["completions"] == job["parallelism"] == IN_PLACE.hosts_per_slice
    pod = job["template"]["spec"]
    inits = pod["initContainers"]
    assert inits[-1]["name"] == "in-place-restart-agent", "the agent is the last sidecar: the trainer waits for it"
    names = [c["name"] for c in inits]
    assert names.index("mtc-replicator") < names.index("in-place-restart-agent")
    agent = inits[-1]
    assert agent["restartPolicy"] == "Always"
    assert agent["restartPolicyRules"] == [{"action": "RestartAllContainers", "exitCodes": {
        "operator": "In", "values": [mr.AGENT_RESTART_EXIT_CODE]}}]
    env = {e["name"]: e for e in agent["env"]}
    assert env["IN_PLACE_RESTART_EXIT_CODE"]["value"] == str(mr.AGENT_RESTART_EXIT_CODE)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "jobset-name" in env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    probe = agent["startupProbe"]
    assert probe["httpGet"] == {"path": env["STARTUP_PROBE_PATH"]["value"], "port": int(env["STARTUP_PROBE_PORT"]["value"])}
    assert probe["periodSeconds"] == 1 and probe["failureThreshold"] >= 600
    # client-go's in-cluster config in the agent only; the Pod mounts no token elsewhere by default.
    assert {"name": "kube-api", "mountPath": mr.IN_CLUSTER_DIR, "readOnly": True} in agent["volumeMounts"]
    assert pod["automountServiceAccountToken"] is False
    assert "kube-api" in {v["name"] for v in pod["volumes"]}
    train = _by_name(pod["containers"])["train"]
    assert train["restartPolicy"] == "Never"
    assert train["restartPolicyRules"] == [{"action": "RestartAllContainers", "exitCodes": {
        "operator": "NotIn", "values": [0, PREEMPTED_EXIT_CODE]}}]
    # No hooks run in an in-place restart: the replicator's SIGTERM flushes only after one (a deletion's).
    args = _by_name(inits)["mtc-replicator"]["args"]
    assert args[args.index("--sigterm-flush") + 1] == "after-hook"
    assert "--sigterm-flush" not in _by_name(_workers(mf.objects(dataclasses.replace(BASE, front_door=door)))[
        "template"]["spec"]["initContainers"])["mtc-replicator"]["args"], "recreated Pods: every SIGTERM flushes"


def test_in_place_keeps_the_notice_path_a_recreate() -> None:
    """A disrupted Pod and a trainer that saved after a notice still fail their Job (JobSet recreates, uncounted)."""
    recreate, in_place = _workers(mf.objects(BASE)), _workers(mf.objects(IN_PLACE))
    assert in_place["podFailurePolicy"] == recreate["podFailurePolicy"]
    rules = in_place["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert any(r["action"] == "FailJob" and r.get("onExitCodes", {}).get("values") == [PREEMPTED_EXIT_CODE]
               for r in rules)
    fp = mf.objects(IN_PLACE)["jobset.yaml"]["spec"]["failurePolicy"]
    assert fp["rules"] == mf.objects(BASE)["jobset.yaml"]["spec"]["failurePolicy"]["rules"]


def test_in_place_renders_the_agents_rbac_and_admission_policy() -> None:
    objs = mf.objects(IN_PLACE)
    role = objs["in-place-restart-role.yaml"]
    assert role["rules"] == [
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    binding = objs["in-place-restart-rolebinding.yaml"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": IN_PLACE.service_account}]
    pol = objs["in-place-restart-policy.yaml"]
    assert pol["kind"] == "ValidatingAdmissionPolicy" and pol["spec"]["failurePolicy"] == "Fail"
    assert f"':{IN_PLACE.service_account}'" in pol["spec"]["matchConditions"][0]["expression"]
    assert any(mr.ATTEMPT_ANNOTATION in v["expression"] for v in pol["spec"]["validations"])
    pb = objs["in-place-restart-policybinding.yaml"]
    assert pb["spec"] == {"policyName": pol["metadata"]["name"], "validationActions": ["Deny"]}
    # The kustomization lists them: `kubectl apply -k` creates them with the rest.
    files = mf.render(IN_PLACE)
    assert set(objs) <= set(yaml.safe_load(files["kustomization.yaml"])["resources"])


def test_the_default_renders_exactly_what_it_did() -> None:
    """--restart recreate is the default and renders none of the in-place objects or fields."""
    assert mf.ManifestOptions().restart == "recreate"
    objs = mf.objects(BASE)
    assert not any(name.startswith("in-place-restart") for name in objs)
    text = mf.dump(objs["jobset.yaml"])
    for word in ("InPlaceRestart", "restartPolicyRules", "podReplacementPolicy", "in-place-restart-agent"):
        assert word not in text
    assert objs["jobset.yaml"]["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"
    assert _workers(objs)["backoffLimit"] == 0


@pytest.mark.parametrize("overrides, message", [
    ({"mode": "pathways"}, "needs --mode multi-controller"),
    ({"mode": "pathways", "elastic_slices": 2}, "needs --mode multi-controller"),
    ({"restart": "rolling"}, "--restart must be one of recreate, in-place"),
])
def test_combinations_that_cannot_work_are_refused(overrides: dict[str, Any], message: str) -> None:
    opts = dataclasses.replace(IN_PLACE, **overrides)
    with pytest.raises(ValueError, match=message):
        opts.validate()


def test_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    assert main(["manifests", "--mode", "multi-controller", "--restart", "in-place", "--job", "ipr",
                 "--in-place-restart-agent-image", "reg/agent:1", "-o", str(tmp_path)]) == 0
    js = yaml.safe_load((tmp_path / "jobset.yaml").read_text())
    inits = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["initContainers"]
    assert inits[-1]["image"] == "reg/agent:1"
    assert main(["manifests", "--mode", "pathways", "--restart", "in-place", "--backup-url", "gs://b/c"]) == 2
    assert "--restart in-place needs --mode multi-controller" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["manifests", "--restart", "sideways"])
