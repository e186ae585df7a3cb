"""Our Pathways JobSet against the one pathwaysutils 0.1.13 builds for the same job, field by field.

pathwaysutils' ``PathwaysJobSet`` + ``add_user_workload`` (the controller) + ``add_colocated_python`` (the
sidecar) is Google's own description of a Pathways job with colocated Python. Both are flattened into paths
(named list items by name, ports by number, flags by name; google_parity.py) and every path that differs
must be an intended difference listed below with its reason; a listed difference that no longer occurs
fails too, so the list stays exact. docs/deploy.md's compatibility table is this list in prose.
pathwaysutils only builds dicts here: no cluster, no network (``to_dict`` never calls the API server).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import google_parity as gp  # noqa: E402

from controller_client import manifests as mf  # noqa: E402

pj = pytest.importorskip("pathwaysutils.experimental.gke.jobset", reason="needs pathwaysutils[gke]: the kubernetes "
                        "client (a dev dependency)", exc_type=ImportError)

RJ = "spec.replicatedJobs"
HEAD = f"{RJ}[head].template.spec.template.spec"
WORKER = f"{RJ}[workers].template.spec.template.spec"
OURS = ("mtc-replicator", "ramdisk-owner", "preemption-notice")

# pattern -> why we differ. Patterns are google_parity.flatten's paths with * for any text.
INTENDED = {
    "metadata.namespace": "we render no namespace: `kubectl apply -n` / kustomize choose it",
    "metadata.labels.*": "our part-of/job labels (NetworkPolicy and monitoring select on them)",
    "spec.coordinator.replicatedJob": "our replicated Jobs are named head/workers (hostnames <job>-workers-<s>-<h> "
                                      "in the replicators' peer template); pathwaysutils names them "
                                      "pathways-head/pathways-worker",
    "spec.successPolicy.targetReplicatedJobs": "same rule (the job is done when the head is), our Job name",
    "spec.network.subdomain": "the headless Service we render (peers resolve each other before they are Ready)",
    "spec.failurePolicy.maxRestarts": "a bounded number of JobSet restarts (pathwaysutils: unset = 0)",
    "spec.failurePolicy.rules*": "hot-swap: which failure restarts what (docs/deploy.md, --worker-failure-policy)",
    f"{RJ}[workers].template.spec.backoffLimit": "restart-jobset: the first failed worker fails its Job so the "
                                                 "JobSet restarts onto any free node pool (pathwaysutils: "
                                                 "hosts x 1e6 Pod retries in place, as our restart-slice)",
    f"{RJ}[*].template.spec.podFailurePolicy.rules": "a preemption / eviction (DisruptionTarget) or a trainer that "
                                                     "saved after a notice (exit 75) restarts the JobSet without "
                                                     "counting; a terminating Pod fails nothing before its save "
                                                     "and flush (docs/deploy.md, failure handling)",
    f"{WORKER}.restartPolicy": "Never: a podFailurePolicy requires it",
    f"{HEAD}.terminationGracePeriodSeconds": "the trainer's save after a notice on the head",
    f"{WORKER}.volumes[kube-api]*": "the preStop hook's token (get Pods and Jobs): a JobSet restart is no notice",
    f"{RJ}[*].template.spec.template.spec.serviceAccountName": "a ServiceAccount allowed to read Pods and Jobs "
                                                               "only (the preStop hook; ours)",
    f"{RJ}[*].template.spec.template.spec.automountServiceAccountToken": "no Kubernetes API token in any Pod",
    f"{RJ}[*].template.spec.template.spec.securityContext.*": "fsGroup 1000 (shared RAM disk) and seccomp "
                                                              "RuntimeDefault",
    f"{RJ}[*].template.spec.template.spec.volumes[mtc-*": "our config, token and TLS volumes",
    f"{WORKER}.volumes[tmp]*": "the replicator's own scratch /tmp (read-only root filesystem)",
    f"{WORKER}.volumes[ramdisk]*": "the checkpoint RAM disk (the seed: GKE's CSI volume; or our hostPath tmpfs)",
    f"{HEAD}.volumes[mtc-*": "the controller's token / TLS files",
    f"{HEAD}.containers[controller].env*": "what our CheckpointManager (or Orbax) needs: coordinator, token, "
                                           "local directory, DNS resolver",
    f"{HEAD}.containers[controller].volumeMounts*": "the token / TLS files",
    f"{HEAD}.containers[controller].securityContext*": "non-root UID 1000, no privilege escalation, no capabilities",
    f"{HEAD}.initContainers[pathways-proxy].args[--sidecar_name]": "the seed's proxy flag: colocated Python "
                                                                  "runs in the workers' external sidecar",
    f"{WORKER}.containers[pathways-worker].lifecycle.preStop*": "preemption: stay up through the save window "
                                                                "(docs/deploy.md, preemption timeline)",
    f"{WORKER}.containers[pathways-worker].volumeMounts[ramdisk]*": "the seed mounts the RAM disk in "
                                                                    "pathways-worker too",
    f"{WORKER}.initContainers[colocated-python-sidecar].volumeMounts[ramdisk]*": "the sidecar writes the "
                                                                                "shards there",
    f"{WORKER}.initContainers[colocated-python-sidecar].resources*": "a request, so the scheduler counts the "
                                                                     "sidecar holding a host's shards during a save",
    f"{WORKER}.initContainers[colocated-python-sidecar].securityContext*": "non-root UID 1000 (RAM disk owner)",
    **{f"{WORKER}.initContainers[{c}]*": "ours: the replicator, the RAM disk's owner" for c in OURS[:2]},
    f"{WORKER}.containers[preemption-notice]*": "ours: gives the replicator the notice at the start of the "
                                                "grace period (its preStop hook)",
}


def _google(opts: mf.ManifestOptions) -> dict:
    tpu_type = {"tpu-v6e-slice": "v6e", "tpu-v5p-slice": "v5p", "tpu-v5-lite-podslice": "v5e",
                "tpu-v4-podslice": "v4"}[opts.tpu_accelerator]
    js = pj.PathwaysJobSet(name=opts.job, namespace="default", pathways_dir=opts.scratch(), tpu_type=tpu_type,
                           topology=opts.tpu_topology, num_slices=opts.slices, elastic_slices=opts.elastic_slices,
                           termination_grace_period_seconds=opts.termination_grace_seconds,
                           pathways_rm_and_worker_image=opts.pathways_server_image,
                           pathways_proxy_image=opts.pathways_proxy_image)
    js.add_user_workload(image=opts.controller_image or opts.sidecar_image, command=list(opts.controller_command),
                         name="controller")
    js.add_colocated_python(image=opts.sidecar_image, shm_mount_path="/tmp/sidecar")
    return js.to_dict()


BASE = mf.ManifestOptions(job="demo", backup_url="gs://b/ckpt")
CASES = {
    "native": BASE,
    "native-elastic": dataclasses.replace(BASE, elastic_slices=2),
    "orbax-tls-priority": dataclasses.replace(BASE, front_door="orbax", tls=True, priority_class="high-prior-job"),
    "native-3x4": dataclasses.replace(BASE, slices=3, hosts_per_slice=4, tpu_topology="4x4"),
}
EXTRA = {
    "native-elastic": {f"{RJ}[workers].template.spec.backoffLimitPerIndex": (
        "restart-slice (elastic): 1e6 retries per host, not hosts x 1e6 per Job, so the Job controller's "
        "re-creation backoff counts per host (a slice notice waits 10 s, not 10 s x 2^(hosts-1); docs/deploy.md)")},
    "orbax-tls-priority": {f"{RJ}[*].template.spec.template.spec.priorityClassName": "gcluster's --priority: on "
                                                                                     "head and workers"},
}


def _match(path: str, pattern: str) -> bool:
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), path) is not None


def unexplained(google: dict, ours: dict, intended: dict[str, str]) -> tuple[dict, set[str]]:
    d = gp.diff(google, ours)
    bad = {k: v for k, v in d.items() if not any(_match(k, pat) for pat in intended)}
    unused = {pat for pat in intended if not any(_match(k, pat) for k in d)}
    return bad, unused


@pytest.mark.parametrize("case", CASES)
def test_our_pathways_jobset_matches_pathwaysutils_except_listed_differences(case: str) -> None:
    opts = CASES[case]
    bad, unused = unexplained(_google(opts), mf.objects(opts)["jobset.yaml"], {**INTENDED, **EXTRA.get(case, {})})
    assert not bad, "differences from pathwaysutils' JobSet with no reason listed:\n" + "\n".join(
        f"  {k}: pathwaysutils {g!r}, ours {o!r}" for k, (g, o) in bad.items())
    if case == "native":
        assert not unused, f"listed differences that no longer occur: {sorted(unused)}"


def test_the_comparison_can_fail() -> None:
    opts = CASES["native"]
    ours = mf.objects(opts)["jobset.yaml"]
    worker = ours["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
    sidecar = next(c for c in worker["initContainers"] if c["name"] == "colocated-python-sidecar")
    sidecar["env"][0]["value"] = "0.0.0.0:50052"   # the port pathwaysutils' sidecar serves on
    worker["containers"][0]["args"].append("--num_elastic_instances=2")
    bad, _ = unexplained(_google(opts), ours, INTENDED)
    assert set(bad) == {f"{WORKER}.initContainers[colocated-python-sidecar].env[GRPC_SERVER_ADDRESS].value",
                        f"{WORKER}.containers[pathways-worker].args[--num_elastic_instances]"}


def test_elastic_flag_is_the_one_pathwaysutils_passes() -> None:
    opts = CASES["native-elastic"]
    head = mf.objects(opts)["jobset.yaml"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (proxy,) = [c for c in head["initContainers"] if c["name"] == "pathways-proxy"]
    assert "--num_elastic_slices=2" in proxy["args"]
    assert not [a for a in proxy["args"] if a.startswith("--num_elastic_instances")]
