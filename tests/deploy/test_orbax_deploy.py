"""Orbax's front door as the guide deploys it: the RAM disk on pathways-worker and colocated Python, not on
the head, and no privilege needed by default (the hostpath DaemonSet is a component)."""

from __future__ import annotations

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


def _deployed(base: str) -> list[dict[str, Any]]:
    return kit.kustomize_build(REPO / "deploy" / base)


SETS = {
    "rendered": lambda: list(mf.objects(mf.ManifestOptions(job="demo", front_door="orbax", backup_url="gs://b/c")).values()),
    "deploy/pathways-orbax": lambda: _deployed("pathways-orbax"),
}


def _pod(docs: list[dict[str, Any]], rj: str) -> dict[str, Any]:
    js = next(d for d in docs if d["kind"] == "JobSet")
    return next(r for r in js["spec"]["replicatedJobs"] if r["name"] == rj)["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("which", sorted(SETS))
def test_ramdisk_on_pathways_worker_and_colocated_python_not_on_the_head(which: str) -> None:
    docs = SETS[which]()
    worker = _pod(docs, "workers")
    vol = next(v for v in worker["volumes"] if v["name"] == "ramdisk")
    # The guide's volume is multitier-checkpoint.csi.storage.gke.io (GKE's own replicator serves it, which
    # would answer Orbax's replicator.yaml too): ours in its place is the Pod's memory by default.
    assert vol == {"name": "ramdisk", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}
    containers = {c["name"]: c for c in worker["containers"] + worker["initContainers"]}
    paths = {n: {m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == "ramdisk"}
             for n, c in containers.items()}
    assert paths["pathways-worker"] == paths["colocated-python-sidecar"] == {"/local"}
    head = _pod(docs, "head")
    assert all(v["name"] != "ramdisk" for v in head.get("volumes", []))
    assert all(m["name"] != "ramdisk" for c in head["containers"] + head["initContainers"]
               for m in c.get("volumeMounts", []))


@pytest.mark.parametrize("which", sorted(SETS))
def test_the_default_needs_no_privilege(which: str) -> None:
    docs = SETS[which]()
    assert not [d for d in docs if d["kind"] == "DaemonSet"]
    for d in docs:
        if d["kind"] != "JobSet":
            continue
        for rj in d["spec"]["replicatedJobs"]:
            pod = rj["template"]["spec"]["template"]["spec"]
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                assert not c.get("securityContext", {}).get("privileged"), (rj["name"], c["name"])
    assert not (REPO / "deploy" / "pathways-orbax" / "ramdisk-daemonset.yaml").exists()
    comp = yaml.safe_load((REPO / "deploy" / "components" / "ramdisk-hostpath-pathways-orbax" /
                           "kustomization.yaml").read_text())
    assert "ramdisk-daemonset.yaml" in comp["resources"], "privilege only by choice: the component"
