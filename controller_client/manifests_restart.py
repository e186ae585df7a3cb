"""`mtc manifests --restart in-place`: JobSet's in-place restart (KEP-467) for the multi-controller JobSet.

With ``restartStrategy: InPlaceRestart`` (JobSet >= v0.11, feature gate ``InPlaceRestart``) a failed trainer does
not delete every Pod: the failed Pod's containers restart in place (Kubernetes' container restart rule
``RestartAllContainers``, v1.35 alpha, v1.36 beta: gates ``ContainerRestartRules`` and
``RestartAllContainersOnContainerExits``), JobSet's in-place-restart agent in every Pod sees the new attempt
and restarts its own Pod the same way, and a startup-probe barrier holds every trainer until all Pods are at
that attempt. Pods keep their node, volumes (a ``memory`` RAM disk included) and name; only processes restart.

What still recreates: a Pod with the ``DisruptionTarget`` condition (a preemption notice, an eviction, a lost
node) and a trainer that saved after a notice (exit 75) fail their Job through the podFailurePolicy, and
JobSet recreates the Jobs as before (uncounted): the notice path (save, flush, ``mtc preempt``'s restart
detection) is the same in both modes. The kubelet kills containers of an in-place restart with no preStop hook
and a 2 s grace: the trainer's hook never runs (no notice), and the replicator (``--sigterm-flush after-hook``)
takes no emergency backup on a SIGTERM that no hook came before: the Pod and its RAM disk stay (docs/deploy.md,
"In-place restart").
"""

from __future__ import annotations

from typing import Any

from controller_client.manifests_options import JOBSET_NAME_FIELD, ManifestOptions, _env_field, _meta
from controller_client.preemption_exit import PREEMPTED_EXIT_CODE

# The Pod annotation the agent writes (its attempt) and the JobSet controller reads (jobset_types.go).
ATTEMPT_ANNOTATION = "jobset.sigs.k8s.io/in-place-restart-attempt"
# The agent's exit code that restarts its Pod in place: not 1 (the agent's own errors, restarted alone as a
# sidecar), not 128 + N (signals), not the trainer's PREEMPTED_EXIT_CODE.
AGENT_RESTART_EXIT_CODE = 86
# The agent serves this once its Pod is at the JobSet's current attempt (cmd/in-place-restart-agent defaults).
BARRIER_PATH = "/barrier-is-down"
BARRIER_PORT = 8081
# How long a Pod may wait at the barrier (the slowest Pod's scheduling and replicator start) before the kubelet
# restarts the agent; a restarted agent re-announces the same attempt, so a timeout costs nothing but a log line.
BARRIER_WAIT_SECONDS = 3600
# client-go's in-cluster config and the agent's namespace file: the job's projected kube-api volume mounted
# here in the agent only (the Pod keeps automountServiceAccountToken: false).
IN_CLUSTER_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_place(opts: ManifestOptions) -> bool:
    return opts.restart == "in-place"


def replicator_args(opts: ManifestOptions) -> list[str]:
    """In place, the replicator's SIGTERM flushes only after a preStop hook (a Pod deletion): the kubelet's
    in-place restart runs none, keeps the Pod and its RAM disk, and would wait for the flush until its kill."""
    return ["--sigterm-flush", "after-hook"] if in_place(opts) else []


def trainer_rules() -> dict[str, Any]:
    """The trainer's restart rule: any failure but a notice's save (75) restarts every container of the Pod."""
    return {"restartPolicy": "Never",
            "restartPolicyRules": [{"action": "RestartAllContainers",
                                    "exitCodes": {"operator": "NotIn", "values": [0, PREEMPTED_EXIT_CODE]}}]}


def agent(opts: ManifestOptions) -> dict[str, Any]:
    """JobSet's in-place-restart agent as the last native sidecar: the trainer starts after its barrier."""
    return {
        "name": "in-place-restart-agent", "image": opts.in_place_restart_agent_image, "restartPolicy": "Always",
        # Its restart exit code restarts the Pod in place; any other exit restarts the agent alone.
        "restartPolicyRules": [{"action": "RestartAllContainers",
                                "exitCodes": {"operator": "In", "values": [AGENT_RESTART_EXIT_CODE]}}],
        "env": [_env_field("JOBSET_NAME", JOBSET_NAME_FIELD), _env_field("POD_NAME", "metadata.name"),
                {"name": "IN_PLACE_RESTART_EXIT_CODE", "value": str(AGENT_RESTART_EXIT_CODE)},
                {"name": "STARTUP_PROBE_PATH", "value": BARRIER_PATH},
                {"name": "STARTUP_PROBE_PORT", "value": str(BARRIER_PORT)}],
        "startupProbe": {"httpGet": {"path": BARRIER_PATH, "port": BARRIER_PORT}, "periodSeconds": 1,
                         "failureThreshold": BARRIER_WAIT_SECONDS},
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "kube-api", "mountPath": IN_CLUSTER_DIR, "readOnly": True}],
    }


def job_backoff() -> dict[str, Any]:
    """What the webhook requires of every replicated Job: a Pod failure never fails the Job by count, and a
    replacement Pod is made only once the failed one is terminal."""
    return {"backoffLimit": 2_147_483_647, "podReplacementPolicy": "Failed"}


def agent_role(opts: ManifestOptions) -> dict[str, Any]:
    """The agent watches its JobSet and writes its Pod's attempt annotation (server-side apply: patch)."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(f"{opts.job}-mtc-in-place-restart", opts),
            "rules": [{"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "watch"]},
                      {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]}


def agent_role_binding(opts: ManifestOptions) -> dict[str, Any]:
    name = f"{opts.job}-mtc-in-place-restart"
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(name, opts),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": opts.service_account}]}


def _same(field: str, empty: str) -> str:
    return f"object.metadata.?{field}.orValue({empty}) == oldObject.metadata.?{field}.orValue({empty})"


def admission_policy(opts: ManifestOptions) -> dict[str, Any]:
    """Pod updates by the job's ServiceAccount may change the attempt annotation and nothing else.

    RBAC cannot name a field: ``patch pods`` would let any container holding the job's token relabel or
    re-annotate a Pod. ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes >= 1.30) is
    cluster-scoped, so it matches the ServiceAccount by name in any namespace.
    """
    key = ATTEMPT_ANNOTATION
    ann, old = "object.metadata.?annotations.orValue({})", "oldObject.metadata.?annotations.orValue({})"
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": _meta(f"{opts.job}-mtc-in-place-restart", opts),
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                    "operations": ["UPDATE"], "resources": ["pods"]}]},
            "matchConditions": [{"name": "job-service-account", "expression":
                                 "request.userInfo.username == 'system:serviceaccount:' + request.namespace + "
                                 f"':{opts.service_account}'"}],
            "validations": [
                {"expression": "object.spec == oldObject.spec", "message": "only the in-place restart attempt"},
                {"expression": " && ".join([_same("labels", "{}"), _same("ownerReferences", "[]"),
                                            _same("finalizers", "[]")]),
                 "message": "only the in-place restart attempt"},
                {"expression": f"{ann}.all(k, k == '{key}' || (k in {old} && {old}[k] == {ann}[k])) && "
                               f"{old}.all(k, k == '{key}' || k in {ann})",
                 "message": f"only the annotation {key} may change"},
                {"expression": f"!('{key}' in {ann}) || {ann}['{key}'].matches('^[0-9]{{1,9}}$')",
                 "message": f"{key} must be a non-negative integer"},
            ],
        },
    }


def admission_policy_binding(opts: ManifestOptions) -> dict[str, Any]:
    name = f"{opts.job}-mtc-in-place-restart"
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": _meta(name, opts), "spec": {"policyName": name, "validationActions": ["Deny"]}}


def objects(opts: ManifestOptions) -> dict[str, dict[str, Any]]:
    """The in-place restart's RBAC and admission policy (empty for ``--restart recreate``)."""
    if not in_place(opts):
        return {}
    return {"in-place-restart-role.yaml": agent_role(opts),
            "in-place-restart-rolebinding.yaml": agent_role_binding(opts),
            "in-place-restart-policy.yaml": admission_policy(opts),
            "in-place-restart-policybinding.yaml": admission_policy_binding(opts)}
