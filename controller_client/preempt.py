"""`mtc preempt`: tell this host's replicator of a preemption notice ahead of its SIGTERM (a preStop hook).

Kubernetes runs a Pod's preStop hooks before it sends SIGTERM, and sends a native sidecar (the replicator)
SIGTERM only after the main containers have exited. The rendered worker Pods (`mtc manifests`) therefore run
this command as the preStop hook of their main containers: it reaches the replicator over its control
socket ``<local-dir>/replicator.sock`` at the very start of the grace period (replicator/preemption.py).
With ``--wait`` it returns once the replicator's flush is recorded in ``<local-dir>/preemption.json`` (or
the budget is spent), which keeps the container -- and so colocated Python -- alive for the training loop's
last save. Exit 0 when the replicator took the notice, 1 when it could not be reached.

Not every Pod deletion is a notice: a JobSet restart (or a hot-swap onto a spare slice) deletes every Job,
then every healthy Pod. With ``--kube-api-dir`` the hook first reads its own Pod and the Job owning it from
the API server (the rendered Role allows ``get`` on Pods and Jobs only): when the Job is gone, being deleted
or failed, the deletion is a restart and the hook returns at once, no save window, no flush (with
``--on-restart skip`` it records ``<local-dir>/restart.json`` so the replicator's SIGTERM skips its emergency
backup too). Anything else, an unreachable API server included, is handled as a notice. Every run first records
``<local-dir>/prestop.json``: a replicator started with ``--sigterm-flush after-hook`` (``mtc manifests --restart
in-place``) flushes on SIGTERM only after a hook ran, since the kubelet's in-place restarts run none.

``--hold-while-port PORT`` is the other half: the main process of the Pathways worker Pod's
``preemption-notice`` container, whose preStop hook this command is. It exits 143 on SIGTERM, and 1 once
``pathways-worker`` (PORT on localhost) stopped accepting after it had: with ``restartPolicy: Never`` a Pod
is Failed only when all its main containers have ended, so a worker that died must not leave this one running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc
from replicator import preemption
from sidecar import layout


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-dir", required=True, help="the host's RAM-disk directory (the replicator's --local-dir)")
    p.add_argument("--save-window-seconds", type=float, default=0.0,
                   help="how long the replicator waits for the training loop's save after the notice (default 0)")
    p.add_argument("--flush-seconds", type=float, default=20.0,
                   help="then how long it tries to get the newest complete step into the bucket (default 20)")
    p.add_argument("--wait", action="store_true",
                   help="return only once the flush is recorded (or save window + flush seconds have passed)")
    p.add_argument("--timeout-seconds", type=float, default=5.0, help="RPC timeout (default 5)")
    p.add_argument("--kube-api-dir", default="",
                   help="token, ca.crt, namespace and pod-name of a projected volume: tell a JobSet restart "
                        "(the Pod's Job gone, being deleted or failed) from a notice; empty = every call is a notice")
    p.add_argument("--on-restart", choices=("skip", "flush"), default="skip",
                   help="on a restart: skip = record it so the replicator's SIGTERM skips the emergency backup "
                        "(a RAM disk that outlives the Pod); flush = leave the SIGTERM flush as it is (emptyDir)")
    p.add_argument("--hold-while-port", type=int, default=0,
                   help="run as the notice container's main process: exit 143 on SIGTERM, 1 once this localhost "
                        "port (pathways-worker) stopped accepting after it had")


def hold(port: int, interval_seconds: float = 5.0, misses_allowed: int = 3) -> int:
    """Block until SIGTERM (143) or until ``port`` was up and then refused ``misses_allowed`` checks in a row (1)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return watch_port(port, interval_seconds, misses_allowed)


def watch_port(port: int, interval_seconds: float, misses_allowed: int) -> int:
    """Return 1 once ``port`` on localhost answered and then refused ``misses_allowed`` checks in a row."""
    seen, misses = False, 0
    while True:
        time.sleep(interval_seconds)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2.0).close()
            seen, misses = True, 0
        except OSError:
            misses += seen
            if misses >= misses_allowed:
                print(f"mtc preempt: port {port} closed: the worker ended", file=sys.stderr)
                return 1


RESTART = "restart"
NOTICE = "notice"
_JOB_ENDING = {"Failed", "FailureTarget"}


def deletion_cause(pod: dict[str, Any] | None, job: dict[str, Any] | None) -> str:
    """``restart`` when the Pod is deleted because its Job is going away, else ``notice``.

    ``pod``/``job``: the objects as the API server returns them; ``job`` None = not found (deleted). A JobSet
    restart deletes the Jobs (foreground) before their Pods; the Job controller deletes a failing Job's
    remaining Pods after setting FailureTarget. A preemption or eviction leaves the Job as it was.
    """
    if pod is None:
        return NOTICE
    owners = [o for o in pod.get("metadata", {}).get("ownerReferences", []) if o.get("kind") == "Job"]
    if not owners:
        return NOTICE
    if job is None or job.get("metadata", {}).get("deletionTimestamp"):
        return RESTART
    for c in job.get("status", {}).get("conditions", []) or []:
        if c.get("type") in _JOB_ENDING and c.get("status") == "True":
            return RESTART
    return NOTICE


def _api_get(base: str, path: str, token: str, ctx: ssl.SSLContext, timeout: float) -> dict[str, Any] | None:
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def classify(kube_dir: Path, timeout_seconds: float = 2.0) -> str:
    """Read the Pod and its Job; ``notice`` whenever the answer is not certain."""
    try:
        token = (kube_dir / "token").read_text().strip()
        ns = (kube_dir / "namespace").read_text().strip()
        name = (kube_dir / "pod-name").read_text().strip()
        ctx = ssl.create_default_context(cafile=str(kube_dir / "ca.crt"))
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        base = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        pod = _api_get(base, f"/api/v1/namespaces/{ns}/pods/{name}", token, ctx, timeout_seconds)
        owners = [o for o in (pod or {}).get("metadata", {}).get("ownerReferences", []) if o.get("kind") == "Job"]
        job = (_api_get(base, f"/apis/batch/v1/namespaces/{ns}/jobs/{owners[0]['name']}", token, ctx, timeout_seconds)
               if owners else None)
        return deletion_cause(pod, job)
    except (OSError, ValueError, ssl.SSLError, urllib.error.URLError) as e:
        print(f"mtc preempt: cannot ask the API server ({e}); handling this as a notice", file=sys.stderr)
        return NOTICE


def notify(local_dir: Path, save_window_seconds: float, flush_seconds: float,
           timeout_seconds: float = 5.0) -> control_pb2.PreemptResponse:
    """One ``LocalControl.Preempt`` call; raises grpc.RpcError when the replicator is not reachable."""
    sock = layout.control_socket(local_dir)
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        req = control_pb2.PreemptRequest(save_window_seconds=save_window_seconds, flush_seconds=flush_seconds)
        return control_pb2_grpc.LocalControlStub(ch).Preempt(req, timeout=timeout_seconds)


def wait_for_record(local_dir: Path, timeout_seconds: float) -> preemption.PreemptionRecord | None:
    """The flush's record once written, None when ``timeout_seconds`` passed first."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            return preemption.read_record(local_dir)
        except (FileNotFoundError, ValueError):
            time.sleep(0.2)
    return None


def run(args: argparse.Namespace) -> int:
    local = Path(args.local_dir)
    if args.hold_while_port:
        return hold(args.hold_while_port)
    t0 = time.monotonic()
    try:  # first: a SIGTERM after a hook is a deletion's, not an in-place restart's (--sigterm-flush after-hook)
        preemption.record_prestop(local)
    except OSError as e:
        print(f"mtc preempt: cannot record the hook in {local}: {e}", file=sys.stderr)
    if args.kube_api_dir and classify(Path(args.kube_api_dir)) == RESTART:
        if args.on_restart == "skip":
            preemption.record_restart(local)
        print(f"mtc preempt: the Pod's Job is going away (a JobSet restart): no save window, "
              f"{'no emergency backup' if args.on_restart == 'skip' else 'the replicator flushes on SIGTERM'}",
              file=sys.stderr)
        return 0
    try:
        resp = notify(local, args.save_window_seconds, args.flush_seconds, args.timeout_seconds)
    except grpc.RpcError as e:
        print(f"mtc preempt: replicator at {layout.control_socket(local)} not reachable: {e.code().name}",
              file=sys.stderr)
        return 1
    print(f"mtc preempt: notice taken (newest complete step {resp.notice_step}"
          f"{'' if resp.started else ', already handling an earlier notice'})", file=sys.stderr)
    if args.wait:
        budget = args.save_window_seconds + args.flush_seconds + 1.0 - (time.monotonic() - t0)
        rec = wait_for_record(local, budget)
        print(f"mtc preempt: {rec.to_dict() if rec is not None else 'no flush record within the budget'}",
              file=sys.stderr)
    return 0
