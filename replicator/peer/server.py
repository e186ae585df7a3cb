"""The serving side of the peer tier: the ``Peer`` gRPC servicer and the TCP data port it issues tickets for.

Control goes over gRPC (``ListSteps``, ``GetManifest``, ``OpenTransfer``); bulk bytes go over a plain TCP
connection to the ``TransferServer`` (``sendfile`` from the RAM disk), authorised by a single-use,
expiring ticket that ``OpenTransfer`` issued over the authenticated channel. ``ReadFiles`` (gRPC
streaming, per-chunk crc32c) is the fallback. Every request is validated before anything touches disk.

The data port and its tickets are in ``replicator.peer.data_port``; every peer-supplied name is validated
here, before a ticket names it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.erasure.holder import ParityStore, check_digest
from replicator.net import rpc
from replicator.peer.data_port import TransferServer
from replicator.peer.protocol import (
    MAX_FILES_PER_REQUEST,
    MAX_STEP,
    MAX_STREAM_CHUNK_BYTES,
    STREAM_CHUNK_BYTES,
    RateLimiter,
    Throttle,
    served_chunk,
)
from sidecar import checksums, commit, layout
from sidecar.checksums import ChecksumError
from sidecar.layout import FileEntry, ManifestError, StepManifest

__all__ = ["PeerServicer", "TransferServer", "step_dir_for"]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- where steps live


def step_dir_for(root: Path, own_rank: int, rank: int, step: int) -> Path:
    """The committed directory of ``rank``'s ``step`` on a host: its own steps or its peer copies."""
    name = layout.step_name(step)
    if rank == own_rank:
        return layout.steps_dir(root) / name
    return layout.peer_dir(root, rank) / name


def _check_rank_step(rank: int, step: int, nodes: int) -> None:
    if not 0 <= rank < nodes:
        raise ValueError(f"unknown rank {rank}: the job has ranks 0..{nodes - 1}")
    if not 0 <= step < MAX_STEP:
        raise ValueError(f"invalid step {step}")


def _select_files(manifest: StepManifest, names: Sequence[str], max_files: int) -> list[FileEntry]:
    """The manifest entries for ``names`` (all files when empty), validating every requested name."""
    return _select(manifest.files, names, max_files, f"rank {manifest.rank} step {manifest.step}")


def _select(files: Sequence[FileEntry], names: Sequence[str], max_files: int, what: str) -> list[FileEntry]:
    """The entries of ``files`` for ``names`` (all when empty), validating every requested name."""
    if not names:
        return list(files)
    if len(names) > max_files:
        raise ValueError(f"{len(names)} file names in one request exceed the limit of {max_files}")
    by_name = {f.name: f for f in files}
    seen: set[str] = set()
    out = []
    for name in names:
        layout.safe_relpath(name)  # ValueError for absolute, '..', NUL, ...
        if name in seen:
            raise ValueError(f"file {name!r} requested twice")
        seen.add(name)
        entry = by_name.get(name)
        if entry is None:
            raise FileNotFoundError(f"file {name!r} is not part of {what}")
        out.append(entry)
    return out



def _pieces(entries: Sequence[FileEntry], pieces: Sequence[Any]) -> tuple[tuple[FileEntry, int, int], ...]:
    """The (file, offset, length) ranges an OpenTransfer asks for instead of whole files (ValueError, i.e.
    INVALID_ARGUMENT, on a piece of another file, out of its file, or out of order)."""
    if len(pieces) > MAX_FILES_PER_REQUEST:
        raise ValueError(f"{len(pieces)} pieces in one request (at most {MAX_FILES_PER_REQUEST})")
    asked = [layout.FilePiece(pc.name, int(pc.offset), int(pc.length), 0) for pc in pieces]
    layout.check_pieces(entries, asked)
    by_name = {e.name: e for e in entries}
    return tuple((by_name[pc.name], pc.offset, pc.length) for pc in asked)


# --------------------------------------------------------------------------- the gRPC servicer


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """Thin ``Peer`` servicer over a host's local root; validates every request before touching disk.

    ``transfer_server``: the data port to issue tickets for (None = no fast path: ``OpenTransfer``
    returns ``data_port=0`` and clients use ``ReadFiles``; do this when TLS is on). ``throttle``
    limits ``ReadFiles`` when there is no transfer server (otherwise the server's limiter is shared).
    """

    def __init__(
        self,
        root: Path,
        own_rank: int,
        nodes: int,
        *,
        transfer_server: TransferServer | None = None,
        throttle: Throttle | None = None,
        advertise_host: str = "",
        max_files_per_request: int = MAX_FILES_PER_REQUEST,
        parity: ParityStore | None = None,
        rebuild: Callable[[Any], Iterator[memoryview]] | None = None,
        max_rebuilds: int = 2,
    ):
        if not isinstance(nodes, int) or nodes < 1 or not 0 <= own_rank < nodes:
            raise ValueError(f"bad own_rank/nodes {own_rank}/{nodes}")
        self.root = Path(root)
        self.own_rank = own_rank
        self.nodes = nodes
        self.transfer_server = transfer_server
        self.advertise_host = advertise_host
        self.max_files = max_files_per_request
        self._parity = parity  # this host's parity (erasure coding); made on the first request for it if None
        # RebuildFragments (a spread rebuild, replicator.erasure.spread.serve, at most ``max_rebuilds`` at once:
        # the daemon passes spread.MAX_SERVED): None = not served here.
        self._rebuild = rebuild
        self._rebuild_slots = threading.BoundedSemaphore(max(1, max_rebuilds))
        # A chain link of a pipelined rebuild (request.chain, replicator.erasure.pipeline) decodes nothing and is
        # in two runs of each rebuild at once: slots of its own, so a failed chain's links still winding down
        # never make the spread rebuild that follows it RESOURCE_EXHAUSTED.
        self._chain_slots = threading.BoundedSemaphore(4 * max(1, max_rebuilds))
        if transfer_server is not None:
            self._limiter, self._slots = transfer_server.limiter, transfer_server.slots
        else:
            t = throttle or Throttle()
            self._limiter, self._slots = (
                RateLimiter(t.bytes_per_second),
                threading.BoundedSemaphore(t.max_streams),
            )

    # -- helpers

    def _load(self, rank: int, step: int, context: grpc.ServicerContext) -> tuple[Path, StepManifest, bytes]:
        _check_rank_step(rank, step, self.nodes)
        step_dir = step_dir_for(self.root, self.own_rank, rank, step)
        try:
            with open(step_dir / layout.MANIFEST_NAME, "rb") as f:
                raw = f.read(layout.MAX_MANIFEST_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"rank {rank} step {step} is not held by rank {self.own_rank}") from None
        try:
            manifest = layout.parse_manifest(raw)  # remembered by its bytes: asked for once per fetch
            if manifest.rank != rank or manifest.step != step:
                raise ManifestError(f"manifest says rank {manifest.rank} step {manifest.step}")
        except ManifestError as e:
            log.error("corrupt manifest in %s: %s", step_dir, e)
            context.abort(grpc.StatusCode.DATA_LOSS, f"manifest of rank {rank} step {step} is corrupt: {e}")
        return step_dir, manifest, raw

    def _parity_entries(self, request: Any) -> tuple[Path, list[FileEntry]]:
        """The files of this host's parity of ``request.step`` for the group ``request.parity`` names."""
        _check_rank_step(request.rank, request.step, self.nodes)
        if request.rank != self.own_rank:
            raise ValueError(f"parity is read from its holder: rank {request.rank} is not this host's "
                             f"({self.own_rank})")
        check_digest(request.parity)  # ValueError before any path is built from it
        if self._parity is None:
            self._parity = ParityStore(self.root, self.own_rank)
        parity_dir, files = self._parity.entries(request.step, request.parity)
        what = f"rank {self.own_rank}'s parity of step {request.step} ({request.parity})"
        return parity_dir, _select(files, list(request.files), self.max_files, what)

    def _check_parity(self, request: Any, sends: Sequence[tuple[FileEntry, int, int]]) -> None:
        """Parity is verified before it is served (:meth:`ParityStore.verify`): bit rot drops it here."""
        if request.parity and self._parity is not None:
            self._parity.verify(request.step, request.parity, [(e.name, o, n) for e, o, n in sends])

    def _entries(
        self, request: Any, context: grpc.ServicerContext
    ) -> tuple[Path, list[FileEntry]]:
        if request.parity:
            step_dir, entries = self._parity_entries(request)
        else:
            step_dir, manifest, _ = self._load(request.rank, request.step, context)
            entries = _select_files(manifest, list(request.files), self.max_files)
        for e in entries:
            path = layout.resolve_under(step_dir, e.name)  # ValueError on a symlink escaping the step
            if not path.is_file():
                raise FileNotFoundError(
                    f"file {e.name!r} of rank {request.rank} step {request.step} is missing"
                )
        return step_dir, entries

    # -- RPCs

    @rpc.map_errors
    def ListSteps(self, request: Any, context: grpc.ServicerContext) -> Any:
        resp = peer_pb2.ListStepsResponse(own_rank=self.own_rank, nodes=self.nodes)
        for rank, step, step_dir in self._held():
            try:
                m = layout.read_manifest(step_dir)
            except (OSError, ManifestError) as e:
                log.warning("skipping unreadable step %s: %s", step_dir, e)
                continue
            if m.rank != rank or m.step != step:
                log.warning("skipping %s: manifest says rank %d step %d", step_dir, m.rank, m.step)
                continue
            resp.steps.add(
                owner_rank=rank,
                step=step,
                content_hash=m.content_hash,
                total_bytes=m.total_bytes,
                kind=m.kind,
                file_count=len(m.files),
            )
        return resp

    def _held(self) -> Iterator[tuple[int, int, Path]]:
        for step in commit.committed_steps(layout.steps_dir(self.root)):
            yield self.own_rank, step, layout.steps_dir(self.root) / layout.step_name(step)
        peer_root = self.root / layout.PEER_DIR
        if not peer_root.is_dir():
            return
        for child in sorted(peer_root.iterdir(), key=lambda p: p.name):
            rank = layout.parse_step_name(child.name)
            if rank is None or rank == self.own_rank or rank >= self.nodes or child.is_symlink():
                continue
            for step in commit.committed_steps(child):
                yield rank, step, child / layout.step_name(step)

    @rpc.map_errors
    def GetManifest(self, request: Any, context: grpc.ServicerContext) -> Any:
        _, _, raw = self._load(request.rank, request.step, context)
        return peer_pb2.GetManifestResponse(manifest_json=raw)

    @rpc.map_errors
    def OpenTransfer(self, request: Any, context: grpc.ServicerContext) -> Any:
        step_dir, entries = self._entries(request, context)
        sends = _pieces(entries, request.pieces)
        self._check_parity(request, sends or [(e, 0, e.size) for e in entries])
        resp = peer_pb2.OpenTransferResponse(
            files=[peer_pb2.TransferFile(name=e.name, size=e.size, crc32c=e.crc32c) for e in entries]
        )
        ts = self.transfer_server
        if ts is not None and ts.running:
            try:
                resp.ticket = ts.issue_ticket(request.rank, request.step, step_dir, entries, sends)
            except OSError as e:  # stopping, or too many pending tickets: the client streams (whole files)
                log.warning("no data-port ticket for rank %d step %d: %s", request.rank, request.step, e)
            else:
                resp.data_port = ts.port
                resp.expires_in_ms = int(ts.tickets.ttl_seconds * 1000)
                resp.data_host = self.advertise_host
        return resp

    @rpc.map_errors
    def ReadFiles(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        step_dir, entries = self._entries(request, context)
        # Whole files, or (pieces) only these ranges: a chunk's file_index is then its piece's index.
        sends = _pieces(entries, request.pieces) or tuple((e, 0, e.size) for e in entries)
        self._check_parity(request, sends)
        chunk = request.chunk_bytes or STREAM_CHUNK_BYTES
        chunk = max(64 << 10, min(int(chunk), MAX_STREAM_CHUNK_BYTES))
        if not self._slots.acquire(timeout=rpc.RPC_TIMEOUT_SECONDS):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent transfers, retry later")
        start, sent = time.monotonic(), 0
        try:
            for idx, (e, first_byte, length) in enumerate(sends):  # (not ``start``: the transfer's clock)
                with open(layout.resolve_under(step_dir, e.name), "rb") as f:
                    offset, end = first_byte, first_byte + length
                    f.seek(first_byte)
                    while True:
                        if not context.is_active():
                            log.info("ReadFiles of rank %d step %d cancelled", request.rank, request.step)
                            return
                        n = min(chunk, end - offset)
                        self._limiter.acquire(n)
                        data = f.read(n)
                        if len(data) != n:
                            raise ChecksumError(f"{e.name} (file shorter than its manifest)", e.crc32c, 0)
                        first = offset == first_byte
                        yield peer_pb2.FileChunk(
                            file_index=idx,
                            offset=offset,
                            data=data,
                            crc32c=checksums.crc32c(data),
                            name=e.name if first else "",
                            file_size=e.size if first else 0,
                        )
                        offset += n
                        sent += n
                        served_chunk()
                        if offset >= end:
                            break
        finally:
            self._slots.release()
        dt = max(time.monotonic() - start, 1e-9)
        log.info(
            "streamed rank %d step %d: %d bytes in %.3fs (%.1f MiB/s)",
            request.rank,
            request.step,
            sent,
            dt,
            sent / dt / 2**20,
        )

    @rpc.map_errors
    def RebuildFragments(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if self._rebuild is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this host rebuilds no fragments for others")
        slots = self._chain_slots if request.chain else self._rebuild_slots
        if not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rebuilding for others already; decode it yourself")
        sent = 0
        try:
            for idx, frag in enumerate(self._rebuild(request)):
                if not context.is_active():
                    log.info("RebuildFragments of rank %d step %d cancelled", request.rank, request.step)
                    return
                for offset in range(0, max(1, len(frag)), STREAM_CHUNK_BYTES):
                    data = bytes(frag[offset:offset + STREAM_CHUNK_BYTES])
                    yield peer_pb2.FileChunk(file_index=idx, offset=offset, data=data, crc32c=checksums.crc32c(data))
                    sent += len(data)
        finally:
            slots.release()
        log.info("sent %d rebuilt bytes of rank %d step %d", sent, request.rank, request.step)
