"""`mtc status --jobset NAME`: the JobSet's own verdict from the Kubernetes API, beside the replicators' view.

After ``maxRestarts`` is used up every Pod is gone (the replicators with them), so this part needs no
coordinator: it reads the JobSet object (kubeconfig, or the in-cluster service account) and says what the
JobSet controller decided and why, from its typed status (conditions, ``restarts``,
``restartsCountTowardsMax``), never from logs. Needs the ``kubernetes`` package (extra ``[k8s]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
TERMINAL = ("Failed", "Completed")
REQUEST_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class JobSetState:
    name: str
    namespace: str
    state: str  # Failed | Completed | Suspended | Running
    reason: str
    message: str
    restarts: int
    restarts_counted: int
    max_restarts: int | None

    @property
    def failed(self) -> bool:
        return self.state == "Failed"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "namespace": self.namespace, "state": self.state, "reason": self.reason,
                "message": self.message, "restarts": self.restarts, "restarts_count_towards_max": self.restarts_counted,
                "max_restarts": self.max_restarts}

    def text(self) -> str:
        budget = f"{self.restarts_counted}/{self.max_restarts}" if self.max_restarts is not None else \
            str(self.restarts_counted)
        why = f": {self.reason}" + (f" ({self.message})" if self.message else "") if self.reason else ""
        return f"{self.state}{why}; restarts {self.restarts} ({budget} counted against maxRestarts)"


def state_of(obj: dict[str, Any]) -> JobSetState:
    """The JobSet's state from its object (the first true terminal or Suspended condition; else Running)."""
    meta, spec, status = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status", {}) or {}
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    found = next((c for kind in (*TERMINAL, "Suspended") for c in conditions if c.get("type") == kind), None)
    policy = spec.get("failurePolicy") or {}
    return JobSetState(
        name=meta.get("name", ""), namespace=meta.get("namespace", ""),
        state=found["type"] if found else "Running", reason=(found or {}).get("reason", ""),
        message=(found or {}).get("message", ""), restarts=int(status.get("restarts", 0)),
        restarts_counted=int(status.get("restartsCountTowardsMax", 0)),
        max_restarts=int(policy["maxRestarts"]) if "maxRestarts" in policy else None)


def read_jobset(name: str, namespace: str = "default", kubeconfig: str | None = None) -> JobSetState:
    """Read JobSet ``namespace/name``; LookupError when it does not exist, RuntimeError without ``kubernetes``."""
    try:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
    except ImportError:
        raise RuntimeError("--jobset needs the kubernetes package: pip install 'multitier-checkpoint[k8s]'") from None
    if kubeconfig:
        api = config.new_client_from_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.ApiClient()
    with api:
        try:
            obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except ApiException as e:
            if e.status == 404:
                raise LookupError(f"no JobSet {namespace}/{name}") from None
            raise
    return state_of(obj)
