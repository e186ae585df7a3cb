"""A node agent in place of the kubelet: fake GKE nodes that really run their Pods' containers as processes.

``with NodeAgent(cp.client(), cp.server, workdir) as agent`` registers Nodes (:meth:`NodeAgent.add_slice`:
one node pool per TPU slice, labelled as GKE labels TPU nodes; :meth:`NodeAgent.add_cpu_pool` for a head),
keeps them Ready (Leases in ``kube-node-lease`` renewed every ``heartbeat_seconds``, node status every
``status_seconds``), and runs the Pods the scheduler binds to them (:mod:`tests.cluster.pod_worker`): each
Pod in a network namespace of its own on the kit's bridge (:mod:`tests.cluster.pod_network`), each container
a process in a mount namespace of its own (:mod:`tests.cluster.pod_runtime`, ``container_init.py``), with
volumes, the Downward API, probes, native sidecars and ``preStop`` hooks; it reports Pod status through the
status subresource and removes a deleted Pod's object once its containers have exited, as the kubelet does.
Containers reach the API server at ``https://10.214.0.1:443`` (``KUBERNETES_SERVICE_HOST``/``PORT``), a relay
in the bridge namespace, and each other by name through the ``/etc/hosts`` the kit writes for every Pod.

Node events for scenarios: :meth:`NodeAgent.preempt`, :meth:`NodeAgent.lose_host`, :meth:`NodeAgent.lose_slice`,
:meth:`NodeAgent.add_slice`, :meth:`NodeAgent.set_ready`; a program's crash: :meth:`NodeAgent.kill_container`.
All state (volumes, logs, node folders) lives under ``workdir``. Needs root, ``ip``, ``unshare``, ``nsenter``
and ``setpriv``.
"""

from __future__ import annotations

import collections
import logging
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kubernetes.client import ApiClient

from bench.children import bound_to_us
from tests.cluster import pod_network
from tests.cluster.kube import Kube, KubeError, add_pod_condition, now_rfc3339, pod_path
from tests.cluster.node_status import renew_lease, report_node_status
from tests.cluster.pod_network import BRIDGE_IP, RELAY_PORT, ApiRelay, PodNetwork
from tests.cluster.pod_runtime import kill_group
from tests.cluster.pod_spec import ImageRule, default_images
from tests.cluster.pod_worker import NodeInfo, PodWorker, Runtime, write_hosts
from tests.cluster.probes import Prober

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
CALL_TIMEOUT_SECONDS = 30.0
WATCH_SECONDS = 30
STOP_SECONDS = 15.0
TPU_RESOURCE = "google.com/tpu"
PODGC_REASON = "DeletionByPodGC"


class NodeAgent:
    """The kubelets of every node the test registers, in one object (see the module docstring)."""

    def __init__(self, api_client: ApiClient, server: str, workdir: Path, *,
                 images: Mapping[str, ImageRule] | None = None, app_dir: Path | None = None,
                 heartbeat_seconds: float = 2.0, status_seconds: float = 10.0, lease_seconds: int = 40,
                 restart_backoff: tuple[float, float] = (1.0, 10.0)) -> None:
        """``server``: the API server's URL on this host's loopback (the relay's target). ``images``: image
        pattern -> :class:`ImageRule`, tried before the defaults for ``*/mtc-replicator:*`` and
        ``*/mtc-sidecar:*`` (``/app`` bound to ``app_dir``)."""
        self.kube = Kube(api_client)
        url = urlparse(server)
        self.api_target = (url.hostname or "127.0.0.1", url.port or 443)
        self.workdir = Path(workdir)
        self.images = {**(images or {}), **default_images(app_dir)}
        self.heartbeat_seconds = heartbeat_seconds
        self.status_seconds = status_seconds
        self.lease_seconds = lease_seconds
        self.restart_backoff = restart_backoff
        self.nodes: dict[str, NodeInfo] = {}
        self._pools: collections.Counter[str] = collections.Counter()
        self._workers: dict[str, PodWorker] = {}  # by Pod uid
        self._reported: dict[str, dict[str, Any]] = {}
        self._deleted: set[str] = set()  # uids whose object this agent removed
        self._events: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self._calls: queue.Queue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.Queue()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hosts_dirty = False
        self._network: PodNetwork | None = None
        self._relay: ApiRelay | None = None
        self._prober: Prober | None = None
        self._rt: Runtime | None = None
        self._threads: list[threading.Thread] = []
        self._started = threading.Event()
        self._start_error: list[BaseException] = []

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> NodeAgent:
        pod_network.reap_stale()
        (self.workdir / "rootfs").mkdir(parents=True, exist_ok=True)
        try:
            self._network = PodNetwork().__enter__()
            listener = pod_network.listen_in(self._network.bridge_ns, BRIDGE_IP, RELAY_PORT)
            self._relay = ApiRelay(listener, self.api_target)
            # The sync thread starts every process (they die with it: pdeathsig), the prober first.
            sync = threading.Thread(target=self._sync_main, name="node-agent-sync", daemon=True)
            watch = threading.Thread(target=self._watch_main, name="node-agent-watch", daemon=True)
            self._threads = [sync, watch]
            sync.start()
            if not self._started.wait(CALL_TIMEOUT_SECONDS) or self._start_error:
                raise RuntimeError(f"node agent did not start: {self._start_error}")
            watch.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every container (SIGKILL, by pid), the helper processes and threads; delete the namespaces
        this agent made. Node objects are left to the control plane's teardown."""
        if self._threads and self._threads[0].is_alive():
            try:
                self._call(self._kill_everything)
            except (TimeoutError, RuntimeError) as e:
                log.warning("node agent: stopping the containers: %s", e)
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(STOP_SECONDS)
        for name in self.node_names():
            try:
                self.kube.delete(f"/api/v1/nodes/{name}")
            except (KubeError, OSError) as e:
                log.warning("node agent: deleting node %s: %s", name, e)
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        if self._network is not None:
            self._network.close()
            self._network = None

    def _kill_everything(self) -> None:
        for w in self._workers.values():
            w.kill_all()
        deadline = time.monotonic() + STOP_SECONDS
        while any(c.running for w in self._workers.values() for c in w.init + w.main):
            for w in self._workers.values():
                w.step(time.monotonic())
            if time.monotonic() > deadline:
                raise TimeoutError("containers still running after SIGKILL")
            time.sleep(0.05)

    # ------------------------------------------------------------------ nodes

    def add_node(self, name: str, labels: Mapping[str, str], capacity: Mapping[str, str] | None = None,
                 ready: bool = True, taints: list[dict[str, str]] | None = None) -> str:
        """Register Node ``name`` with ``labels`` (plus ``kubernetes.io/hostname``) and ``capacity``
        (allocatable the same); ``ready`` False reports it NotReady until :meth:`set_ready`."""
        cap = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi", **(capacity or {})}
        labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  **labels}
        self._call(lambda: self._register(name, labels, cap, ready, taints or []))
        return name

    def add_slice(self, nodepool: str, hosts: int = 2, accelerator: str = "tpu-v6e-slice", topology: str = "2x4",
                  chips: int = 4, ready: bool = True) -> list[str]:
        """A TPU slice: node pool ``nodepool`` of ``hosts`` nodes with ``chips`` ``google.com/tpu`` each."""
        labels = {"cloud.google.com/gke-nodepool": nodepool, "cloud.google.com/gke-tpu-accelerator": accelerator,
                  "cloud.google.com/gke-tpu-topology": topology, "node.kubernetes.io/instance-type":
                  f"ct6e-standard-{chips}t"}
        return [self.add_node(self._next_name(nodepool), labels, {TPU_RESOURCE: str(chips)}, ready)
                for _ in range(hosts)]

    def add_cpu_pool(self, nodepool: str = "cpu-np", nodes: int = 1, cpu: str = "8",
                     memory: str = "32Gi") -> list[str]:
        """A CPU node pool (for a head or a coordinator)."""
        labels = {"cloud.google.com/gke-nodepool": nodepool, "node.kubernetes.io/instance-type": "n2-standard-8"}
        return [self.add_node(self._next_name(nodepool), labels, {"cpu": cpu, "memory": memory}, True)
                for _ in range(nodes)]

    def _next_name(self, nodepool: str) -> str:
        with self._lock:
            self._pools[nodepool] += 1
            return f"gke-{nodepool}-{self._pools[nodepool] - 1}"

    def node_names(self, nodepool: str | None = None) -> list[str]:
        """This agent's nodes (of ``nodepool``), lost ones included."""
        with self._lock:
            return [n for n, i in self.nodes.items()
                    if nodepool is None or i.extra["labels"].get("cloud.google.com/gke-nodepool") == nodepool]

    def ramdisk(self, node: str) -> Path:
        """The host folder behind node ``node``'s ``multitier-checkpoint.csi.storage.gke.io`` volumes."""
        return self.workdir / "nodes" / node / "mtc-ramdisk"

    def set_ready(self, node_or_pool: str, ready: bool = True) -> None:
        """Report the node (or every node of the pool) Ready or NotReady from now on."""
        def do() -> None:
            for n in self._resolve(node_or_pool):
                self.nodes[n].extra["ready"] = ready
                self.nodes[n].extra["next_status"] = 0.0
        self._call(do)

    def _resolve(self, node_or_pool: str) -> list[str]:
        if node_or_pool in self.nodes:
            return [node_or_pool]
        names = self.node_names(node_or_pool)
        if not names:
            raise KeyError(f"no node or node pool {node_or_pool}")
        return names

    def _register(self, name: str, labels: dict[str, str], cap: dict[str, str], ready: bool,
                  taints: list[dict[str, str]]) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels},
                "spec": {"taints": taints} if taints else {}}
        try:
            node = self.kube.request("POST", "/api/v1/nodes", body=body)
        except KubeError as e:
            if e.status != 409:
                raise
            # A node of that name left by an agent that did not close: this machine replaces it.
            self.kube.delete(f"/api/v1/nodes/{name}")
            node = self.kube.request("POST", "/api/v1/nodes", body=body)
        n = len(self.nodes)
        info = NodeInfo(name, f"10.214.255.{1 + n % 250}", dict(cap), self.workdir / "nodes" / name)
        info.dir.mkdir(parents=True, exist_ok=True)
        info.extra.update(labels=labels, uid=node["metadata"]["uid"], ready=ready, next_status=0.0,
                          next_lease=0.0, lease=False, drain=None)
        with self._lock:
            self.nodes[name] = info
        self._heartbeat(info, time.monotonic())
        log.info("node %s registered (%s)", name, labels.get("cloud.google.com/gke-nodepool"))

    def _heartbeat(self, info: NodeInfo, now: float) -> None:
        x = info.extra
        if now >= x["next_lease"]:
            x["next_lease"] = now + self.heartbeat_seconds
            renew_lease(self.kube, info, self.lease_seconds)
        if now >= x["next_status"]:
            x["next_status"] = now + self.status_seconds
            report_node_status(self.kube, info)

    # ------------------------------------------------------------------ node events

    def preempt(self, node: str, disruption_target: bool = True, grace_seconds: int | None = None,
                reason: str = "TerminationByKubelet", then: str = "delete") -> list[str]:
        """Preempt ``node`` as GKE does a TPU node: cordon it; every Pod there gets the ``DisruptionTarget``
        condition (``reason``; not when ``disruption_target`` is False) and is deleted with ``grace_seconds``
        (None: the Pod's own); once they are gone the node is deleted (``then="delete"``) or reports
        NotReady (``then="not_ready"``). Returns the Pods deleted ("ns/name"); does not wait for them."""
        if then not in ("delete", "not_ready"):
            raise ValueError(f"then must be 'delete' or 'not_ready', not {then}")
        self.kube.patch(f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True}})
        pods = [p for p in self._pods_on(node) if not p["metadata"].get("deletionTimestamp")]
        for p in pods:
            if disruption_target:
                add_pod_condition(self.kube, p, {"type": "DisruptionTarget", "status": "True", "reason": reason,
                                                 "message": f"node agent: {node} is preempted",
                                                 "lastTransitionTime": now_rfc3339()})
            body: dict[str, Any] = {"preconditions": {"uid": p["metadata"]["uid"]}}
            if grace_seconds is not None:
                body["gracePeriodSeconds"] = grace_seconds
            self.kube.delete(pod_path(p), body)

        def mark() -> None:
            self.nodes[node].extra["drain"] = then
        self._call(mark)
        return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods]

    def lose_host(self, node: str, evict_after_seconds: float | None = None) -> None:
        """The machine is gone: every process there SIGKILLed at once, heartbeats stopped (the control plane's
        node-lifecycle controller marks the node NotReady), its folders (RAM disk, hostPath) removed. Once the
        node is NotReady, Pods there that the control plane deleted, and after ``evict_after_seconds`` (None:
        never) the others too, are failed and force-removed as the pod GC does. The controller evicts only while
        some node of the zone is still Ready (all NotReady is a "full disruption", where it evicts nothing)."""
        self._call(lambda: self._lose([node], evict_after_seconds))

    def lose_slice(self, nodepool: str, evict_after_seconds: float | None = None) -> None:
        """:meth:`lose_host` for every node of ``nodepool`` at once."""
        self._call(lambda: self._lose(self._resolve(nodepool), evict_after_seconds))

    def _lose(self, names: list[str], evict_after: float | None) -> None:
        for name in names:
            info = self.nodes[name]
            info.lost = True
            info.extra.update(evict_after=evict_after, not_ready_at=None, next_check=0.0)
        for w in self._workers.values():
            if w.node.name in names:
                w.kill_all()
        for name in names:
            log.info("node %s: host lost", name)

    def kill_container(self, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL) -> None:
        """Signal every process of container ``container`` of Pod ``namespace/pod`` (a crash: SIGKILL exits 137),
        as a fault of the program, not of the node: the Pod's own policy and restart rules decide what follows."""
        def do() -> None:
            for w in self._workers.values():
                if w.key == f"{namespace}/{pod}" and not w.done:
                    c = next(c for c in w.init + w.main if c.name == container)
                    if c.proc is None:
                        raise RuntimeError(f"container {container} of {w.key} is not running")
                    kill_group(c.proc.pid, sig)
                    return
            raise KeyError(f"no Pod {namespace}/{pod} on this agent")
        self._call(do)

    # ------------------------------------------------------------------ pods

    def logs(self, pod: str, container: str, namespace: str = "default") -> str:
        """Everything container ``container`` of the newest Pod ``namespace/pod`` wrote (all restarts)."""
        dirs = sorted((self.workdir / "logs").glob(f"{namespace}_{pod}_*"), key=lambda d: d.stat().st_mtime)
        if not dirs or not (dirs[-1] / f"{container}.log").exists():
            raise FileNotFoundError(f"no log of {namespace}/{pod} {container}")
        return (dirs[-1] / f"{container}.log").read_text(errors="replace")

    def pods_running(self) -> list[str]:
        """The Pods ("ns/name") with at least one container process running."""
        with self._lock:
            return sorted(w.key for w in self._workers.values() if any(c.running for c in w.init + w.main))

    def _pods_on(self, node: str) -> list[dict[str, Any]]:
        pods = self.kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node}"})
        return [p for p in pods.get("items") or [] if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]

    # ------------------------------------------------------------------ threads

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the sync thread (the one that owns the processes) and wait for it."""
        if threading.current_thread() is self._threads[0]:
            return fn()
        done = threading.Event()
        out: list[Any] = []
        self._calls.put((fn, out, done))
        self._wake.set()
        if not done.wait(CALL_TIMEOUT_SECONDS):
            raise TimeoutError("the node agent's sync thread did not answer")
        if out and isinstance(out[0], BaseException):
            raise out[0]
        return out[0] if out else None

    def _watch_main(self) -> None:
        rv = ""
        while not self._stop.is_set():
            try:
                if not rv:
                    listing = self.kube.request("GET", "/api/v1/pods")
                    for p in listing.get("items") or []:
                        self._event("ADDED", p)
                    rv = listing["metadata"]["resourceVersion"]
                for ev in self.kube.watch("/api/v1/pods", rv, WATCH_SECONDS):
                    if self._stop.is_set():
                        return
                    if ev["type"] == "ERROR":
                        rv = ""  # 410 Gone: list again
                        break
                    rv = ev["object"]["metadata"].get("resourceVersion", rv)
                    if ev["type"] != "BOOKMARK":
                        self._event(ev["type"], ev["object"])
            except Exception as e:  # the API server restarting, a read timeout: list and watch again
                if self._stop.is_set():
                    return
                log.info("node agent: pod watch: %s", e)
                rv = ""
                self._stop.wait(1.0)

    def _event(self, kind: str, pod: dict[str, Any]) -> None:
        with self._lock:
            if pod.get("spec", {}).get("nodeName") not in self.nodes:
                return
            self._events.append((kind, pod))
        self._wake.set()

    def _sync_main(self) -> None:
        try:
            assert self._network is not None
            self._prober = Prober(bound_to_us(self._network.command(self._network.bridge_ns, [])))
            self._rt = Runtime(self.kube, self._network, self._prober, self.workdir, self.images, BRIDGE_IP,
                               RELAY_PORT, self.restart_backoff, self._mark_hosts)
        except BaseException as e:
            self._start_error.append(e)
            self._started.set()
            return
        self._started.set()
        try:
            while not self._stop.is_set():
                self._wake.wait(TICK_SECONDS)
                self._wake.clear()
                self._run_calls()
                try:
                    self._sync_once()
                except Exception:
                    log.exception("node agent: sync")
        finally:
            for w in self._workers.values():
                w.kill_all()
                w.step(time.monotonic())
            self._prober.close()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, out, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                out.append(fn())
            except BaseException as e:
                out.append(e)
            done.set()

    def _mark_hosts(self) -> None:
        self._hosts_dirty = True

    def _sync_once(self) -> None:
        now = time.monotonic()
        with self._lock:
            events, self._events = list(self._events), collections.deque()
        for kind, pod in events:
            self._apply_event(kind, pod)
        for uid, w in list(self._workers.items()):
            w.step(now)
            if not w.lost:
                self._report(w)
            if w.done and w.deleting and not w.gone and not w.lost and uid not in self._deleted:
                body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
                self.kube.delete(pod_path(w.pod), body)
                self._deleted.add(uid)
                log.info("pod %s: removed", w.key)
            if w.finished or (w.gone and w.done):
                with self._lock:
                    del self._workers[uid]
                self._reported.pop(uid, None)
        if self._hosts_dirty:
            self._hosts_dirty = False
            write_hosts(self._workers.values())
        for info in list(self.nodes.values()):
            if info.lost:
                self._pod_gc(info, now)
            else:
                self._heartbeat(info, now)
                self._drain(info)

    def _apply_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        w = self._workers.get(uid)
        if kind == "DELETED":
            if w is not None:
                w.removed()
            return
        if w is None:
            node = self.nodes.get(pod["spec"]["nodeName"])
            terminal = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
            if node is None or node.lost or terminal or uid in self._deleted:
                return
            w = PodWorker(self._rt, node, pod)  # type: ignore[arg-type]
            with self._lock:
                self._workers[uid] = w
        if _newer(pod, w.pod):
            w.update(pod)

    def _report(self, w: PodWorker) -> None:
        if w.gone or w.uid in self._deleted:
            return
        status = w.status()
        if self._reported.get(w.uid) == status:
            return
        body = {"metadata": {"resourceVersion": w.pod["metadata"]["resourceVersion"]}, "status": status}
        try:
            fresh = self.kube.patch(pod_path(w.pod) + "/status", body)
        except KubeError as e:
            if e.status == 404:
                w.removed()
            elif e.status == 409:
                latest = self.kube.get(pod_path(w.pod))
                if latest is None or latest["metadata"]["uid"] != w.uid:
                    w.removed()
                else:
                    w.update(latest)
            else:
                log.warning("pod %s: status: %s", w.key, e)
            return
        self._reported[w.uid] = status
        w.update(fresh)

    def _drain(self, info: NodeInfo) -> None:
        then = info.extra.get("drain")
        if then is None or any(w.node is info for w in self._workers.values()):
            return
        info.extra["drain"] = None
        if then == "not_ready":
            info.extra["ready"] = False
            info.extra["next_status"] = 0.0
            return
        self.kube.delete(f"/api/v1/nodes/{info.name}")
        with self._lock:
            del self.nodes[info.name]
        shutil.rmtree(info.dir, ignore_errors=True)
        log.info("node %s: preempted and deleted", info.name)

    def _pod_gc(self, info: NodeInfo, now: float) -> None:
        """For a lost node: once NotReady, fail and force-remove its Pods as the pod GC does."""
        x = info.extra
        if now < x["next_check"]:
            return
        x["next_check"] = now + 1.0
        if x.get("dir_removed") is None and not any(w.node is info and w.serving for w in self._workers.values()):
            shutil.rmtree(info.dir, ignore_errors=True)
            x["dir_removed"] = True
        if x["not_ready_at"] is None:
            node = self.kube.get(f"/api/v1/nodes/{info.name}")
            ready = [c for c in (node or {}).get("status", {}).get("conditions") or [] if c["type"] == "Ready"]
            if node is not None and ready and ready[0]["status"] == "True":
                return
            x["not_ready_at"] = now
            log.info("node %s: NotReady (seen by the node agent)", info.name)
        evict = x["evict_after"] is not None and now - x["not_ready_at"] >= x["evict_after"]
        for p in self._pods_on(info.name):
            if not (p["metadata"].get("deletionTimestamp") or evict):
                continue
            gc = {"type": "DisruptionTarget", "status": "True", "reason": PODGC_REASON,
                  "message": f"PodGC: node {info.name} is gone", "lastTransitionTime": now_rfc3339()}
            add_pod_condition(self.kube, p, gc, phase="Failed", keep_existing=True)
            self.kube.delete(pod_path(p), {"gracePeriodSeconds": 0,
                                                 "preconditions": {"uid": p["metadata"]["uid"]}})
            log.info("pod %s/%s on lost node %s: failed and removed", p["metadata"]["namespace"],
                     p["metadata"]["name"], info.name)


def _newer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether object ``a`` is at least as new as ``b`` (resource versions compared as numbers when they are)."""
    ra, rb = a["metadata"].get("resourceVersion", ""), b["metadata"].get("resourceVersion", "")
    if ra.isdigit() and rb.isdigit():
        return int(ra) >= int(rb)
    return True
