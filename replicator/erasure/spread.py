"""Spread rebuilds (issue #35): the other parity holders decode a lost rank's data, so that the host rebuilding
it receives each rebuilt byte once instead of the K fragments it is decoded from.

Decoded where it is restored (:func:`replicator.erasure.rebuild.rebuild_own` without spreading), a rebuild pulls
K fragments per rebuilt byte into one host: where each host has a network link of its own, that link carries
K times the step and the rebuild takes about K times a copy's transfer. Spread, the stripes of the rank's
stream are shared out among the other members whose parity record answered, each stripe to one of its
rotation's fragment holders in turn (:func:`shares`). Each decodes its share (``Peer.RebuildFragments``,
:func:`serve`): it reads the K intact fragments of each stripe (its own from its RAM disk, the others' from
their holders, each checked against its crc32c), decodes, checks every rebuilt fragment against its crc32c
and streams it. The rebuilding host opens every share at once, checks every fragment again against the crc32c
of the manifest it merged itself, and reads the shares in stream order. With S helpers every helper's link
carries about K/S of the step (the K - 1 fragments it reads or sends per stripe, and what it rebuilt) and the
rebuilding host's exactly one step: for ec:3+1 on 4 hosts, one step on every link, as a copy.

Any failure of a spread rebuild (a helper refusing, busy, lost or sending bad bytes) is a :class:`SpreadError`:
the caller decodes here instead, from scratch. A helper serves only code groups it holds parity of (the
coordinator's), a bounded number at once (:data:`MAX_SERVED`), at the bulk threads' CPU priority.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from replicator.erasure.group import stream_plan
from replicator.erasure.helped import Item, Put, failing_as
from replicator.erasure.host import EcHost, GroupReads, open_group, task_links
from replicator.erasure.remote import WINDOW_BYTES
from replicator.erasure.wire import CodeGroupSpec
from replicator.net.priority import lower_current_thread
from replicator.peer.protocol import MAX_STEP
from sidecar.checksums import ChecksumError, crc32c

log = logging.getLogger(__name__)


# Fragments one request may ask for: 2^17 stripes of 1 MiB, 128 GiB of one rank's step.
MAX_FRAGMENTS_PER_REQUEST = 1 << 17
# Spread rebuilds one host serves at once; more are refused (RESOURCE_EXHAUSTED): the asker decodes itself.
MAX_SERVED = 2
# Rebuilt fragments a serving thread keeps ready ahead of the gRPC stream.
QUEUE_FRAGMENTS = 8


class SpreadError(IOError):
    """A spread rebuild failed (a helper refused, failed, or sent what does not verify): decode here instead."""


def shares(plan: Sequence[Item], layout_holders: Callable[[int], Sequence[int]], helpers: Sequence[int],
           run: int = 1) -> list[int]:
    """The helper of each item of ``plan``: one of its rotation's fragment holders among ``helpers`` (any helper
    when none is), in turn per rotation, ``run`` consecutive items of a rotation each (a helper reads the
    others' fragments by windows of consecutive stripes: a run of a window's stripes reads each window once,
    where single stripes in turn would read every window whole for a few of its stripes)."""
    if not helpers or run < 1:
        raise ValueError("a spread rebuild needs helpers and runs of at least one item")
    turn: dict[int, int] = {}
    out = []
    for rotation, _, _ in plan:
        cands = [h for h in layout_holders(rotation) if h in helpers] or list(helpers)
        n = turn.get(rotation, 0)
        turn[rotation] = n + 1
        out.append(cands[(n // run) % len(cands)])
    return out


def spread_stream(host: EcHost, step: int, group: CodeGroupSpec, g: GroupReads, links: Any) -> Iterator[memoryview]:
    """``host.rank``'s step stream of ``step``, decoded by the holders ``g.holders`` (module docstring), in
    order, every fragment checked against ``g.manifest``; SpreadError on any failure."""
    man, lay = g.manifest, g.manifest.layout
    plan = stream_plan(man, host.rank)
    who = shares(plan, lay.holders, g.holders, run=max(1, WINDOW_BYTES // man.stripe_bytes))
    # Members neither whose data nor whose parity could be read here (no address, down): helpers skip them too.
    lost = sorted(g.decoder.lost | {host.rank})
    mine: dict[int, list[Item]] = {}
    for item, helper in zip(plan, who, strict=True):
        mine.setdefault(helper, []).append(item)
    calls: dict[int, Iterator[bytes]] = {}
    with failing_as(SpreadError, calls):
        for helper, items in mine.items():  # every share starts at once
            lengths = [man.stripe_range(t)[1] for _, t, _ in items]
            calls[helper] = links(group.address_of(helper)).rebuilt_fragments(step, group, host.rank, items, lost,
                                                                              lengths)
        left = man.stream_bytes[lay.position(host.rank)]
        for (r, t, i), helper in zip(plan, who, strict=True):
            frag = next(calls[helper], None)
            if frag is None:
                raise SpreadError(f"rank {helper} ended its share of rank {host.rank}'s step {step} early")
            want = man.crc32c[r][t][i]
            if crc32c(frag) != want:
                raise SpreadError(str(ChecksumError(f"fragment {i} of rotation {r} stripe {t} rebuilt by rank "
                                                    f"{helper}", want, crc32c(frag))))
            piece = memoryview(frag)[:left]
            left -= len(piece)
            yield piece


def _check(host: EcHost, request: Any) -> tuple[int, CodeGroupSpec, int, list[Item], set[int]]:
    """The request's (step, group, rank, fragments, ranks not to read); ValueError when malformed,
    FileNotFoundError when this host holds no parity of that step for that group."""
    step = int(request.step)
    if not 0 <= step < MAX_STEP:
        raise ValueError(f"invalid step {step}")
    group = CodeGroupSpec.from_proto(request.group)
    lay = group.layout
    rank = int(request.rank)
    lay.position(rank)  # ValueError: not a member
    lay.position(host.rank)
    if rank == host.rank:
        raise ValueError(f"rank {rank} asks itself to rebuild its own data")
    if not 0 < len(request.fragments) <= MAX_FRAGMENTS_PER_REQUEST:
        raise ValueError(f"{len(request.fragments)} fragments asked (1 to {MAX_FRAGMENTS_PER_REQUEST})")
    items = []
    for f in request.fragments:
        if f.rotation >= lay.n or f.index >= lay.k + lay.m:
            raise ValueError(f"no fragment {f.index} of rotation {f.rotation} in a group of {lay.n} (ec:{lay.k}+"
                             f"{lay.m})")
        items.append((int(f.rotation), int(f.stripe), int(f.index)))
    lost = {int(r) for r in request.lost} | {rank}
    if not lost <= set(group.members):
        raise ValueError(f"lost ranks {sorted(lost - set(group.members))} are not members")
    if host.parity.record(step, group.digest()) is None:
        raise FileNotFoundError(f"rank {host.rank} holds no parity of step {step} for {group.digest()}")
    return step, group, rank, items, lost


def run_ahead(host: EcHost, fill: Callable[[Put], None], name: str, bulk_priority: str = "normal") -> Iterator[Any]:
    """What ``fill(put)`` puts as ("frag", value), yielded in order while ``fill`` runs on a thread of its own at
    ``bulk_priority``, :data:`QUEUE_FRAGMENTS` ahead; ``fill`` ends with ("end", None) or ("error", exception),
    and stops when ``put`` answers False (the consumer is gone). TimeoutError when nothing comes for
    ``host.timeout_seconds``."""
    out: queue.Queue[tuple[str, Any]] = queue.Queue(QUEUE_FRAGMENTS)
    stop = threading.Event()

    def put(what: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                out.put(what, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        lower_current_thread(bulk_priority)
        try:
            fill(put)
        except BaseException as e:  # noqa: BLE001 - handed to the serving thread, which raises it
            put(("error", e))

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    try:
        while True:
            kind, value = out.get(timeout=host.timeout_seconds)
            if kind == "frag":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    except queue.Empty:
        raise TimeoutError(f"{name}: nothing within {host.timeout_seconds:.0f} s") from None
    finally:
        stop.set()
        worker.join(timeout=host.rpc_timeout_seconds)


def serve(host: EcHost, request: Any, bulk_priority: str = "normal") -> Iterator[memoryview]:
    """``Peer.RebuildFragments`` here: the fragments asked for, rebuilt in order (module docstring), or, with
    ``request.chain``, this host's link of a repair pipeline (:func:`replicator.erasure.pipeline.link_fill`).
    Validated before anything is read; decoded on a thread of its own at ``bulk_priority``, a few fragments
    ahead (:func:`run_ahead`)."""
    step, group, rank, items, lost = _check(host, request)
    if request.chain:
        from replicator.erasure import pipeline  # builds on this module

        fill = pipeline.link_fill(host, request, step, group, rank, items)
        return run_ahead(host, fill, f"ec-chain-{rank}-{step}", bulk_priority)

    def decode(put: Put) -> None:
        t0 = time.monotonic()
        with task_links(host) as links:
            g = open_group(host, step, group, links, lost)
            stripes = g.manifest.stripes
            bad = [t for _, t, _ in items if t >= stripes]
            if bad:
                raise ValueError(f"stripe {bad[0]} asked of a group of {stripes} stripes")
            with contextlib.closing(g.decoder.fragments(items)) as frags:
                for frag in frags:
                    if not put(("frag", frag)):
                        return
            if g.decoder.corrupt or g.decoder.unreadable:
                log.warning("rebuilding for rank %d step %d passed over corrupt fragments %s and unreadable "
                            "ones %s", rank, step, g.decoder.corrupt[:8], g.decoder.unreadable[:8])
        log.info("rebuilt %d fragments of rank %d's step %d for it in %.3fs", len(items), rank, step,
                 time.monotonic() - t0)
        put(("end", None))

    return run_ahead(host, decode, f"ec-serve-{rank}-{step}", bulk_priority)
