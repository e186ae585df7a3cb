"""Offline checks of deploy/ and the Dockerfiles against the real `mtc` parser, options and pyproject.toml.

No cluster and no Docker engine: every YAML document is parsed, Kubernetes' ``$(VAR)`` expansion and
the Downward API are emulated per worker Pod (slice, host), shell commands run in a real ``/bin/sh``
with a stub ``mtc`` that records its argv, and that argv goes through the real argparse parser and
``replicator.options.from_args`` (with the Pod's mounts mapped to temporary directories). One test starts
the real daemon with rank 0's rendered flags and asks its health service what a Kubernetes gRPC probe
would ask, without the token, then stops it with SIGTERM as the kubelet does.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
sys.path.insert(0, str(REPO))

from controller_client.cli import build_parser  # noqa: E402
from replicator.options import ReplicatorOptions, from_args  # noqa: E402

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

API_VERSIONS = {
    "JobSet": "jobset.x-k8s.io/v1alpha2",
    "ServiceAccount": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "PriorityClass": "scheduling.k8s.io/v1",
    "Deployment": "apps/v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The Downward API fields the manifests may read, and what the emulation gives them for Pod (s, h).
FIELD_REFS = {
    "metadata.labels['jobset.sigs.k8s.io/jobset-name']": lambda js, s, h: js,
    "metadata.annotations['jobset.sigs.k8s.io/job-index']": lambda js, s, h: str(s),
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": lambda js, s, h: str(h),
}


# --------------------------------------------------------------------------- loading


@dataclasses.dataclass
class Doc:
    path: Path
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.body.get("kind", "")

    @property
    def name(self) -> str:
        return self.body.get("metadata", {}).get("name", "")


def _load_all() -> list[Doc]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        for body in yaml.safe_load_all(path.read_text()):
            if body is not None:
                assert isinstance(body, dict), f"{path}: a YAML document is not a mapping"
                docs.append(Doc(path, body))
    return docs


DOCS = _load_all()


def _of_kind(kind: str) -> list[Doc]:
    return [d for d in DOCS if d.kind == kind]


def _one(kind: str) -> Doc:
    found = _of_kind(kind)
    assert len(found) == 1, f"expected exactly one {kind} in deploy/, found {[str(d.path) for d in found]}"
    return found[0]


JOBSETS = _of_kind("JobSet")
CONFIGMAP = _one("ConfigMap")
SECRET = _one("Secret")


def _replicator_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["replicator"]
    raise AssertionError("mtc has no subcommands")


REPLICATOR_PARSER = _replicator_parser()
OPTION_FIELDS = {f.name for f in dataclasses.fields(ReplicatorOptions)}


# --------------------------------------------------------------------------- Dockerfiles


def _dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in (REPO / name).read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, rest = buf.partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{name}: dangling continuation line"
    return out


def _final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    idx = max(i for i, (k, _) in enumerate(instrs) if k == "FROM")
    return instrs[idx:]


def _global_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    args: dict[str, str] = {}
    for k, v in instrs:
        if k == "FROM":
            break
        if k == "ARG" and "=" in v:
            name, _, default = v.partition("=")
            args[name] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), default)
    return args


def _entrypoint(name: str) -> list[str]:
    found = [v for k, v in _final_stage(_dockerfile(name)) if k == "ENTRYPOINT"]
    assert found, f"{name} has no ENTRYPOINT"
    return json.loads(found[-1])


def _copy_sources(name: str) -> list[str]:
    srcs: list[str] = []
    for k, v in _dockerfile(name):
        if k == "COPY" and not v.startswith("--from"):
            parts = shlex.split(v)
            srcs.extend(p.rstrip("/") for p in parts[:-1])
    return srcs


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.rstrip("/")
        candidates = [pat] + ([pat[3:]] if pat.startswith("**/") else [])
        hit = any(fnmatch.fnmatch(rel, c) or rel.startswith(c + "/") for c in candidates)
        if hit:
            ignored = not neg
    return ignored


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.replicator", "Dockerfile.sidecar"])
def test_dockerfile_copies_exactly_the_installable_project(dockerfile: str) -> None:
    srcs = _copy_sources(dockerfile)
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    assert "pyproject.toml" in srcs
    assert PYPROJECT["project"]["readme"] in srcs, "pyproject's readme must be in the build context"
    assert sorted(s for s in srcs if (REPO / s).is_dir()) == sorted(packages), \
        f"{dockerfile} copies {srcs}, pyproject packages are {packages}"
    patterns = _dockerignore()
    for s in srcs:
        assert (REPO / s).exists(), f"{dockerfile}: COPY {s}: no such path in the repository"
        assert not _dockerignored(s, patterns), f"{dockerfile}: COPY {s} is excluded by .dockerignore"
    text = (REPO / dockerfile).read_text()
    assert "pip wheel" in text and "/wheels/*.whl" in text, "the image installs the project's own wheel"


def test_dockerignore_excludes_local_state() -> None:
    patterns = _dockerignore()
    for path in (".venv", ".git", ".pytest_cache", ".ruff_cache", "tests", "replicator/__pycache__",
                 "multitier_checkpoint.egg-info"):
        assert _dockerignored(path, patterns), f".dockerignore does not exclude {path}"


def test_replicator_image_entrypoint_is_the_mtc_console_script() -> None:
    entry = _entrypoint("Dockerfile.replicator")
    assert entry == ["mtc", "replicator"]
    assert PYPROJECT["project"]["scripts"].get("mtc") == "controller_client.cli:main"
    # The subcommand exists in the real parser (argparse exits on an unknown one).
    assert build_parser().parse_args(["replicator", "--local-dir", "/x"]).func.__name__ == "run_from_args"
    instrs = _dockerfile("Dockerfile.replicator")
    final = _final_stage(instrs)
    assert ("EXPOSE", "7070") in final
    assert ReplicatorOptions(local_dir=Path("/x")).listen.endswith(":7070")
    users = [v for k, v in final if k == "USER"]
    assert users and users[-1].split(":")[0] == "1000", "the replicator image runs as UID 1000, not root"
    base = _global_args(instrs)["PYTHON_IMAGE"]
    assert base == "python:3.11-slim"
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


def test_sidecar_image_takes_jax_and_orbax_pins_from_pyproject() -> None:
    deps = PYPROJECT["project"]["dependencies"]
    pins = dict(d.split("==", 1) for d in deps if "==" in d)
    for name in ("jax", "jaxlib", "orbax-checkpoint"):
        assert name in pins, f"pyproject.toml no longer pins {name}"
    text = (REPO / "Dockerfile.sidecar").read_text()
    # Any version literal in the Dockerfile would be a second source of truth: it must agree.
    for name, version in re.findall(r"\b(jax|jaxlib|orbax-checkpoint)(?:\[[^\]]*\])?==([\w.]+)", text):
        assert version == pins[name], f"Dockerfile.sidecar pins {name}=={version}, pyproject {pins[name]}"
    final = _final_stage(_dockerfile("Dockerfile.sidecar"))
    runs = " ".join(v for k, v in final if k == "RUN")
    assert "import jax, orbax.checkpoint, cloudpickle" in runs, "the build smoke-imports what it pinned"
    users = [v for k, v in final if k == "USER"]
    assert users and users[-1].split(":")[0] == "1000"


def test_wheel_built_from_the_docker_context_has_mtc_and_the_pins(tmp_path: Path) -> None:
    """Do offline what the images' build stage does: pip wheel from exactly the COPYed files."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for src in _copy_sources("Dockerfile.replicator"):
        s = REPO / src
        if s.is_dir():
            shutil.copytree(s, ctx / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(s, ctx / src)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--wheel-dir", str(out), str(ctx)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert re.search(r"^mtc = controller_client\.cli:main$", entry_points, re.M), entry_points
    for pkg in PYPROJECT["tool"]["setuptools"]["packages"]:
        assert f"{pkg}/__init__.py" in names, f"wheel lacks package {pkg}"
    assert "replicator/options.py" in names and "mtc_rpc/peer_pb2.py" in names
    for dep in PYPROJECT["project"]["dependencies"]:
        if "==" in dep:
            assert f"Requires-Dist: {dep}" in meta, f"wheel metadata lacks {dep}"


# --------------------------------------------------------------------------- generic manifest checks


def test_every_document_has_kind_api_version_and_a_valid_name() -> None:
    assert DOCS, "deploy/ holds no YAML"
    for d in DOCS:
        assert d.kind in API_VERSIONS, f"{d.path}: unexpected kind {d.kind!r}"
        assert d.body.get("apiVersion") == API_VERSIONS[d.kind], f"{d.path}: {d.kind} apiVersion"
        if d.kind != "Kustomization":
            assert DNS_1123_LABEL.match(d.name) and len(d.name) <= 63, f"{d.path}: bad name {d.name!r}"
            assert "namespace" not in d.body["metadata"], f"{d.path}: leave the namespace to kubectl/kustomize"
    names = [(d.kind, d.name) for d in DOCS if d.kind not in ("Kustomization", "JobSet")]
    assert len(names) == len(set(names)), "duplicate object names"


def test_kustomizations_reference_existing_files_and_never_the_secret() -> None:
    secret_file = SECRET.path.resolve()
    covered: set[Path] = set()
    for k in _of_kind("Kustomization"):
        for res in k.body.get("resources", []):
            target = (k.path.parent / res).resolve()
            assert target.exists(), f"{k.path}: resource {res} does not exist"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{k.path}: {res} is not a kustomization"
            else:
                covered.add(target)
        assert secret_file not in covered, "a real token must never be applied from the repository"
    for overlay in ("pathways", "orbax"):
        res = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())["resources"]
        assert "../common" in res and "jobset.yaml" in res
    # Every manifest is applied by some kustomization, except the two documented standalone files.
    standalone = {secret_file, (DEPLOY / "hot-swap" / "spare-capacity.yaml").resolve()}
    for d in DOCS:
        if d.kind != "Kustomization":
            assert d.path.resolve() in covered | standalone, f"{d.path} is not in any kustomization"


def test_priority_classes_for_hot_swap() -> None:
    pcs = {d.name: d.body for d in _of_kind("PriorityClass")}
    train, spare = pcs["mtc-training"], pcs["mtc-spare"]
    assert train["value"] > spare["value"]
    assert train.get("preemptionPolicy", "PreemptLowerPriority") == "PreemptLowerPriority"
    assert spare["preemptionPolicy"] == "Never"
    assert not train.get("globalDefault") and not spare.get("globalDefault")
    spare_pods = [t for _, t in _pod_templates() if t["spec"].get("priorityClassName") == "mtc-spare"]
    assert spare_pods, "no spare-capacity placeholder uses mtc-spare"


def test_service_account_is_least_privilege() -> None:
    sa = _one("ServiceAccount")
    assert sa.body.get("automountServiceAccountToken") is False
    assert not [d for d in DOCS if d.kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]


def _pod_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    for js in JOBSETS:
        for rj in js.body["spec"]["replicatedJobs"]:
            yield f"{js.path.relative_to(REPO)}:{rj['name']}", rj["template"]["spec"]["template"]
    for dep in _of_kind("Deployment"):
        yield f"{dep.path.relative_to(REPO)}", dep.body["spec"]["template"]


def _all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


@pytest.mark.parametrize("where,template", list(_pod_templates()), ids=lambda x: x if isinstance(x, str) else "")
def test_pod_template_is_consistent(where: str, template: dict[str, Any]) -> None:
    spec = template["spec"]
    sa_names = {d.name for d in _of_kind("ServiceAccount")}
    pc_names = {d.name for d in _of_kind("PriorityClass")}
    assert spec.get("serviceAccountName") in sa_names, f"{where}: unknown ServiceAccount"
    assert spec.get("automountServiceAccountToken") is False, f"{where}: mounts an API token it never uses"
    assert spec.get("priorityClassName") in pc_names, f"{where}: unknown PriorityClass"
    sc = spec.get("securityContext", {})
    assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    assert len(volumes) == len(spec.get("volumes", [])), f"{where}: duplicate volume names"
    used: set[str] = set()
    names = [c["name"] for c in _all_containers(spec)]
    assert len(names) == len(set(names)), f"{where}: duplicate container names"
    for c in _all_containers(spec):
        assert c.get("image"), f"{where}/{c['name']}: no image"
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), f"{where}/{c['name']}: two mounts at one path"
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{where}/{c['name']}: mounts undefined volume {m['name']}"
            used.add(m["name"])
        csc = c.get("securityContext", {})
        assert csc.get("allowPrivilegeEscalation") is False, f"{where}/{c['name']}: allowPrivilegeEscalation"
        assert csc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{c['name']}: drop ALL"
    for c in spec.get("initContainers", []):
        assert c.get("restartPolicy") in (None, "Always"), f"{where}/{c['name']}: bad restartPolicy"
    assert set(volumes) <= used, f"{where}: volumes never mounted: {set(volumes) - used}"
    for v in volumes.values():
        if "configMap" in v:
            assert v["configMap"]["name"] == CONFIGMAP.name, f"{where}: unknown ConfigMap"
        if "secret" in v:
            assert v["secret"]["secretName"] == SECRET.name, f"{where}: unknown Secret"
            assert v["secret"].get("defaultMode", 0o644) & 0o007 == 0, f"{where}: token readable by others"


# --------------------------------------------------------------------------- JobSet shape and DNS


@dataclasses.dataclass(frozen=True)
class Shape:
    jobset: str
    subdomain: str
    slices: int
    hosts: int

    @property
    def nodes(self) -> int:
        return self.slices * self.hosts

    def dns(self, s: int, h: int, port: int = 7070) -> str:
        return f"{self.jobset}-workers-{s}-{h}.{self.subdomain}:{port}"


def _workers(js: Doc) -> dict[str, Any]:
    (w,) = [rj for rj in js.body["spec"]["replicatedJobs"] if rj["name"] == "workers"]
    return w


def _shape(js: Doc) -> Shape:
    w = _workers(js)
    job = w["template"]["spec"]
    assert job.get("completionMode") == "Indexed", f"{js.path}: workers must be an Indexed Job"
    assert job["parallelism"] == job["completions"], f"{js.path}: every host of a slice runs at once"
    net = js.body["spec"].get("network", {})
    assert net.get("enableDNSHostnames") is True, f"{js.path}: peers are found by Pod hostname"
    assert net.get("publishNotReadyAddresses", True) is True, f"{js.path}: peers must resolve before Ready"
    return Shape(js.name, net.get("subdomain") or js.name, w.get("replicas", 1), job["completions"])


@pytest.mark.parametrize("js", JOBSETS, ids=lambda d: d.path.parent.name)
def test_jobset_structure(js: Doc) -> None:
    shape = _shape(js)
    assert DNS_1123_LABEL.match(js.name)
    assert len(f"{js.name}-workers-{shape.slices - 1}-{shape.hosts - 1}") <= 63, "Pod hostname too long"
    rjs = [rj["name"] for rj in js.body["spec"]["replicatedJobs"]]
    if js.path.parent.name == "pathways":
        assert rjs == ["head", "workers"]
        head = js.body["spec"]["replicatedJobs"][0]
        assert head["replicas"] == 1 and head["template"]["spec"]["completions"] == 1
        # Workers serve forever; without this the JobSet never completes.
        assert js.body["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["head"]}
    else:
        assert rjs == ["workers"]


def test_configmap_peers_match_every_jobset_dns() -> None:
    sys.path.insert(0, str(DEPLOY))
    try:
        import peers as peers_tool
    finally:
        sys.path.remove(str(DEPLOY))
    cfg = yaml.safe_load(CONFIGMAP.body["data"]["config.yaml"])
    for key in cfg:
        assert key.replace("-", "_") in OPTION_FIELDS, f"config.yaml key {key!r} is not an mtc replicator option"
    for js in JOBSETS:
        shape = _shape(js)
        expected = {s * shape.hosts + h: shape.dns(s, h) for s in range(shape.slices) for h in range(shape.hosts)}
        assert cfg["peers"] == expected, f"{js.path}: ConfigMap peers do not match the JobSet's DNS names"
        assert peers_tool.peer_addresses(shape.jobset, shape.slices, shape.hosts, subdomain=shape.subdomain) \
            == expected
        # The block in the ConfigMap is exactly what the documented generator prints.
        assert peers_tool.render_yaml(expected) in (DEPLOY / "common" / "configmap.yaml").read_text()
    with pytest.raises(ValueError):
        peers_tool.peer_addresses("Bad_Name", 1, 1)
    with pytest.raises(ValueError):
        peers_tool.peer_addresses("x" * 60, 2, 2)
    with pytest.raises(ValueError):
        peers_tool.peer_addresses("ok", 0, 2)


# --------------------------------------------------------------------------- per-Pod rendering


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ escapes, undefined or malformed references stay as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$" or i + 1 >= len(text):
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2:close]
            out.append(env[name] if name in env else f"$({name})")
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def pod_env(container: dict[str, Any], shape: Shape, s: int, h: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in FIELD_REFS, f"unexpected Downward API field {field}"
            env[e["name"]] = FIELD_REFS[field](shape.jobset, s, h)
        else:
            env[e["name"]] = k8s_expand(str(e["value"]), env)  # only earlier variables are visible
    return env


@dataclasses.dataclass
class Rendered:
    argv: list[str]  # after `mtc`
    env: dict[str, str]
    mounts: dict[str, Path]  # container mountPath -> temporary directory holding the volume's files


def _materialize(spec: dict[str, Any], container: dict[str, Any], root: Path) -> dict[str, Path]:
    volumes = {v["name"]: v for v in spec["volumes"]}
    cm_data = CONFIGMAP.body["data"]
    secret_data = SECRET.body["stringData"]
    shared = root / "volumes"
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        d = shared / m["name"]
        if not d.exists():
            d.mkdir(parents=True)
            if "configMap" in vol:
                for k, v in cm_data.items():
                    (d / k).write_text(v)
            elif "secret" in vol:
                for k, v in secret_data.items():
                    (d / k).write_text(v)
        mounts[m["mountPath"]] = d
    return mounts


def _remap(value: str, mounts: dict[str, Path]) -> str:
    for mount, real in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if value == mount or value.startswith(mount + "/"):
            return str(real) + value[len(mount):]
    return value


def render(spec: dict[str, Any], container: dict[str, Any], shape: Shape, s: int, h: int,
           root: Path, stub_dir: Path) -> Rendered | None:
    """The argv `mtc` would receive in Pod (s, h), or None when the container does not run `mtc`."""
    env = pod_env(container, shape, s, h)
    command = [k8s_expand(str(x), env) for x in container.get("command", [])]
    args = [k8s_expand(str(x), env) for x in container.get("args", [])]
    if not command:
        image = container["image"]
        if "mtc-replicator" not in image:
            return None
        command = _entrypoint("Dockerfile.replicator")
    mounts = _materialize(spec, container, root)
    if command[0] == "mtc":
        argv = command[1:] + args
    elif command[0] in ("/bin/sh", "sh") and "mtc" in " ".join(command):
        proc = subprocess.run(command + args, env={**env, "PATH": f"{stub_dir}:/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        argv = json.loads(proc.stdout)
    else:
        return None
    for a in argv:
        assert "$(" not in a, f"unexpanded Kubernetes reference in {a!r} (undefined variable?)"
    return Rendered(argv, env, mounts)


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stub")
    stub = d / "mtc"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    return d


def _pods(js: Doc) -> Iterator[tuple[int, int]]:
    shape = _shape(js)
    for s in range(shape.slices):
        for h in range(shape.hosts):
            yield s, h


def _worker_spec(js: Doc) -> dict[str, Any]:
    return _workers(js)["template"]["spec"]["template"]["spec"]


def _replicator_containers(js: Doc, root: Path, stub_dir: Path) -> list[tuple[dict[str, Any], Rendered]]:
    spec = _worker_spec(js)
    shape = _shape(js)
    found = []
    for c in _all_containers(spec):
        r = render(spec, c, shape, 0, 0, root, stub_dir)
        if r is not None and r.argv[:1] == ["replicator"]:
            found.append((c, r))
    return found


def _options(r: Rendered) -> ReplicatorOptions:
    """Parse like `mtc` does, with the container's paths mapped to the materialized volumes."""
    argv = [_remap(a, r.mounts) for a in r.argv]
    ns = build_parser().parse_args(argv)
    environ = {k: _remap(v, r.mounts) for k, v in r.env.items() if k.startswith("MTC_")}
    return from_args(ns, environ=environ)


@pytest.mark.parametrize("js", JOBSETS, ids=lambda d: d.path.parent.name)
def test_replicator_flags_are_accepted_by_mtc_replicator(js: Doc, tmp_path: Path, stub_dir: Path) -> None:
    known = set(REPLICATOR_PARSER._option_string_actions)
    reps = _replicator_containers(js, tmp_path, stub_dir)
    assert len(reps) == 1, f"{js.path}: expected one replicator container per worker Pod, got {len(reps)}"
    container, rendered = reps[0]
    assert container in _worker_spec(js).get("initContainers", []) and container["restartPolicy"] == "Always", \
        "the replicator is a native sidecar (starts first, stops last, does not block Job completion)"
    for tok in rendered.argv[1:]:
        if tok.startswith("--"):
            flag = tok.split("=", 1)[0]
            assert flag in known, f"{js.path}: mtc replicator has no flag {flag} (see `mtc replicator --help`)"
    for name in rendered.env:
        if name.startswith("MTC_"):
            assert name[4:].lower() in OPTION_FIELDS, f"{js.path}: {name} is not an MTC_<OPTION> variable"
    try:
        build_parser().parse_args(rendered.argv)
    except SystemExit as e:  # argparse exits on unknown flags or bad syntax
        pytest.fail(f"{js.path}: `mtc {' '.join(rendered.argv)}` is rejected by argparse ({e})")


@pytest.mark.parametrize("js", JOBSETS, ids=lambda d: d.path.parent.name)
def test_every_worker_pod_gets_valid_options_rank_and_dns(js: Doc, tmp_path: Path, stub_dir: Path) -> None:
    shape = _shape(js)
    spec = _worker_spec(js)
    (container, _) = _replicator_containers(js, tmp_path / "probe", stub_dir)[0]
    orbax = js.path.parent.name == "orbax"
    ranks = []
    for s, h in _pods(js):
        r = render(spec, container, shape, s, h, tmp_path / f"pod-{s}-{h}", stub_dir)
        assert r is not None
        opts = _options(r)  # the real validation `mtc replicator` does at start-up
        assert opts.local_dir == r.mounts["/local"], "the replicator's --local-dir is the RAM-disk mount"
        assert opts.advertise == shape.dns(s, h), f"Pod ({s},{h}) advertises {opts.advertise}"
        assert opts.token_file and opts.token() == SECRET.body["stringData"]["token"]
        for rank in range(shape.nodes):
            assert opts.peer_address(rank) == shape.dns(rank // shape.hosts, rank % shape.hosts)
        if orbax:
            assert opts.orbax_mode, "Orbax mode: no --rank/--nodes, topology from replicator.yaml"
            assert not opts.jax_coordinator
        else:
            assert not opts.orbax_mode
            assert opts.rank == s * shape.hosts + h, f"Pod ({s},{h}) got rank {opts.rank}"
            assert opts.nodes == shape.nodes
            assert opts.data_parallelism == shape.slices
            assert opts.job == shape.jobset
            assert opts.coordinator_address() == shape.dns(0, 0)
            ranks.append(opts.rank)
        # Replicator.stop(): heartbeat join (5 s grace + one RPC deadline), then the servers' 5 s grace.
        stop_budget = 5 + opts.rpc_timeout_seconds + 5
        assert spec.get("terminationGracePeriodSeconds", 30) >= 2 * stop_budget, \
            f"terminationGracePeriodSeconds leaves no room for a clean replicator shutdown ({stop_budget} s)"
        listen_port = int(opts.listen.rpartition(":")[2])
        ports = [p["containerPort"] for p in container.get("ports", [])]
        assert listen_port in ports
        probes = [container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        assert container.get("readinessProbe"), "readiness probe"
        for p in filter(None, probes):
            assert p["grpc"]["port"] == listen_port, "gRPC probes go to the port the daemon serves health on"
        if not orbax:
            assert all(probes), "native mode: startup, readiness and liveness probes"
    if not orbax:
        assert sorted(ranks) == list(range(shape.nodes)), "ranks are a permutation of 0..nodes-1"


@pytest.mark.parametrize("js", JOBSETS, ids=lambda d: d.path.parent.name)
def test_ramdisk_is_shared_at_the_same_path(js: Doc, tmp_path: Path, stub_dir: Path) -> None:
    spec = _worker_spec(js)
    volumes = {v["name"]: v for v in spec["volumes"]}
    (container, rendered) = _replicator_containers(js, tmp_path, stub_dir)[0]
    local = rendered.argv[rendered.argv.index("--local-dir") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == local]
    vol = volumes[mount["name"]]
    if "emptyDir" in vol:
        assert vol["emptyDir"].get("medium") == "Memory", "the RAM disk is tmpfs"
        assert vol["emptyDir"].get("sizeLimit"), "an unbounded tmpfs can take the node's memory"
    else:
        assert "hostPath" in vol, "RAM disk: emptyDir medium Memory or a hostPath tmpfs"
    workload = [c for c in spec["containers"]]
    assert workload, "no workload container"
    for c in workload:
        mine = [m for m in c.get("volumeMounts", []) if m["name"] == mount["name"]]
        assert [m["mountPath"] for m in mine] == [local], f"{c['name']} must mount the RAM disk at {local}"
        assert not mine[0].get("readOnly"), f"{c['name']} writes steps to the RAM disk"
    sc = spec["securityContext"]
    assert sc.get("runAsUser") == 1000 and sc.get("runAsGroup") == 1000, \
        "one UID for every container: the control socket is 0600"


@pytest.mark.parametrize("js", JOBSETS, ids=lambda d: d.path.parent.name)
def test_shape_variables_agree_with_the_jobset(js: Doc) -> None:
    shape = _shape(js)
    spec = _worker_spec(js)
    for c in _all_containers(spec):
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if "HOSTS_PER_SLICE" in env:
            assert int(env["HOSTS_PER_SLICE"]) == shape.hosts, f"{c['name']}: HOSTS_PER_SLICE"
        if "SLICES" in env:
            assert int(env["SLICES"]) == shape.slices, f"{c['name']}: SLICES"
        if "NODES" in env:
            assert int(env["NODES"]) == shape.nodes, f"{c['name']}: NODES"


def test_pathways_head_reaches_the_coordinator_with_the_token() -> None:
    (js,) = [j for j in JOBSETS if j.path.parent.name == "pathways"]
    shape = _shape(js)
    head = js.body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (controller,) = head["containers"]
    env = pod_env(controller, shape, 0, 0)
    assert env["MTC_COORDINATOR"] == shape.dns(0, 0), "coordinator = rank 0's replicator (coordinator-rank 0)"
    assert env["MTC_LOCAL_DIRECTORY"] == "/local"
    token = env["MTC_TOKEN_FILE"]
    secret_vols = {v["name"] for v in head["volumes"] if "secret" in v}
    mounts = [m for m in controller["volumeMounts"] if m["name"] in secret_vols]
    assert any(token == m["mountPath"] + "/token" for m in mounts), "MTC_TOKEN_FILE is inside the Secret mount"
    assert "token" in SECRET.body["stringData"]
    assert "sidecar" in controller["image"]


def test_orbax_init_container_writes_jax_init_info(tmp_path: Path) -> None:
    """Run the init container's real command for every Pod; Orbax reads the result as process id + address."""
    (js,) = [j for j in JOBSETS if j.path.parent.name == "orbax"]
    shape = _shape(js)
    spec = _worker_spec(js)
    inits = [c["name"] for c in spec["initContainers"]]
    assert inits.index("jax-init-info") < inits.index("replicator")
    (init,) = [c for c in spec["initContainers"] if c["name"] == "jax-init-info"]
    assert init.get("restartPolicy") is None, "a run-to-completion init container, before the trainer"
    assert "mtc-replicator" in init["image"]
    seen = set()
    for s, h in _pods(js):
        env = pod_env(init, shape, s, h)
        local = tmp_path / f"local-{s}-{h}"
        local.mkdir()
        assert env["LOCAL_DIR"] == "/local"
        env["LOCAL_DIR"] = str(local)
        cmd = [k8s_expand(x, env) for x in init["command"]]
        assert cmd[0] == "python"
        proc = subprocess.run([sys.executable] + cmd[1:], env={**env, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        pid, coord = (local / "jax-init-info.txt").read_text().split("\n")[:2]
        assert int(pid) == s * shape.hosts + h
        assert coord == shape.dns(0, 0, port=8476)
        seen.add(int(pid))
    assert seen == set(range(shape.nodes))
    (train,) = spec["containers"]
    assert 8476 in [p["containerPort"] for p in train.get("ports", [])], "process 0 serves the JAX coordinator"


# --------------------------------------------------------------------------- the real daemon


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendered_rank0_daemon_answers_the_kubernetes_probe_and_stops_on_sigterm(
        tmp_path: Path, stub_dir: Path) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    (js,) = [j for j in JOBSETS if j.path.parent.name == "pathways"]
    (container, r) = _replicator_containers(js, tmp_path, stub_dir)[0]
    port = _free_port()
    # Loopback instead of the Pod network; the bucket of the example ConfigMap does not exist here.
    argv = [_remap(a, r.mounts) for a in r.argv] + [
        "--listen", f"127.0.0.1:{port}", "--advertise", f"127.0.0.1:{port}"]
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
        sock = r.mounts["/local"] / "replicator.sock"
        assert sock.exists(), "the control socket lives on the shared RAM disk"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            # What `grpc: {port: 7070}` sends: service "", no metadata (the token is not available to it).
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=45)
        took = time.monotonic() - t0
        assert rc == 0, proc.stderr.read()[-2000:]
        grace = _worker_spec(js)["terminationGracePeriodSeconds"]
        assert took < grace, f"SIGTERM shutdown took {took:.1f} s, grace period is {grace} s"
        assert not sock.exists(), "the daemon removes its socket on shutdown"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
