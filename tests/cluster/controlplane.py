"""A real Kubernetes control plane on loopback for the cluster tests (``make test-cluster``).

etcd, kube-apiserver, kube-controller-manager and kube-scheduler (Kubernetes v1.36.3, etcd at the version that
release pins) and JobSet's controller (v0.12.0, with its CRD and admission webhooks from the same release, the
feature gate InPlaceRestart on; its in-place-restart agent too), all built from Go modules by ``make cluster-bin``
into ``build/cluster/bin`` (tests/cluster/controlplane/go.mod, tests/cluster/jobset/go.mod). Nothing runs a kubelet: tests/cluster/node_agent.py registers nodes and runs
the Pods the scheduler binds to them.

Out of a cluster, JobSet's webhooks are registered by ``url:`` with the CA bundle of this plane (JobSet's
internal certificate management is off), and the CRD keeps its one version without the conversion webhook
that the release's kustomize patch adds (with a single served version the API server never converts). The
controller-manager runs every default controller with per-controller service-account credentials, as kubeadm
sets it up, and short node-monitor periods so that a lost node is seen in seconds; the API server's
``DefaultTolerationSeconds`` are short for the same reason (docs/testing.md).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.pki import ClusterCA, KeyPair

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = REPO / "build" / "cluster" / "bin"
JOBSET_MODULE_DIR = REPO / "tests" / "cluster" / "jobset"
PROGRAMS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "jobset", "in-place-restart-agent")
KUBERNETES_VERSION = "v1.36.3"
JOBSET_VERSION = "v0.12.0"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
# The Pod network's gateway (tests/cluster/pod_network.py): Pods reach the API server there, through a relay.
POD_GATEWAY_IP = "10.214.0.1"
# Container restart rules with the RestartAllContainers action (`mtc manifests --restart in-place`): beta and on by
# default in v1.36 (pkg/features/kube_features.go), named here so that the tests' dependence on them is explicit.
API_FEATURE_GATES = "ContainerRestartRules=true,RestartAllContainersOnContainerExits=true,NodeDeclaredFeatures=true"
# JobSet's in-place-restart agent (cmd/in-place-restart-agent of the same JobSet module), run by the node agent
# for the agent image of the rendered Pods (tests/cluster/pod_spec.py).
IN_PLACE_RESTART_AGENT = "in-place-restart-agent"
START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0
NODE_MONITOR_GRACE_SECONDS = 4
NOT_READY_TOLERATION_SECONDS = 2
# Nodes per second the node-lifecycle controller taints NoExecute (and so evicts from) once they are NotReady: 0.1 by
# default, one node every 10 s from a queue that every node of the session's earlier tests went through too (their
# agents stopped, then the nodes were deleted: each deleted one still takes its 10 s slot). A test losing one node
# late in a full suite had its Pod evicted 37 s after the loss instead of ~6 s (host_lost_to_first_step_in_place
# 41.65 / 52.14 / 42.54 s against 9-12 s alone; the controller-manager's log showed the queue: "Node no longer
# present in nodeLister" for three earlier tests' nodes at 10 s intervals, then the eviction). A cluster losing
# one node has a full token at once; so does every test here.
NODE_EVICTION_RATE = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_programs(bin_dir: Path = BIN_DIR) -> list[str]:
    return [p for p in PROGRAMS if not (bin_dir / p).is_file()]


def jobset_release_dir() -> Path:
    """The JobSet module's source in the Go module cache (its CRD and webhook manifests)."""
    out = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/jobset"], cwd=JOBSET_MODULE_DIR,
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def _kubeconfig(path: Path, server: str, ca: Path, client: KeyPair) -> Path:
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
           "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
           "users": [{"name": "u", "user": {"client-certificate": str(client.cert), "client-key": str(client.key)}}],
           "contexts": [{"name": "test", "context": {"cluster": "test", "user": "u"}}]}
    path.write_text(yaml.safe_dump(cfg))
    return path


class ControlPlane:
    """``with ControlPlane(workdir) as cp``: every program started and healthy, stopped by pid on exit.

    ``server`` is ``https://127.0.0.1:<port>``; ``kubeconfig`` an admin's (group system:masters); ``ca_file``
    the CA that signed every certificate here, the API server's serving one included (SANs 127.0.0.1,
    the Service IP, :data:`POD_GATEWAY_IP` and the ``kubernetes.default.svc`` names)."""

    def __init__(self, workdir: Path, *, bin_dir: Path = BIN_DIR) -> None:
        self.dir = workdir
        self.bin = bin_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.port = 0
        self.server = ""
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.ca_file = workdir / "pki" / "ca.crt"
        self.started_seconds = 0.0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        missing = missing_programs(self.bin)
        if missing:
            raise RuntimeError(f"control-plane programs not built: {', '.join(missing)} (run `make cluster-bin`)")
        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        ca = ClusterCA(self.dir / "pki")
        self.ca_file = ca.cert
        sa = ca.service_account_keys()
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        serving = ca.issue("apiserver", dns=("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                             "kubernetes.default.svc.cluster.local", "localhost"),
                           ips=("127.0.0.1", SERVICE_IP, POD_GATEWAY_IP))
        _kubeconfig(self.kubeconfig, self.server, ca.cert, ca.issue("admin", groups=("system:masters",)))
        kcm_cfg = _kubeconfig(self.dir / "kcm.kubeconfig", self.server, ca.cert,
                              ca.issue("kcm", cn="system:kube-controller-manager"))
        sched_cfg = _kubeconfig(self.dir / "scheduler.kubeconfig", self.server, ca.cert,
                                ca.issue("scheduler", cn="system:kube-scheduler"))
        jobset_cfg = _kubeconfig(self.dir / "jobset.kubeconfig", self.server, ca.cert,
                                 ca.issue("jobset", cn="jobset-controller"))
        etcd_port, etcd_peer = free_port(), free_port()
        self._spawn("etcd", [
            "--name", "default", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync", "--log-level", "warn"])
        self._spawn("kube-apiserver", [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}", f"--secure-port={self.port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--service-cluster-ip-range={SERVICE_CIDR}", f"--client-ca-file={ca.cert}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa.cert}", f"--service-account-signing-key-file={sa.key}",
            "--authorization-mode=RBAC", "--allow-privileged=true", "--profiling=false",
            f"--feature-gates={API_FEATURE_GATES}",
            f"--default-not-ready-toleration-seconds={NOT_READY_TOLERATION_SECONDS}",
            f"--default-unreachable-toleration-seconds={NOT_READY_TOLERATION_SECONDS}", "--v=1"])
        self._wait("API server ready", self._apiserver_ready)
        self._install_jobset(ca, jobset_cfg)
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={kcm_cfg}", f"--authentication-kubeconfig={kcm_cfg}",
            f"--authorization-kubeconfig={kcm_cfg}", "--secure-port=0", "--leader-elect=false",
            "--use-service-account-credentials=true", f"--service-account-private-key-file={sa.key}",
            f"--root-ca-file={ca.cert}", "--controllers=*", "--node-monitor-period=1s",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE_SECONDS}s", f"--node-eviction-rate={NODE_EVICTION_RATE}",
            "--concurrent-job-syncs=10",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1"])
        self._spawn("kube-scheduler", [
            f"--kubeconfig={sched_cfg}", f"--authentication-kubeconfig={sched_cfg}",
            f"--authorization-kubeconfig={sched_cfg}", "--secure-port=0", "--leader-elect=false", "--v=1"])
        self._wait("the controller-manager's service-account controller", self._default_service_account)
        self._wait("the controller-manager's root-CA publisher", self._root_ca_published)
        self.started_seconds = time.monotonic() - t0
        log.info("control plane up in %.1f s at %s", self.started_seconds, self.server)

    def close(self) -> None:
        """Stop every program by its pid (SIGTERM, then SIGKILL after a bounded wait), newest first."""
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_SECONDS)
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) ignored SIGTERM: SIGKILL", name, proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=STOP_TIMEOUT_SECONDS)
        self.procs.clear()

    # ------------------------------------------------------------------ clients
    def client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` with the admin's credentials."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def versions(self) -> dict[str, str]:
        return {"kubernetes": KUBERNETES_VERSION, "jobset": JOBSET_VERSION, "etcd": self.etcd_version()}

    def etcd_version(self) -> str:
        out = subprocess.run([str(self.bin / "etcd"), "--version"], capture_output=True, text=True, timeout=10,
                             check=True)
        for line in out.stdout.splitlines():
            if line.startswith("etcd Version:"):
                return "v" + line.split(":", 1)[1].strip()
        raise RuntimeError(f"etcd --version printed no version: {out.stdout!r}")

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.dir / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # ------------------------------------------------------------------ parts
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        out = open(self.dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (the child's stdout; closed below)
        try:
            self.procs[name] = subprocess.Popen([str(self.bin / name), *args], stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True,
                                                env={**os.environ, **(env or {})})
        finally:
            out.close()

    def _wait(self, what: str, ready: Any, timeout: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                       f"{self.log_tail(name)}")
            try:
                if ready():
                    return
            except Exception as e:  # not up yet: connection refused, 403 before RBAC bootstraps, ...
                last = e
            time.sleep(0.2)
        raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {last})")

    def _get(self, path: str) -> tuple[int, bytes]:
        import ssl
        import urllib.error
        import urllib.request
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        cfg = yaml.safe_load(self.kubeconfig.read_text())
        user = cfg["users"][0]["user"]
        ctx.load_cert_chain(user["client-certificate"], user["client-key"])
        try:
            with urllib.request.urlopen(self.server + path, context=ctx, timeout=5) as r:  # noqa: S310
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _apiserver_ready(self) -> bool:
        return self._get("/readyz")[0] == 200

    def _default_service_account(self) -> bool:
        return self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200

    def _root_ca_published(self) -> bool:
        return self._get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt")[0] == 200

    def _install_jobset(self, ca: ClusterCA, kubeconfig: Path) -> None:
        """The release's CRD, RBAC (bound to this controller's client identity) and webhooks (by url)."""
        from kubernetes import client, utils
        release = jobset_release_dir() / "config" / "components"
        api = self.client()
        with contextlib.closing(api):
            utils.create_from_yaml(api, str(release / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml"))
            role = yaml.safe_load((release / "rbac" / "role.yaml").read_text())
            role["metadata"]["name"] = "jobset-manager-role"
            rbac = client.RbacAuthorizationV1Api(api)
            rbac.create_cluster_role(role)
            rbac.create_cluster_role_binding({
                "metadata": {"name": "jobset-manager-rolebinding"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "jobset-manager-role"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                              "name": "jobset-controller"}]})
            self._wait("the JobSet CRD established", lambda: self._crd_established(api))
            webhook_port, probe_port = free_port(), free_port()
            cert_dir = self.dir / "jobset-webhook-certs"
            cert_dir.mkdir()
            pair = ca.issue("jobset-webhook", dns=("localhost",), ips=("127.0.0.1",))
            (cert_dir / "tls.crt").write_bytes(pair.cert.read_bytes())
            (cert_dir / "tls.key").write_bytes(pair.key.read_bytes())
            config = self.dir / "jobset-config.yaml"
            config.write_text(yaml.safe_dump({
                "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
                "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
                "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
                "metrics": {"bindAddress": "0"},
                # Alpha in v0.11/v0.12: the webhook refuses restartStrategy InPlaceRestart while it is off.
                "featureGates": {"InPlaceRestart": True},
                "health": {"healthProbeBindAddress": f"127.0.0.1:{probe_port}"}}))
            self._spawn("jobset", [f"--config={config}", f"--kubeconfig={kubeconfig}", "--zap-log-level=info"])
            self._wait("the JobSet controller ready", lambda: _http_ok(f"http://127.0.0.1:{probe_port}/readyz"))
            self._register_webhooks(api, release, webhook_port)

    @staticmethod
    def _crd_established(api: Any) -> bool:
        from kubernetes import client
        crd = client.ApiextensionsV1Api(api).read_custom_resource_definition("jobsets.jobset.x-k8s.io")
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    def _register_webhooks(self, api: Any, release: Path, port: int) -> None:
        from kubernetes import client
        bundle = base64.b64encode(self.ca_file.read_bytes()).decode()
        adm = client.AdmissionregistrationV1Api(api)
        for doc in yaml.safe_load_all((release / "webhook" / "manifests.yaml").read_text()):
            if not doc:
                continue
            doc["metadata"]["name"] = "jobset-" + doc["metadata"]["name"]
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
                if path.endswith("-v1-pod"):  # the release's kustomize patches: only JobSet's Pods
                    hook["objectSelector"] = {"matchExpressions": [
                        {"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}
            if doc["kind"] == "MutatingWebhookConfiguration":
                adm.create_mutating_webhook_configuration(doc)
            else:
                adm.create_validating_webhook_configuration(doc)


def _http_ok(url: str) -> bool:
    import urllib.request
    with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (loopback)
        return r.status == 200
