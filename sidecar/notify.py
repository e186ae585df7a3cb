"""Tell the host's replicator, over its local control socket, that the sidecar committed a step."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc
from sidecar import layout

log = logging.getLogger(__name__)

NOTIFY_TIMEOUT_SECONDS = 1.0


def notify_step_committed(root: Path, step: int, timeout_seconds: float = NOTIFY_TIMEOUT_SECONDS) -> bool:
    """Wake the replicator of the host owning ``root`` for ``step``; True when it answered.

    Best effort by design: the replicator also finds the step by its periodic scan, so a missing or busy
    daemon only delays replication by one heartbeat interval and is not an error for the training step.
    """
    sock = layout.control_socket(root)
    if not sock.exists():
        return False
    try:
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            control_pb2_grpc.LocalControlStub(ch).StepCommitted(
                control_pb2.StepCommittedRequest(step=step), timeout=timeout_seconds)
        return True
    except grpc.RpcError as e:
        log.debug("replicator not reachable on %s: %s", sock, e)
        return False
