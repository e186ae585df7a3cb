"""Every variant `mtc manifests` renders, applied to the real API server: accepted by the built-in types'
validation, the JobSet CRD's schema and CEL rules and JobSet's admission webhooks; the JobSet controller then
creates the worker Jobs. A manifest the server refuses fails with the server's own message."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from controller_client import manifests as mf
from tests.cluster.controlplane import ControlPlane

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

MODES = ("pathways", "multi-controller")
FRONT_DOORS = ("native", "orbax")
VARIANTS = ("plain", "elastic", "hot-swap", "in-place")
JOBS_TIMEOUT_SECONDS = 30.0


def _options(mode: str, front_door: str, variant: str) -> mf.ManifestOptions:
    base = mf.ManifestOptions(mode=mode, front_door=front_door, job=f"v-{mode[:2]}-{front_door[:2]}-{variant[:2]}",
                              backup_url="gs://b/ckpt", pathways_scratch="gs://b/tmp")
    if variant == "elastic":
        return dataclasses.replace(base, elastic_slices=base.slices)
    if variant == "hot-swap":
        return dataclasses.replace(base, priority_class="high-prior-job", priority_value=2000)
    if variant == "in-place":  # JobSet's InPlaceRestart: its webhook's rules, the restart rules, the policy
        return dataclasses.replace(base, restart="in-place")
    return base


def _cases() -> Iterator[Any]:
    """Every mode x front door x variant but multi-controller elastic and Pathways in place, which `mtc manifests`
    refuses (below; tests/controller_client/test_manifests_restart.py)."""
    for mode in MODES:
        for door in FRONT_DOORS:
            for variant in VARIANTS:
                if not (mode == "multi-controller" and variant == "elastic") and not (
                        mode == "pathways" and variant == "in-place"):
                    yield pytest.param(_options(mode, door, variant), id=f"{mode}-{door}-{variant}")


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_multi_controller_elastic_is_refused_by_the_renderer(door: str) -> None:
    with pytest.raises(ValueError, match="needs Pathways"):
        _options("multi-controller", door, "elastic").validate()


def apply(api: Any, doc: dict[str, Any], namespace: str, dry_run: bool = False) -> Any:
    """Create ``doc`` as it is (kubectl create); raises AssertionError with the server's message if refused."""
    dyn = dynamic.DynamicClient(api)
    res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    kw: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
    try:
        if res.namespaced:
            return res.create(body=doc, namespace=namespace, **kw)
        return res.create(body=doc, **kw)
    except ApiException as e:
        try:
            message = json.loads(e.body).get("message", e.body)
        except (TypeError, ValueError):
            message = e.body
        raise AssertionError(f"the API server refused {doc['kind']} {doc['metadata']['name']}: {message}") from None


def _token_secret(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mtc-token", "namespace": namespace},
            "stringData": {"token": "0123456789abcdef"}}


@pytest.mark.parametrize("opts", list(_cases()))
def test_every_rendered_variant_is_accepted_and_reconciled(control_plane: ControlPlane, opts: mf.ManifestOptions) -> None:
    ns = opts.job
    with control_plane.client() as api:
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": ns}})
        try:
            apply(api, _token_secret(ns), ns)
            for name, doc in mf.objects(opts).items():
                if doc["kind"] == "PriorityClass":
                    doc = {**doc, "metadata": {**doc["metadata"], "name": f"{doc['metadata']['name']}-{ns}"}}
                if name == "jobset.yaml" and opts.priority_value is not None:
                    _rename_priority(doc, f"{opts.priority_class}-{ns}")
                apply(api, doc, ns)
            _wait_for_jobs(api, ns, opts)
        finally:
            core.delete_namespace(ns)
            for pc in client.SchedulingV1Api(api).list_priority_class().items:
                if pc.metadata.name.endswith(f"-{ns}"):
                    client.SchedulingV1Api(api).delete_priority_class(pc.metadata.name)


def _rename_priority(jobset: dict[str, Any], name: str) -> None:
    for rj in jobset["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        if "priorityClassName" in pod:
            pod["priorityClassName"] = name


def _wait_for_jobs(api: Any, ns: str, opts: mf.ManifestOptions) -> None:
    """The JobSet controller reconciled the JobSet: one Job per replica of every replicated Job, or, with
    ``startupPolicy: InOrder`` (Pathways: the head before the workers), of the first one (the next waits for
    its Pods to be ready, and no node runs them here)."""
    spec = mf.objects(opts)["jobset.yaml"]["spec"]
    rjobs = spec["replicatedJobs"]
    if spec.get("startupPolicy", {}).get("startupPolicyOrder") == "InOrder":
        rjobs = rjobs[:1]
    want = sum(rj["replicas"] for rj in rjobs)
    batch = client.BatchV1Api(api)
    deadline = time.monotonic() + JOBS_TIMEOUT_SECONDS
    jobs: list[str] = []
    while time.monotonic() < deadline:
        jobs = [j.metadata.name for j in batch.list_namespaced_job(ns).items]
        if len(jobs) == want:
            return
        time.sleep(0.3)
    raise AssertionError(f"the JobSet controller made {len(jobs)} Jobs ({jobs}) of {want} within "
                         f"{JOBS_TIMEOUT_SECONDS:.0f} s")


def test_the_server_refuses_an_int32_overflow_with_its_message(control_plane: ControlPlane) -> None:
    """The check above can fail: a backoffLimit past int32, as hosts x 1,000,000 rendered at 2,240 hosts per slice
    before the elastic budget became per host."""
    opts = mf.ManifestOptions(mode="pathways", job="overflow", backup_url="gs://b/ckpt", elastic_slices=2)
    doc = mf.objects(opts)["jobset.yaml"]
    doc["spec"]["replicatedJobs"][-1]["template"]["spec"]["backoffLimit"] = 2_240_000_000
    with control_plane.client() as api:
        with pytest.raises(AssertionError, match="backoffLimit|int32|2240000000"):
            apply(api, doc, "default", dry_run=True)


def test_the_webhook_refuses_what_it_must(control_plane: ControlPlane) -> None:
    """JobSet's validating webhook answers (not only the CRD's schema): RestartJob is refused while its
    feature gate is off (v0.12.0's webhook)."""
    opts = mf.ManifestOptions(mode="multi-controller", front_door="native", job="gated", backup_url="gs://b/ckpt")
    doc = mf.objects(opts)["jobset.yaml"]
    doc["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartJob"
    with control_plane.client() as api:
        with pytest.raises(AssertionError, match="(?i)RestartJob"):
            apply(api, doc, "default", dry_run=True)
