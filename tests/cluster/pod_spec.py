"""From a Pod object to what runs: images mapped to host commands, environment (with the Downward API and
``$(VAR)`` expansion), volumes made on the node, and each container's launch spec for ``container_init.py``.

Containers run as root: ``runAsUser``/``runAsGroup``/``fsGroup`` are not honoured, because a container's view
is the host's own filesystem (the repository's venv, the kit's volume directories), owned by root, and the kit
makes no user namespace to map ids; the manifests' non-root users are checked by the image tests, not here.
ConfigMap, Secret, projected and downwardAPI volumes are written once, when the Pod starts (no refresh).
"""

from __future__ import annotations

import base64
import fnmatch
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.kube import Kube, KubeError

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
IN_PLACE_RESTART_AGENT = REPO / "build" / "cluster" / "bin" / "in-place-restart-agent"
DEFAULT_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
MTC_CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
CLUSTER_DOMAIN = "cluster.local"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class PodSetupError(RuntimeError):
    """What keeps a Pod from starting for now (a missing ConfigMap, an unknown image, ...): retried."""


@dataclass(frozen=True)
class ImageRule:
    """What a container image is on this node: the host's filesystem plus ``binds`` (container path -> host
    path), ``path`` first on PATH, ``env``, and the image's entrypoint/arguments when the Pod sets none."""

    binds: Mapping[str, str] = field(default_factory=dict)
    path: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    command: Sequence[str] = ()
    args: Sequence[str] = ()


def default_images(app_dir: Path | None = None) -> dict[str, ImageRule]:
    """``*/mtc-replicator:*`` and ``*/mtc-sidecar:*``: the host with the repository's venv first on PATH,
    ``/app`` bound to ``app_dir`` (the training script) when given. ``*/jobset-in-place-restart-agent:*``: JobSet's
    agent as ``make cluster-bin`` builds it from the pinned JobSet module (its image's entrypoint)."""
    binds = {"/app": str(app_dir)} if app_dir is not None else {}
    rule = ImageRule(binds=binds, path=[str(VENV_BIN)])
    return {"*/mtc-replicator:*": rule, "*/mtc-sidecar:*": rule,
            "*/jobset-in-place-restart-agent:*": ImageRule(command=[str(IN_PLACE_RESTART_AGENT)])}


def match_image(rules: Mapping[str, ImageRule], image: str) -> ImageRule:
    """The first rule whose pattern (fnmatch; a pattern without wildcards is a prefix) matches ``image``."""
    for pattern, rule in rules.items():
        pat = pattern if any(c in pattern for c in "*?[") else pattern + "*"
        if fnmatch.fnmatchcase(image, pat):
            return rule
    raise PodSetupError(f"ErrImagePull: no image rule for {image}")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names replaced, undefined ones left, ``$$`` -> ``$``."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """A Downward API ``fieldRef.fieldPath`` of ``pod``."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    m = _FIELD_KEY.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
              "status.hostIP": status.get("hostIP"),
              "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
              "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or [])}
    if path not in simple:
        raise PodSetupError(f"unsupported fieldPath {path}")
    return simple[path] or ""


def _quantity(q: str) -> float:
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
             "Ti": 2**40}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    if not m or m.group(2) not in ("", *units):
        raise PodSetupError(f"cannot parse quantity {q}")
    return float(m.group(1)) * units.get(m.group(2), 1.0)


def resource_value(container: Mapping[str, Any], ref: Mapping[str, Any], node_alloc: Mapping[str, str]) -> str:
    """A ``resourceFieldRef`` (``limits.cpu``, ``requests.memory``, ...); limits default to the node's."""
    kind, _, res = ref["resource"].partition(".")
    res_map = (container.get("resources") or {}).get(kind) or {}
    value = res_map.get(res) or (node_alloc.get(res) if kind == "limits" else None) or "0"
    return str(math.ceil(_quantity(value) / _quantity(ref.get("divisor") or "1")))


class Volumes:
    """The Pod's volumes as host directories (``sources``), made by :meth:`build`."""

    def __init__(self, kube: Kube, pod: Mapping[str, Any], pod_dir: Path, node_dir: Path) -> None:
        self.kube = kube
        self.pod = pod
        self.pod_dir = pod_dir
        self.node_dir = node_dir
        self.ns = pod["metadata"]["namespace"]
        self.sources: dict[str, tuple[str, bool, bool]] = {}  # name -> (host path, owned, read-only)

    def build(self) -> None:
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            own = self.pod_dir / "volumes" / name
            if "emptyDir" in vol:
                own.mkdir(parents=True, exist_ok=True)
                self.sources[name] = (str(own), True, False)
            elif "hostPath" in vol:
                self.sources[name] = (self._host_path(vol["hostPath"]), True, False)
            elif "csi" in vol:
                csi = vol["csi"]
                if csi.get("driver") != MTC_CSI_DRIVER:
                    raise PodSetupError(f"FailedMount: no CSI driver {csi.get('driver')} on this node")
                # The RAM disk is the node's: it outlives the Pods that mount it.
                disk = self.node_dir / "mtc-ramdisk"
                disk.mkdir(parents=True, exist_ok=True)
                self.sources[name] = (str(disk), True, bool(csi.get("readOnly")))
            elif any(k in vol for k in ("configMap", "secret", "projected", "downwardAPI")):
                shutil.rmtree(own, ignore_errors=True)
                own.mkdir(parents=True)
                self._files(vol, own)
                self.sources[name] = (str(own), False, True)
            else:
                raise PodSetupError(f"FailedMount: volume {name}: unsupported source {sorted(vol)}")

    def _host_path(self, hp: Mapping[str, Any]) -> str:
        path = self.node_dir / "hostpath" / hp["path"].lstrip("/")
        kind = hp.get("type") or ""
        if kind in ("File", "FileOrCreate"):
            if not path.exists() and kind == "File":
                raise PodSetupError(f"FailedMount: hostPath file {hp['path']} does not exist")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        elif kind in ("", "Directory", "DirectoryOrCreate"):
            if not path.exists() and kind == "Directory":
                raise PodSetupError(f"FailedMount: hostPath directory {hp['path']} does not exist")
            path.mkdir(parents=True, exist_ok=True)
        else:
            raise PodSetupError(f"FailedMount: hostPath type {kind} is not supported")
        return str(path)

    def _files(self, vol: Mapping[str, Any], dest: Path) -> None:
        if "projected" in vol:
            mode = vol["projected"].get("defaultMode", 0o644)
            for src in vol["projected"].get("sources") or []:
                self._source(src, dest, mode)
        else:
            kind = next(k for k in ("configMap", "secret", "downwardAPI") if k in vol)
            self._source(vol, dest, vol[kind].get("defaultMode", 0o644))

    def _source(self, src: Mapping[str, Any], dest: Path, mode: int) -> None:
        if "serviceAccountToken" in src:
            sat = src["serviceAccountToken"]
            self._write(dest, sat["path"], self.token(sat.get("audience"), sat.get("expirationSeconds", 3600)),
                        mode)
        elif "configMap" in src or "secret" in src:
            kind = "configMap" if "configMap" in src else "secret"
            ref = src[kind]
            name = ref.get("name") or ref.get("secretName")
            data = self.object_data(kind, name, bool(ref.get("optional")))
            items = ref.get("items") or [{"key": k, "path": k} for k in sorted(data)]
            for it in items:
                if it["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise PodSetupError(f"FailedMount: {kind} {name} has no key {it['key']}")
                self._write(dest, it["path"], data[it["key"]], it.get("mode", mode))
        elif "downwardAPI" in src:
            for it in src["downwardAPI"].get("items") or []:
                if "fieldRef" not in it:
                    raise PodSetupError("downwardAPI volumes support fieldRef items only")
                self._write(dest, it["path"], field_value(self.pod, it["fieldRef"]["fieldPath"]).encode(),
                            it.get("mode", mode))
        else:
            raise PodSetupError(f"FailedMount: unsupported projection {sorted(src)}")

    @staticmethod
    def _write(dest: Path, rel: str, data: bytes, mode: int) -> None:
        path = (dest / rel).resolve()
        if not path.is_relative_to(dest.resolve()):
            raise PodSetupError(f"FailedMount: item path {rel} leaves the volume")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)

    def object_data(self, kind: str, name: str, optional: bool) -> dict[str, bytes]:
        """A ConfigMap's or Secret's data as bytes ({} when missing and ``optional``)."""
        plural = "configmaps" if kind == "configMap" else "secrets"
        obj = self.kube.get(f"/api/v1/namespaces/{self.ns}/{plural}/{name}")
        if obj is None:
            if optional:
                return {}
            raise PodSetupError(f"FailedMount: {kind} {self.ns}/{name} not found")
        if kind == "secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    def token(self, audience: str | None, expiration_seconds: int) -> bytes:
        """A token of the Pod's ServiceAccount bound to the Pod (the TokenRequest API, as the kubelet asks)."""
        meta = self.pod["metadata"]
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [audience] if audience else [], "expirationSeconds": expiration_seconds,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                            "uid": meta["uid"]}}}
        try:
            out = self.kube.request("POST", f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body=body)
        except KubeError as e:
            raise PodSetupError(f"FailedMount: token for serviceaccount {self.ns}/{sa}: {e}") from e
        return out["status"]["token"].encode()


def container_env(volumes: Volumes, container: Mapping[str, Any], base: Mapping[str, str],
                  node_alloc: Mapping[str, str]) -> dict[str, str]:
    """``base`` (PATH, HOSTNAME, the API server's service variables, the image's) then ``envFrom`` then
    ``env`` in order, each value expanded against what came before."""
    pod = volumes.pod
    env = dict(base)
    for src in container.get("envFrom") or []:
        kind = "configMap" if "configMapRef" in src else "secret"
        ref = src.get("configMapRef") or src.get("secretRef") or {}
        for k, v in volumes.object_data(kind, ref["name"], bool(ref.get("optional"))).items():
            env[src.get("prefix", "") + k] = v.decode()
    for e in container.get("env") or []:
        if "valueFrom" not in e:
            env[e["name"]] = expand(e.get("value", ""), env)
            continue
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            env[e["name"]] = field_value(pod, vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            env[e["name"]] = resource_value(container, vf["resourceFieldRef"], node_alloc)
        else:
            kind = "configMap" if "configMapKeyRef" in vf else "secret"
            ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef") or {}
            data = volumes.object_data(kind, ref["name"], bool(ref.get("optional")))
            if ref["key"] in data:
                env[e["name"]] = data[ref["key"]].decode()
            elif not ref.get("optional"):
                raise PodSetupError(f"CreateContainerConfigError: {kind} {ref['name']} has no key {ref['key']}")
    return env


def service_env(host: str, port: int) -> dict[str, str]:
    """The ``kubernetes`` Service's variables, as the kubelet gives every container."""
    return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": str(port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(port), "KUBERNETES_PORT": f"tcp://{host}:{port}",
            f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}", f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": str(port), f"KUBERNETES_PORT_{port}_TCP_ADDR": host}


def launch_spec(volumes: Volumes, container: Mapping[str, Any], rule: ImageRule, env: Mapping[str, str],
                root: Path, hostname: str, pod_files: Mapping[str, str]) -> dict[str, Any]:
    """The JSON spec ``container_init.py`` reads: mounts (deepest last), argv, env."""
    entry = list(container.get("command") or rule.command)
    args = list(container.get("args") or ([] if container.get("command") else rule.args))
    argv = [expand(a, env) for a in entry + args]
    if not argv:
        raise PodSetupError(f"container {container['name']}: no command and the image rule has none")
    mounts: list[dict[str, Any]] = [{"source": src, "target": tgt, "readOnly": False, "owned": False}
                                    for tgt, src in {**pod_files, **rule.binds}.items()]
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in volumes.sources:
            raise PodSetupError(f"volume {vm['name']} of container {container['name']} is not defined")
        src, owned, ro = volumes.sources[vm["name"]]
        if vm.get("subPath"):
            sub = Path(src) / vm["subPath"]
            if not sub.resolve().is_relative_to(Path(src).resolve()):
                raise PodSetupError(f"subPath {vm['subPath']} leaves volume {vm['name']}")
            if not sub.exists():
                sub.mkdir(parents=True)
            src = str(sub)
        mounts.append({"source": src, "target": vm["mountPath"], "readOnly": ro or bool(vm.get("readOnly")),
                       "owned": owned})
    mounts.sort(key=lambda m: len([p for p in m["target"].split("/") if p]))
    return {"root": str(root), "hostname": hostname, "mounts": mounts, "argv": argv, "env": dict(env),
            "workingDir": container.get("workingDir") or "/"}


def default_base_env(rule: ImageRule, hostname: str, api_host: str, api_port: int) -> dict[str, str]:
    env = {"PATH": os.pathsep.join([*rule.path, *DEFAULT_PATH]), "HOSTNAME": hostname, "HOME": "/root"}
    env.update(rule.env)
    env.update(service_env(api_host, api_port))
    return env
