"""A client of the coordinator for the fault tests, run inside a namespace of the test network.

``watch``: until SIGTERM, every ``--interval`` seconds, asks a ``CoordinatorClient`` with every candidate
for the newest complete step (``GetSteps``) and the status, and asks each ``--direct`` candidate alone for its
status; appends one JSON line per answer (or error) to ``--out``, with ``time.monotonic()`` (the same clock
as the test's). ``restore``: one ``prepare_restore`` of the newest step (or ``--step``) through every candidate; prints one
JSON line (step, seconds) and exits 0, or prints the error and exits 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import grpc

from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import coordinator_pb2_grpc as cpb_grpc
from replicator.coordinator.client import CoordinatorClient
from replicator.net import rpc

RPC_TIMEOUT_SECONDS = 2.0
DIRECT_TIMEOUT_SECONDS = 1.0

_stop = False


def _on_term(*_: object) -> None:
    global _stop
    _stop = True


def _code(e: grpc.RpcError) -> str:
    return e.code().name if hasattr(e, "code") else type(e).__name__


def _client_record(client: CoordinatorClient) -> dict:
    rec: dict = {"who": "client"}
    try:
        steps = client.steps(wait_seconds=0)
        rec["newest"] = steps.newest_complete_step
        rec["steps_epoch"] = steps.epoch
        st = client.status()
        rec.update(code="OK", serving=client.serving_address, epoch=st.epoch, address=st.coordinator_address,
                   status_newest=st.newest_complete_step, lost=st.lost_ranks,
                   redundant=[s.step for s in st.steps if s.complete and s.redundant])
    except grpc.RpcError as e:
        rec["code"] = _code(e)
    return rec


def _direct_record(address: str, stub: cpb_grpc.CoordinatorStub) -> dict:
    rec: dict = {"who": f"direct:{address}"}
    try:
        st = stub.GetStatus(cpb.GetStatusRequest(), timeout=DIRECT_TIMEOUT_SECONDS)
        rec.update(code="OK", epoch=st.epoch, newest=st.newest_complete_step, lost=st.lost_ranks)
    except grpc.RpcError as e:
        rec.update(code=_code(e), detail=(e.details() or "")[:80] if hasattr(e, "details") else "")
    return rec


def watch(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _on_term)
    client = CoordinatorClient(args.candidates, rpc_timeout_seconds=RPC_TIMEOUT_SECONDS,
                               failover_seconds=2 * RPC_TIMEOUT_SECONDS)
    direct = [(a, cpb_grpc.CoordinatorStub(rpc.make_channel(a))) for a in args.direct.split(",") if a]
    with open(args.out, "a", buffering=1) as out:
        while not _stop:
            t0 = time.monotonic()
            for rec in [_client_record(client)] + [_direct_record(a, s) for a, s in direct]:
                rec["t"] = time.monotonic()
                out.write(json.dumps(rec) + "\n")
            time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    client.close()
    return 0


def restore(args: argparse.Namespace) -> int:
    client = CoordinatorClient(args.candidates, rpc_timeout_seconds=RPC_TIMEOUT_SECONDS,
                               failover_seconds=args.wait)
    t0 = time.monotonic()
    try:
        step = client.prepare_restore(None if args.step < 0 else args.step, wait_seconds=args.wait)
    except (grpc.RpcError, TimeoutError, FileNotFoundError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        return 1
    finally:
        client.close()
    print(json.dumps({"step": step, "seconds": round(time.monotonic() - t0, 3)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fault_probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("--candidates", required=True)
    w.add_argument("--direct", default="")
    w.add_argument("--out", required=True)
    w.add_argument("--interval", type=float, default=0.3)
    r = sub.add_parser("restore")
    r.add_argument("--candidates", required=True)
    r.add_argument("--wait", type=float, default=60.0)
    r.add_argument("--step", type=int, default=-1, help="the step to restore (-1: the newest recoverable)")
    args = p.parse_args(argv)
    return watch(args) if args.cmd == "watch" else restore(args)


if __name__ == "__main__":
    sys.exit(main())
