"""Network probes (grpc, tcpSocket, httpGet) from the Pod network, as the kubelet runs them from the node.

Pod IPs are reachable only from the bridge namespace, and gRPC opens its sockets from threads of its own,
so the probes run in one long-lived helper process started there (``python probes.py``): it reads one JSON
request a line on stdin and answers one JSON line each on stdout, running up to :data:`WORKERS` probes at
once. :class:`Prober` is the agent's side: :meth:`Prober.submit` returns at once, :meth:`Prober.result`
is polled. A gRPC probe calls ``grpc.health.v1.Health/Check`` (the service named in the probe, "" by default)
and passes on ``SERVING``; tcpSocket passes when a connection opens; httpGet on a status in 200..399.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

WORKERS = 8


def _probe(req: dict[str, Any]) -> tuple[bool, str]:
    host, port, timeout = req["host"], int(req["port"]), float(req["timeout"])
    kind = req["kind"]
    if kind == "tcp":
        import socket
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            return False, str(e)
        return True, ""
    if kind == "http":
        import http.client
        conn_cls = http.client.HTTPSConnection if req.get("scheme", "HTTP").upper() == "HTTPS" else \
            http.client.HTTPConnection
        kw: dict[str, Any] = {}
        if conn_cls is http.client.HTTPSConnection:
            import ssl
            kw["context"] = ssl._create_unverified_context()  # the kubelet does not verify either
        try:
            conn = conn_cls(host, port, timeout=timeout, **kw)
            conn.request("GET", req.get("path") or "/", headers=req.get("headers") or {})
            status = conn.getresponse().status
            conn.close()
        except (OSError, http.client.HTTPException) as e:
            return False, str(e)
        return 200 <= status < 400, f"HTTP {status}"
    if kind == "grpc":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        try:
            with grpc.insecure_channel(f"{host}:{port}") as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=req.get("service") or ""), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code()}: {e.details()}"
        ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        return ok, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return False, f"unknown probe kind {kind}"


def serve(inp: IO[str], out: IO[str]) -> None:
    """The helper's loop: probes from ``inp`` until it closes, answers to ``out``."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()

    def one(req: dict[str, Any]) -> None:
        try:
            ok, msg = _probe(req)
        except Exception as e:  # a probe that breaks is a failed probe, not a dead helper
            ok, msg = False, repr(e)
        with lock:
            out.write(json.dumps({"id": req["id"], "ok": ok, "message": msg}) + "\n")
            out.flush()

    with ThreadPoolExecutor(WORKERS) as pool:
        for line in inp:
            if line.strip():
                pool.submit(one, json.loads(line))


class Prober:
    """The agent's handle on the helper process (started by the caller inside the bridge namespace)."""

    def __init__(self, argv_prefix: Sequence[str]) -> None:
        """``argv_prefix``: what runs a command in the bridge namespace (``ip netns exec <ns>``)."""
        self.proc = subprocess.Popen([*argv_prefix, sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._results: dict[int, tuple[bool, str]] = {}
        self._reader = threading.Thread(target=self._read, name="prober-read", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._lock:
                self._results[msg["id"]] = (msg["ok"], msg["message"])

    def submit(self, kind: str, host: str, port: int, timeout_seconds: float, **extra: Any) -> int:
        """Start a probe; returns its id for :meth:`result`."""
        pid = next(self._ids)
        req = {"id": pid, "kind": kind, "host": host, "port": port, "timeout": timeout_seconds, **extra}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return pid

    def result(self, probe_id: int) -> tuple[bool, str] | None:
        """``(passed, message)`` once the probe finished, else None."""
        with self._lock:
            return self._results.pop(probe_id, None)

    def close(self, timeout_seconds: float = 5.0) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_seconds)
        self._reader.join(timeout_seconds)


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
