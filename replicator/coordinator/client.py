"""The controller's view of the replicators: globally complete steps and restore preparation."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class CoordinatorClient:
    """Calls to the coordinator, each with a deadline."""

    def __init__(self, address: str, token_file: str | None = None, rpc_timeout_seconds: float = 30.0,
                 tls: Any = None):
        from replicator.net import rpc

        token = Path(token_file).read_text().strip() if token_file else None
        self.address = address
        self.timeout = rpc_timeout_seconds
        self._channel = rpc.make_channel(address, token=token, tls=tls)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    def steps(self, wait_seconds: float | None = None) -> pb.GetStepsResponse:
        wait = self.timeout / 2 if wait_seconds is None else wait_seconds
        return self._stub.GetSteps(pb.GetStepsRequest(wait_seconds=wait), timeout=wait + self.timeout)

    def complete_steps(self) -> list[int]:
        return list(self.steps().complete_steps)

    def prepare_restore(self, step: int | None, wait_seconds: float) -> int:
        """Have every host hold its data of ``step`` (default: newest recoverable); returns the step."""
        resp = self._stub.PrepareRestore(
            pb.PrepareRestoreRequest(step=-1 if step is None else step, wait_seconds=wait_seconds),
            timeout=wait_seconds + self.timeout,
        )
        if resp.step < 0:
            raise FileNotFoundError(f"nothing to restore: {resp.reason}")
        if not resp.ready:
            raise TimeoutError(f"restore of step {resp.step} not ready: {resp.reason}")
        log.info("coordinator prepared restore: %s", resp.reason)
        return resp.step

    def status(self) -> dict[str, Any]:
        resp = self._stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout)
        return json.loads(resp.status_json)

    def close(self) -> None:
        self._channel.close()
