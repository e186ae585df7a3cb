"""Byte ranges of another host's data over the peer tier, for erasure coding: a code group member's step stream
and a parity holder's parity (``proto/peer.proto``, ``OpenTransfer``/``ReadFiles`` with ``pieces`` and ``parity``).

The coder reads 1 MiB stripes, member by member; each member is read sequentially within a rotation, so a
reader fetches a window of :data:`WINDOW_BYTES` at a time (one ``OpenTransfer`` and one data connection per
window) and serves the stripes from it. Each window is a whole transfer: no data-port slot is held while this
host waits for another member (the members of a group all encode at once and read from one another).
Bytes come over the data port (raw; the coder checks every fragment against its crc32c) or, without one
(TLS), over the ``ReadFiles`` stream with a crc32c per chunk. A peer that failed once is not asked again
within the same reader (every stripe would wait for its timeout): its fragments count as unreadable.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import peer_pb2, peer_pb2_grpc
from replicator.erasure.holder import RECORD_NAME, ParityRecord, shard_name
from replicator.erasure.stream import StepStream
from replicator.net import rpc
from replicator.net.address import host_of
from replicator.net.security import TlsOptions
from replicator.peer.protocol import (
    DATA_CONNECT_TIMEOUT_SECONDS,
    DATA_IDLE_TIMEOUT_SECONDS,
    DATA_MAGIC,
    STATUS_OK,
    STREAM_CHUNK_BYTES,
    RateLimiter,
    TransferRejected,
    keep_alive,
    recv_exact,
    stream_chunks,
)
from sidecar import checksums
from sidecar.checksums import ChecksumError
from sidecar.layout import ManifestError

log = logging.getLogger(__name__)

# Bytes one transfer brings of a member's stream or a parity shard (a few stripes: the coder holds one
# window per member it reads, K of them at most). Measured (/dev/shm, every host's Peer server in the test's
# process, 64 MiB per host, load ~1.6-3 on 2 cores, 2026-12-05): 4 MiB and 16 MiB windows alike, encode
# 500-600 / 280 MiB/s of data and rebuild 215-230 / 170-185 MiB/s at 3+1 / 4+2; fetching the next window
# ahead on another thread (one reader thread) was slower here (410 / 200 and 180 / 125-145 MiB/s). The coder
# now reads each member on that member's own thread, a window and a stripe ahead (EcHost.ahead_stripes,
# replicator.erasure.ahead): see docs/benchmarks.md for what that measured.
WINDOW_BYTES = 4 << 20
Piece = tuple[str, int, int]  # (file name, offset, length)


class StaleGroupError(ValueError):
    """A member's data (or a holder's parity) is not the one the code group names: another save."""


class PeerLink:
    """One channel to one peer, for ranged reads; every call has a timeout, the whole life a deadline."""

    def __init__(self, address: str, *, token: str | None, tls: TlsOptions | None, deadline: float,
                 rpc_timeout_seconds: float = rpc.RPC_TIMEOUT_SECONDS, use_data_port: bool = True,
                 limiter: RateLimiter | None = None):
        self.address = address
        self.limiter = limiter or RateLimiter(None)  # the host's replication throttle, shared by a task's links
        self.host = host_of(address)
        self.deadline = deadline
        self.rpc_timeout_seconds = rpc_timeout_seconds
        self.use_data_port = use_data_port and tls is None
        self._channel = rpc.make_channel(address, token=token, tls=tls)
        self._stub = peer_pb2_grpc.PeerStub(self._channel)
        self.failed: BaseException | None = None  # the first transport failure: later reads fail at once
        self.bytes = 0
        self._bytes_lock = threading.Lock()  # the coder reads members on threads (erasure.ahead); two may share us

    def close(self) -> None:
        self._channel.close()

    def _timeout(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"reading from {self.address}: deadline exceeded")
        return min(self.rpc_timeout_seconds, left)

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``; a transport failure (gRPC, socket, timeout) is a ConnectionError, remembered so that
        later calls fail at once. A NOT_FOUND answer is a FileNotFoundError, DATA_LOSS a ChecksumError (the peer
        is fine)."""
        if self.failed is not None:
            raise ConnectionError(f"{self.address} failed earlier: {self.failed}") from self.failed
        try:
            return fn(*args)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise FileNotFoundError(f"{self.address}: {e.details()}") from e
            if e.code() == grpc.StatusCode.DATA_LOSS:  # bad bytes there (its holder drops them): the peer is fine
                raise ChecksumError(f"{self.address}: {e.details()}") from e
            self.failed = e
            raise ConnectionError(f"{self.address}: {e.code().name} {e.details()}") from e
        except (ChecksumError, FileNotFoundError, ValueError):
            raise
        except OSError as e:
            self.failed = e
            raise ConnectionError(f"{self.address}: {type(e).__name__}: {e}") from e

    def manifest_bytes(self, rank: int, step: int) -> bytes:
        resp = self.call(lambda: self._stub.GetManifest(peer_pb2.GetManifestRequest(rank=rank, step=step),
                                                        timeout=self._timeout()))
        return bytes(resp.manifest_json)

    def read(self, rank: int, step: int, pieces: list[Piece], parity: str = "") -> list[bytes]:
        """The bytes of ``pieces`` of ``rank``'s step (or, ``parity``: of its parity for that digest)."""
        return self.call(self._read, rank, step, [n for n, _, _ in pieces], pieces, parity)

    def read_files(self, rank: int, step: int, names: list[str], parity: str = "") -> list[bytes]:
        """Whole files, each checked against the crc32c the peer lists for it."""
        return self.call(self._read, rank, step, names, [], parity)

    def _read(self, rank: int, step: int, names: list[str], pieces: list[Piece], parity: str) -> list[bytes]:
        names = list(dict.fromkeys(names))
        self.limiter.acquire(sum(ln for _, _, ln in pieces))  # whole files (records: small) are not counted
        wire = [peer_pb2.TransferPiece(name=n, offset=o, length=ln) for n, o, ln in pieces]
        if self.use_data_port:
            req = peer_pb2.OpenTransferRequest(rank=rank, step=step, files=names, pieces=wire, parity=parity)
            resp = self._stub.OpenTransfer(req, timeout=self._timeout())
            host = resp.data_host or self.host
            if resp.data_port and host:
                try:
                    out = self._receive(host, resp.data_port, resp.ticket,
                                        [ln for _, _, ln in pieces] or [f.size for f in resp.files])
                except (ConnectionRefusedError, socket.gaierror, TransferRejected) as e:
                    log.warning("data port %s:%d unusable (%s); reading over the gRPC stream", host,
                                resp.data_port, e)
                else:
                    if not pieces:
                        for f, data in zip(resp.files, out, strict=True):
                            if checksums.crc32c(data) != f.crc32c:
                                raise ChecksumError(f"{f.name} from {self.address}", f.crc32c, checksums.crc32c(data))
                    self._count(out)
                    return out
        req = peer_pb2.ReadFilesRequest(rank=rank, step=step, files=names, pieces=wire, parity=parity,
                                        chunk_bytes=STREAM_CHUNK_BYTES)
        count = len(pieces) or len(names)
        bufs = [bytearray() for _ in range(count)]
        sizes = [ln for _, _, ln in pieces] or [-1] * count
        starts = [o for _, o, _ in pieces] or [0] * count
        call = self._stub.ReadFiles(req, timeout=max(0.1, self.deadline - time.monotonic()))
        try:
            for chunk in stream_chunks(call, f"ReadFiles of rank {rank} step {step} from {self.address}"):
                idx = chunk.file_index
                if idx >= count:
                    raise ConnectionError(f"{self.address} sent part {idx} of {count}")
                if checksums.crc32c(chunk.data) != chunk.crc32c:
                    raise ChecksumError(f"chunk at {chunk.offset} of {names[min(idx, len(names) - 1)]} from "
                                        f"{self.address}", chunk.crc32c, checksums.crc32c(chunk.data))
                if chunk.offset != starts[idx] + len(bufs[idx]):
                    raise ConnectionError(f"{self.address}: out-of-order chunk at {chunk.offset}")
                if chunk.name and not pieces:
                    sizes[idx] = chunk.file_size
                bufs[idx] += chunk.data
        finally:
            call.cancel()
        if [len(b) for b in bufs] != sizes:
            raise ConnectionError(f"{self.address}: the stream ended before every part was complete")
        self._count(bufs)
        return [bytes(b) for b in bufs]

    def rebuilt_fragments(self, step: int, group: Any, rank: int, items: list[tuple[int, int, int]],
                          lost: list[int], lengths: list[int], chain: Sequence[int] = (), chain_at: int = 0,
                          chain_crc32c: Sequence[int] = ()) -> Iterator[bytes]:
        """``Peer.RebuildFragments``: the peer rebuilds fragments ``items`` ((rotation, stripe, index), of
        ``lengths`` bytes) of ``rank``'s ``step`` for ``group`` (a CodeGroupSpec) and streams them; yields
        each whole, in order (every chunk checked against its crc32c; the caller checks the fragment's).
        With ``chain``: the peer is ``chain[chain_at]`` of a repair pipeline (:mod:`replicator.erasure.pipeline`)
        and streams its partial sums. The call starts here, before the first is asked for. A failed call is a
        ConnectionError that, unlike :meth:`call`'s, leaves the link usable for reads (a busy helper still
        serves its fragments)."""
        if self.failed is not None:
            raise ConnectionError(f"{self.address} failed earlier: {self.failed}") from self.failed
        req = peer_pb2.RebuildFragmentsRequest(step=step, rank=rank, lost=lost, fragments=[
            peer_pb2.FragmentRef(rotation=r, stripe=t, index=i) for r, t, i in items], chain=chain,
            chain_at=chain_at, chain_crc32c=chain_crc32c)
        group.to_proto(req.group)
        call = self._stub.RebuildFragments(req, timeout=max(0.1, self.deadline - time.monotonic()))
        return self._fragments(call, lengths)

    def _fragments(self, call: Any, lengths: list[int]) -> Iterator[bytes]:
        chunks = iter(call)
        try:
            for idx, length in enumerate(lengths):
                self.limiter.acquire(length)
                buf = bytearray()
                while len(buf) < length:
                    try:
                        chunk = next(chunks, None)
                    except grpc.RpcError as e:  # not remembered as failed: the link still serves reads
                        raise ConnectionError(f"{self.address}: {e.code().name} {e.details()}") from e
                    if chunk is None:
                        raise ConnectionError(f"{self.address}: the stream ended within fragment {idx} of "
                                              f"{len(lengths)}")
                    if chunk.file_index != idx or chunk.offset != len(buf) or len(buf) + len(chunk.data) > length:
                        raise ConnectionError(f"{self.address}: chunk of fragment {chunk.file_index} at "
                                              f"{chunk.offset} where fragment {idx} at {len(buf)} was due")
                    if checksums.crc32c(chunk.data) != chunk.crc32c:
                        raise ChecksumError(f"chunk at {chunk.offset} of rebuilt fragment {idx} from {self.address}",
                                            chunk.crc32c, checksums.crc32c(chunk.data))
                    buf += chunk.data
                self._count([buf])
                yield bytes(buf)
        finally:
            call.cancel()

    def _count(self, parts: list[bytes] | list[bytearray]) -> None:
        with self._bytes_lock:
            self.bytes += sum(len(b) for b in parts)

    def _receive(self, host: str, port: int, ticket: bytes, lengths: list[int]) -> list[bytes]:
        left = self.deadline - time.monotonic()
        with keep_alive(socket.create_connection((host, port), timeout=min(DATA_CONNECT_TIMEOUT_SECONDS, left))) as sock:
            sock.settimeout(min(DATA_IDLE_TIMEOUT_SECONDS, max(0.1, self.deadline - time.monotonic())))
            sock.sendall(DATA_MAGIC + ticket)
            sock.settimeout(max(0.1, self.deadline - time.monotonic()))  # the server may queue us for a slot
            status = recv_exact(sock, 1)[0]
            if status != STATUS_OK:
                (n,) = struct.unpack(">H", recv_exact(sock, 2))
                raise TransferRejected(f"data port {host}:{port} refused: "
                                       f"{recv_exact(sock, n).decode(errors='replace')}")
            sock.settimeout(min(DATA_IDLE_TIMEOUT_SECONDS, max(0.1, self.deadline - time.monotonic())))
            return [recv_exact(sock, n) for n in lengths]


class _Window:
    """The last window read of one byte sequence: (start, bytes)."""

    def __init__(self) -> None:
        self.start, self.data = 0, b""

    def get(self, offset: int, length: int) -> bytes | None:
        if self.start <= offset and offset + length <= self.start + len(self.data):
            return self.data[offset - self.start:offset - self.start + length]
        return None


class RemoteStream:
    """A code group member's step stream on another host, read by byte range (``GroupEncoder``'s and
    ``GroupDecoder``'s ``read_data`` for that member). :meth:`open` checks that its data is the group's."""

    def __init__(self, link: PeerLink, rank: int, step: int, stream: StepStream):
        self.link, self.rank, self.step, self.stream = link, rank, step, stream
        self._window = _Window()

    @classmethod
    def open(cls, link: PeerLink, rank: int, step: int, content_hash: str) -> RemoteStream:
        """StaleGroupError when the member's data of ``step`` is not ``content_hash`` (another save)."""
        raw = link.manifest_bytes(rank, step)
        stream = StepStream(Path(), raw)  # parses and checks the manifest's own checksum
        m = stream.manifest
        if (m.rank, m.step) != (rank, step):
            raise ManifestError(f"{link.address} sent the manifest of rank {m.rank} step {m.step}")
        if m.content_hash != content_hash:
            raise StaleGroupError(f"rank {rank}'s data of step {step} on {link.address} is {m.content_hash[:12]}, "
                                  f"the code group names {content_hash[:12]}")
        return cls(link, rank, step, stream)

    @property
    def length(self) -> int:
        return self.stream.length

    @property
    def manifest_bytes(self) -> bytes:
        return self.stream.manifest_bytes

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the stream (cut at its end)."""
        length = max(0, min(length, self.stream.length - offset))
        if length == 0:
            return b""
        hit = self._window.get(offset, length)
        if hit is not None:
            return hit
        want = min(max(length, WINDOW_BYTES), self.stream.length - offset)
        ranges = self.stream.ranges(offset, want)
        pieces = [(self.stream.parts[i].name, at, n) for i, at, n in ranges if i > 0]
        got = iter(self.link.read(self.rank, self.step, pieces) if pieces else [])
        data = b"".join(self.stream.manifest_bytes[at:at + n] if i == 0 else next(got) for i, at, n in ranges)
        self._window.start, self._window.data = offset, data
        return data[:length]


class RemoteParity:
    """A parity holder's parity of one step on another host: its record (``GROUP.json``) and its shards by byte
    range (``GroupDecoder``'s ``read_parity`` for that holder)."""

    def __init__(self, link: PeerLink, holder: int, step: int, digest: str):
        self.link, self.holder, self.step, self.digest = link, holder, step, digest
        self._windows: dict[tuple[int, int], _Window] = {}
        self._record: ParityRecord | None = None

    def record(self) -> ParityRecord:
        """The holder's record, validated: its group's digest must be the one asked for."""
        if self._record is None:
            (raw,) = self.link.read_files(self.holder, self.step, [RECORD_NAME], parity=self.digest)
            rec = ParityRecord.from_json(raw)
            if rec.digest != self.digest or rec.step != self.step or rec.holder != self.holder:
                raise StaleGroupError(f"{self.link.address} sent the parity record of rank {rec.holder} step "
                                      f"{rec.step} ({rec.digest}), asked for rank {self.holder} step {self.step} "
                                      f"({self.digest})")
            self._record = rec
        return self._record

    def read(self, rotation: int, index: int, offset: int, length: int) -> bytes:
        shard = self.record().manifest.shard_bytes
        w = self._windows.setdefault((rotation, index), _Window())
        hit = w.get(offset, length)
        if hit is not None:
            return hit
        want = min(max(length, WINDOW_BYTES), shard - offset)
        (data,) = self.link.read(self.holder, self.step, [(shard_name(rotation, index), offset, want)],
                                 parity=self.digest)
        w.start, w.data = offset, data
        return data[:length]
