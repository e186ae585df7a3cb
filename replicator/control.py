"""The sidecar's local control service: a Unix socket under the host's local directory (owner-only).

The sidecar tells the replicator a step was committed, asks where a step is, and has data it lacks fetched
from the other tiers. Errors become status codes through the shared mapping of :mod:`replicator.net.rpc`
(the sidecar decides by the code: NOT_FOUND no tier has it, INVALID_ARGUMENT a bad request, UNAVAILABLE
anything transient — a peer, the bucket, the coordinator).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import grpc

from mtc_rpc import control_pb2, control_pb2_grpc
from replicator.net.rpc import map_errors_as_unavailable
from sidecar import faults, layout


class ControlTarget(Protocol):
    """What the service asks of its daemon (:class:`replicator.daemon.Replicator`)."""

    def wake(self) -> None: ...
    def local_status(self) -> control_pb2.GetLocalStatusResponse: ...
    def request_backup_now(self) -> None: ...


class StepService(Protocol):
    """Where a step is and its data brought here (:class:`replicator.sidecar_fetch.SidecarFetch`)."""

    def locate(self, step: int) -> tuple[list[int], int]: ...
    def fetch_step(self, owner: int, step: int, manifest_only: bool, replace_local: bool,
                   timeout_seconds: float, min_generation: int = 0) -> tuple[str, bytes]: ...
    def fetch_files(self, owner: int, step: int, entries: list[layout.FileEntry], dest_rel: str,
                    timeout_seconds: float, pieces: Sequence[layout.FilePiece] = ()) -> tuple[str, int]: ...
    def stream_step(self, owner: int, step: int, timeout_seconds: float) -> Iterator[control_pb2.StepLanding]: ...


class NoticeService(Protocol):
    """A preemption notice and whether the job got one (:class:`replicator.preemption.Preemption`)."""

    def status(self) -> control_pb2.GetPreemptionResponse: ...
    def on_notice(self, request: control_pb2.PreemptRequest) -> control_pb2.PreemptResponse: ...


class LocalControl(control_pb2_grpc.LocalControlServicer):
    """Thin servicer over the daemon, its sidecar data service and its preemption handling."""

    def __init__(self, daemon: ControlTarget, steps: StepService, preemption: NoticeService):
        self.daemon = daemon
        self.steps = steps
        self.preemption = preemption

    def StepCommitted(self, request, context):
        faults.point("notify.received")
        self.daemon.wake()
        return control_pb2.StepCommittedResponse()

    def GetLocalStatus(self, request, context):
        return self.daemon.local_status()

    @map_errors_as_unavailable
    def LocateStep(self, request, context):
        savers, generation = self.steps.locate(request.step)
        return control_pb2.LocalLocateResponse(savers=savers, generation=generation)

    @map_errors_as_unavailable
    def FetchStep(self, request, context):
        rel, manifest = self.steps.fetch_step(request.owner_rank, request.step, request.manifest_only,
                                              request.replace_local, _wait_seconds(request.timeout_seconds, context),
                                              min_generation=request.min_generation)
        return control_pb2.FetchStepResponse(step_dir=rel, manifest_json=manifest)

    @map_errors_as_unavailable
    def StreamStep(self, request, context):
        yield from self.steps.stream_step(request.owner_rank, request.step,
                                          _wait_seconds(request.timeout_seconds, context))

    @map_errors_as_unavailable
    def FetchFiles(self, request, context):
        # ManifestError (INVALID_ARGUMENT): a malformed file list.
        entries = [layout.FileEntry.from_dict({"name": f.name, "size": f.size, "crc32c": f.crc32c})
                   for f in request.files]
        # ValueError (INVALID_ARGUMENT): a piece of another file, out of its file, or out of order.
        pieces = [layout.FilePiece(pc.name, pc.offset, pc.length, pc.crc32c) for pc in request.pieces]
        layout.check_pieces(entries, pieces)
        source, nbytes = self.steps.fetch_files(request.owner_rank, request.step, entries, request.dest_dir,
                                                _wait_seconds(request.timeout_seconds, context), pieces)
        return control_pb2.FetchFilesResponse(source=source, bytes=nbytes)

    def GetPreemption(self, request, context):
        return self.preemption.status()

    def BackupNow(self, request, context):
        self.daemon.request_backup_now()
        return control_pb2.BackupNowResponse()

    def Preempt(self, request, context):
        return self.preemption.on_notice(request)


# A wait bounded by the caller's deadline ends this long before it, so the caller gets the answer (what was
# found, or why not) rather than DEADLINE_EXCEEDED with nothing.
ANSWER_MARGIN_SECONDS = 0.25


def _wait_seconds(value: float, context: grpc.ServicerContext | None = None) -> float:
    """A request's ``timeout_seconds``: finite and not negative (ValueError, i.e. INVALID_ARGUMENT: a NaN
    made every deadline computed from it unreachable, and the call never returned), and no longer than the
    call's own deadline allows (less :data:`ANSWER_MARGIN_SECONDS`)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"timeout_seconds must be a finite number >= 0, got {value!r}")
    left = context.time_remaining() if context is not None else None
    if left is not None:
        value = min(value, max(0.0, left - ANSWER_MARGIN_SECONDS))
    return value


def serve_control(daemon: ControlTarget, steps: StepService, preemption: NoticeService, root: Path) -> grpc.Server:
    """Start the local control service on ``<root>``'s control socket (replacing a stale one)."""
    sock = layout.control_socket(root)
    sock.unlink(missing_ok=True)
    # A streamed restore holds a worker for as long as its copy lands: room for it and the other calls.
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
    control_pb2_grpc.add_LocalControlServicer_to_server(LocalControl(daemon, steps, preemption), server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    os.chmod(sock, 0o600)
    return server
