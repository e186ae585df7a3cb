"""A thin JSON client for the Kubernetes API over a ``kubernetes.client.ApiClient`` (its TLS and credentials).

The node agent reads and writes objects as the API's own JSON (camelCase dicts, as the kubelet sees them)
rather than through the generated models: field paths such as ``metadata.annotations['...']`` and status
patches map one to one. Every request has a timeout; :meth:`Kube.watch` ends when the server closes the
stream (``timeoutSeconds``) or the read times out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiClient

REQUEST_TIMEOUT_SECONDS = 10.0
MERGE_PATCH = "application/merge-patch+json"


class KubeError(Exception):
    """A request the API server answered with a status outside 2xx."""

    def __init__(self, status: int, reason: str, body: str) -> None:
        super().__init__(f"{status} {reason}: {body[:300]}")
        self.status = status
        self.reason = reason
        self.body = body


def now_rfc3339() -> str:
    """The API's ``metav1.Time`` (seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """The API's ``metav1.MicroTime`` (Lease renewTime)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp the API wrote."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Kube:
    """JSON requests with the credentials of ``api_client``."""

    def __init__(self, api_client: ApiClient) -> None:
        self.api_client = api_client

    def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                body: Any = None, content_type: str = "application/json",
                timeout_seconds: float = REQUEST_TIMEOUT_SECONDS) -> dict[str, Any]:
        """The decoded answer; raises :class:`KubeError` on a non-2xx status."""
        resp = self._send(method, path, query, body, content_type, (timeout_seconds, timeout_seconds))
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, resp.reason or "", data.decode(errors="replace"))
        return json.loads(data) if data else {}

    def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, None when it does not exist."""
        try:
            return self.request("GET", path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (lists are replaced whole)."""
        return self.request("PATCH", path, body=dict(body), content_type=MERGE_PATCH)

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> bool:
        """False when the object was already gone (404) or its precondition no longer holds (409)."""
        try:
            self.request("DELETE", path, body=dict(body or {}))
        except KubeError as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    def watch(self, path: str, resource_version: str, timeout_seconds: int) -> Iterator[dict[str, Any]]:
        """The events (``{"type", "object"}``) of a watch from ``resource_version``, for at most
        ``timeout_seconds`` (the server ends the stream then; a read waits at most that long plus 10 s)."""
        query = {"watch": "true", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout_seconds)}
        resp = self._send("GET", path, query, None, "application/json",
                          (REQUEST_TIMEOUT_SECONDS, timeout_seconds + 10.0))
        if not 200 <= resp.status < 300:
            raise KubeError(resp.status, resp.reason or "", resp.read().decode(errors="replace"))
        raw = resp.response
        deadline = time.monotonic() + timeout_seconds + 15.0
        buf = b""
        try:
            for chunk in raw.stream(65536, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
                if time.monotonic() > deadline:
                    return
        finally:
            raw.release_conn()

    def _send(self, method: str, path: str, query: Mapping[str, Any] | None, body: Any,
              content_type: str, timeout: tuple[float, float]) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, body, post = self.api_client.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
            auth_settings=["BearerToken"])
        return self.api_client.call_api(method, url, headers, body, post, _request_timeout=timeout)


def pod_path(pod: Mapping[str, Any]) -> str:
    return f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}"


def add_pod_condition(kube: Kube, pod: Mapping[str, Any], cond: dict[str, Any], phase: str | None = None,
                      keep_existing: bool = False) -> None:
    """Add (replace; keep one of the same type when ``keep_existing``) a Pod condition, and set ``phase``,
    through the status subresource, with the Pod's resourceVersion as precondition, retrying on conflicts."""
    for _ in range(10):
        old = pod.get("status", {}).get("conditions") or []
        conds = [c for c in old if c["type"] != cond["type"]]
        mine = [c for c in old if c["type"] == cond["type"]] if keep_existing else []
        status: dict[str, Any] = {"conditions": [*conds, *(mine[:1] or [cond])]}
        if phase:
            status["phase"] = phase
        try:
            kube.patch(pod_path(pod) + "/status",
                       {"metadata": {"resourceVersion": pod["metadata"]["resourceVersion"]}, "status": status})
            return
        except KubeError as e:
            if e.status == 404:
                return
            if e.status != 409:
                raise
        fresh = kube.get(pod_path(pod))
        if fresh is None:
            return
        pod = fresh
    raise RuntimeError(f"could not add condition {cond['type']} to {pod['metadata']['name']}")

