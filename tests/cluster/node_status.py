"""What a kubelet writes about its node: the Lease in ``kube-node-lease`` and the node status (Ready and the
pressure conditions, capacity, addresses), through the status subresource."""

from __future__ import annotations

import logging
import os

from tests.cluster.kube import Kube, KubeError, now_micro, now_rfc3339
from tests.cluster.pod_worker import NodeInfo

log = logging.getLogger(__name__)

LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
KUBELET_VERSION = "v1.36.3"
# What a v1.36 kubelet declares (NodeDeclaredFeatures, beta): the scheduler places a Pod with a RestartAllContainers
# restart rule only on a node declaring it (component-helpers nodedeclaredfeatures/features/restartallcontainers).
DECLARED_FEATURES = ["RestartAllContainersOnContainerExits"]


def renew_lease(kube: Kube, info: NodeInfo, lease_seconds: int) -> None:
    """Renew (create the first time, owned by the Node so that it goes with it) the node's Lease."""
    path = f"{LEASES}/{info.name}"
    spec = {"holderIdentity": info.name, "leaseDurationSeconds": lease_seconds, "renewTime": now_micro()}
    try:
        if info.extra["lease"]:
            kube.patch(path, {"spec": spec})
            return
    except KubeError as e:
        if e.status != 404:
            log.warning("lease of %s: %s", info.name, e)
            return
    owner = {"apiVersion": "v1", "kind": "Node", "name": info.name, "uid": info.extra["uid"]}
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": info.name, "namespace": "kube-node-lease", "ownerReferences": [owner]},
            "spec": spec}
    try:
        kube.request("POST", LEASES, body=body)
    except KubeError as e:
        if e.status != 409:
            log.warning("lease of %s: %s", info.name, e)
            return
        kube.patch(path, {"spec": spec})
    info.extra["lease"] = True


def report_node_status(kube: Kube, info: NodeInfo) -> None:
    """Post the node's status: Ready as ``info.extra["ready"]`` says, no pressure, its capacity."""
    now = now_rfc3339()
    ready = bool(info.extra["ready"])
    if info.extra.get("ready_since", ("", ""))[0] != ready:
        info.extra["ready_since"] = (ready, now)
    since = info.extra["ready_since"][1]

    def cond(t: str, ok: bool, reason: str) -> dict[str, str]:
        return {"type": t, "status": "True" if ok else "False", "reason": reason, "message": reason,
                "lastHeartbeatTime": now, "lastTransitionTime": since}

    uid = info.extra["uid"]
    status = {"capacity": info.allocatable, "allocatable": info.allocatable,
              "conditions": [cond("MemoryPressure", False, "KubeletHasSufficientMemory"),
                             cond("DiskPressure", False, "KubeletHasNoDiskPressure"),
                             cond("PIDPressure", False, "KubeletHasSufficientPID"),
                             cond("Ready", ready, "KubeletReady" if ready else "KubeletNotReady")],
              "addresses": [{"type": "InternalIP", "address": info.ip}, {"type": "Hostname", "address": info.name}],
              "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}}, "declaredFeatures": DECLARED_FEATURES,
              "nodeInfo": {"machineID": uid, "systemUUID": uid, "bootID": uid, "kernelVersion": os.uname().release,
                           "osImage": "node agent (tests/cluster)", "containerRuntimeVersion": "mtck://0.1",
                           "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "", "operatingSystem": "linux",
                           "architecture": "amd64"}}
    try:
        kube.patch(f"/api/v1/nodes/{info.name}/status", {"status": status})
    except KubeError as e:
        log.warning("status of node %s: %s", info.name, e)
