"""Regenerate deploy/ from `mtc manifests` (the single source): two kustomize bases and their components.

    python deploy/regen.py          # rewrite deploy/pathways, deploy/multi-controller, deploy/components

``deploy/pathways`` and ``deploy/multi-controller`` are ``render()`` of the default options of each mode
(native front door on Pathways, Orbax on multi-controller); ``deploy/pathways-orbax`` and
``deploy/multi-controller-native`` the other front door of each.
Each component under ``deploy/components`` is the difference between a base (the Pathways one unless
COMPONENT_BASE names another) and one variant of the options: new objects become the component's resources, changed objects JSON 6902 patches (list items
appended with ``/-`` so that components compose). tests/deploy checks that regenerating yields no diff and
that base + component builds exactly what ``mtc manifests`` renders for that variant.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parent
sys.path.insert(0, str(DEPLOY.parent))

from controller_client.manifests import ManifestOptions, dump, objects, render  # noqa: E402

# The example job every file under deploy/ is rendered for; change the shape with `mtc manifests` instead.
BASE_OPTIONS = {
    "pathways": ManifestOptions(mode="pathways", backup_url="gs://REPLACE-ME-bucket/mtc"),
    "multi-controller": ManifestOptions(mode="multi-controller", backup_url="gs://REPLACE-ME-bucket/mtc"),
    # The other front door of each mode: Orbax on Pathways (colocated), our CheckpointManager per process.
    "pathways-orbax": ManifestOptions(mode="pathways", front_door="orbax", backup_url="gs://REPLACE-ME-bucket/mtc"),
    "multi-controller-native": ManifestOptions(mode="multi-controller", front_door="native",
                                               backup_url="gs://REPLACE-ME-bucket/mtc"),
}
BASES = tuple(BASE_OPTIONS)
# Component name -> the Pathways base's options changed as the component changes them.
COMPONENTS = {
    "tls": {"tls": True},
    # Per-Pod certificates from cert-manager's csi-driver (rank-bound mTLS); instead of "tls", not with it.
    "tls-pod-identity": {"tls": True, "tls_identity": "pod"},
    "priority-class": {"priority_class": "high-prior-job", "priority_value": 2000},
    "elastic": {"elastic_slices": 2},
    "ramdisk-hostpath": {"ramdisk": "hostpath"},
    "ramdisk-memory": {"ramdisk": "memory"},
    "workload-identity": {"gcp_service_account": "mtc-backup@PROJECT_ID.iam.gserviceaccount.com"},
    # The Orbax bases' RAM disk is the Pod's memory (no privilege); these keep it on the node instead (a tmpfs
    # per job that outlives the Pods, prepared by a privileged DaemonSet): one per base, their JobSets differ.
    "ramdisk-hostpath-pathways-orbax": {"ramdisk": "hostpath"},
    "ramdisk-hostpath-multi-controller": {"ramdisk": "hostpath"},
}
# Component name -> the base it is the difference to (default: pathways).
COMPONENT_BASE = {"ramdisk-hostpath-pathways-orbax": "pathways-orbax",
                  "ramdisk-hostpath-multi-controller": "multi-controller"}


def _pointer(path: list[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def json_patch(base: Any, variant: Any, path: list[str | int] | None = None) -> list[dict[str, Any]]:
    """JSON 6902 operations turning ``base`` into ``variant`` (appends to lists as ``/-``)."""
    path = path or []
    if isinstance(base, dict) and isinstance(variant, dict):
        ops: list[dict[str, Any]] = []
        for k in base:
            if k not in variant:
                ops.append({"op": "remove", "path": _pointer(path + [k])})
        for k, v in variant.items():
            if k not in base:
                ops.append({"op": "add", "path": _pointer(path + [k]), "value": v})
            else:
                ops += json_patch(base[k], v, path + [k])
        return ops
    if isinstance(base, list) and isinstance(variant, list) and len(variant) >= len(base):
        ops = []
        for i, item in enumerate(base):
            ops += json_patch(item, variant[i], path + [i])
        ops += [{"op": "add", "path": _pointer(path + ["-"]), "value": v} for v in variant[len(base):]]
        return ops
    if base == variant:
        return []
    return [{"op": "replace", "path": _pointer(path), "value": variant}]


def component(base: ManifestOptions, variant: ManifestOptions) -> dict[str, str]:
    """File name -> text of the kustomize Component turning ``base``'s objects into ``variant``'s."""
    before, after = objects(base), objects(variant)
    removed = set(before) - set(after)
    if removed:
        raise ValueError(f"a component cannot remove objects: {sorted(removed)}")
    files = render(variant)
    out = {name: files[name] for name in after if name not in before}
    patches = []
    for name in before:
        ops = json_patch(before[name], after[name])
        if ops:
            obj = before[name]
            group, _, version = obj["apiVersion"].rpartition("/")
            target = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
            if not group:
                del target["group"]
            patches.append({"target": target, "patch": dump(ops)})
    kust: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component"}
    if out:
        kust["resources"] = list(out)
    if patches:
        kust["patches"] = patches
    out["kustomization.yaml"] = "# Generated by deploy/regen.py; see docs/deploy.md.\n" + dump(kust)
    return out


def generate() -> dict[str, str]:
    """Relative path under deploy/ -> text, for every generated file."""
    out: dict[str, str] = {}
    for mode, opts in BASE_OPTIONS.items():
        for name, text in render(opts).items():
            out[f"{mode}/{name}"] = text
    for comp, changes in COMPONENTS.items():
        base = BASE_OPTIONS[COMPONENT_BASE.get(comp, "pathways")]
        for name, text in component(base, dataclasses.replace(base, **changes)).items():
            out[f"components/{comp}/{name}"] = text
    return out


def main() -> int:
    files = generate()
    for sub in (*BASES, "components"):
        d = DEPLOY / sub
        if d.exists():
            for f in sorted(d.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
    for rel, text in files.items():
        p = DEPLOY / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    print(f"wrote {len(files)} files under {DEPLOY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
