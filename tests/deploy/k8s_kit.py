"""Offline Kubernetes emulation for the deploy tests: schema validation, Downward API and ``$(VAR)``
expansion per Pod, a small ``kustomize build`` (resources, components, JSON 6902 patches), and NetworkPolicy
ingress evaluation. No cluster, no Docker engine.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
KUBERNETES_VERSION = "1.37.0"
JOBSET_SCHEMA = HERE / "data" / "jobset-v1alpha2.schema.json"


# --------------------------------------------------------------------------- schema validation


@functools.cache
def _jobset_schema() -> dict[str, Any]:
    schema = json.loads(JOBSET_SCHEMA.read_text())
    schema.pop("$comment", None)
    return schema


@functools.cache
def _jobset_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_jobset_schema())


def validate(doc: dict[str, Any]) -> None:
    """Raise AssertionError when ``doc`` does not match its schema.

    Built-in kinds: kubernetes-validate (strict: unknown fields rejected) at KUBERNETES_VERSION. JobSet: the
    JobSet CRD's OpenAPI schema (vendored), and every Pod template in it as a strict built-in Pod and Job.
    cert-manager objects: no schema here; structural checks only.
    """
    kind = doc.get("kind")
    where = f"{kind}/{doc.get('metadata', {}).get('name')}"
    if kind == "JobSet":
        errors = sorted(_jobset_validator().iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{where}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
        violated = cel_violations(doc)
        assert not violated, f"{where}: CEL: " + "; ".join(violated)
        too_big = int32_violations(doc)
        assert not too_big, f"{where}: int32: " + "; ".join(too_big)
        for rj in doc["spec"]["replicatedJobs"]:
            job_spec = rj["template"]["spec"]
            _k8s({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, "spec": job_spec},
                 f"{where}/{rj['name']} (as a Job)")
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": rj["name"]},
                   "spec": job_spec["template"]["spec"]}
            _k8s(pod, f"{where}/{rj['name']} (as a Pod)")
        return
    if doc.get("apiVersion", "").startswith("cert-manager.io/"):
        spec = doc["spec"]
        assert spec["secretName"] and spec["issuerRef"]["name"], f"{where}: secretName and issuerRef"
        # A client-only identity (the controller's mtc://<job>/admin) needs client auth; a serving one both.
        client_only = bool(spec.get("uris")) and all(u.endswith("/admin") for u in spec["uris"])
        need = {"client auth"} if client_only else {"server auth", "client auth"}
        assert set(spec["usages"]) >= need, f"{where}: mutual TLS needs usages {sorted(need)}"
        assert spec.get("dnsNames") or spec.get("uris") or spec.get("commonName"), f"{where}: names no one"
        return
    _k8s(doc, where)


INT32 = (-(2**31), 2**31 - 1)


def int32_violations(doc: dict[str, Any]) -> list[str]:
    """Integers of a JobSet outside the range of their schema's ``format: int32`` (the API server refuses
    them; jsonschema does not check formats)."""
    out: list[str] = []

    def walk(schema: dict[str, Any], value: Any, path: list[str | int]) -> None:
        if schema.get("format") == "int32" and isinstance(value, int) and not INT32[0] <= value <= INT32[1]:
            out.append(f"{'/'.join(map(str, path))}: {value} is not an int32")
        if isinstance(value, dict):
            props = schema.get("properties", {})
            extra = schema.get("additionalProperties")
            for k, v in value.items():
                sub = props.get(k, extra if isinstance(extra, dict) else None)
                if sub is not None:
                    walk(sub, v, [*path, k])
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                walk(schema["items"], v, [*path, i])

    walk(_jobset_schema(), doc, [])
    return out


def cel_violations(doc: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """The JobSet CRD's ``x-kubernetes-validations`` (CEL) that ``doc`` breaks, evaluated with PyPI cel-python.

    ``old``: the stored object of an update (transition rules, those naming ``oldSelf``, are evaluated only
    then, as the API server does); None = a create.
    """
    schema = json.loads(JOBSET_SCHEMA.read_text())
    out: list[str] = []
    _cel_walk(schema, doc, old, [], out)
    return out


@functools.cache
def _cel_program(rule: str) -> Any:
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel_walk(schema: dict[str, Any], value: Any, old: Any, path: list[str | int], out: list[str]) -> None:
    import celpy

    for v in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in v["rule"]
        if transition and old is None:
            continue
        act = {"self": celpy.json_to_cel(value)}
        if transition:
            act["oldSelf"] = celpy.json_to_cel(old)
        result = _cel_program(v["rule"]).evaluate(act)
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            out.append(f"{'.'.join(map(str, path)) or '<root>'}: {v.get('message', v['rule'])}")
    if isinstance(value, dict):
        for k, sub in value.items():
            child = schema.get("properties", {}).get(k) or (schema.get("additionalProperties")
                                                            if isinstance(schema.get("additionalProperties"), dict) else None)
            if child is not None:
                # A field absent from the stored object: its transition rules are skipped (old None).
                _cel_walk(child, sub, old.get(k) if isinstance(old, dict) else None, path + [k], out)
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            o = old[i] if isinstance(old, list) and i < len(old) else None
            _cel_walk(schema["items"], sub, o, path + [i], out)


def _k8s(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{where}: {e.message} at {list(e.path)}") from None


# --------------------------------------------------------------------------- kustomize


def _unpointer(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def apply_json_patch(doc: Any, ops: Iterable[dict[str, Any]]) -> Any:
    """JSON 6902 add / replace / remove (what deploy/regen.py emits)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [_unpointer(p) for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        elif op["op"] in ("add", "replace"):
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif op["op"] == "add":
                    parent.insert(int(last), value)
                else:
                    parent[int(last)] = value
            else:
                if op["op"] == "replace":
                    assert last in parent, f"replace of a missing key {op['path']}"
                parent[last] = value
        else:
            raise AssertionError(f"unsupported JSON patch op {op['op']}")
    return doc


def _matches(target: dict[str, Any], doc: dict[str, Any]) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    return (target.get("kind", doc["kind"]) == doc["kind"]
            and target.get("name", doc["metadata"]["name"]) == doc["metadata"]["name"]
            and target.get("group", group) == group and target.get("version", version) == version)


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """The subset of ``kustomize build`` deploy/ uses: resources, components, patches with targets."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "components", "patches"}
    assert set(kust) <= known, f"{directory}: kustomization fields beyond this emulation: {set(kust) - known}"
    docs: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            docs += kustomize_build(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for comp in kust.get("components", []):
        path = (directory / comp).resolve()
        ck = yaml.safe_load((path / "kustomization.yaml").read_text())
        assert ck["kind"] == "Component", f"{path} is not a Component"
        docs += [d for r in ck.get("resources", []) for d in yaml.safe_load_all((path / r).read_text()) if d]
        docs = _patch(docs, ck.get("patches", []))
    return _patch(docs, kust.get("patches", []))


def _patch(docs: list[dict[str, Any]], patches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for p in patches:
        ops = yaml.safe_load(p["patch"])
        hits = [i for i, d in enumerate(docs) if _matches(p["target"], d)]
        assert hits, f"patch target {p['target']} matches nothing"
        for i in hits:
            docs[i] = apply_json_patch(docs[i], ops)
    return docs


def real_kustomize() -> list[str] | None:
    """``kustomize build`` or ``kubectl kustomize`` when installed (no registry package ships one)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def run_real_kustomize(cmd: list[str], directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(cmd + [str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_key(docs: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        assert key not in out, f"duplicate {key}"
        out[key] = d
    return out


# --------------------------------------------------------------------------- Pods


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


def pod_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment in one Pod; ``fields`` = Downward API fieldPath -> value."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in fields, f"unexpected Downward API field {field}"
            env[e["name"]] = fields[field]
        else:
            env[e["name"]] = k8s_expand(str(e["value"]), env)  # only earlier variables are visible
    return env


def jobset_pod_fields(jobset: str, replicated_job: str, job_index: int, pod_index: int) -> dict[str, str]:
    """What JobSet and the Job controller put on Pod (job_index, pod_index) for the Downward API."""
    return {
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']": jobset,
        "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']": replicated_job,
        "metadata.annotations['jobset.sigs.k8s.io/job-index']": str(job_index),
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(pod_index),
    }


def jobset_pod_labels(jobset: str, replicated_job: str) -> dict[str, str]:
    return {"jobset.sigs.k8s.io/jobset-name": jobset, "jobset.sigs.k8s.io/replicatedjob-name": replicated_job}


# --------------------------------------------------------------------------- NetworkPolicy


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "matchExpressions are beyond this emulation"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def ingress_allowed(policies: list[dict[str, Any]], dst_labels: dict[str, str], src_labels: dict[str, str] | None,
                    port: int, same_namespace: bool = True, src_namespace_labels: dict[str, str] | None = None) -> bool:
    """Whether TCP ``port`` on a Pod with ``dst_labels`` accepts a connection from a Pod with ``src_labels``
    (None = from outside the cluster), under NetworkPolicy semantics (isolated once any policy selects it).
    A source in another namespace (``same_namespace=False``) is matched by ``namespaceSelector`` peers
    against ``src_namespace_labels``."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dst_labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(pp.get("protocol", "TCP") == "TCP" and pp.get("port") == port for pp in ports):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                assert set(peer) <= {"podSelector", "namespaceSelector"}, "only pod/namespace selectors are emulated"
                if src_labels is None:
                    continue
                if "namespaceSelector" in peer:
                    ns_ok = not same_namespace and _selects(peer["namespaceSelector"], src_namespace_labels or {})
                else:
                    ns_ok = same_namespace
                if ns_ok and _selects(peer.get("podSelector", {}), src_labels):
                    return True
    return False
