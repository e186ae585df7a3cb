"""The JobSets of `mtc manifests`: Pathways (head + workers) and multi-controller, each with either front door.

Split from manifests.py (options, the job's other objects, the command line). The Pathways JobSet follows
what pathwaysutils 0.1.13's ``PathwaysJobSet`` + ``add_user_workload`` + ``add_colocated_python`` build
(tests/deploy/test_google_parity.py compares the two field by field and lists every intended difference);
docs/deploy.md explains the preemption and hot-swap timelines these objects implement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from controller_client import manifests_restart as restart
from controller_client.manifests_options import (
    CERT_MANAGER_CSI_DRIVER,
    COLOCATED_PYTHON_PORT,
    CONFIG_DIR,
    GKE_MTC_CSI_DRIVER,
    HOST_ANNOTATION,
    JAX_COORDINATOR_PORT,
    JOBSET_NAME_FIELD,
    PATHWAYS_PROXY_PORT,
    PATHWAYS_RM_PORT,
    PATHWAYS_WORKER_PORT,
    SIDECAR_SHM_DIR,
    SLICE_ANNOTATION,
    TLS_DIR,
    TOKEN_DIR,
    TPU_INSTANCE_TYPES,
    UID,
    ManifestOptions,
    _env_field,
    _meta,
    _pod_security,
    _restricted,
)
from controller_client.preemption_exit import PREEMPTED_EXIT_CODE

EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# The label JobSet puts on every Pod when spec.coordinator is set: the coordinator Pod's stable DNS name.
COORDINATOR_LABEL_FIELD = "metadata.labels['jobset.sigs.k8s.io/coordinator']"
# The Downward API sources Google's Pathways JobSets use (JobSet sets both labels and annotations).
JOBSET_NAME_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
REPLICATED_JOB_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"
# Google's images are pulled by tag on every start, as its JobSets do.
PULL = {"imagePullPolicy": "Always"}
# pathwaysutils' default slice-restart budget per host (max_slice_restarts): Pathways, not the JobSet,
# handles a failed worker of an elastic job.
ELASTIC_WORKER_RESTARTS_PER_HOST = 1_000_000
# A Job's backoffLimit and backoffLimitPerIndex are int32s (batch/v1 JobSpec; the JobSet CRD: "format": "int32").
INT32_MAX = 2_147_483_647


# --------------------------------------------------------------------------- preemption budget


@dataclasses.dataclass(frozen=True)
class PreemptionBudget:
    """How a Pod's ``terminationGracePeriodSeconds`` is shared after a preemption notice (docs/deploy.md).

    ``save``: the training loop's last save (the Pathways worker and colocated Python stay up this long);
    ``flush``: the emergency backup of the newest complete step; ``reserve``: the containers' exit and the
    replicator's own SIGTERM path. Kubernetes kills whatever still runs at ``grace``.
    """

    grace: int
    save: int
    flush: int

    @property
    def reserve(self) -> int:
        return self.grace - self.save - self.flush


SAVE_SHARE = 0.3
FLUSH_SHARE = 0.5


def preemption_budget(opts: ManifestOptions) -> PreemptionBudget:
    g = opts.termination_grace_seconds
    return PreemptionBudget(g, int(g * SAVE_SHARE), int(g * FLUSH_SHARE))


# Where the preStop hook finds the API server's credentials (the projected volume ``kube-api``): it reads its
# own Pod and Job to tell a JobSet restart from a preemption notice (controller_client/preempt.py).
KUBE_API_DIR = "/var/run/mtc/kube-api"


def _preempt_command(opts: ManifestOptions, *, wait: bool) -> list[str]:
    """`mtc preempt`: the preStop hook telling this host's replicator of the notice (controller_client/preempt.py).

    A deletion whose Job is going away (a JobSet restart, a hot-swap) is no notice: the hook returns at once
    and, where the RAM disk outlives the Pod (csi, hostpath), the replicator skips its SIGTERM flush too.
    """
    b = preemption_budget(opts)
    cmd = ["mtc", "preempt", "--local-dir", opts.local_dir, "--flush-seconds", str(b.flush)]
    if wait:
        cmd += ["--save-window-seconds", str(b.save), "--wait"]
    cmd += ["--kube-api-dir", KUBE_API_DIR,
            "--on-restart", "flush" if opts.ramdisk_kind == "memory" else "skip"]
    return cmd


def _kube_api_volume() -> dict[str, Any]:
    """A short-lived token of the job's ServiceAccount (manifests._preempt_role: get its Pods and Jobs only)."""
    return {"name": "kube-api", "projected": {"defaultMode": 0o440, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}},
                                   {"path": "pod-name", "fieldRef": {"fieldPath": "metadata.name"}}]}}]}}


KUBE_API_MOUNT = {"name": "kube-api", "mountPath": KUBE_API_DIR, "readOnly": True}


# --------------------------------------------------------------------------- containers


def _ramdisk_volume(opts: ManifestOptions) -> dict[str, Any]:
    kind = opts.ramdisk_kind
    if kind == "csi":
        return {"name": "ramdisk", "csi": {"driver": GKE_MTC_CSI_DRIVER}}
    if kind == "hostpath":
        # Prepared (tmpfs, owned by UID 1000) by this job's DaemonSet; Directory = fail until it exists.
        return {"name": "ramdisk", "hostPath": {"path": f"{opts.ramdisk_host_path}/{opts.job}", "type": "Directory"}}
    return {"name": "ramdisk", "emptyDir": {"medium": "Memory", "sizeLimit": opts.ramdisk_size}}


def _ramdisk_owner(opts: ManifestOptions) -> dict[str, Any]:
    """Give the RAM disk to UID 1000 before any of our containers starts.

    The GKE CSI driver's volume is the node's tmpfs, not created for this Pod: fsGroup is applied to it
    only if the driver's fsGroupPolicy asks for it, so a non-root container might not write there. This
    container (root, CAP_CHOWN and CAP_FOWNER only) changes the owner of the top directory only. Rendered for
    every RAM disk kind (a no-op on the hostpath and memory ones), so kustomize components compose.
    """
    return {"name": "ramdisk-owner", "image": opts.replicator_image,
            "command": ["/bin/sh", "-c", 'chown "$0:$0" "$1" && chmod 0770 "$1"', str(UID), opts.local_dir],
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}},
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
            "volumeMounts": [{"name": "ramdisk", "mountPath": opts.local_dir}]}


def _probe(opts: ManifestOptions, **timing: Any) -> dict[str, Any]:
    if opts.tls:
        # Kubernetes' gRPC probe speaks plaintext only; ask the daemon over its Unix socket instead.
        return {"exec": {"command": ["mtc", "status", "--local-dir", opts.local_dir, "--timeout-seconds", "3"]},
                "timeoutSeconds": 5, **timing}
    return {"grpc": {"port": opts.grpc_port}, **timing}


# The replicator's startupProbe: 120 probes a second apart (CheckpointManagerOptions.replicator_wait_seconds,
# the multi-controller trainer's own wait, is as long).
STARTUP_PROBES = 120


def _replicator(opts: ManifestOptions, *, holds_back: bool) -> dict[str, Any]:
    """The per-host daemon as a native sidecar (init container with restartPolicy Always).

    ``holds_back`` (native front door only): a startupProbe, so that the kubelet starts the containers after it
    once the replicator serves. The Pathways workers need that: colocated Python serves the controller's calls
    whenever they come (a worker replaced under a running controller included), so its host's replicator must
    serve first. The multi-controller trainer does not: its CheckpointManager waits for its host's replicator
    before its first decision that needs the other tiers (``replicator_wait_seconds``), so trainer and
    replicator start together and a restart does not pay the replicator's start and a probe period first."""
    common = ["--config", f"{CONFIG_DIR}/config.yaml", "--local-dir", opts.local_dir,
              "--token-file", f"{TOKEN_DIR}/token",
              "--advertise", f"$(JOBSET_NAME)-workers-$(SLICE_INDEX)-$(HOST_INDEX).{opts.subdomain}:{opts.grpc_port}",
              # Its SIGTERM comes after the main containers exit: what is left of the grace is the flush's.
              "--preemption-grace-seconds", str(preemption_budget(opts).flush)] + restart.replicator_args(opts)
    env = [_env_field("JOBSET_NAME", JOBSET_NAME_FIELD), _env_field("SLICE_INDEX", SLICE_ANNOTATION),
           _env_field("HOST_INDEX", HOST_ANNOTATION),
           # libc resolver: honours the Pod's DNS search path for the short JobSet names.
           {"name": "GRPC_DNS_RESOLVER", "value": "native"},
           # One JSON line per event (Cloud Logging's severity/message), each save, copy, backup, restore.
           {"name": "MTC_LOG_LEVEL", "value": "info"},
           {"name": "MTC_LOG_FORMAT", "value": "json"}]
    c: dict[str, Any] = {"name": "mtc-replicator", "image": opts.replicator_image, "restartPolicy": "Always"}
    if opts.front_door_kind == "native":
        # Native mode: the rank is slice * hosts_per_slice + host, arithmetic the Downward API cannot do,
        # so a POSIX shell computes it and exec's the image's mtc-replicator with the flags below.
        c["command"] = ["/bin/sh", "-c",
                        'exec mtc-replicator "$@" --rank "$((SLICE_INDEX * HOSTS_PER_SLICE + HOST_INDEX))"',
                        "mtc-replicator"]
        c["args"] = common + ["--job", "$(JOBSET_NAME)", "--nodes", str(opts.nodes),
                              "--data-parallelism", str(opts.slices)]
        if opts.backup_url:
            c["args"] += ["--backup-interval-minutes", f"{opts.backup_interval_minutes:g}"]
        env.insert(3, {"name": "HOSTS_PER_SLICE", "value": str(opts.hosts_per_slice)})
    else:
        # Orbax mode: no rank/nodes; job, rank, peers and backup interval come from Orbax's replicator.yaml.
        c["args"] = common
    if opts.tls:
        c["args"] += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key",
                      "--tls-ca", f"{TLS_DIR}/ca.crt"]
    if opts.tls and opts.tls_identity == "pod":
        # Each Pod's certificate names the Pod (mtc://<job>/pod/<job>-workers-<s>-<h>-<x>): reports are bound to
        # the rank s * hosts_per_slice + h (--tls-pod-replicated-job's default is "workers"). Native mode derives
        # hosts per slice from --nodes / --data-parallelism; Orbax mode's come from replicator.yaml, so say it.
        c["args"] += ["--tls-rank-identity", "require"]
        if opts.front_door_kind != "native":
            c["args"] += ["--tls-pod-hosts-per-slice", str(opts.hosts_per_slice)]
    c["env"] = env
    c["ports"] = [{"name": "mtc-grpc", "containerPort": opts.grpc_port, "protocol": "TCP"},
                  {"name": "mtc-data", "containerPort": opts.data_port, "protocol": "TCP"},
                  # Prometheus text (deploy/monitoring/podmonitoring.yaml scrapes the port by this name).
                  {"name": "metrics", "containerPort": opts.metrics_port, "protocol": "TCP"}]
    if opts.front_door_kind == "native":
        if holds_back:  # the next native sidecar (colocated Python) and the main containers start once it serves
            c["startupProbe"] = _probe(opts, periodSeconds=1, failureThreshold=STARTUP_PROBES)
            c["livenessProbe"] = _probe(opts, periodSeconds=10, failureThreshold=6)
        else:  # the same time to start as the startupProbe would give before liveness may restart it
            c["livenessProbe"] = _probe(opts, initialDelaySeconds=STARTUP_PROBES - 60, periodSeconds=10,
                                        failureThreshold=6)
    # Orbax mode: readiness only. The daemon serves after the replicator.yaml handshake, which needs the
    # trainer running: a startupProbe would deadlock, a livenessProbe could kill a correctly waiting daemon.
    c["readinessProbe"] = _probe(opts, periodSeconds=5, failureThreshold=3)
    # tmpfs pages are charged to the container that writes them: the replicator writes peer copies and
    # restore fetches (replicas x keep-local x shard bytes).
    c["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": opts.replicator_memory_limit}}
    c["securityContext"] = {**_restricted(), "readOnlyRootFilesystem": True}
    mounts = [{"name": "ramdisk", "mountPath": opts.local_dir},
              {"name": "mtc-config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "mtc-token", "mountPath": TOKEN_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if opts.tls:
        mounts.append({"name": "mtc-tls", "mountPath": TLS_DIR, "readOnly": True})
    c["volumeMounts"] = mounts
    return c


def _tls_volume(opts: ManifestOptions, *, worker: bool) -> dict[str, Any]:
    """``mtc-tls``: tls.crt, tls.key and ca.crt, from the job's Certificate or (``--tls-identity pod``, workers) the csi-driver."""
    if opts.tls_identity != "pod":
        return {"name": "mtc-tls", "secret": {"secretName": f"{opts.job}-mtc-tls", "defaultMode": 0o440}}
    if not worker:  # the controller: the admin identity (manifests._admin_certificate)
        return {"name": "mtc-tls", "secret": {"secretName": f"{opts.job}-mtc-admin", "defaultMode": 0o440}}
    prefix = "csi.cert-manager.io/"
    # cert-manager's csi-driver requests a certificate for this Pod when the volume is mounted, renews it and
    # deletes it with the Pod; it substitutes ${POD_NAME} (JobSet's <job>-workers-<slice>-<host>-<x>).
    return {"name": "mtc-tls", "csi": {"driver": CERT_MANAGER_CSI_DRIVER, "readOnly": True, "volumeAttributes": {
        prefix + "issuer-name": opts.tls_issuer, prefix + "issuer-kind": opts.tls_issuer_kind,
        prefix + "issuer-group": "cert-manager.io",
        # Peers and the controller dial <job>-workers-<s>-<h>.<job>:<port>, as for the shared certificate.
        prefix + "dns-names": f"*.{opts.subdomain}",
        prefix + "uri-sans": f"mtc://{opts.job}/pod/${{POD_NAME}}",
        prefix + "key-usages": "server auth,client auth",
        prefix + "key-algorithm": "ECDSA", prefix + "key-size": "256", prefix + "key-encoding": "PKCS8",
        prefix + "duration": "2160h", prefix + "renew-before": "360h",
        # The files are written for this group (mode 0440): the containers run as UID/GID 1000.
        prefix + "fs-group": str(UID),
    }}}


def _common_volumes(opts: ManifestOptions, *, worker: bool = True) -> list[dict[str, Any]]:
    vols = [{"name": "mtc-config", "configMap": {"name": f"{opts.job}-mtc"}},
            {"name": "mtc-token", "secret": {"secretName": opts.token_secret, "defaultMode": 0o440}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    if opts.tls:
        vols.append(_tls_volume(opts, worker=worker))
    return vols


def _pod_spec(opts: ManifestOptions, *, worker: bool) -> dict[str, Any]:
    # restartPolicy Never everywhere: a podFailurePolicy (_pod_failure_policy) requires it. The head: backoffLimit
    # 0 as in Google's JobSets: a failed controller fails its Job and the JobSet's failure policy restarts the
    # job (a restarted controller alone would find workers holding a previous session's state).
    spec: dict[str, Any] = {"restartPolicy": "Never",
                            "serviceAccountName": opts.service_account, "automountServiceAccountToken": False}
    if opts.priority_class:
        # Head and workers (as gcluster's --priority): a restarted job preempts lower-priority Pods (spare
        # capacity placeholders, other jobs) instead of waiting behind them.
        spec["priorityClassName"] = opts.priority_class
    # The head too: after a notice on the head the trainer saves within this grace (its SIGTERM is the notice).
    spec["terminationGracePeriodSeconds"] = opts.termination_grace_seconds
    if worker:
        spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": opts.tpu_accelerator,
                                "cloud.google.com/gke-tpu-topology": opts.tpu_topology}
    elif opts.head_node_pool:
        spec["nodeSelector"] = {"cloud.google.com/gke-nodepool": opts.head_node_pool}
    spec["securityContext"] = _pod_security()
    return spec


def _worker_backoff(opts: ManifestOptions) -> dict[str, int]:
    """The worker Jobs' failure budget. restart-jobset: the first failed worker Pod fails its Job, so the JobSet
    restarts (hot-swap: the re-created Jobs are placed on any free node pool, a spare one included).
    restart-slice (elastic): Pathways handles a lost slice, the Job re-creates its Pods (it never fails within
    this budget, so the JobSet never restarts the other slices: the default-on way, no RestartJob feature
    gate), the controller keeps running.

    Elastic budgets are per index (per host), not per Job: the Job controller delays re-creating failed Pods by
    10 s doubling per failure up to 6 min, notices (podFailurePolicy Ignore) included, and a Job-wide count
    only resets on a success, which an elastic worker never has. Counted per Job, one notice to a slice of H
    hosts cost 10 s x 2^(H-1) before its Pods came back (80 s at 4 hosts) and a few notices 6 min; per index it
    is 10 s x 2^(n-1) from that host's previous failure, n its failures so far (pkg/controller/job
    backoff_utils.go, Kubernetes 1.36; measured in tests/cluster/test_decisions.py)."""
    if opts.worker_failure_kind == "restart-jobset":
        return {"backoffLimit": 0}
    return {"backoffLimitPerIndex": min(ELASTIC_WORKER_RESTARTS_PER_HOST, INT32_MAX)}


# The Pod condition the scheduler's preemption, the Eviction API, the taint manager, PodGC and the kubelet's
# node-shutdown and node-pressure evictions add to a Pod they terminate.
DISRUPTION = {"type": "DisruptionTarget", "status": "True"}
# The reason the Job controller gives a Job failed by a podFailurePolicy FailJob rule.
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"


def _pod_failure_policy(opts: ManifestOptions, *, replicated_job: str) -> dict[str, Any]:
    """Which failed Pods fail their Job at once (FailJob: reason PodFailurePolicy), which are not counted.

    Setting one also makes the Job controller count a terminating Pod only once it is Failed (isPodFailed,
    onlyReplaceFailedPods in pkg/controller/job/job_controller.go): a notice never fails a Job before the
    Pod's save and flush are done. ``trainer``: the container whose PREEMPTED_EXIT_CODE means "saved after a
    preemption notice, resume me" (Pathways: the head's controller; multi-controller: every worker's train).
    """
    elastic_workers = replicated_job == "workers" and opts.worker_failure_kind == "restart-slice"
    # Elastic: a preempted slice's Pods are re-created by their Job without counting (Pathways carries on
    # with the other slices); otherwise a preempted Pod fails its Job, whose reason the JobSet rule matches.
    rules: list[dict[str, Any]] = [{"action": "Ignore" if elastic_workers else "FailJob", "onPodConditions": [DISRUPTION]}]
    trainer = "controller" if replicated_job == "head" else ("train" if opts.mode == "multi-controller" else "")
    if trainer:
        rules.append({"action": "FailJob", "onExitCodes": {"containerName": trainer, "operator": "In",
                                                           "values": [PREEMPTED_EXIT_CODE]}})
    return {"rules": rules}


def _job_template(pod: dict[str, Any], completions: int, backoff: dict[str, Any], topology: str,
                  failure: dict[str, Any], *, on_job: bool = False) -> dict[str, Any]:
    # One slice per node pool (workers), the head alone on its node: exclusive placement per replicated Job
    # (on the JobSet it would also claim a whole node pool for the head), where Google's JobSets put it.
    ann = {EXCLUSIVE_TOPOLOGY: topology}
    return {**({"metadata": {"annotations": dict(ann)}} if on_job else {}),
            "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": completions,
                     **backoff, "podFailurePolicy": failure,
                     "template": {"metadata": {"annotations": dict(ann)}, "spec": pod}}}


def _failure_policy(opts: ManifestOptions) -> dict[str, Any]:
    """The JobSet's answer to a failed Job; rule names as the JobSet webhook allows (no hyphens).

    A Job failed by a podFailurePolicy FailJob rule (a preemption, an eviction, a trainer that saved after a
    notice) restarts the JobSet without using up maxRestarts; any other failed Job (a worker or the controller
    exited non-zero: backoffLimit exceeded) restarts it and counts. Only actions of a default JobSet >= v0.8
    (RestartJob is alpha, feature gate RestartJob, v0.12; the webhook refuses it while the gate is off).
    """
    return {"maxRestarts": opts.max_restarts,
            # Recreate: every child Job is deleted and re-created, so the scheduler places each slice afresh.
            # InPlaceRestart (--restart in-place): a failed trainer restarts every Pod's containers in place; a Job
            # failed by the rules below is still recreated (manifests_restart.py).
            "restartStrategy": "InPlaceRestart" if restart.in_place(opts) else "Recreate",
            "rules": [{"name": "preempted_or_saved_restart_uncounted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                       "onJobFailureReasons": [POD_FAILURE_POLICY_REASON]},
                      {"name": "failed_restart_counted", "action": "RestartJobSet"}]}


def _tpu_resources(opts: ManifestOptions) -> dict[str, Any]:
    n = str(opts.tpu_chips_per_host)
    return {"requests": {"google.com/tpu": n}, "limits": {"google.com/tpu": n}}


def _mtc_env(opts: ManifestOptions) -> list[dict[str, Any]]:
    """What a native CheckpointManager needs (Pathways controller, multi-controller trainer)."""
    env = [# The coordinator candidates, one per slice (each slice's first host), in the order the
           # replicators use: the first live one serves, so losing slice 0 does not stop restores.
           {"name": "MTC_COORDINATOR",
            "value": ",".join(f"$(JOBSET_NAME)-workers-{s}-0.{opts.subdomain}:{opts.grpc_port}"
                              for s in range(opts.slices))},
           {"name": "MTC_TOKEN_FILE", "value": f"{TOKEN_DIR}/token"}]
    if opts.tls:
        env += [{"name": "MTC_TLS_CERT_FILE", "value": f"{TLS_DIR}/tls.crt"},
                {"name": "MTC_TLS_KEY_FILE", "value": f"{TLS_DIR}/tls.key"},
                {"name": "MTC_TLS_CA_FILE", "value": f"{TLS_DIR}/ca.crt"}]
    return env


def _controller_env(opts: ManifestOptions) -> list[dict[str, Any]]:
    env = [_env_field("JOBSET_NAME", JOBSET_NAME_FIELD)]
    if opts.front_door_kind == "native":
        env += _mtc_env(opts)
    else:
        # Orbax on Pathways: initialize_multi_tier_checkpointing(MTC_LOCAL_DIRECTORY, num_slices=MTC_NUM_SLICES,
        # use_colocated_python=True); the handshake runs in colocated Python on the workers.
        env.append({"name": "MTC_NUM_SLICES", "value": str(opts.slices)})
    env += [# The RAM disk as the worker Pods mount it (the colocated sidecar writes there).
            {"name": "MTC_LOCAL_DIRECTORY", "value": opts.local_dir},
            {"name": "GRPC_DNS_RESOLVER", "value": "native"},
            {"name": "JAX_PLATFORMS", "value": "proxy"},
            {"name": "JAX_BACKEND_TARGET", "value": f"grpc://localhost:{PATHWAYS_PROXY_PORT}"},
            {"name": "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS", "value": "true"}]
    return env


def _mtc_mounts(opts: ManifestOptions) -> list[dict[str, Any]]:
    if opts.front_door_kind != "native":
        return []
    return ([{"name": "mtc-token", "mountPath": TOKEN_DIR, "readOnly": True}]
            + ([{"name": "mtc-tls", "mountPath": TLS_DIR, "readOnly": True}] if opts.tls else []))


# --------------------------------------------------------------------------- Pathways


def _pathways_head(opts: ManifestOptions, instance_type: str, scratch: str) -> dict[str, Any]:
    head_addr = f"$(PATHWAYS_HEAD):{PATHWAYS_RM_PORT}"
    head_env = _env_field("PATHWAYS_HEAD", COORDINATOR_LABEL_FIELD)
    # The resource manager and the proxy as native sidecars, the controller as the one main container (as
    # pathwaysutils' add_user_workload): the head Pod completes when the training program does.
    rm = {"name": "pathways-rm", "image": opts.pathways_server_image, **PULL, "restartPolicy": "Always",
          "args": [f"--server_port={PATHWAYS_RM_PORT}", "--node_type=resource_manager",
                   f"--gcs_scratch_location={scratch}", f"--instance_count={opts.slices}",
                   f"--instance_type={instance_type}"],
          "env": [_env_field("REPLICATED_JOB_NAME", REPLICATED_JOB_ANNOTATION),
                  _env_field("JOBSET_NAME", JOBSET_NAME_ANNOTATION),
                  _env_field("HOST_ADDRESS", COORDINATOR_LABEL_FIELD),
                  {"name": "TPU_SKIP_MDS_QUERY", "value": "true"}],
          "ports": [{"containerPort": PATHWAYS_RM_PORT, "protocol": "TCP"},
                    {"containerPort": 29002, "protocol": "TCP"}],
          "resources": {"limits": {"cpu": "8", "memory": "32G"}}}
    proxy_args = [f"--server_port={PATHWAYS_PROXY_PORT}", f"--resource_manager_address={head_addr}",
                  f"--gcs_scratch_location={scratch}",
                  # Colocated Python runs in the workers' colocated-python-sidecar containers.
                  "--sidecar_name=external"]
    if opts.elastic_slices:
        # The flag the proxy takes (pathwaysutils, the PathwaysJob operator and xpk recipes all pass this
        # one; no public source passes --num_elastic_instances).
        proxy_args.append(f"--num_elastic_slices={opts.elastic_slices}")
    proxy_args += list(opts.proxy_args)  # --proxy-args: whatever else the proxy should get (the guide's flags)
    proxy = {"name": "pathways-proxy", "image": opts.pathways_proxy_image, **PULL, "restartPolicy": "Always",
             "args": proxy_args, "env": [head_env, {"name": "IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS", "value": "true"}],
             "ports": [{"containerPort": PATHWAYS_PROXY_PORT, "protocol": "TCP"}],
             "resources": {"limits": {"cpu": "16", "memory": "100G"}}}
    controller = {"name": "controller", "image": opts.controller_image or opts.sidecar_image, **PULL,
                  # Native: CheckpointManagerOptions(local_directory=$MTC_LOCAL_DIRECTORY, job_name=$JOBSET_NAME,
                  # coordinator_address=$MTC_COORDINATOR, token_file=$MTC_TOKEN_FILE). Orbax: the seed's
                  # initialize_multi_tier_checkpointing(..., use_colocated_python=True) + ReplicatorCheckpointManager.
                  "command": list(opts.controller_command),
                  "env": _controller_env(opts),
                  "securityContext": _restricted()}
    mounts = _mtc_mounts(opts)
    if mounts:
        controller["volumeMounts"] = mounts
    head = _pod_spec(opts, worker=False)
    head["initContainers"] = [rm, proxy]
    head["containers"] = [controller]
    head["volumes"] = [v for v in _common_volumes(opts, worker=False) if v["name"] in {m["name"] for m in mounts}]
    if not head["volumes"]:
        del head["volumes"]
    return head


def _pathways_worker(opts: ManifestOptions, scratch: str) -> dict[str, Any]:
    b = preemption_budget(opts)
    worker = {"name": "pathways-worker", "image": opts.pathways_server_image, **PULL,
              "args": [f"--resource_manager_address=$(PATHWAYS_HEAD):{PATHWAYS_RM_PORT}",
                       f"--server_port={PATHWAYS_WORKER_PORT}", f"--gcs_scratch_location={scratch}",
                       f"--cloud_pathways_sidecar_shm_directory={SIDECAR_SHM_DIR}"],
              "env": [{"name": "TPU_MIN_LOG_LEVEL", "value": "0"}, {"name": "TF_CPP_MIN_LOG_LEVEL", "value": "0"},
                      {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
                      {"name": "MEGASCALE_GRPC_ENABLE_XOR_TRACER", "value": "false"},
                      _env_field("MEGASCALE_NUM_SLICES", "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"),
                      _env_field("JOBSET_NAME", JOBSET_NAME_ANNOTATION),
                      _env_field("REPLICATED_JOB_NAME", REPLICATED_JOB_ANNOTATION),
                      _env_field("MEGASCALE_SLICE_ID", "metadata.labels['jobset.sigs.k8s.io/job-index']"),
                      _env_field("PATHWAYS_HEAD", COORDINATOR_LABEL_FIELD),
                      _env_field("MEGASCALE_COORDINATOR_ADDRESS", COORDINATOR_LABEL_FIELD),
                      {"name": "CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY", "value": SIDECAR_SHM_DIR}],
              "ports": [{"containerPort": PATHWAYS_WORKER_PORT, "protocol": "TCP"},
                        {"containerPort": 29006, "protocol": "TCP"}, {"containerPort": 8471, "protocol": "TCP"},
                        {"containerPort": 8080, "protocol": "TCP"}],
              "resources": {"limits": {"google.com/tpu": str(opts.tpu_chips_per_host)}},
              # Stay up through the save window after a notice: the training loop's last save goes through
              # this worker into colocated Python (Kubernetes runs preStop hooks before SIGTERM).
              "lifecycle": {"preStop": {"sleep": {"seconds": b.save}}},
              # No securityContext: the TPU device plugin gives the container its chips, as in Google's JobSets.
              "volumeMounts": [{"name": "shared-tmp", "mountPath": "/tmp"},
                               {"name": "shared-memory", "mountPath": SIDECAR_SHM_DIR},
                               {"name": "ramdisk", "mountPath": opts.local_dir}]}
    # A native sidecar started after the replicator and before pathways-worker (which connects to it during
    # placement), stopped after pathways-worker exits: as pathwaysutils' add_colocated_python.
    sidecar = {"name": "colocated-python-sidecar", "image": opts.sidecar_image, **PULL, "restartPolicy": "Always",
               "env": [{"name": "GRPC_SERVER_ADDRESS", "value": f"0.0.0.0:{COLOCATED_PYTHON_PORT}"},
                       {"name": "CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY", "value": SIDECAR_SHM_DIR}],
               "ports": [{"containerPort": COLOCATED_PYTHON_PORT}],
               # A save holds a host's shards in this process while it writes them to the RAM disk: no memory
               # limit (the node's memory is the training job's), a request so the scheduler counts it.
               "resources": {"requests": {"cpu": "2", "memory": "8Gi"}},
               "securityContext": _restricted(),
               "volumeMounts": [{"name": "shared-tmp", "mountPath": "/tmp"},
                                {"name": "shared-memory", "mountPath": SIDECAR_SHM_DIR},
                                {"name": "ramdisk", "mountPath": opts.local_dir}]}
    # The replicator is a native sidecar too, so its own SIGTERM comes last; this main container exists to
    # give the notice at the start of the grace period (its preStop hook) and waits for the flush.
    # It exits 143 on SIGTERM: a terminated worker Pod always ends Failed (never Succeeded: its Indexed Job would
    # take the index as done and not re-create it), so the Job's podFailurePolicy decides what it means; and 1
    # once pathways-worker has ended (restartPolicy Never: the Pod fails only when every main container ended).
    notice = {"name": "preemption-notice", "image": opts.replicator_image,
              "command": ["mtc", "preempt", "--local-dir", opts.local_dir,
                          "--hold-while-port", str(PATHWAYS_WORKER_PORT)],
              "lifecycle": {"preStop": {"exec": {"command": _preempt_command(opts, wait=True)}}},
              "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
              "securityContext": {**_restricted(), "readOnlyRootFilesystem": True},
              "volumeMounts": [{"name": "ramdisk", "mountPath": opts.local_dir}, KUBE_API_MOUNT]}
    wspec = _pod_spec(opts, worker=True)
    wspec["initContainers"] = [_ramdisk_owner(opts), _replicator(opts, holds_back=True), sidecar]
    wspec["containers"] = [worker, notice]
    wspec["volumes"] = [{"name": "shared-tmp", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}},
                        {"name": "shared-memory", "emptyDir": {"medium": "Memory"}},
                        _ramdisk_volume(opts)] + _common_volumes(opts) + [_kube_api_volume()]
    return wspec


def pathways_jobset(opts: ManifestOptions) -> dict[str, Any]:
    instance_type = f"{TPU_INSTANCE_TYPES[opts.tpu_accelerator]}:{opts.tpu_topology}"
    scratch = opts.scratch()
    head = _pathways_head(opts, instance_type, scratch)
    wspec = _pathways_worker(opts, scratch)
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(opts.job, opts),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": opts.subdomain, "publishNotReadyAddresses": True},
            # The head first (workers connect to its resource manager); PATHWAYS_HEAD is its DNS name.
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            "coordinator": {"replicatedJob": "head"},
            # Pathways workers serve until stopped: the job is done when the controller is.
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["head"]},
            "failurePolicy": _failure_policy(opts),
            "replicatedJobs": [
                {"name": "head", "replicas": 1,
                 "template": _job_template(head, 1, {"backoffLimit": 0}, "kubernetes.io/hostname",
                                           _pod_failure_policy(opts, replicated_job="head"), on_job=True)},
                {"name": "workers", "replicas": opts.slices,
                 "template": _job_template(wspec, opts.hosts_per_slice, _worker_backoff(opts),
                                           "cloud.google.com/gke-nodepool",
                                           _pod_failure_policy(opts, replicated_job="workers"))},
            ],
        },
    }


# --------------------------------------------------------------------------- multi-controller


def multi_controller_jobset(opts: ManifestOptions) -> dict[str, Any]:
    jax_coord = f"$(JOBSET_NAME)-workers-0-0.{opts.subdomain}:{JAX_COORDINATOR_PORT}"
    place = [_env_field("JOBSET_NAME", JOBSET_NAME_FIELD), _env_field("SLICE_INDEX", SLICE_ANNOTATION),
             _env_field("HOST_INDEX", HOST_ANNOTATION), {"name": "HOSTS_PER_SLICE", "value": str(opts.hosts_per_slice)}]
    orbax = opts.front_door_kind == "orbax"
    train: dict[str, Any] = {"name": "train", "image": opts.controller_image or opts.sidecar_image}
    if orbax:
        # Your program: initialize_multi_tier_checkpointing(<local>, ...) + ReplicatorCheckpointManager; JAX's
        # process id and coordinator come from <local>/jax-init-info.txt (the init container below).
        train["command"] = list(opts.controller_command)
        train["env"] = [_env_field("JOBSET_NAME", JOBSET_NAME_FIELD),
                        {"name": "MTC_LOCAL_DIRECTORY", "value": opts.local_dir},
                        {"name": "MTC_NUM_SLICES", "value": str(opts.slices)}]
    else:
        # Your program: jax.distributed.initialize(jax_service.reachable_address(JAX_COORDINATOR_ADDRESS,
        # JAX_PROCESS_ID), JAX_NUM_PROCESSES, JAX_PROCESS_ID)
        # and a CheckpointManager per process (sidecar in-process) on MTC_LOCAL_DIRECTORY / MTC_COORDINATOR.
        train["command"] = ["/bin/sh", "-c",
                            'JAX_PROCESS_ID="$((SLICE_INDEX * HOSTS_PER_SLICE + HOST_INDEX))" exec "$@"',
                            "train", *opts.controller_command]
        train["env"] = place + [{"name": "JAX_COORDINATOR_ADDRESS", "value": jax_coord},
                                {"name": "JAX_NUM_PROCESSES", "value": str(opts.nodes)},
                                {"name": "MTC_LOCAL_DIRECTORY", "value": opts.local_dir},
                                {"name": "GRPC_DNS_RESOLVER", "value": "native"}] + _mtc_env(opts)
    train["ports"] = [{"name": "jax-coord", "containerPort": JAX_COORDINATOR_PORT, "protocol": "TCP"}]
    train["resources"] = _tpu_resources(opts)
    # Native: the training loop learns of the notice from reached_preemption() and saves while this hook
    # waits. Orbax: the trainer's own SIGTERM is its notice (JAX's preemption sync point), so the hook only
    # tells the replicator and returns at once; the replicator flushes Orbax's last step on its own SIGTERM.
    train["lifecycle"] = {"preStop": {"exec": {"command": _preempt_command(opts, wait=not orbax)}}}
    # TPU device access as in Google's TPU JobSets; UID 1000 like the replicator (shared RAM disk).
    train["securityContext"] = {"privileged": True, "runAsUser": UID, "runAsGroup": UID}
    train["volumeMounts"] = [{"name": "ramdisk", "mountPath": opts.local_dir}] + _mtc_mounts(opts) + [KUBE_API_MOUNT]
    inits: list[dict[str, Any]] = [_ramdisk_owner(opts)]
    if orbax:
        inits.append({
            "name": "jax-init-info", "image": opts.replicator_image,
            # Orbax (use_mtc_process_ids=True) waits for <local>/jax-init-info.txt = "<process id>\n<coordinator>\n".
            "command": ["python", "-c",
                        "import os\n"
                        "from pathlib import Path\n"
                        "from replicator.orbax.contract import write_jax_init_info\n"
                        "pid = int(os.environ['SLICE_INDEX']) * int(os.environ['HOSTS_PER_SLICE'])"
                        " + int(os.environ['HOST_INDEX'])\n"
                        "write_jax_init_info(Path(os.environ['LOCAL_DIR']), pid, os.environ['JAX_COORDINATOR'])\n"],
            "env": place + [{"name": "LOCAL_DIR", "value": opts.local_dir},
                            {"name": "JAX_COORDINATOR", "value": jax_coord}],
            "securityContext": {**_restricted(), "readOnlyRootFilesystem": True},
            "volumeMounts": [{"name": "ramdisk", "mountPath": opts.local_dir}]})
    wspec = _pod_spec(opts, worker=True)
    # The trainer starts with its replicator, not after it (_replicator: holds_back).
    wspec["initContainers"] = inits + [_replicator(opts, holds_back=False)]
    backoff = _worker_backoff(opts)
    if restart.in_place(opts):
        # The agent last: the replicator starts (and restores) while the Pods wait at the barrier for each other.
        wspec["initContainers"].append(restart.agent(opts))
        train.update(restart.trainer_rules())
        backoff = restart.job_backoff()
    wspec["containers"] = [train]
    wspec["volumes"] = [_ramdisk_volume(opts)] + _common_volumes(opts) + [_kube_api_volume()]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(opts.job, opts),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": opts.subdomain, "publishNotReadyAddresses": True},
            "failurePolicy": _failure_policy(opts),
            "replicatedJobs": [{"name": "workers", "replicas": opts.slices,
                                "template": _job_template(wspec, opts.hosts_per_slice, backoff,
                                                          "cloud.google.com/gke-nodepool",
                                                          _pod_failure_policy(opts, replicated_job="workers"))}],
        },
    }
