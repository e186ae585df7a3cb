"""`mtc preempt`: tell this host's replicator of a preemption notice ahead of its SIGTERM (a preStop hook).

Kubernetes runs a Pod's preStop hooks before it sends SIGTERM, and sends a native sidecar (the replicator)
SIGTERM only after the main containers have exited. The rendered worker Pods (`mtc manifests`) therefore run
this command as the preStop hook of their main containers: it reaches the replicator over its control
socket ``<local-dir>/replicator.sock`` at the very start of the grace period (replicator/preemption.py).
With ``--wait`` it returns once the replicator's flush is recorded in ``<local-dir>/preemption.json`` (or
the budget is spent), which keeps the container -- and so colocated Python -- alive for the training loop's
last save. Exit 0 when the replicator took the notice, 1 when it could not be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc
from sidecar import layout

PREEMPTION_RECORD = "preemption.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local-dir", required=True, help="the host's RAM-disk directory (the replicator's --local-dir)")
    p.add_argument("--save-window-seconds", type=float, default=0.0,
                   help="how long the replicator waits for the training loop's save after the notice (default 0)")
    p.add_argument("--flush-seconds", type=float, default=20.0,
                   help="then how long it tries to get the newest complete step into the bucket (default 20)")
    p.add_argument("--wait", action="store_true",
                   help="return only once the flush is recorded (or save window + flush seconds have passed)")
    p.add_argument("--timeout-seconds", type=float, default=5.0, help="RPC timeout (default 5)")


def notify(local_dir: Path, save_window_seconds: float, flush_seconds: float,
           timeout_seconds: float = 5.0) -> control_pb2.PreemptResponse:
    """One ``LocalControl.Preempt`` call; raises grpc.RpcError when the replicator is not reachable."""
    sock = layout.control_socket(local_dir)
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        req = control_pb2.PreemptRequest(save_window_seconds=save_window_seconds, flush_seconds=flush_seconds)
        return control_pb2_grpc.LocalControlStub(ch).Preempt(req, timeout=timeout_seconds)


def wait_for_record(local_dir: Path, timeout_seconds: float) -> dict | None:
    """The flush's record once written, None when ``timeout_seconds`` passed first."""
    path = local_dir / PREEMPTION_RECORD
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.2)
    return None


def run(args: argparse.Namespace) -> int:
    local = Path(args.local_dir)
    t0 = time.monotonic()
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
        print(f"mtc preempt: {rec if rec is not None else 'no flush record within the budget'}", file=sys.stderr)
    return 0
