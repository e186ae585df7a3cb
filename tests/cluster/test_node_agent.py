"""The node agent (tests/cluster/node_agent.py) on the real control plane: Pods run as processes in namespaces
of their own, report status like the kubelet's, see each other and the API server, stop with grace; a lost
host is found out by the real node-lifecycle controller."""

from __future__ import annotations

import json
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.node_agent import NodeAgent

pytestmark = pytest.mark.cluster

IMAGE = "example.com/mtc-sidecar:0.1.0"
GRACE_SECONDS = 6
PRESTOP_SLEEP_SECONDS = 1


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0, every: float = 0.2) -> Any:
    """``fn()``'s first truthy answer within ``timeout`` seconds, else a failure naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout:.0f} s (last: {last!r})")


@pytest.fixture
def agent(control_plane: ControlPlane, tmp_path: Path) -> Iterator[NodeAgent]:
    api = control_plane.client()
    try:
        with NodeAgent(api, control_plane.server, tmp_path / "agent") as a:
            yield a
    finally:
        api.close()


@pytest.fixture
def namespace(agent: NodeAgent) -> Iterator[str]:
    """A namespace of the test's own with ServiceAccount ``mtc`` and ConfigMap ``cfg``."""
    kube = agent.kube
    ns = f"na-{uuid.uuid4().hex[:6]}"
    kube.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", body={"metadata": {"name": "mtc"}})
    kube.request("POST", f"/api/v1/namespaces/{ns}/configmaps",
                 body={"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}})
    wait_for("kube-root-ca.crt published", lambda: kube.get(f"/api/v1/namespaces/{ns}/configmaps/kube-root-ca.crt"))
    yield ns
    kube.delete(f"/api/v1/namespaces/{ns}")


def py(script: str) -> list[str]:
    return ["python", "-c", textwrap.dedent(script)]


SERVER = """
    import socket
    s = socket.create_server(("0.0.0.0", 8080))
    while True:
        c, _ = s.accept()
        c.sendall(b"hello from " + socket.gethostname().encode())
        c.close()
"""

# A native sidecar: a gRPC health server that turns SERVING 1.5 s after it starts (its startup probe gates the
# main container), records SIGTERM and ignores it, so only the SIGKILL at the end of the grace stops it.
SIDECAR = """
    import signal, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    def ev(m):
        with open("/local/events", "a") as f:
            f.write(f"{m} {time.time()}\\n")
    signal.signal(signal.SIGTERM, lambda *a: ev("side-term"))
    s = grpc.server(futures.ThreadPoolExecutor(2))
    h = health.HealthServicer()
    h.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # a HealthServicer starts SERVING
    health_pb2_grpc.add_HealthServicer_to_server(h, s)
    s.add_insecure_port("0.0.0.0:50051")
    s.start()
    time.sleep(1.5)
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    open("/shared/side-serving", "w").close()
    ev("side-serving")
    while True:
        time.sleep(0.2)
"""

MAIN = """
    import json, os, signal, socket, ssl, sys, time, urllib.request
    def ev(m):
        with open("/local/events", "a") as f:
            f.write(f"{m} {time.time()}\\n")
    def term(*a):
        ev("main-term")
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    ev("main-start")
    print("main-start", flush=True)
    out = {"env": {k: os.environ.get(k) for k in ("POD_NAME", "POD_NS", "NODE", "POD_IP", "SLICE", "JOBSET",
                                                  "GREETING", "EXPANDED", "KUBERNETES_SERVICE_HOST")},
           "hostname": socket.gethostname(),
           "sidecar_serving_before_main": os.path.exists("/shared/side-serving"),
           "init": open("/scratch/init-done").read(), "cfg": open("/etc/cfg/greeting").read()}
    for _ in range(100):
        try:
            with socket.create_connection(("server.sub", 8080), timeout=2) as c:
                out["peer"] = c.recv(100).decode()
            break
        except OSError as e:
            out["peer_error"] = repr(e)
            time.sleep(0.2)
    try:
        kd = "/var/run/mtc/kube-api"
        token = open(kd + "/token").read()
        ctx = ssl.create_default_context(cafile=kd + "/ca.crt")
        url = "https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews" % (
            os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode()
        req = urllib.request.Request(url, data=body, headers={"Authorization": "Bearer " + token,
                                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            out["whoami"] = json.load(r)["status"]["userInfo"]["username"]
        out["ns_file"] = open(kd + "/namespace").read()
    except Exception as e:
        out["api_error"] = repr(e)
    with open("/local/report.json.tmp", "w") as f:
        json.dump(out, f)
    os.rename("/local/report.json.tmp", "/local/report.json")
    while True:
        time.sleep(0.2)
"""


def pod(name: str, pool: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/jobset-name": "demo"},
                         "annotations": {"jobset.sigs.k8s.io/job-index": "1"}},
            "spec": {"serviceAccountName": "mtc", "automountServiceAccountToken": False, "hostname": name,
                     "subdomain": "sub", "nodeSelector": {"cloud.google.com/gke-nodepool": pool},
                     "containers": containers, **spec}}


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def client_pod(pool: str) -> dict[str, Any]:
    mounts = [{"name": "ramdisk", "mountPath": "/local"}, {"name": "shared", "mountPath": "/shared"}]
    main = {"name": "main", "image": IMAGE, "command": py(MAIN),
            "env": [field_env("POD_NAME", "metadata.name"), field_env("POD_NS", "metadata.namespace"),
                    field_env("NODE", "spec.nodeName"), field_env("POD_IP", "status.podIP"),
                    field_env("SLICE", "metadata.annotations['jobset.sigs.k8s.io/job-index']"),
                    field_env("JOBSET", "metadata.labels['jobset.sigs.k8s.io/jobset-name']"),
                    {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
                    {"name": "EXPANDED", "value": "$(JOBSET)-workers-$(SLICE)-0"}],
            "resources": {"limits": {"google.com/tpu": "4"}, "requests": {"google.com/tpu": "4"}},
            "lifecycle": {"preStop": {"exec": {"command": [
                "sh", "-c", f"echo prestop $(date +%s.%N) >> /local/events; sleep {PRESTOP_SLEEP_SECONDS}"]}}},
            "volumeMounts": [*mounts, {"name": "scratch", "mountPath": "/scratch"},
                             {"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True},
                             {"name": "kube-api", "mountPath": "/var/run/mtc/kube-api", "readOnly": True}]}
    side = {"name": "side", "image": IMAGE, "restartPolicy": "Always", "command": py(SIDECAR),
            "startupProbe": {"grpc": {"port": 50051}, "periodSeconds": 1, "failureThreshold": 30},
            "readinessProbe": {"grpc": {"port": 50051}, "periodSeconds": 2},
            "volumeMounts": mounts}
    prep = {"name": "prep", "image": IMAGE, "command": ["sh", "-c", "echo done > /scratch/init-done"],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}
    volumes = [{"name": "ramdisk", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}},
               {"name": "shared", "emptyDir": {"medium": "Memory"}}, {"name": "scratch", "emptyDir": {}},
               {"name": "cfg", "configMap": {"name": "cfg"}},
               {"name": "kube-api", "projected": {"sources": [
                   {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                   {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                   {"downwardAPI": {"items": [{"path": "namespace",
                                               "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}]
    return pod("client", pool, [main], initContainers=[prep, side], volumes=volumes,
               terminationGracePeriodSeconds=GRACE_SECONDS)


def conditions(p: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in p.get("status", {}).get("conditions") or []}


def events(path: Path) -> list[tuple[str, float]]:
    out = []
    for line in path.read_text().splitlines():
        name, at = line.split()
        out.append((name, float(at)))
    return out


def test_pod_runs_reports_resolves_reaches_api_and_stops_with_grace(agent: NodeAgent, namespace: str) -> None:
    kube, ns = agent.kube, namespace
    pool = f"tpu-{uuid.uuid4().hex[:4]}"
    nodes = agent.add_slice(pool, hosts=2)
    server = pod("server", pool, [{"name": "srv", "image": IMAGE, "command": py(SERVER),
                                   "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}])
    # TPU requests fill a node: the client cannot land where the server is.
    server["spec"]["containers"][0]["resources"] = {"limits": {"google.com/tpu": "4"}}
    kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=server)
    kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=client_pod(pool))
    path = f"/api/v1/namespaces/{ns}/pods/client"

    def running_and_ready() -> dict[str, Any] | None:
        p = kube.get(path)
        return p if p and p["status"].get("phase") == "Running" and conditions(p).get("Ready") == "True" else None

    p = wait_for("client Running and Ready", running_and_ready, timeout=90)
    node = p["spec"]["nodeName"]
    assert node in nodes
    st = p["status"]
    assert st["podIP"].startswith("10.214.") and st["podIPs"] == [{"ip": st["podIP"]}]
    assert {k: conditions(p).get(k) for k in ("PodReadyToStartContainers", "Initialized", "ContainersReady")} == \
        {"PodReadyToStartContainers": "True", "Initialized": "True", "ContainersReady": "True"}
    init = {c["name"]: c for c in st["initContainerStatuses"]}
    assert init["prep"]["state"]["terminated"]["exitCode"] == 0
    assert init["prep"]["state"]["terminated"]["reason"] == "Completed"
    assert "running" in init["side"]["state"] and init["side"]["started"] and init["side"]["ready"]
    main = st["containerStatuses"][0]
    assert "running" in main["state"] and main["ready"] and main["started"] and main["restartCount"] == 0

    report_file = agent.ramdisk(node) / "report.json"
    wait_for("the main container's report", report_file.exists, timeout=60)
    report = json.loads(report_file.read_text())
    assert report["env"] == {"POD_NAME": "client", "POD_NS": ns, "NODE": node, "POD_IP": st["podIP"], "SLICE": "1",
                             "JOBSET": "demo", "GREETING": "hello", "EXPANDED": "demo-workers-1-0",
                             "KUBERNETES_SERVICE_HOST": "10.214.0.1"}, report
    assert report["hostname"] == "client"
    assert report["sidecar_serving_before_main"], "the main container started before the sidecar's startup probe"
    assert report["init"] == "done\n" and report["cfg"] == "hello"
    server_pod = kube.get(f"/api/v1/namespaces/{ns}/pods/server")
    assert server_pod is not None and server_pod["spec"]["nodeName"] != node
    assert report.get("peer") == "hello from server", report
    assert report.get("whoami") == f"system:serviceaccount:{ns}:mtc", report
    assert report.get("ns_file") == ns
    assert sorted(agent.pods_running()) == [f"{ns}/client", f"{ns}/server"]

    # Deletion: preStop, then SIGTERM to main; the sidecar only after main exited, SIGKILLed at the grace's end.
    t0 = time.time()
    assert kube.delete(path)
    wait_for("the client Pod removed", lambda: kube.get(path) is None, timeout=GRACE_SECONDS + 20, every=0.1)
    removed_after = time.time() - t0
    order = [e for e in events(agent.ramdisk(node) / "events") if e[0] in ("prestop", "main-term", "side-term")]
    names = [n for n, _ in order]
    assert names == ["prestop", "main-term", "side-term"], order
    at = dict(order)
    assert at["main-term"] - at["prestop"] >= PRESTOP_SLEEP_SECONDS - 0.2, "SIGTERM before the preStop hook ended"
    assert GRACE_SECONDS - 0.5 <= removed_after <= GRACE_SECONDS + 5, removed_after
    assert f"{ns}/client" not in agent.pods_running()
    assert agent.logs("client", "main", ns).splitlines()[0] == "main-start"


def test_exit_codes_make_the_phase(agent: NodeAgent, namespace: str) -> None:
    kube, ns = agent.kube, namespace
    pool = f"cpu-{uuid.uuid4().hex[:4]}"
    agent.add_cpu_pool(pool)
    for name, code in (("ok", 0), ("bad", 3)):
        p = pod(name, pool, [{"name": "c", "image": IMAGE, "command": ["sh", "-c", f"echo out-{name}; exit {code}"]}],
                restartPolicy="Never")
        kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=p)

    def phase(name: str) -> str:
        p = kube.get(f"/api/v1/namespaces/{ns}/pods/{name}")
        return p["status"].get("phase", "") if p else ""

    wait_for("ok Succeeded", lambda: phase("ok") == "Succeeded", timeout=60)
    wait_for("bad Failed", lambda: phase("bad") == "Failed", timeout=60)
    bad = kube.get(f"/api/v1/namespaces/{ns}/pods/bad")
    assert bad is not None
    term = bad["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (3, "Error")
    assert conditions(bad)["Ready"] == "False"
    assert agent.logs("bad", "c", ns).strip() == "out-bad"


def test_lost_host_is_found_out_by_the_node_lifecycle_controller(agent: NodeAgent, namespace: str) -> None:
    kube, ns = agent.kube, namespace
    pool = f"tpu-{uuid.uuid4().hex[:4]}"
    [node] = agent.add_slice(pool, hosts=1)
    # A zone whose nodes are all NotReady is a "full disruption": the controller then evicts nothing.
    agent.add_cpu_pool(f"cpu-{uuid.uuid4().hex[:4]}")
    kube.request("POST", f"/api/v1/namespaces/{ns}/pods",
                 body=pod("victim", pool, [{"name": "c", "image": IMAGE, "command": ["sleep", "600"],
                                            "volumeMounts": [{"name": "ramdisk", "mountPath": "/local"}]}],
                          volumes=[{"name": "ramdisk", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}}]))
    path = f"/api/v1/namespaces/{ns}/pods/victim"
    wait_for("victim Running", lambda: (kube.get(path) or {}).get("status", {}).get("phase") == "Running")
    assert agent.pods_running() == [f"{ns}/victim"]
    assert agent.ramdisk(node).is_dir()

    agent.lose_host(node)
    wait_for("the victim's processes killed", lambda: not agent.pods_running(), timeout=5, every=0.05)

    def node_ready() -> dict[str, Any]:
        n = kube.get(f"/api/v1/nodes/{node}") or {}
        return next((c for c in n.get("status", {}).get("conditions") or [] if c["type"] == "Ready"), {})

    # The agent never writes "Unknown": only the node-lifecycle controller does, when the Lease goes stale.
    ready = wait_for("node Ready=Unknown", lambda: (c := node_ready()).get("status") == "Unknown" and c, timeout=60)
    assert ready["reason"] == "NodeStatusUnknown", ready
    wait_for("the unreachable:NoExecute taint", lambda: [t for t in (kube.get(f"/api/v1/nodes/{node}") or {})
                                                         .get("spec", {}).get("taints") or []
                                                         if (t["key"], t["effect"]) ==
                                                         ("node.kubernetes.io/unreachable", "NoExecute")])
    # Taint eviction deletes the Pod; nobody on the node can finish it, so the agent fails and removes it.
    wait_for("victim removed", lambda: kube.get(path) is None, timeout=60)
    assert not agent.ramdisk(node).exists(), "the lost host's RAM disk outlived it"


def test_preempt_marks_disruption_target_and_removes_the_node(agent: NodeAgent, namespace: str) -> None:
    kube, ns = agent.kube, namespace
    pool = f"tpu-{uuid.uuid4().hex[:4]}"
    [node] = agent.add_slice(pool, hosts=1)
    # SIGTERM is noted and ignored: only the SIGKILL at the end of the grace stops the container.
    loop = "trap 'echo got-term' TERM; echo up; while :; do sleep 0.1; done"
    kube.request("POST", f"/api/v1/namespaces/{ns}/pods",
                 body=pod("worker", pool, [{"name": "c", "image": IMAGE, "command": ["sh", "-c", loop]}],
                          terminationGracePeriodSeconds=30))
    path = f"/api/v1/namespaces/{ns}/pods/worker"
    wait_for("worker Running", lambda: (kube.get(path) or {}).get("status", {}).get("phase") == "Running")
    wait_for("the container up", lambda: "up" in agent.logs("worker", "c", ns), timeout=10)

    t0 = time.monotonic()
    assert agent.preempt(node, grace_seconds=3) == [f"{ns}/worker"]
    p = kube.get(path)
    assert p is not None and p["metadata"].get("deletionTimestamp")
    target = [c for c in p["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert [(c["status"], c["reason"]) for c in target] == [("True", "TerminationByKubelet")], target
    assert (kube.get(f"/api/v1/nodes/{node}") or {}).get("spec", {}).get("unschedulable") is True
    wait_for("worker removed", lambda: kube.get(path) is None, timeout=20, every=0.1)
    assert time.monotonic() - t0 >= 3 - 0.5, "removed before the grace it was deleted with"
    assert "got-term" in agent.logs("worker", "c", ns)
    wait_for("the preempted node deleted", lambda: kube.get(f"/api/v1/nodes/{node}") is None, timeout=20)
    assert node not in agent.node_names()


def test_a_restart_all_containers_rule_restarts_the_pod_in_place(agent: NodeAgent, namespace: str) -> None:
    """A main container exits with a code its ``RestartAllContainers`` rule names: the sidecar is stopped too
    (no preStop hook), the init container runs again, then the sidecar, then the main container; the Pod keeps
    its uid and node, each restarted container counts one restart. A code no rule names fails the Pod."""
    kube, ns = agent.kube, namespace
    pool = f"cpu-{uuid.uuid4().hex[:4]}"
    (node,) = agent.add_cpu_pool(pool)
    mounts = [{"name": "ramdisk", "mountPath": "/local"}]  # the node's folder: it outlives the Pod
    prep = {"name": "prep", "image": IMAGE, "command": ["sh", "-c", "echo prep >> /local/runs"], "volumeMounts": mounts}
    side = {"name": "side", "image": IMAGE, "restartPolicy": "Always",
            "command": ["sh", "-c", "echo side >> /local/runs; exec sleep 600"],
            "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo hook >> /local/runs"]}}},
            "volumeMounts": mounts}
    # The first run exits 3 (restart in place), the second 4 (no rule: the Pod fails).
    main = {"name": "main", "image": IMAGE, "restartPolicy": "Never",
            "restartPolicyRules": [{"action": "RestartAllContainers", "exitCodes": {"operator": "In", "values": [3]}}],
            "command": ["sh", "-c", "echo main >> /local/runs; sleep 1; "
                        "if [ $(grep -c main /local/runs) = 1 ]; then exit 3; else exit 4; fi"],
            "volumeMounts": mounts}
    body = pod("inplace", pool, [main], initContainers=[prep, side], restartPolicy="Never",
               volumes=[{"name": "ramdisk", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}}])
    created = kube.request("POST", f"/api/v1/namespaces/{ns}/pods", body=body)
    path = f"/api/v1/namespaces/{ns}/pods/inplace"
    p = wait_for("inplace Failed", lambda: (x := kube.get(path)) and x["status"].get("phase") == "Failed" and x,
                 timeout=90)
    assert (p["metadata"]["uid"], p["spec"]["nodeName"]) == (created["metadata"]["uid"], node)
    statuses = {c["name"]: c for c in p["status"]["initContainerStatuses"] + p["status"]["containerStatuses"]}
    assert {n: c["restartCount"] for n, c in statuses.items()} == {"prep": 1, "side": 1, "main": 1}
    assert statuses["main"]["state"]["terminated"]["exitCode"] == 4
    runs = (agent.ramdisk(node) / "runs").read_text().split()
    # prep first each time; side and main race to write their line (no startup probe holds main back).
    assert runs[0] == runs[3] == "prep" and sorted(runs[:3]) == sorted(runs[3:]) == ["main", "prep", "side"], runs
    assert conditions(p).get("AllContainersRestarting") == "False"
