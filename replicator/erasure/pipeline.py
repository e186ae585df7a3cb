"""Pipelined rebuilds (repair pipelining, ECPipe: Li et al., USENIX ATC '17; issue #48): a lost rank's data is
rebuilt along chains of the other members, so that every link carries about one fragment per rebuilt stripe.

Reed-Solomon is linear over GF(2^8): a lost fragment is r = c_1·f_1 + ... + c_K·f_K over K surviving
fragments (addition is XOR). A chain of K helpers rebuilds a run of stripes: helper 1 sends c_1·f_1 of each
stripe to helper 2, which adds c_2·f_2 and passes the sum on, ..., and the last streams r to the rebuilding
host. Each helper reads only its own fragment (from its RAM disk: its step's data or its parity), checked
against the crc32c the rebuilding host sends along (from the merged manifest); the rebuilding host checks
every rebuilt fragment against its crc32c before it is used. The lost rank's stream is cut in runs, one per
shard (one rotation each); each run has K of its rotation's surviving holders, chosen so that no helper sends
more than its share, and is dealt stripe by stripe to :data:`LANES` chains of them in different orders
(:func:`chain_runs`): for ec:3+1 every helper's link carries one step's worth, as a copy's source does. The
next run's chains are asked for while this one's drain.

Opt-in (``EcHost.pipeline``): on our shared 2-core box, with every host's processes on it, a pipelined rebuild
was no faster than a spread one (slower at 400 Mbit/s links: docs/benchmarks.md, ``bench.erasure``).

We never do GF(2^8) arithmetic ourselves (:mod:`replicator.erasure.codec`'s rule): the products c_i·x come
from pyeclib. For a (code, lost index, K survivors), :func:`term_tables` rebuilds the lost fragment from
fragments where survivor i holds the bytes 0..255 and every other survivor zeros: by linearity, byte x of the
result is c_i·x. That 256-byte table, applied with numpy (``table[fragment]``), is helper i's term.

Wire: ``Peer.RebuildFragments`` with ``chain`` set (proto/peer.proto); served by
:func:`replicator.erasure.spread.serve`, which hands such requests to :func:`link_fill`. A chain that fails
(a helper lost, busy, refusing, bad bytes) is a :class:`PipelineError`: the caller rebuilds spread instead.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from replicator.erasure.codec import StripeCodec
from replicator.erasure.group import GroupManifest, _padded, stream_plan
from replicator.erasure.helped import Item, Put, close_call, failing_as
from replicator.erasure.host import EcHost, GroupReads, _own_stream, task_links
from replicator.erasure.wire import CodeGroupSpec
from sidecar.checksums import ChecksumError, crc32c

TABLE_BYTES = 256  # one byte per GF(2^8) element
# Chains each run is dealt to, stripe by stripe in turn: more streams per link at once (one gRPC stream's
# flow control window bounds what it carries per round trip), each in a chain order of its own.
# (1 and 3 measured no different from 2 on our box: bench.erasure in docs/benchmarks.md.)
LANES = 2


class PipelineError(IOError):
    """A pipelined rebuild failed (a helper refused, failed, or sent what does not verify): rebuild spread."""


_tables_lock = threading.Lock()


@functools.lru_cache(maxsize=256)
def _tables(k: int, m: int, backend: str, want: int, survivors: tuple[int, ...]) -> dict[int, np.ndarray]:
    codec = StripeCodec(k, m, backend)
    ramp = bytes(range(TABLE_BYTES))
    zeros = bytes(TABLE_BYTES)
    out = {}
    for i in survivors:
        got = codec.rebuild({j: ramp if j == i else zeros for j in survivors}, [want])[want]
        out[i] = np.frombuffer(bytes(got), np.uint8)
        out[i].setflags(write=False)
    return out


def term_tables(k: int, m: int, backend: str, want: int, survivors: Sequence[int]) -> dict[int, np.ndarray]:
    """For each fragment index i of ``survivors`` (K distinct indexes, ``want`` not among them), the table
    ``t`` with ``t[x] = c_i·x``, where fragment ``want`` = XOR over i of c_i·f_i (module docstring); cached."""
    key = tuple(sorted(set(survivors)))
    if len(key) != k or want in key or not all(0 <= i < k + m for i in (*key, want)):
        raise ValueError(f"ec:{k}+{m}: fragment {want} from {list(survivors)}: need K distinct other indexes")
    with _tables_lock:  # one codec per call; the cache is shared
        return _tables(k, m, backend, want, key)


Lane = tuple[tuple[int, ...], list[Item]]  # a chain and the fragments it rebuilds, in order


def chain_runs(man: GroupManifest, rank: int, helpers: Sequence[int], lanes: int = 1) -> list[list[Lane]]:
    """``rank``'s stream plan (:func:`stream_plan`) cut in runs of one rotation each, each run dealt to ``lanes``
    chains in turn (item n to lane n mod lanes): K of the rotation's holders among ``helpers``, the least
    loaded so far chosen (ties: in turn), in an order that moves lane by lane and run by run (who sends to the
    rebuilding host moves). PipelineError when a rotation has fewer than K."""
    lay = man.layout
    runs: list[list[Lane]] = []
    load = dict.fromkeys(helpers, 0)
    items_of: list[list[Item]] = []
    for item in stream_plan(man, rank):
        if items_of and items_of[-1][-1][0] == item[0]:
            items_of[-1].append(item)
        else:
            items_of.append([item])
    for s, items in enumerate(items_of):
        rotation = items[0][0]
        cands = [h for h in lay.holders(rotation) if h in load and h != rank]
        if len(cands) < lay.k:
            raise PipelineError(f"rotation {rotation} of step {man.step}: {len(cands)} holder(s) {cands} can "
                                f"join a chain, ec:{lay.k}+{lay.m} needs {lay.k}")
        turn = {h: (i - s) % len(cands) for i, h in enumerate(cands)}
        chosen = sorted(cands, key=lambda h: (load[h], turn[h]))[:lay.k]
        chain = sorted(chosen, key=lambda h: turn[h])
        for h in chain:
            load[h] += len(items)
        runs.append([(tuple(chain[j % lay.k:] + chain[:j % lay.k]), items[j::lanes])
                     for j in range(min(lanes, len(items)))])
    return runs


def _chain_crcs(man: GroupManifest, chain: Sequence[int], items: Sequence[Item]) -> list[int]:
    lay = man.layout
    if not all(man.covers(r) for r, _, _ in items):
        raise PipelineError(f"step {man.step}: no crc32c rows of rotation {items[0][0]} to check fragments with")
    return [man.crc32c[r][t][lay.holders(r).index(h)] for r, t, _ in items for h in chain]


def pipeline_stream(host: EcHost, step: int, group: CodeGroupSpec, g: GroupReads, links: Any) -> Iterator[memoryview]:
    """``host.rank``'s step stream of ``step``, rebuilt along chains of the holders ``g.holders`` (module
    docstring), in order, every fragment checked against ``g.manifest``; PipelineError on any failure."""
    man, lay = g.manifest, g.manifest.layout
    runs = chain_runs(man, host.rank, g.holders, LANES)
    lost = sorted(g.decoder.lost - {host.rank})
    calls: dict[tuple[int, int], Iterator[bytes]] = {}

    def start(i: int) -> None:
        for j, (chain, items) in enumerate(runs[i] if i < len(runs) else []):
            if (i, j) not in calls:
                lengths = [man.stripe_range(t)[1] for _, t, _ in items]
                calls[i, j] = links(group.address_of(chain[-1])).rebuilt_fragments(
                    step, group, host.rank, items, lost, lengths, chain, len(chain) - 1,
                    _chain_crcs(man, chain, items))

    left = man.stream_bytes[lay.position(host.rank)]
    with failing_as(PipelineError, calls):
        for i, lanes in enumerate(runs):
            start(i)
            start(i + 1)  # the next run's chains fill while this one's drain
            for n in range(sum(len(items) for _, items in lanes)):
                chain, items = lanes[n % len(lanes)]
                r, t, want = items[n // len(lanes)]
                frag = next(calls[i, n % len(lanes)], None)
                if frag is None:
                    raise PipelineError(f"chain {list(chain)} ended early (rank {host.rank}'s step {step})")
                if crc32c(frag) != man.crc32c[r][t][want]:
                    raise PipelineError(str(ChecksumError(f"fragment {want} of rotation {r} stripe {t} rebuilt by "
                                                          f"chain {list(chain)}", man.crc32c[r][t][want],
                                                          crc32c(frag))))
                piece = memoryview(frag)[:left]
                left -= len(piece)
                yield piece
            for j in range(len(lanes)):
                close_call(calls.pop((i, j)))


def _check_chain(group: CodeGroupSpec, host_rank: int, rank: int, items: Sequence[Item],
                 request: Any) -> tuple[tuple[int, ...], int, list[int]]:
    """(chain, this host's place in it, crc32c of every chain fragment) of a chain request; ValueError when
    malformed."""
    lay = group.layout
    chain, at, crcs = tuple(int(r) for r in request.chain), int(request.chain_at), list(request.chain_crc32c)
    if len(chain) != lay.k or len(set(chain)) != lay.k or rank in chain:
        raise ValueError(f"a chain of ec:{lay.k}+{lay.m} is K distinct members other than rank {rank}: {list(chain)}")
    if not 0 <= at < lay.k or chain[at] != host_rank:
        raise ValueError(f"chain {list(chain)} at {at} is not rank {host_rank}")
    if len(crcs) != len(items) * lay.k:
        raise ValueError(f"{len(crcs)} chain crc32c values for {len(items)} fragments x {lay.k}")
    for r, _, want in items:
        holders = lay.holders(r)
        if any(h not in holders for h in chain) or holders[want] == host_rank:
            raise ValueError(f"chain {list(chain)} does not hold rotation {r}'s fragments other than {want}")
    return chain, at, crcs


def link_fill(host: EcHost, request: Any, step: int, group: CodeGroupSpec, rank: int,
              items: Sequence[Item]) -> Callable[[Put], None]:
    """This host's link of a chain (``request.chain``, validated here): for each fragment asked for, its own
    fragment's term added to the partial sum from the chain's previous member (asked here, one call), put
    in order (:func:`replicator.erasure.spread.run_ahead`)."""
    chain, at, crcs = _check_chain(group, host.rank, rank, items, request)
    lay, lost = group.layout, [int(r) for r in request.lost]

    def fill(put: Put) -> None:
        rec = host.parity.record(step, group.digest())
        if rec is None:
            raise FileNotFoundError(f"rank {host.rank} holds no parity of step {step} for {group.digest()}")
        man = rec.manifest
        if any(t >= man.stripes for _, t, _ in items):
            raise ValueError(f"stripes asked beyond the group's {man.stripes}")
        own = functools.partial(_own_fragment, host, man, group, step, _OwnStream(host, step, group))
        with task_links(host) as links, contextlib.ExitStack() as closing:
            up: Iterator[bytes] | None = None
            if at > 0:
                lengths = [man.stripe_range(t)[1] for _, t, _ in items]
                up = links(group.address_of(chain[at - 1])).rebuilt_fragments(step, group, rank, list(items), lost,
                                                                             lengths, chain, at - 1, crcs)
                closing.callback(close_call, up)
            for n, (r, t, want) in enumerate(items):
                idx = [lay.holders(r).index(h) for h in chain]
                frag = own(r, t, idx[at], crcs[n * lay.k + at])
                term = np.take(term_tables(lay.k, lay.m, man.backend, want, idx)[idx[at]], np.frombuffer(frag, np.uint8))
                if up is not None:
                    part = next(up, None)
                    if part is None or len(part) != len(term):
                        raise ConnectionError(f"rank {chain[at - 1]} ended its partial sums early or short")
                    np.bitwise_xor(term, np.frombuffer(part, np.uint8), out=term)
                if not put(("frag", memoryview(term))):
                    return
        put(("end", None))

    return fill


class _OwnStream:
    """This host's step of the group, opened (and its content hash checked) on first use."""

    def __init__(self, host: EcHost, step: int, group: CodeGroupSpec):
        self.host, self.step, self.group = host, step, group
        self._stream: Any = None

    def _opened(self) -> Any:
        if self._stream is None:
            self._stream = _own_stream(self.host, self.step, self.group.hash_of(self.host.rank))
        return self._stream

    def read(self, _rank: int, offset: int, length: int) -> bytes:
        return self._opened().read(offset, length)

    def length(self) -> int:
        return self._opened().length


def _own_fragment(host: EcHost, man: GroupManifest, group: CodeGroupSpec, step: int, stream: _OwnStream,
                  rotation: int, stripe: int, index: int, want_crc: int) -> bytes:
    """This host's fragment ``index`` of (rotation, stripe): its step's bytes (zero-padded) or its parity;
    ChecksumError unless it matches ``want_crc``."""
    off, length = man.stripe_range(stripe)
    k = man.layout.k
    if index < k:
        data = _padded(stream.read, host.rank, index * man.shard_bytes + off, length, stream.length())
    else:
        data = host.parity.read(step, group.digest(), rotation, index - k, off, length)
    if len(data) != length or crc32c(data) != want_crc:
        raise ChecksumError(f"rank {host.rank}'s fragment {index} of rotation {rotation} stripe {stripe}", want_crc,
                            crc32c(data))
    return data
