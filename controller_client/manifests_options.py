"""The options of `mtc manifests` and the pieces every rendered object shares (names, ports, security).

Split from manifests.py so that manifests.py (the job's objects, the command line) and manifests_jobsets.py
(the JobSets) both build on it without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from replicator.options import job_code_groups, resolve_redundancy
from sidecar.layout import check_job_name

MODES = ("pathways", "multi-controller")
FRONT_DOORS = ("native", "orbax")
WORKER_FAILURE_POLICIES = ("restart-jobset", "restart-slice")
RESTARTS = ("recreate", "in-place")
RAMDISKS = ("csi", "hostpath", "memory")
TLS_IDENTITIES = ("shared", "pod")
# cert-manager's csi-driver: a key and certificate per Pod, requested when the Pod's volume is mounted.
CERT_MANAGER_CSI_DRIVER = "csi.cert-manager.io"
# Kubernetes' generateName keeps at most 58 characters of a name's prefix (63 minus the 5 random ones); the
# Indexed Job controller truncates its Pods' prefix "<job name>-<index>-" beyond that.
MAX_GENERATE_NAME_PREFIX = 58
# GKE Multi-Tier Checkpointing's node RAM disk: a tmpfs owned by the node, kept across workload Pods.
GKE_MTC_CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
PART_OF = {"app.kubernetes.io/part-of": "multitier-checkpoint"}
# Labels JobSet puts on every Pod it creates (jobset.sigs.k8s.io/v1alpha2).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
# Downward API sources of a worker's place in the allocation.
SLICE_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
HOST_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOBSET_NAME_FIELD = f"metadata.labels['{JOBSET_NAME_LABEL}']"
# Pathways server ports (the resource manager on 29001, workers on 29005, the proxy on 29000) and the colocated
# Python server's gRPC port, as Google's Pathways JobSets use them.
PATHWAYS_RM_PORT = 29001
PATHWAYS_PROXY_PORT = 29000
PATHWAYS_WORKER_PORT = 29005
COLOCATED_PYTHON_PORT = 50051
JAX_COORDINATOR_PORT = 8476
SIDECAR_SHM_DIR = "/tmp/sidecar"
TOKEN_DIR = "/var/run/secrets/mtc"
TLS_DIR = "/etc/mtc/tls"
CONFIG_DIR = "/etc/mtc"
UID = 1000
# GKE TPU node label value -> Pathways --instance_type prefix.
TPU_INSTANCE_TYPES = {
    "tpu-v6e-slice": "tpuv6e",
    "tpu-v5p-slice": "tpuv5",
    "tpu-v5-lite-podslice": "tpuv5e",
    "tpu-v4-podslice": "tpuv4",
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(Ki|Mi|Gi|Ti)?$")


@dataclasses.dataclass(frozen=True)
class ManifestOptions:
    """What `mtc manifests` renders (flag ``--x-y`` = field ``x_y``).

    Attributes:
      mode: ``pathways`` (head + workers with colocated Python) or ``multi-controller`` (every worker runs
        the training program).
      front_door: ``native`` (our CheckpointManager; replicators in native mode with --rank/--nodes) or
        ``orbax`` (unchanged Orbax multi-tier checkpointing; replicators in Orbax mode, answering
        ``replicator.yaml``). Empty = the mode's default: native for pathways, orbax for multi-controller.
      job: JobSet name; also the headless Service / DNS subdomain. Worker hostnames are
        ``<job>-workers-<slice>-<host>`` and must fit in 63 characters.
      slices, hosts_per_slice: the allocation; rank = slice * hosts_per_slice + host.
      backup_url: the bucket tier (``gs://bucket/prefix``); empty = no backup tier.
      ramdisk: ``csi`` (GKE Multi-Tier Checkpointing's node RAM disk), ``hostpath`` (a node tmpfs kept by
        this job's DaemonSet) or ``memory`` (``emptyDir``, for trying it out). Empty = the front door's
        default: ``csi`` for native, ``memory`` for orbax (GKE's replicator would answer Orbax on csi; the
        hostpath DaemonSet is privileged, so it is opt-in).
      ramdisk_size: size of the RAM disk per host (Kubernetes quantity).
      tls: mutual TLS between replicators and the controller from a cert-manager ``Certificate``.
      tls_identity: ``shared`` (one ``Certificate`` for every Pod; it names no rank, so the replicators run
        with ``--tls-rank-identity auto`` and any holder may report for any rank) or ``pod`` (cert-manager's
        csi-driver issues each worker Pod its own certificate, URI SAN ``mtc://<job>/pod/<pod name>``, whose
        rank the replicators derive from the Pod name and bind reports to, ``--tls-rank-identity require``;
        the controller gets a ``Certificate`` with the admin identity ``mtc://<job>/admin``).
      priority_class: ``priorityClassName`` of the worker Pods (hot-swap); empty = none.
      priority_value: also render that PriorityClass with this value (None = it already exists).
      elastic_slices: Pathways proxy ``--num_elastic_slices`` (0 = not elastic).
      redundancy: the replicators' ``--redundancy`` (``copies:N`` | ``ec:K+M``); empty = ``copies:<replicas>``.
      worker_failure_policy: ``restart-jobset`` (a failed worker restarts the whole JobSet; the hot-swap of
        the seed) or ``restart-slice`` (Pathways keeps the controller alive, the slice's Job re-creates its
        Pods; elastic training). Empty = restart-slice when elastic, else restart-jobset.
      max_restarts: the JobSet's ``failurePolicy.maxRestarts`` (in place: also the most restarts of any container).
      restart: how the JobSet restarts after a failed trainer: ``recreate`` (every Pod deleted and re-created) or
        ``in-place`` (JobSet's InPlaceRestart: the containers restart in the same Pods, multi-controller only;
        manifests_restart.py, docs/deploy.md "In-place restart").
      in_place_restart_agent_image: JobSet's in-place-restart agent (cmd/in-place-restart-agent of the JobSet
        release), rendered with ``--restart in-place`` only.
      termination_grace_seconds: the worker Pods' ``terminationGracePeriodSeconds``, shared after a
        preemption notice as save 30 %, flush 50 %, reserve 20 % (manifests_jobsets.PreemptionBudget).
      proxy_args: extra flags of the Pathways proxy (``pathways-proxy``), after the rendered ones.
      head_node_pool: node pool of the Pathways head (``cloud.google.com/gke-nodepool``); empty = anywhere.
      grpc_port, data_port: the replicator's gRPC port and fixed TCP bulk-data port.
      metrics_port: the replicator's Prometheus port (``deploy/monitoring`` scrapes it).
      network_policy: render a NetworkPolicy letting only this job's Pods reach the workers.
      gcp_service_account: Workload Identity: annotate the ServiceAccount with this Google service account.
    """

    mode: str = "pathways"
    front_door: str = ""
    job: str = "mtc-train"
    slices: int = 2
    hosts_per_slice: int = 2
    backup_url: str = ""
    backup_interval_minutes: float = 30.0
    backup_keep: int = 3
    replicas: int = 1
    redundancy: str = ""
    keep_local: int = 2
    ramdisk: str = ""
    ramdisk_size: str = "64Gi"
    ramdisk_host_path: str = "/mnt/mtc-ramdisk"
    local_dir: str = "/local"
    tls: bool = False
    tls_issuer: str = "mtc-ca"
    tls_issuer_kind: str = "Issuer"
    tls_identity: str = "shared"
    priority_class: str = ""
    priority_value: int | None = None
    elastic_slices: int = 0
    worker_failure_policy: str = ""
    max_restarts: int = 5
    restart: str = "recreate"
    in_place_restart_agent_image: str = "REGISTRY/jobset-in-place-restart-agent:v0.12.0"
    termination_grace_seconds: int = 60
    head_node_pool: str = "cpu-np"
    grpc_port: int = 7070
    data_port: int = 7071
    metrics_port: int = 9400
    network_policy: bool = True
    gcp_service_account: str = ""
    service_account: str = "mtc"
    token_secret: str = "mtc-token"
    replicator_image: str = "REGISTRY/mtc-replicator:0.1.0"
    sidecar_image: str = "REGISTRY/mtc-sidecar:0.1.0"
    controller_image: str = ""
    controller_command: tuple[str, ...] = ("python", "/app/train.py")
    proxy_args: tuple[str, ...] = ()
    pathways_server_image: str = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:jax-0.10.2"
    pathways_proxy_image: str = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:jax-0.10.2"
    pathways_scratch: str = ""
    tpu_accelerator: str = "tpu-v6e-slice"
    tpu_topology: str = "2x4"
    tpu_chips_per_host: int = 4
    replicator_memory_limit: str = "40Gi"
    ramdisk_image: str = "busybox:1.37.0"

    @property
    def nodes(self) -> int:
        return self.slices * self.hosts_per_slice

    @property
    def front_door_kind(self) -> str:
        return self.front_door or ("native" if self.mode == "pathways" else "orbax")

    @property
    def ramdisk_kind(self) -> str:
        # Orbax: not csi (GKE's replicator would answer Orbax's replicator.yaml there) and not hostpath by
        # default (its DaemonSet is privileged): the Pod's own memory, deploy/components/ramdisk-hostpath to keep it.
        return self.ramdisk or ("csi" if self.front_door_kind == "native" else "memory")

    @property
    def worker_failure_kind(self) -> str:
        return self.worker_failure_policy or ("restart-slice" if self.elastic_slices else "restart-jobset")

    @property
    def subdomain(self) -> str:
        return self.job

    def worker_host(self, s: int, h: int) -> str:
        return f"{self.job}-workers-{s}-{h}"

    def peer_address_template(self) -> str:
        return f"{self.job}-workers-{{slice}}-{{host}}.{self.subdomain}:{self.grpc_port}"

    def scratch(self) -> str:
        if self.pathways_scratch:
            return self.pathways_scratch
        m = re.match(r"^gs://([^/]+)", self.backup_url)
        return f"gs://{m.group(1)}/pathways-scratch" if m else ""

    def _check_redundancy(self) -> None:
        """The replicators' own rule (replicator.options) plus what only this set knows: elastic, Orbax."""
        red = resolve_redundancy(self.redundancy, self.replicas)  # a ConfigError is a ValueError
        if not red.is_ec:
            return
        if self.elastic_slices:
            raise ValueError(f"--redundancy {red} with --elastic-slices: erasure coding does not support elastic "
                             "training yet (a step saved by a subset of the slices); use copies:N")
        if self.front_door_kind == "orbax":
            raise ValueError(f"--redundancy {red} with --front-door orbax: the replicators' Orbax mode does not "
                             "support erasure coding (elastic node counts); use copies:N")
        job_code_groups(red, self.nodes, self.slices)  # the replicators warn when a lost slice is not survived

    def _check_restart(self) -> None:
        """``--restart in-place`` (manifests_restart.py) restarts the multi-controller Pods' containers in place."""
        if self.restart not in RESTARTS:
            raise ValueError(f"--restart must be one of {', '.join(RESTARTS)}, got {self.restart!r}")
        if self.restart == "in-place" and self.mode != "multi-controller":
            raise ValueError("--restart in-place needs --mode multi-controller: a Pathways job keeps its healthy "
                             "workers already (--elastic-slices, restart-slice), and its head (backoffLimit 0) and "
                             "the proxy's sessions do not survive a container restart")

    def validate(self) -> ManifestOptions:
        """Raise ValueError with a one-line reason when the set could not work."""
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.ramdisk not in ("",) + RAMDISKS:
            raise ValueError(f"--ramdisk must be one of {', '.join(RAMDISKS)}, got {self.ramdisk!r}")
        check_job_name(self.job, "--job")
        if not _DNS_LABEL.match(self.job):  # Kubernetes names its objects after the job: a DNS label
            raise ValueError(f"--job {self.job!r} is not a DNS label (lower-case letters, digits, '-')")
        if self.slices < 1 or self.hosts_per_slice < 1:
            raise ValueError(f"need at least one slice and one host, got {self.slices} x {self.hosts_per_slice}")
        longest = self.worker_host(self.slices - 1, self.hosts_per_slice - 1)
        if len(longest) > 63:
            raise ValueError(f"Pod hostname {longest!r} is longer than 63 characters: shorten --job")
        if self.front_door not in ("",) + FRONT_DOORS:
            raise ValueError(f"--front-door must be one of {', '.join(FRONT_DOORS)}, got {self.front_door!r}")
        if self.front_door_kind == "orbax" and self.ramdisk_kind == "csi":
            raise ValueError("--ramdisk csi with --front-door orbax: GKE's own replicator serves that volume "
                             "and would answer Orbax's replicator.yaml too; use --ramdisk memory or hostpath")
        if self.worker_failure_policy not in ("",) + WORKER_FAILURE_POLICIES:
            raise ValueError(f"--worker-failure-policy must be one of {', '.join(WORKER_FAILURE_POLICIES)}")
        if self.worker_failure_kind == "restart-slice" and self.mode != "pathways":
            raise ValueError("--worker-failure-policy restart-slice needs Pathways (multi-controller JAX cannot "
                             "go on without a slice)")
        if any(not a.startswith("--") for a in self.proxy_args):
            raise ValueError(f"--proxy-args: flags only (each starting with --), got {list(self.proxy_args)}")
        if self.proxy_args and self.mode != "pathways":
            raise ValueError("--proxy-args: the Pathways proxy runs in --mode pathways only")
        self._check_restart()
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must be >= 0")
        if self.termination_grace_seconds < 20:
            raise ValueError("--termination-grace-seconds must be >= 20 (save, flush and exit share it)")
        if not _QUANTITY.match(self.ramdisk_size):
            raise ValueError(f"--ramdisk-size must be a quantity such as 64Gi, got {self.ramdisk_size!r}")
        if self.elastic_slices and self.mode != "pathways":
            raise ValueError("--elastic-slices is a Pathways proxy setting (--mode pathways)")
        if not 0 <= self.elastic_slices <= self.slices:
            raise ValueError(f"--elastic-slices must be 0..{self.slices} (the slices allocated)")
        self._check_redundancy()
        ports = (self.grpc_port, self.data_port, self.metrics_port)
        for name in ("grpc_port", "data_port", "metrics_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be 1..65535")
        reserved = {JAX_COORDINATOR_PORT, PATHWAYS_WORKER_PORT, COLOCATED_PYTHON_PORT}
        if len(set(ports)) < len(ports) or set(ports) & reserved:
            raise ValueError("--grpc-port, --data-port and --metrics-port must differ from each other and "
                             f"from {sorted(reserved)}")
        if self.tls_issuer_kind not in ("Issuer", "ClusterIssuer"):
            raise ValueError(f"--tls-issuer-kind must be Issuer or ClusterIssuer, got {self.tls_issuer_kind!r}")
        if self.tls_identity not in TLS_IDENTITIES:
            raise ValueError(f"--tls-identity must be one of {', '.join(TLS_IDENTITIES)}, got {self.tls_identity!r}")
        if self.tls_identity == "pod":
            if not self.tls:
                raise ValueError("--tls-identity pod needs --tls")
            prefix = self.worker_host(self.slices - 1, self.hosts_per_slice - 1) + "-"
            if len(prefix) > MAX_GENERATE_NAME_PREFIX:
                raise ValueError(f"--tls-identity pod: the Pod name prefix {prefix!r} is longer than "
                                 f"{MAX_GENERATE_NAME_PREFIX} characters, so Kubernetes would truncate it and the Pod "
                                 "name would no longer carry slice and host: shorten --job")
        if self.priority_value is not None and not self.priority_class:
            raise ValueError("--priority-value needs --priority-class (the name of the class to create)")
        if self.priority_class and not _DNS_LABEL.match(self.priority_class):
            raise ValueError(f"--priority-class {self.priority_class!r} is not a valid name")
        if self.backup_url and self.backup_interval_minutes <= 0:
            raise ValueError("--backup-interval-minutes must be > 0")
        if self.mode == "pathways":
            if not self.scratch().startswith("gs://"):
                raise ValueError("Pathways needs a gs:// scratch location: give --pathways-scratch or a gs:// "
                                 "--backup-url")
        if self.tpu_accelerator not in TPU_INSTANCE_TYPES:
            raise ValueError(f"--tpu-accelerator must be one of {', '.join(TPU_INSTANCE_TYPES)}")
        if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}", self.tpu_topology):
            raise ValueError(f"--tpu-topology must look like 2x4 or 2x2x2, got {self.tpu_topology!r}")
        chips = math.prod(int(d) for d in self.tpu_topology.split("x"))
        if chips != self.hosts_per_slice * self.tpu_chips_per_host:
            raise ValueError(f"--tpu-topology {self.tpu_topology} has {chips} chips but --hosts-per-slice "
                             f"{self.hosts_per_slice} x --tpu-chips-per-host {self.tpu_chips_per_host} = "
                             f"{self.hosts_per_slice * self.tpu_chips_per_host}")
        return self


# --------------------------------------------------------------------------- building blocks


def _meta(name: str, opts: ManifestOptions, **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": {**PART_OF, "mtc.dev/job": opts.job}, **extra}


def _env_field(name: str, field: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}


def _restricted() -> dict[str, Any]:
    """Security context of the containers running this project's images, as UID 1000.

    One UID for the replicator, the colocated sidecar, the controller and the Orbax trainer: the control
    socket <local>/replicator.sock is mode 0600 and each deletes step directories another wrote. Pathways'
    own server containers keep what their images and Google's JobSets give them.
    """
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID}


def _pod_security() -> dict[str, Any]:
    return {"fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}}


