"""`mtc manifests`: render a complete, ready-to-apply Kubernetes set for one job (Pathways or multi-controller).

Every object is built as a Python dict and dumped with pyyaml; ``render(options)`` returns file name -> YAML
text, including a ``kustomization.yaml`` listing the others (so ``kubectl apply -k DIR`` works as well as
``kubectl apply -f DIR``). ``deploy/`` is this module's output for the default options, plus kustomize
components computed as the difference to other options (``python deploy/regen.py``); docs/deploy.md
explains every choice. No jax import: this runs on a laptop.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from controller_client.manifests_options import (  # noqa: F401  (re-exported: the public names)
    CERT_MANAGER_CSI_DRIVER,
    COLOCATED_PYTHON_PORT,
    CONFIG_DIR,
    FRONT_DOORS,
    GKE_MTC_CSI_DRIVER,
    HOST_ANNOTATION,
    JAX_COORDINATOR_PORT,
    JOBSET_NAME_FIELD,
    JOBSET_NAME_LABEL,
    MODES,
    PART_OF,
    PATHWAYS_PROXY_PORT,
    PATHWAYS_RM_PORT,
    PATHWAYS_WORKER_PORT,
    RAMDISKS,
    REPLICATED_JOB_LABEL,
    RESTARTS,
    SIDECAR_SHM_DIR,
    SLICE_ANNOTATION,
    TLS_DIR,
    TLS_IDENTITIES,
    TOKEN_DIR,
    TPU_INSTANCE_TYPES,
    UID,
    WORKER_FAILURE_POLICIES,
    ManifestOptions,
    _env_field,
    _meta,
    _pod_security,
    _restricted,
)


def _config_map(opts: ManifestOptions) -> dict[str, Any]:
    # Keys are spelled like `mtc replicator` flags; precedence: this file < MTC_* env < flags.
    cfg: dict[str, Any] = {
        "listen": f"0.0.0.0:{opts.grpc_port}",
        "data-port": opts.data_port,
        "metrics-port": opts.metrics_port,
        "peer-address-template": opts.peer_address_template(),
        "replicas": opts.replicas,
        **({"redundancy": opts.redundancy} if opts.redundancy else {}),
        "keep-local": opts.keep_local,
        "backup-url": opts.backup_url,
        "backup-keep": opts.backup_keep,
    }
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{opts.job}-mtc", opts),
            "data": {"config.yaml": yaml.safe_dump(cfg, sort_keys=False)}}


def _service(opts: ManifestOptions) -> dict[str, Any]:
    # JobSet uses an existing Service named like the subdomain instead of creating its own.
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(opts.subdomain, opts),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {JOBSET_NAME_LABEL: opts.job},
                     "ports": [{"name": "mtc-grpc", "port": opts.grpc_port, "targetPort": opts.grpc_port},
                               {"name": "mtc-data", "port": opts.data_port, "targetPort": opts.data_port}]}}


def _service_account(opts: ManifestOptions) -> dict[str, Any]:
    meta = _meta(opts.service_account, opts)
    if opts.gcp_service_account:
        meta["annotations"] = {"iam.gke.io/gcp-service-account": opts.gcp_service_account}
    # No Kubernetes API access: peers are found through DNS, ranks through the Downward API.
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False}


def _network_policy(opts: ManifestOptions) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(f"{opts.job}-workers", opts),
        "spec": {
            "podSelector": {"matchLabels": {JOBSET_NAME_LABEL: opts.job, REPLICATED_JOB_LABEL: "workers"}},
            "policyTypes": ["Ingress"],
            # From this job's Pods only (head and workers), on every port: the replicators' gRPC and fixed
            # bulk-data ports, and whatever Pathways, JAX and the TPU runtime exchange between the job's Pods.
            # Managed Prometheus' collectors (namespace gmp-system) may reach the metrics port only.
            "ingress": [{"from": [{"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: opts.job}}}]},
                        {"from": [{"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": "gmp-system"}}}],
                         "ports": [{"port": opts.metrics_port, "protocol": "TCP"}]}],
        },
    }


def _priority_class(opts: ManifestOptions) -> dict[str, Any]:
    return {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": _meta(opts.priority_class, opts),
            "value": opts.priority_value, "globalDefault": False, "preemptionPolicy": "PreemptLowerPriority",
            "description": f"Worker Pods of multitier-checkpoint job {opts.job} (hot-swap onto spare capacity)."}


def _certificate(opts: ManifestOptions) -> dict[str, Any]:
    if opts.tls_identity == "pod":
        return _admin_certificate(opts)
    return {
        "apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": _meta(f"{opts.job}-mtc-tls", opts),
        "spec": {
            "secretName": f"{opts.job}-mtc-tls",
            # One certificate for every Pod of the job: server (replicators) and client (controller, peers).
            "commonName": f"{opts.job}.mtc",
            # Peers and the controller dial <job>-workers-<s>-<h>.<job>:<port>; the wildcard covers every worker.
            "dnsNames": [f"*.{opts.subdomain}"],
            "usages": ["server auth", "client auth"],
            "duration": "2160h", "renewBefore": "360h",
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": {"name": opts.tls_issuer, "kind": opts.tls_issuer_kind, "group": "cert-manager.io"},
        },
    }


def _admin_certificate(opts: ManifestOptions) -> dict[str, Any]:
    """``--tls-identity pod``: the controller's (and operators') client certificate, ``mtc://<job>/admin``.

    The worker Pods get theirs from cert-manager's csi-driver (manifests_jobsets._tls_volume). Under
    ``--tls-rank-identity require`` only this identity may call the admin actions (pin, restore, backup now,
    bad-copy reports); it can never report as a rank.
    """
    return {
        "apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": _meta(f"{opts.job}-mtc-admin", opts),
        "spec": {
            "secretName": f"{opts.job}-mtc-admin",
            "commonName": f"admin.{opts.job}.mtc",
            "uris": [f"mtc://{opts.job}/admin"],
            "usages": ["client auth"],
            "duration": "2160h", "renewBefore": "360h",
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": {"name": opts.tls_issuer, "kind": opts.tls_issuer_kind, "group": "cert-manager.io"},
        },
    }


def _ramdisk_daemonset(opts: ManifestOptions) -> dict[str, Any]:
    """Mounts a tmpfs on each TPU node at <host path>/<job>, owned by UID 1000; it outlives every Pod."""
    target = f"/host{opts.ramdisk_host_path}/{opts.job}"
    script = (
        "set -eu\n"
        f'dir="{target}"\n'
        'mkdir -p "$dir"\n'
        # Idempotent: a restarted DaemonSet Pod finds the tmpfs (and the checkpoints in it) in place.
        'if ! mountpoint -q "$dir"; then\n'
        f'  mount -t tmpfs -o size={opts.ramdisk_size.replace("i", "").lower()},mode=0770,uid={UID},gid={UID} '
        'mtc-ramdisk "$dir"\n'
        "fi\n"
        'echo "RAM disk ready at ${dir#/host}"\n'
        "exec sleep infinity\n"
    )
    labels = {**PART_OF, "app.kubernetes.io/component": "ramdisk", "mtc.dev/job": opts.job}
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta(f"{opts.job}-ramdisk", opts),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/component": "ramdisk", "mtc.dev/job": opts.job}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": opts.tpu_accelerator},
                    "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "tmpfs", "image": opts.ramdisk_image,
                        "command": ["/bin/sh", "-c", script],
                        # mount(2) needs CAP_SYS_ADMIN; Bidirectional propagation makes the mount the node's.
                        "securityContext": {"privileged": True},
                        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                                      "limits": {"memory": "32Mi"}},
                        "volumeMounts": [{"name": "host", "mountPath": f"/host{opts.ramdisk_host_path}",
                                          "mountPropagation": "Bidirectional"}],
                    }],
                    "volumes": [{"name": "host", "hostPath": {"path": opts.ramdisk_host_path,
                                                              "type": "DirectoryOrCreate"}}],
                },
            },
        },
    }


def _preempt_role(opts: ManifestOptions) -> dict[str, Any]:
    """What the workers' preStop hook may read: Pods and Jobs of the namespace, nothing else, no writes.

    `mtc preempt --kube-api-dir` reads its own Pod and the Job owning it to tell a JobSet restart or hot-swap
    (the Job is being deleted or has failed: no save window, no flush) from a preemption notice.
    """
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(f"{opts.job}-mtc-preempt", opts),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                      {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"]}]}


def _preempt_role_binding(opts: ManifestOptions) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _meta(f"{opts.job}-mtc-preempt", opts),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{opts.job}-mtc-preempt"},
            "subjects": [{"kind": "ServiceAccount", "name": opts.service_account}]}


def objects(opts: ManifestOptions) -> dict[str, dict[str, Any]]:
    """File name -> Kubernetes object, in apply order."""
    opts.validate()
    out: dict[str, dict[str, Any]] = {"serviceaccount.yaml": _service_account(opts),
                                      "role.yaml": _preempt_role(opts), "rolebinding.yaml": _preempt_role_binding(opts),
                                      "configmap.yaml": _config_map(opts), "service.yaml": _service(opts)}
    if opts.priority_value is not None:
        out["priorityclass.yaml"] = _priority_class(opts)
    if opts.network_policy:
        out["networkpolicy.yaml"] = _network_policy(opts)
    if opts.tls:
        out["certificate.yaml"] = _certificate(opts)
    if opts.ramdisk_kind == "hostpath":
        out["ramdisk-daemonset.yaml"] = _ramdisk_daemonset(opts)
    from controller_client import manifests_jobsets as js
    from controller_client import manifests_restart

    out.update(manifests_restart.objects(opts))

    out["jobset.yaml"] = js.pathways_jobset(opts) if opts.mode == "pathways" else js.multi_controller_jobset(opts)
    return out


class YamlDumper(yaml.SafeDumper):
    """Safe YAML with multi-line strings (scripts, patches) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


YamlDumper.add_representer(str, _represent_str)


def dump(body: Any) -> str:
    return yaml.dump(body, Dumper=YamlDumper, sort_keys=False, width=120)


def _header(opts: ManifestOptions) -> str:
    return (f"# Rendered by `mtc manifests --mode {opts.mode} --front-door {opts.front_door_kind} --job {opts.job} --slices {opts.slices} "
            f"--hosts-per-slice {opts.hosts_per_slice} ...`; see docs/deploy.md.\n")


def render(opts: ManifestOptions) -> dict[str, str]:
    """File name -> YAML text, plus ``kustomization.yaml`` listing them (the token Secret is never rendered)."""
    objs = objects(opts)
    files = {name: _header(opts) + dump(body) for name, body in objs.items()}
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(objs)}
    files["kustomization.yaml"] = _header(opts) + dump(kust)
    return files


# --------------------------------------------------------------------------- command line

_FIELDS = {f.name: f for f in dataclasses.fields(ManifestOptions)}
_HELP = {
    "mode": "pathways (head + workers with colocated Python) or multi-controller (the program on every host)",
    "front_door": "native (our CheckpointManager) or orbax (unchanged Orbax multi-tier checkpointing); "
                  "default native for pathways, orbax for multi-controller",
    "worker_failure_policy": "restart-jobset (a failed worker restarts the JobSet: hot-swap onto spare slices) or "
                             "restart-slice (Pathways elastic: the controller stays); default by --elastic-slices",
    "max_restarts": "JobSet failurePolicy.maxRestarts (default 5; with --restart in-place also the most restarts of "
                    "any container)",
    "restart": "recreate (a failure deletes and re-creates every Pod) or in-place (multi-controller: JobSet's "
               "InPlaceRestart, the containers restart in the same Pods; needs JobSet >= v0.11 with the InPlaceRestart "
               "gate and Kubernetes >= 1.35 with RestartAllContainersOnContainerExits; docs/deploy.md); default recreate",
    "in_place_restart_agent_image": "with --restart in-place: JobSet's in-place-restart agent image (built from "
                                    "the JobSet release's cmd/in-place-restart-agent/Dockerfile)",
    "termination_grace_seconds": "worker terminationGracePeriodSeconds, shared after a preemption notice: "
                                 "save 30%%, flush 50%%, exit 20%% (default 60)",
    "head_node_pool": "node pool of the Pathways head (default cpu-np, as Google's JobSets; '' = any)",
    "job": "JobSet name (default mtc-train)",
    "slices": "number of slices (default 2)",
    "hosts_per_slice": "hosts per slice (default 2)",
    "backup_url": "bucket tier, e.g. gs://BUCKET/ckpt (default: none)",
    "ramdisk": "csi (GKE Multi-Tier Checkpointing driver), hostpath (node tmpfs kept by a DaemonSet) or memory "
               "(emptyDir); default csi for the native front door, memory for orbax (hostpath needs a privileged DaemonSet)",
    "ramdisk_size": "RAM disk size per host (default 64Gi)",
    "tls": "mutual TLS from a cert-manager Certificate",
    "tls_identity": "with --tls: shared (one Certificate for the job; any holder may report for any rank) or pod "
                    "(cert-manager's csi-driver issues each worker Pod mtc://<job>/pod/<pod name>, reports bound "
                    "to the rank the Pod name derives; needs the csi-driver installed); default shared",
    "priority_class": "priorityClassName of the worker Pods, e.g. high-prior-job (default: none)",
    "priority_value": "also create that PriorityClass with this value, e.g. 2000",
    "elastic_slices": "Pathways proxy --num_elastic_slices (default 0 = not elastic)",
    "data_port": "the replicator's fixed TCP bulk-data port (default 7071)",
    "metrics_port": "the replicator's Prometheus /metrics port (default 9400)",
    "network_policy": "render the NetworkPolicy (default on; --no-network-policy to skip)",
    "gcp_service_account": "Workload Identity: Google service account for the bucket (annotation)",
    "controller_command": "the training program (default: python /app/train.py); quote it as one string",
    "proxy_args": "extra flags of the Pathways proxy, quoted as one string (e.g. '--xla_tpu_foo=1 --bar=2', or "
                  "one flag: '--num_elastic_instances=2'), appended after the rendered ones",
    "backup_interval_minutes": "Pathways mode: back up every N minutes (default 30; Orbax sets its own)",
    "backup_keep": "backups kept in the bucket (default 3)",
    "replicas": "extra verified copies of each host's step on other slices (default 1)",
    "redundancy": "the replicators' --redundancy: copies:N or ec:K+M (default copies:<--replicas>; ec needs "
                  "slices x hosts-per-slice >= K+M, not with --elastic-slices or --front-door orbax; docs/peer.md)",
    "keep_local": "committed steps kept on each RAM disk (default 2)",
    "ramdisk_host_path": "--ramdisk hostpath: node directory holding one tmpfs per job (default /mnt/mtc-ramdisk)",
    "local_dir": "where the RAM disk is mounted in the containers (default /local)",
    "tls_issuer": "cert-manager issuer of the Certificate (default mtc-ca)",
    "tls_issuer_kind": "Issuer (default) or ClusterIssuer",
    "grpc_port": "the replicator's gRPC port (default 7070)",
    "service_account": "Kubernetes ServiceAccount of every Pod (default mtc)",
    "token_secret": "Secret with the bearer token under key 'token' (default mtc-token; create it yourself)",
    "replicator_image": "Dockerfile.replicator image",
    "sidecar_image": "Dockerfile.sidecar image built on the colocated-Python base (workers; multi-controller trainer)",
    "controller_image": "image of the head's controller / the trainer (default: --sidecar-image)",
    "pathways_server_image": "Pathways server image (resource manager and workers), same jax as the sidecar",
    "pathways_proxy_image": "Pathways proxy image, same jax as the sidecar",
    "pathways_scratch": "Pathways --gcs_scratch_location (default gs://<backup bucket>/pathways-scratch)",
    "tpu_accelerator": "GKE TPU accelerator label, e.g. tpu-v6e-slice",
    "tpu_topology": "TPU slice topology, e.g. 2x4 (chips = hosts per slice x chips per host)",
    "tpu_chips_per_host": "google.com/tpu chips per worker host (default 4)",
    "replicator_memory_limit": "memory limit of the replicator container (default 40Gi)",
    "ramdisk_image": "image of the hostpath DaemonSet (needs sh, mount, mountpoint; default busybox)",
}


# Flags whose value is a command line of its own: the word after them is their value even when it starts with
# "--" (argparse takes a lone "--num_elastic_instances=2" for an option and fails: "expected one argument").
VERBATIM_FLAGS = ("--controller-command", "--proxy-args")


def bind_verbatim_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--proxy-args VALUE`` / ``--controller-command VALUE`` written as ``FLAG=VALUE``, which
    argparse reads as the flag's value whatever VALUE looks like (``mtc`` calls this before parsing)."""
    out: list[str] = []
    it = iter(argv)
    for word in it:
        if word == "--":  # the rest is positional: left as it is
            out.append(word)
            out.extend(it)
            break
        if word in VERBATIM_FLAGS:
            value = next(it, None)
            out.append(word if value is None else f"{word}={value}")  # no value: argparse says so
        else:
            out.append(word)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ManifestOptions field, plus ``-o/--output``."""
    parser.add_argument("-o", "--output", help="directory to write the files to (default: one stream on stdout)")
    for name, f in _FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if str(f.type) == "bool":
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=_HELP.get(name))
        elif name in ("controller_command", "proxy_args"):
            parser.add_argument(flag, dest=name, default=None, help=_HELP[name])
        else:
            kind = {"int": int, "float": float, "int | None": int}.get(str(f.type), str)
            parser.add_argument(flag, dest=name, type=kind, default=f.default,
                                choices={"mode": MODES, "front_door": FRONT_DOORS, "restart": RESTARTS,
                                         "tls_identity": TLS_IDENTITIES}.get(name),
                                help=_HELP.get(name))


def options_from_args(args: argparse.Namespace) -> ManifestOptions:
    kwargs = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    import shlex

    for name in ("controller_command", "proxy_args"):
        if isinstance(kwargs.get(name), str):
            kwargs[name] = tuple(shlex.split(kwargs[name]))
    return ManifestOptions(**kwargs).validate()


def run(args: argparse.Namespace) -> int:
    try:
        files = render(options_from_args(args))
    except ValueError as e:
        print(f"mtc manifests: {e}", file=sys.stderr)
        return 2
    if not args.output:
        sys.stdout.write("---\n".join(text for name, text in files.items() if name != "kustomization.yaml"))
        return 0
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
    print(f"wrote {len(files)} files to {out}/: kubectl apply -k {out}", file=sys.stderr)
    return 0
