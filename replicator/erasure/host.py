"""This host's side of erasure coding (issue #35): compute its parity on a ``ParityTask``, and open a code
group's step for a rebuild (:func:`open_group`: :mod:`replicator.erasure.rebuild` rebuilds this host's own
rank's data, :mod:`replicator.erasure.spread` decodes shares of another's).

Per-holder encoding (docs/peer.md, "Erasure coding"): member h holds the parity of rotations
``layout.parity_held(h)``; it reads the K data shards of each of them from the members' step streams (its
own locally, the others' over the peer tier by byte range), encodes, and keeps only its own stripes, with
the crc32c rows of its rotations in ``GROUP.json``. Every member's data must be the one the group names
(its manifest's content hash), checked before and again after encoding: a stale task writes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from replicator.erasure.codec import NotEnoughFragmentsError, StripeCodec
from replicator.erasure.group import DEFAULT_STRIPE_BYTES, GroupDecoder, GroupEncoder, GroupManifest
from replicator.erasure.holder import ParityRecord, ParityStore
from replicator.erasure.remote import WINDOW_BYTES, PeerLink, RemoteParity, RemoteStream, StaleGroupError
from replicator.erasure.stream import StepStream
from replicator.erasure.wire import CodeGroupSpec
from replicator.net import rpc
from replicator.net.security import TlsOptions
from replicator.net.throttle import RateLimiter
from sidecar import faults, layout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EcHost:
    """What this host's coding needs: its rank, RAM disk, parity store and how to reach its peers."""

    rank: int
    root: Path
    parity: ParityStore
    token: str | None = None
    tls: TlsOptions | None = None
    timeout_seconds: float = rpc.TRANSFER_TIMEOUT_SECONDS  # a whole task's deadline
    rpc_timeout_seconds: float = rpc.RPC_TIMEOUT_SECONDS
    stripe_bytes: int = DEFAULT_STRIPE_BYTES
    use_data_port: bool = True
    bytes_per_second: float | None = None  # the replication throttle (--max-bytes-per-second), per task
    # Read the fragments of this many stripes ahead, each member's on its own thread (None: a window and a
    # stripe more, so the next window is in flight while this one is decoded; 0: one after another).
    ahead_stripes: int | None = None
    # Rebuild this host's data spread over the other parity holders (replicator.erasure.spread): each decodes
    # a share and sends only what it rebuilt. False: read the K fragments of every stripe and decode here.
    spread: bool = True
    # With spread: rebuild it along chains of the other members first (replicator.erasure.pipeline: every
    # link carries about one fragment per stripe), spread if that fails. Off by default: on our shared 2-core
    # box its K gRPC hops per stripe made it slower than spread (docs/benchmarks.md, bench.erasure).
    pipeline: bool = False

    @property
    def ahead(self) -> int:
        if self.ahead_stripes is not None:
            return self.ahead_stripes
        return -(-WINDOW_BYTES // self.stripe_bytes) + 1

    def own_step_dir(self, step: int) -> Path:
        return layout.steps_dir(self.root) / layout.step_name(step)


class _Links:
    """One :class:`PeerLink` per member address for one task, closed together."""

    def __init__(self, host: EcHost, deadline: float):
        self.host, self.deadline = host, deadline
        self._links: dict[str, PeerLink] = {}
        self._limiter = RateLimiter(host.bytes_per_second)

    def __call__(self, address: str) -> PeerLink:
        if address not in self._links:
            h = self.host
            self._links[address] = PeerLink(address, token=h.token, tls=h.tls, deadline=self.deadline,
                                            rpc_timeout_seconds=h.rpc_timeout_seconds,
                                            use_data_port=h.use_data_port, limiter=self._limiter)
        return self._links[address]

    def close(self) -> None:
        for link in self._links.values():
            link.close()

    @property
    def bytes(self) -> int:
        return sum(link.bytes for link in self._links.values())


@contextlib.contextmanager
def task_links(host: EcHost) -> Iterator[_Links]:
    links = _Links(host, time.monotonic() + host.timeout_seconds)
    try:
        yield links
    finally:
        links.close()


def _own_stream(host: EcHost, step: int, content_hash: str) -> StepStream:
    """This rank's committed step as a stream; StaleGroupError unless its content is ``content_hash``."""
    try:
        stream = StepStream.open(host.own_step_dir(step))
    except FileNotFoundError:
        raise StaleGroupError(f"rank {host.rank} holds no step {step} (the code group names "
                              f"{content_hash[:12]})") from None
    if stream.manifest.content_hash != content_hash:
        raise StaleGroupError(f"rank {host.rank}'s step {step} is {stream.manifest.content_hash[:12]}, the code "
                              f"group names {content_hash[:12]}")
    return stream


def compute_parity(host: EcHost, step: int, group: CodeGroupSpec) -> ParityRecord:
    """A ``ParityTask``: compute and commit this host's parity of ``step`` for ``group`` (already held: its
    record). StaleGroupError when a member's data is not the group's (before or after encoding): nothing is
    written; ConnectionError etc. when a member cannot be read (retried by the caller's backoff)."""
    digest = group.digest()
    held = host.parity.record(step, digest)
    if held is not None:
        return held
    lay = group.layout
    lay.position(host.rank)  # ValueError when this host is not a member
    t0 = time.monotonic()
    with task_links(host) as links:
        streams: dict[int, StepStream | RemoteStream] = {}
        for rank, content_hash, address in zip(group.members, group.content_hashes, group.addresses, strict=True):
            if rank == host.rank:
                streams[rank] = _own_stream(host, step, content_hash)
            elif not address:
                raise ConnectionError(f"member rank {rank} of the code group of step {step} has no address")
            else:
                streams[rank] = RemoteStream.open(links(address), rank, step, content_hash)
        lengths = [streams[r].length for r in lay.members]
        manifest_lengths = [len(streams[r].manifest_bytes) for r in lay.members]
        enc = GroupEncoder(StripeCodec(lay.k, lay.m), lay, step, lengths, manifest_lengths,
                           lambda rank, offset, length: streams[rank].read(offset, length),
                           stripe_bytes=host.stripe_bytes, ahead_stripes=host.ahead)
        rotations = sorted(r for r, _ in lay.parity_held(host.rank))

        def mine() -> Iterator:
            with contextlib.closing(enc.stripes(rotations)) as all_stripes:
                for p in all_stripes:
                    if p.holder == host.rank:
                        yield p

        def manifest() -> GroupManifest:
            # A member that saved the step again while we read it gave us a mix: refuse it before commit.
            for rank, content_hash, address in zip(group.members, group.content_hashes, group.addresses,
                                                   strict=True):
                if rank == host.rank:
                    _own_stream(host, step, content_hash)
                else:
                    RemoteStream.open(links(address), rank, step, content_hash)
            faults.point("ec.parity.before_commit")  # every stripe written, checked; GROUP.json next
            return enc.manifest(rotations)

        with contextlib.closing(mine()) as stripes:  # its read-ahead threads end here
            record = host.parity.write_all(step, group, stripes, manifest)
        moved = links.bytes
    dt = max(time.monotonic() - t0, 1e-9)
    log.info("parity of step %d (ec:%d+%d, rotations %s, %s): %d parity bytes from %d bytes read over the "
             "peer tier in %.3fs (%.1f MiB/s)", step, lay.k, lay.m, rotations, digest, record.parity_bytes,
             moved, dt, moved / dt / 2**20)
    return record


@dataclasses.dataclass
class GroupReads:
    """A code group's step as one host reads it for a rebuild: the merged manifest (every reachable parity
    holder's crc32c rows) and a decoder over every member's data and parity that can be read (this host's own
    locally, the others' over the peer tier); ``holders``: the members whose parity record was read."""

    manifest: GroupManifest
    decoder: GroupDecoder
    holders: tuple[int, ...]


def open_group(host: EcHost, step: int, group: CodeGroupSpec, links: _Links, lost: Collection[int]) -> GroupReads:
    """:class:`GroupReads` of ``step`` for ``group``, never reading the members ``lost`` (nor those without an
    address). NotEnoughFragmentsError when no parity holder answered."""
    digest = group.digest()
    reads: dict[int, Callable[[int, int, int, int], bytes]] = {}
    records: list[ParityRecord] = []
    for rank, address in zip(group.members, group.addresses, strict=True):
        if rank in lost:
            continue
        if rank == host.rank:
            rec = host.parity.record(step, digest)
            if rec is not None:
                records.append(rec)
                reads[rank] = functools.partial(host.parity.read, step, digest)
            continue
        if not address:
            continue
        rp = RemoteParity(links(address), rank, step, digest)
        try:
            records.append(rp.record())
            reads[rank] = rp.read
        except (OSError, ValueError) as e:
            log.warning("rebuild of step %d: no parity record from rank %d: %s", step, rank, e)
    if not records:
        raise NotEnoughFragmentsError(f"rebuild of step {step} ({digest}) at rank {host.rank}: no parity holder "
                                      f"of the code group answered")
    manifest = records[0].manifest.merged([r.manifest for r in records[1:]])
    streams: dict[int, StepStream | RemoteStream] = {}
    unread = set(lost)
    for rank, content_hash, address in zip(group.members, group.content_hashes, group.addresses, strict=True):
        if rank in unread or (not address and rank != host.rank):
            unread.add(rank)
            continue
        try:
            streams[rank] = (_own_stream(host, step, content_hash) if rank == host.rank
                             else RemoteStream.open(links(address), rank, step, content_hash))
        except (OSError, ValueError) as e:
            log.warning("rebuild of step %d: rank %d's data unavailable: %s", step, rank, e)
            unread.add(rank)

    def read_data(rank: int, offset: int, length: int) -> bytes:
        if rank not in streams:
            raise ConnectionError(f"rank {rank}'s data is unavailable")
        return streams[rank].read(offset, length)

    def read_parity(rank: int, rotation: int, index: int, offset: int, length: int) -> bytes:
        if rank not in reads:
            raise ConnectionError(f"no parity of rank {rank}")
        return reads[rank](rotation, index, offset, length)

    lay = group.layout
    dec = GroupDecoder(StripeCodec(lay.k, lay.m, manifest.backend), manifest, read_data, read_parity,
                       lost=unread - set(reads), ahead_stripes=host.ahead, local=host.rank)
    return GroupReads(manifest, dec, tuple(r for r in lay.members if r in reads and r != host.rank))
