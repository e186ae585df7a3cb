"""The fetching side of the peer tier: copy a step from a peer, verified, committed only when complete.

Bulk bytes arrive over the peer's TCP data port (``recv_into`` a ring of buffers, crc32c on the receiving
thread, ``pwrite`` on a writer thread) after ``OpenTransfer`` handed out a ticket; the ``ReadFiles`` gRPC
stream is the fallback (TLS, no data port, port unreachable) and the path of transfers under
``STREAM_BELOW_BYTES``. Why not gRPC streaming: measured on our 2-core box, Python gRPC streaming with 1 MiB
messages reaches 0.2-0.6 of raw loopback TCP, this path 0.8-1.0 on a quiet box (``python -m bench.peer``).
See docs/peer.md. The daemon passes ``channels`` (``replicator.peer.channels``): one kept gRPC channel per peer.

A fetched step is written under a temporary sibling directory and committed by rename only after every
file's crc32c matched the manifest, so a partial copy is never visible.

Where the bytes land (whole files or erasure pieces, verified as they arrive) is replicator/peer/sinks.py.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator import restore_phases
from replicator.net import rpc
from replicator.net.address import host_of
from replicator.net.security import TlsOptions
from replicator.peer.channels import PeerChannels
from replicator.peer.progress import FetchProgress
from replicator.peer.protocol import (
    DATA_CONNECT_TIMEOUT_SECONDS,
    DATA_IDLE_TIMEOUT_SECONDS,
    DATA_MAGIC,
    RECV_BYTES,
    STATUS_OK,
    STREAM_BELOW_BYTES,
    STREAM_CHUNK_BYTES,
    PeerUnavailableError,
    RateLimiter,
    Throttle,
    TransferRejected,
    keep_alive,
    recv_exact,
    stream_chunks,
)
from replicator.peer.sinks import FileSink, PieceSink
from sidecar import checksums, commit, faults, layout, spares
from sidecar.checksums import ChecksumError
from sidecar.layout import FileEntry, ManifestError, StepManifest

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- client side


@dataclasses.dataclass(frozen=True)
class HeldStep:
    """One committed step a peer holds (its own or a copy of ``owner_rank``'s)."""

    owner_rank: int
    step: int
    content_hash: str
    total_bytes: int
    kind: str
    file_count: int


Peer = grpc.Channel | str


class DataPortUnreachable(ConnectionError):
    """No connection to the peer's data port within ``DATA_CONNECT_TIMEOUT_SECONDS`` (no byte sent yet: the
    gRPC stream, over the channel's established connection, takes over)."""


@contextmanager
def _open(peer: Peer, token: str | None, tls: TlsOptions | None,
          channels: PeerChannels | None = None) -> Iterator[tuple[grpc.Channel, str | None]]:
    """(channel, host to dial for the data port or None when unknown). An address's channel comes from
    ``channels`` (kept for the next call) when given, else it is made for this call and closed after it."""
    if not isinstance(peer, str):
        yield peer, None
        return
    host = host_of(peer)
    if channels is not None:
        with channels.lease(peer, token=token, tls=tls) as channel:
            yield channel, host
        return
    channel = rpc.make_channel(peer, token=token, tls=tls)
    try:
        yield channel, host
    finally:
        channel.close()


def _wait_until_connected(channel: grpc.Channel, seconds: float) -> None:
    """Wait up to ``seconds`` for ``channel`` to connect; a peer still unreachable then fails the next call."""
    try:
        grpc.channel_ready_future(channel).result(timeout=seconds)
    except grpc.FutureTimeoutError:
        pass


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("peer transfer deadline exceeded")
    return left


def list_steps(
    peer: Peer,
    *,
    timeout_seconds: float = rpc.RPC_TIMEOUT_SECONDS,
    token: str | None = None,
    tls: TlsOptions | None = None,
    channels: PeerChannels | None = None,
) -> list[HeldStep]:
    """Every committed step ``peer`` holds (its channel from ``channels`` when given, as for every call here)."""
    with _open(peer, token, tls, channels) as (channel, _):
        resp = peer_pb2_grpc.PeerStub(channel).ListSteps(peer_pb2.ListStepsRequest(), timeout=timeout_seconds)
    return [
        HeldStep(s.owner_rank, s.step, s.content_hash, s.total_bytes, s.kind, s.file_count)
        for s in resp.steps
    ]


def _get_manifest(stub: Any, rank: int, step: int, timeout_seconds: float) -> StepManifest:
    resp = stub.GetManifest(peer_pb2.GetManifestRequest(rank=rank, step=step), timeout=timeout_seconds)
    manifest = StepManifest.from_json(resp.manifest_json)  # untrusted: validates every name
    if manifest.rank != rank or manifest.step != step:
        raise ManifestError(
            f"peer sent the manifest of rank {manifest.rank} step {manifest.step}, "
            f"asked for rank {rank} step {step}"
        )
    return manifest


def get_manifest(
    peer: Peer,
    rank: int,
    step: int,
    *,
    timeout_seconds: float = rpc.RPC_TIMEOUT_SECONDS,
    token: str | None = None,
    tls: TlsOptions | None = None,
    channels: PeerChannels | None = None,
) -> StepManifest:
    """The validated manifest of ``rank``'s ``step`` as held by ``peer``."""
    with _open(peer, token, tls, channels) as (channel, _):
        return _get_manifest(peer_pb2_grpc.PeerStub(channel), rank, step, timeout_seconds)


def _connect_data(host: str, port: int, deadline: float) -> socket.socket:
    """A new connection to the peer's data port (one per transfer: the server closes it after the files);
    DataPortUnreachable when none is made within ``DATA_CONNECT_TIMEOUT_SECONDS``."""
    seconds = min(DATA_CONNECT_TIMEOUT_SECONDS, _remaining(deadline))
    try:
        return keep_alive(socket.create_connection((host, port), timeout=seconds))
    except TimeoutError as e:
        # Its SYNs (or their answers) lost twice: with 8 % loss on every host, about 2 % of connections.
        raise DataPortUnreachable(f"no connection to the data port {host}:{port} within {seconds:.1f}s") from e


def _receive_tcp(
    host: str, port: int, ticket: bytes, sink: FileSink | PieceSink, deadline: float, limiter: RateLimiter
) -> None:
    """Receive the ticket's files from the data port, on this thread alone: each ``recv_into`` of a reused
    ``RECV_BYTES`` buffer takes what has arrived, its crc32c is computed while those bytes are still in cache,
    and the sink ``pwrite``s them (it renames a file only once that crc32c matched its entry)."""
    with _connect_data(host, port, deadline) as sock:
        sock.settimeout(min(DATA_IDLE_TIMEOUT_SECONDS, _remaining(deadline)))
        sock.sendall(DATA_MAGIC + ticket)
        # The server answers once one of its transfer slots is free: wait up to the whole deadline.
        sock.settimeout(_remaining(deadline))
        status = recv_exact(sock, 1)[0]
        if status != STATUS_OK:
            (length,) = struct.unpack(">H", recv_exact(sock, 2))
            reason = recv_exact(sock, length).decode(errors="replace")
            raise TransferRejected(f"data port {host}:{port} refused the transfer: {reason}")
        view = memoryview(bytearray(RECV_BYTES))
        idle = min(DATA_IDLE_TIMEOUT_SECONDS, _remaining(deadline))
        sock.settimeout(idle)
        for idx, e in enumerate(sink.entries):
            offset, crc = 0, 0
            while offset < e.size:
                if deadline - time.monotonic() < idle:  # near the deadline: each wait ends at it
                    idle = _remaining(deadline)  # (settimeout costs syscalls: not on every recv)
                    sock.settimeout(idle)
                k = sock.recv_into(view[: min(RECV_BYTES, e.size - offset)])
                if not k:
                    raise ConnectionError(f"data connection closed in {e.name} at {offset} of {e.size} bytes")
                t_crc = time.perf_counter()
                crc = checksums.crc32c_extend(crc, view[:k])
                restore_phases.verified(time.perf_counter() - t_crc)
                sink.write(idx, offset, view[:k], running_crc=crc)
                offset += k
                limiter.acquire(k)
            sink.finish(idx)


def _receive_stream(
    stub: Any, rank: int, step: int, sink: FileSink, deadline: float, limiter: RateLimiter
) -> None:
    """Receive files over the ``ReadFiles`` gRPC stream, checking each chunk's crc32c."""
    names = [e.name for e in sink.entries]
    req = peer_pb2.ReadFilesRequest(rank=rank, step=step, files=names, chunk_bytes=STREAM_CHUNK_BYTES)
    call = stub.ReadFiles(req, timeout=_remaining(deadline))
    try:
        for chunk in stream_chunks(call, f"ReadFiles of rank {rank} step {step}"):
            idx = chunk.file_index
            if idx >= len(sink.entries):
                raise ConnectionError(f"peer sent file index {idx} of {len(sink.entries)}")
            e = sink.entries[idx]
            t_crc = time.perf_counter()
            bad = chunk.crc32c != checksums.crc32c(chunk.data)
            restore_phases.verified(time.perf_counter() - t_crc)
            if bad:
                raise ChecksumError(
                    f"chunk at {chunk.offset} of {e.name} from peer", chunk.crc32c, checksums.crc32c(chunk.data)
                )
            limiter.acquire(len(chunk.data))
            sink.write(idx, chunk.offset, chunk.data)
            if chunk.offset + len(chunk.data) == e.size:
                sink.finish(idx)
    finally:
        call.cancel()
    if len(sink.done) != len(sink.entries):
        missing = sink.entries[len(sink.done)].name
        raise ConnectionError(f"stream ended before {missing} was complete")


def fetch_files(
    peer: Peer,
    owner_rank: int,
    step: int,
    entries: Sequence[FileEntry],
    dest_dir: Path,
    *,
    timeout_seconds: float = rpc.TRANSFER_TIMEOUT_SECONDS,
    throttle: Throttle | None = None,
    token: str | None = None,
    tls: TlsOptions | None = None,
    use_data_port: bool = True,
    pieces: Sequence[layout.FilePiece] = (),
    channels: PeerChannels | None = None,
) -> int:
    """Copy some files of ``owner_rank``'s ``step`` from ``peer`` into the existing ``dest_dir``.

    ``pieces``: only these byte ranges of ``entries`` (over the data port; the gRPC stream sends whole
    files): each lands at its offset in a file of the full size, once its crc32c matched.

    ``entries`` come from the manifest the caller trusts (``get_manifest``); every file lands under its
    final name only once its crc32c matched. Files already present in ``dest_dir`` → FileExistsError
    before anything is transferred. On error, files completed so far stay, the partial one is removed.
    Returns the number of bytes received. The TCP data port is used unless ``use_data_port`` is False,
    ``tls`` is set, the files are fewer than ``STREAM_BELOW_BYTES`` (and no ``pieces``), or the server offers
    none / cannot be reached (then the gRPC stream is used).
    """
    deadline = time.monotonic() + timeout_seconds
    with _open(peer, token, tls, channels) as (channel, host):
        return _fetch_files_on(
            channel,
            host,
            owner_rank,
            step,
            entries,
            Path(dest_dir),
            deadline,
            throttle,
            use_data_port and tls is None,
            pieces=pieces,
        )


def _fetch_files_on(
    channel: grpc.Channel,
    host: str | None,
    owner_rank: int,
    step: int,
    entries: Sequence[FileEntry],
    dest_dir: Path,
    deadline: float,
    throttle: Throttle | None,
    use_data_port: bool,
    pool: spares.SparePool | None = None,
    progress: FetchProgress | None = None,
    pieces: Sequence[layout.FilePiece] = (),
) -> int:
    limiter = RateLimiter((throttle or Throttle()).bytes_per_second)
    entries = list(entries)
    sink: FileSink | PieceSink = (PieceSink(dest_dir, entries, pieces) if pieces
                                    else FileSink(dest_dir, entries, pool, progress))
    start = time.monotonic()
    path = "stream"
    stub = peer_pb2_grpc.PeerStub(channel)
    try:
        done_tcp = False
        # Pieces only over the data port (the stream sends whole files); a small transfer over the stream.
        if use_data_port and entries and (pieces or sum(e.size for e in entries) >= STREAM_BELOW_BYTES):
            req = peer_pb2.OpenTransferRequest(rank=owner_rank, step=step, files=[e.name for e in entries],
                                               pieces=[peer_pb2.TransferPiece(name=pc.name, offset=pc.offset,
                                                                              length=pc.length) for pc in pieces])
            resp = stub.OpenTransfer(req, timeout=min(rpc.RPC_TIMEOUT_SECONDS, _remaining(deadline)))
            offered = [FileEntry(f.name, f.size, f.crc32c) for f in resp.files]
            if offered != entries:
                raise ManifestError(
                    f"peer's files for rank {owner_rank} step {step} differ from the manifest"
                )
            data_host = resp.data_host or host
            if resp.data_port and data_host:
                try:
                    _receive_tcp(data_host, resp.data_port, resp.ticket, sink, deadline, limiter)
                    done_tcp, path = True, "tcp"
                except (ConnectionRefusedError, socket.gaierror, DataPortUnreachable, TransferRejected) as e:
                    # Unreachable, or refused before any byte (busy, ticket expired while queued).
                    log.warning(
                        "data port %s:%d unusable (%s); falling back to gRPC streaming",
                        data_host,
                        resp.data_port,
                        e,
                    )
        if not done_tcp:
            if isinstance(sink, PieceSink):  # the stream sends whole files: those, then
                sink.abort()
                sink = FileSink(dest_dir, entries, pool, progress)
            _receive_stream(stub, owner_rank, step, sink, deadline, limiter)
    except BaseException:
        sink.abort()
        raise
    dt = max(time.monotonic() - start, 1e-9)
    log.info(
        "fetched %d files (%d bytes) of rank %d step %d over %s in %.3fs (%.1f MiB/s)",
        len(entries),
        sink.bytes,
        owner_rank,
        step,
        path,
        dt,
        sink.bytes / dt / 2**20,
    )
    return sink.bytes


def _peer_manifest(channel: grpc.Channel, owner_rank: int, step: int, deadline: float, connect_wait_seconds: float,
                   expected_content_hash: str | None) -> StepManifest:
    """The peer's manifest of ``owner_rank``'s ``step``, checked: it names no manifest file of its own and has
    the expected content hash (ManifestError). A refusing peer is waited for ``connect_wait_seconds``."""
    stub = peer_pb2_grpc.PeerStub(channel)
    try:
        manifest = _get_manifest(stub, owner_rank, step, min(rpc.RPC_TIMEOUT_SECONDS, _remaining(deadline)))
    except grpc.RpcError as e:
        if connect_wait_seconds <= 0 or e.code() is not grpc.StatusCode.UNAVAILABLE:
            raise
        # Refused (a restarting daemon, say): wait for the peer to listen again, then ask once more.
        _wait_until_connected(channel, min(connect_wait_seconds, _remaining(deadline)))
        manifest = _get_manifest(stub, owner_rank, step, min(rpc.RPC_TIMEOUT_SECONDS, _remaining(deadline)))
    if any(f.name == layout.MANIFEST_NAME for f in manifest.files):
        raise ManifestError(
            f"rank {owner_rank} step {step}: the manifest lists a file named {layout.MANIFEST_NAME}"
        )
    if expected_content_hash is not None and manifest.content_hash != expected_content_hash:
        raise ManifestError(
            f"rank {owner_rank} step {step}: content hash {manifest.content_hash[:12]} "
            f"differs from the expected {expected_content_hash[:12]}"
        )
    return manifest


def fetch_step(
    peer: Peer,
    owner_rank: int,
    step: int,
    dest_parent: Path,
    *,
    timeout_seconds: float = rpc.TRANSFER_TIMEOUT_SECONDS,
    throttle: Throttle | None = None,
    token: str | None = None,
    tls: TlsOptions | None = None,
    use_data_port: bool = True,
    expected_content_hash: str | None = None,
    spare_dir: Path | None = None,
    progress: FetchProgress | None = None,
    connect_wait_seconds: float = 0.0,
    channels: PeerChannels | None = None,
) -> StepManifest:
    """Copy ``owner_rank``'s ``step`` from ``peer`` and commit it as ``dest_parent/<step>``.

    ``connect_wait_seconds``: how long a peer that refuses connections is waited for before the fetch fails
    (gRPC's own channel readiness, reconnecting with ``rpc.RECONNECT_OPTIONS``): a daemon that restarts (every
    daemon of an Orbax handshake restarts at once) is back within a second, and its copy beats the bucket.

    ``spare_dir``: the destination RAM disk's pool of recycled files (``spares.spare_dir``), whose
    already-allocated pages are overwritten instead of allocating fresh ones. ``progress``: told the
    temporary directory, each file's bytes written so far, and the outcome, so that a reader can consume
    the copy while it lands (``replicator.peer.progress``); each part file then has its full size from
    the start (bytes past the watermark are not written yet).

    ``peer`` is a channel or a "host:port" address (then ``token``/``tls`` configure the channel, taken from
    ``channels`` when given: one kept channel per peer, see ``replicator.peer.channels``).
    Everything is written into a temporary sibling directory and renamed into place only after every
    file's crc32c matched the manifest; on any error the temporary directory is removed, and a crash
    leaves only a ``.tmp-*`` directory that ``commit.remove_tmp_dirs`` deletes. Raises FileExistsError
    when the step is already committed there, ChecksumError on corrupt data, ManifestError on a bad
    manifest (or one whose content hash differs from ``expected_content_hash``), grpc.RpcError,
    ConnectionError or TimeoutError on transport failures.
    """
    dest_parent = Path(dest_parent)
    final = dest_parent / layout.step_name(step)
    if (final / layout.MANIFEST_NAME).is_file():  # debris without a manifest is replaced at commit
        raise FileExistsError(f"step directory {final} already exists")
    deadline = time.monotonic() + timeout_seconds
    with _open(peer, token, tls, channels) as (channel, host):
        manifest = _peer_manifest(channel, owner_rank, step, deadline, connect_wait_seconds, expected_content_hash)
        tmp = commit.make_tmp_dir(dest_parent, step)
        if progress is not None:
            progress.begin(manifest, tmp, final)
        faults.point("peer.fetch.after_tmp_dir")
        try:
            _fetch_files_on(channel, host, owner_rank, step, manifest.files, tmp, deadline, throttle,
                            use_data_port and tls is None,
                            spares.SparePool(spare_dir) if spare_dir is not None else None, progress)
            faults.point("peer.fetch.before_manifest")
            commit.write_manifest(tmp, manifest)
            faults.point("peer.fetch.before_commit")
            commit.commit_dir(tmp, final)
            if progress is not None:
                progress.committed()
            faults.point("peer.fetch.after_commit")
        except BaseException as e:
            if progress is not None:
                progress.failed(e)
            shutil.rmtree(tmp, ignore_errors=True)
            if spare_dir is not None and getattr(e, "errno", None) == errno.ENOSPC:
                spares.drop_spares(spare_dir)  # the recycled pages were not enough: free them for the retry
            raise
    return manifest


def fetch_step_from_any(
    holders: Sequence[Peer],
    owner_rank: int,
    step: int,
    dest_parent: Path,
    *,
    start_index: int = 0,
    timeout_seconds: float = rpc.TRANSFER_TIMEOUT_SECONDS,
    throttle: Throttle | None = None,
    token: str | None = None,
    tls: TlsOptions | None = None,
    use_data_port: bool = True,
    expected_content_hash: str | None = None,
    spare_dir: Path | None = None,
    channels: PeerChannels | None = None,
) -> StepManifest:
    """``fetch_step`` from the first holder that delivers a verified copy.

    Holders are tried in order starting at ``start_index % len(holders)`` and wrapping around; pass
    e.g. the fetching host's own rank so that many hosts restoring at once spread over the holders.
    ``timeout_seconds`` applies to each attempt. FileExistsError is raised at once; after every holder
    failed, PeerUnavailableError carries each holder's error.
    """
    if not holders:
        raise PeerUnavailableError(f"no holder of rank {owner_rank} step {step}")
    n = len(holders)
    errors: list[tuple[str, BaseException]] = []
    for i in range(n):
        holder = holders[(start_index + i) % n]
        name = holder if isinstance(holder, str) else f"channel#{(start_index + i) % n}"
        try:
            return fetch_step(
                holder,
                owner_rank,
                step,
                dest_parent,
                timeout_seconds=timeout_seconds,
                throttle=throttle,
                token=token,
                tls=tls,
                use_data_port=use_data_port,
                expected_content_hash=expected_content_hash,
                spare_dir=spare_dir,
                channels=channels,
            )
        except FileExistsError:
            raise
        except (
            grpc.RpcError,
            OSError,
            ValueError,
            EOFError,
        ) as e:  # OSError covers Checksum/Connection/Timeout
            log.warning("fetching rank %d step %d from %s failed: %s", owner_rank, step, name, e)
            errors.append((name, e))
    summary = "; ".join(f"{h}: {type(e).__name__}: {_short(e)}" for h, e in errors)
    raise PeerUnavailableError(
        f"no holder delivered rank {owner_rank} step {step}: {summary}", errors
    ) from errors[-1][1]


def _short(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"{e.code().name} {e.details()}"
    return str(e)

