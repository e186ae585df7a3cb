"""`mtc preempt --kube-api-dir`: a JobSet restart or hot-swap is told from a preemption notice.

The hook reads its own Pod and the Job owning it from the API server (a stand-in HTTPS server on loopback
with a throwaway CA, answering as kube-apiserver does: the objects, or 404); a restart returns at once and
records ``restart.json`` so the replicator's SIGTERM skips the emergency backup; anything uncertain is a
notice (the full save window and flush).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from kits.certs import CertAuthority  # noqa: E402

from controller_client import preempt  # noqa: E402
from replicator.preemption import RESTART_RECORD, restart_recorded  # noqa: E402

POD = {"metadata": {"name": "demo-workers-0-0-x", "ownerReferences": [{"kind": "Job", "name": "demo-workers-0"}]}}
LIVE_JOB: dict[str, Any] = {"metadata": {"name": "demo-workers-0"}, "status": {}}


@pytest.mark.parametrize(("job", "cause"), [
    (LIVE_JOB, preempt.NOTICE),
    (None, preempt.RESTART),  # gone: background deletion
    ({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}, preempt.RESTART),  # JobSet: foreground
    ({"metadata": {}, "status": {"conditions": [{"type": "FailureTarget", "status": "True"}]}}, preempt.RESTART),
    ({"metadata": {}, "status": {"conditions": [{"type": "Failed", "status": "True"}]}}, preempt.RESTART),
    ({"metadata": {}, "status": {"conditions": [{"type": "Failed", "status": "False"}]}}, preempt.NOTICE),
])
def test_deletion_cause(job: dict[str, Any] | None, cause: str) -> None:
    assert preempt.deletion_cause(POD, job) == cause
    assert preempt.deletion_cause(None, job) == preempt.NOTICE
    assert preempt.deletion_cause({"metadata": {}}, job) == preempt.NOTICE  # no Job owns it


class _Api(BaseHTTPRequestHandler):
    objects: dict[str, Any] = {}
    token = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        body = self.objects.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        if body is not None:
            self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, dict[str, Any]]]:
    ca = CertAuthority(tmp_path / "ca")
    pair = ca.issue("apiserver")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pair.cert, pair.key)
    objects: dict[str, Any] = {}
    handler = type("Api", (_Api,), {"objects": objects, "token": "t0ken"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kube = tmp_path / "kube-api"
    kube.mkdir()
    (kube / "token").write_text("t0ken\n")
    (kube / "ca.crt").write_bytes(ca.ca_file.read_bytes())
    (kube / "namespace").write_text("ml")
    (kube / "pod-name").write_text(POD["metadata"]["name"])
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
    try:
        yield kube, objects
    finally:
        server.shutdown()
        server.server_close()


def _args(local: Path, kube: Path, on_restart: str = "skip") -> argparse.Namespace:
    p = argparse.ArgumentParser()
    preempt.add_arguments(p)
    return p.parse_args(["--local-dir", str(local), "--kube-api-dir", str(kube), "--on-restart", on_restart,
                         "--save-window-seconds", "30", "--flush-seconds", "30", "--wait", "--timeout-seconds", "1"])


def test_a_restart_returns_at_once_and_records_it(api: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    kube, objects = api
    objects["/api/v1/namespaces/ml/pods/demo-workers-0-0-x"] = POD  # its Job is gone (404): a JobSet restart
    local = tmp_path / "local"
    local.mkdir()
    before = time.time() - 1
    t0 = time.monotonic()
    assert preempt.run(_args(local, kube)) == 0
    assert time.monotonic() - t0 < 5, "no save window, no flush wait"
    assert restart_recorded(local, before)
    assert not restart_recorded(local, time.time() + 5), "an earlier Pod's record is not this daemon's"
    (local / RESTART_RECORD).unlink()
    assert preempt.run(_args(local, kube, on_restart="flush")) == 0
    assert not (local / RESTART_RECORD).exists(), "emptyDir RAM disk: the replicator's SIGTERM flush stays"


def test_a_notice_takes_the_full_path(api: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    kube, objects = api
    objects["/api/v1/namespaces/ml/pods/demo-workers-0-0-x"] = POD
    objects["/apis/batch/v1/namespaces/ml/jobs/demo-workers-0"] = LIVE_JOB
    assert preempt.classify(kube) == preempt.NOTICE
    local = tmp_path / "local"
    local.mkdir()
    # The notice path asks the replicator over its socket; none runs here, so the hook says so (exit 1).
    assert preempt.run(_args(local, kube)) == 1
    assert not (local / RESTART_RECORD).exists()


def test_an_unreachable_or_refusing_api_server_means_a_notice(api: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    kube, objects = api
    objects["/api/v1/namespaces/ml/pods/demo-workers-0-0-x"] = POD
    (kube / "token").write_text("wrong")  # 401
    assert preempt.classify(kube) == preempt.NOTICE
    os.environ["KUBERNETES_SERVICE_PORT"] = "1"  # nothing listens
    assert preempt.classify(kube, timeout_seconds=1) == preempt.NOTICE
    assert preempt.classify(tmp_path / "missing") == preempt.NOTICE


def test_the_notice_container_ends_when_pathways_worker_does() -> None:
    """restartPolicy Never: the Pod fails only once every main container ended, so the holder must follow
    pathways-worker (its port) down; before the port ever answered it keeps waiting (startup)."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(preempt.watch_port(port, interval_seconds=0.05, misses_allowed=2)),
                         daemon=True)
    t.start()
    time.sleep(0.5)
    assert not result, "the worker still serves"
    srv.close()
    t.join(timeout=5)
    assert result == [1]
