"""A code group: its rotated layout, shard geometry, versioned manifest, and the streaming encoder/decoder.

A group of ``n >= K + M`` hosts (positions 0..n-1, see :mod:`replicator.erasure.placement`) is coded in ``n``
rotations, RAID-6 style. In rotation ``r`` the hosts at positions ``r, r+1, ..., r+K-1`` (mod n) give data
fragment ``0..K-1`` and the hosts at ``r+K, ..., r+K+M-1`` hold parity fragment ``0..M-1``. Each host's step
stream (:mod:`replicator.erasure.stream`) is cut into K shards of ``shard_bytes``; its shard ``j`` is data
fragment ``j`` of rotation ``position - j``. So every host gives data to K rotations and holds parity of M:
``M x shard_bytes`` ~ ``M/K`` of its own step. Every rotation spans K + M distinct hosts, so any M of the
group's hosts may be lost together. Shards are coded in stripes of ``stripe_bytes`` (memory stays at
~(2K + M) stripes whatever the step's size), each fragment of each stripe with its crc32c in the manifest.
With ``ahead_stripes`` > 0 the encoder and decoder read the fragments of up to that many stripes ahead, each
holder's on its own thread (:mod:`replicator.erasure.ahead`): for readers that wait (a peer's windows).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from replicator.erasure.ahead import HolderThreads, lookahead
from replicator.erasure.codec import DEFAULT_BACKEND, NotEnoughFragmentsError, StripeCodec
from sidecar.checksums import ChecksumError, crc32c

log = logging.getLogger(__name__)

GROUP_FORMAT_VERSION = 1
# Shards are multiples of this: aligned stripes for ISA-L's SIMD loops (any length codes correctly).
ALIGN_BYTES = 64
# Bytes of one fragment of one stripe. Encoding holds ~(2K + M) x this whatever the step's size. Measured on
# our 2-core VM (bench.erasure, 256 MiB, one thread, 2026-12-04, load ~0.4), encode / rebuild GiB/s per core
# at 4+2: 256 KiB 3.1 / 1.1, 1 MiB 2.5 / 1.2, 4 MiB 0.95 / 0.53, 16 MiB 0.72 / 0.61 (large stripes leave the
# caches and pyeclib maps fresh pages for each output). Smaller stripes mean more crc32cs in the manifest:
# a 10 GiB step at 4+2 and 1 MiB is 92k of them.
DEFAULT_STRIPE_BYTES = 1 << 20

# read_data(rank, offset, length) -> bytes of that host's step stream (shorter at its end);
# read_parity(rank, rotation, parity_index, offset, length) -> bytes of the parity shard it holds.
ReadData = Callable[[int, int, int], bytes]
ReadParity = Callable[[int, int, int, int, int], bytes]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(v: Any, name: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Who gives and who holds which fragment of each rotation (pure; see the module docstring)."""

    k: int
    m: int
    members: tuple[int, ...]  # ranks, in position order

    def __post_init__(self) -> None:
        _positive_int(self.k, "K", 1)
        _positive_int(self.m, "M", 1)
        if len(self.members) < self.k + self.m:
            raise ValueError(f"a code group of ec:{self.k}+{self.m} needs >= {self.k + self.m} hosts, "
                             f"got {list(self.members)}")
        for r in self.members:
            _positive_int(r, "code group member rank", 0)
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"code group members repeat: {list(self.members)}")

    @property
    def n(self) -> int:
        return len(self.members)

    def position(self, rank: int) -> int:
        try:
            return self.members.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in code group {list(self.members)}") from None

    def holders(self, rotation: int) -> tuple[int, ...]:
        """The K + M ranks of ``rotation`` by fragment index: data 0..K-1, then parity 0..M-1."""
        return tuple(self.members[(rotation + i) % self.n] for i in range(self.k + self.m))

    def data_rotation(self, rank: int, shard: int) -> int:
        """The rotation whose data fragment ``shard`` is ``rank``'s shard ``shard`` (0..K-1)."""
        if not 0 <= shard < self.k:
            raise ValueError(f"shard {shard} outside 0..{self.k - 1}")
        return (self.position(rank) - shard) % self.n

    def parity_held(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(rotation, parity index) of every parity shard ``rank`` holds: M of them."""
        p = self.position(rank)
        return tuple(((p - self.k - j) % self.n, j) for j in range(self.m))


@dataclasses.dataclass(frozen=True)
class GroupManifest:
    """What a code group's parity holders keep beside their parity of one step: the geometry and the
    crc32c of every fragment (data and parity) of every stripe, so each fragment read back is verified."""

    step: int
    layout: GroupLayout
    stream_bytes: tuple[int, ...]  # per member (position order): its stream's true length
    manifest_bytes: tuple[int, ...]  # per member: the length of its MANIFEST.json, the stream's first part
    shard_bytes: int
    stripe_bytes: int
    # [rotation][stripe][fragment index]; a parity holder's manifest covers only the rotations whose parity
    # it holds (``layout.parity_held``): the rows of the others are empty. :meth:`merged` joins holders' rows.
    crc32c: tuple[tuple[tuple[int, ...], ...], ...]
    backend: str = DEFAULT_BACKEND
    format_version: int = GROUP_FORMAT_VERSION

    def __post_init__(self) -> None:
        n, width = self.layout.n, self.layout.k + self.layout.m
        _positive_int(self.step, "step", 0)
        _positive_int(self.shard_bytes, "shard_bytes", 1)
        _positive_int(self.stripe_bytes, "stripe_bytes", 1)
        if len(self.stream_bytes) != n or len(self.manifest_bytes) != n:
            raise ValueError(f"stream_bytes / manifest_bytes need one entry per member ({n})")
        for s, mb in zip(self.stream_bytes, self.manifest_bytes, strict=True):
            _positive_int(s, "stream_bytes", 1)
            _positive_int(mb, "manifest_bytes", 1)
            if not mb <= s <= self.layout.k * self.shard_bytes:
                raise ValueError(f"member stream of {s} bytes (manifest {mb}) does not fit K x {self.shard_bytes}")
        stripes = self.stripes
        if len(self.crc32c) != n or any(r and (len(r) != stripes or any(len(t) != width or any(
                type(c) is not int or not 0 <= c < 2**32 for c in t) for t in r)) for r in self.crc32c):
            raise ValueError(f"crc32c table must be {n} rotations x ({stripes} stripes or none) x {width} fragments")
        if not any(self.crc32c):
            raise ValueError("a code group manifest covers no rotation")

    @property
    def rotations(self) -> tuple[int, ...]:
        """The rotations whose crc32c rows this manifest has (all of them, or a parity holder's own)."""
        return tuple(r for r, row in enumerate(self.crc32c) if row)

    def covers(self, rotation: int) -> bool:
        return bool(self.crc32c[rotation])

    def geometry(self) -> dict[str, Any]:
        """Everything but the crc32c rows: equal for every holder's manifest of one group's step."""
        return {k: v for k, v in self.to_dict().items() if k != "crc32c"}

    def merged(self, others: Sequence[GroupManifest]) -> GroupManifest:
        """This manifest with the rows of ``others`` (other holders' of the same group's step) it lacks.
        ValueError when their geometry differs (another save, another group): never mixed."""
        rows = list(self.crc32c)
        mine = self.geometry()
        for o in others:
            if o.geometry() != mine:
                raise ValueError(f"code group manifests of step {self.step} differ in geometry: {o.geometry()} "
                                 f"vs {mine}")
            for r, row in enumerate(o.crc32c):
                if row and not rows[r]:
                    rows[r] = row
                elif row and row != rows[r]:
                    log.warning("code group of step %d: two holders' crc32c of rotation %d differ; keeping the "
                                "first (the fragments that match neither are passed over)", self.step, r)
        return dataclasses.replace(self, crc32c=tuple(rows))

    @property
    def stripes(self) -> int:
        return _ceil_div(self.shard_bytes, self.stripe_bytes)

    def stripe_range(self, stripe: int) -> tuple[int, int]:
        """(offset in the shard, length) of ``stripe``."""
        off = stripe * self.stripe_bytes
        return off, min(self.stripe_bytes, self.shard_bytes - off)

    @property
    def parity_bytes(self) -> int:
        """Parity bytes the whole group holds (n rotations x M shards)."""
        return self.layout.n * self.layout.m * self.shard_bytes

    @property
    def ram_vs_copy(self) -> float:
        """Parity bytes held / the bytes one whole copy of every member's step would hold."""
        return self.parity_bytes / sum(self.stream_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version, "step": self.step, "k": self.layout.k, "m": self.layout.m,
            "members": list(self.layout.members), "stream_bytes": list(self.stream_bytes),
            "manifest_bytes": list(self.manifest_bytes), "shard_bytes": self.shard_bytes,
            "stripe_bytes": self.stripe_bytes, "backend": self.backend,
            "crc32c": [[list(t) for t in r] for r in self.crc32c],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GroupManifest:
        """Validated (a parity holder's manifest comes from a peer: untrusted); ValueError if malformed."""
        try:
            if d["format_version"] != GROUP_FORMAT_VERSION:
                raise ValueError(f"code group manifest version {d['format_version']!r}, expected {GROUP_FORMAT_VERSION}")
            layout = GroupLayout(d["k"], d["m"], tuple(d["members"]))
            return cls(
                step=d["step"], layout=layout, stream_bytes=tuple(d["stream_bytes"]),
                manifest_bytes=tuple(d["manifest_bytes"]), shard_bytes=d["shard_bytes"],
                stripe_bytes=d["stripe_bytes"], backend=str(d["backend"]),
                crc32c=tuple(tuple(tuple(t) for t in r) for r in d["crc32c"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed code group manifest: {e!r}") from e


def shard_bytes_for(stream_bytes: Sequence[int], k: int) -> int:
    """Shard length of a group whose longest stream is ``max(stream_bytes)``: ceil(longest / K), aligned."""
    return max(ALIGN_BYTES, _ceil_div(_ceil_div(max(stream_bytes), k), ALIGN_BYTES) * ALIGN_BYTES)


@dataclasses.dataclass(frozen=True)
class ParityStripe:
    """One stripe of one parity shard: held by ``holder`` at ``offset`` in parity file (rotation, index)."""

    holder: int
    rotation: int
    index: int  # parity index 0..M-1
    stripe: int
    offset: int
    data: bytes | memoryview
    crc32c: int


def _padded(read: ReadData, rank: int, offset: int, length: int, stream_len: int) -> bytes:
    """``length`` bytes of ``rank``'s stream at ``offset``, zeros past its end (the padding is coded too)."""
    want = max(0, min(length, stream_len - offset))
    data = read(rank, offset, want) if want else b""
    if len(data) != want:
        raise ChecksumError(f"rank {rank} stream bytes {offset}+{want} (got {len(data)})", 0, 0)
    return data + bytes(length - want) if want < length else data


class GroupEncoder:
    """Parity of one step of one code group, stripe by stripe: iterate :meth:`stripes`, then take
    :meth:`manifest`. Reads each member's data through ``read_data`` (local files, or a peer's)."""

    def __init__(self, codec: StripeCodec, layout: GroupLayout, step: int, stream_bytes: Sequence[int],
                 manifest_bytes: Sequence[int], read_data: ReadData, stripe_bytes: int = DEFAULT_STRIPE_BYTES,
                 ahead_stripes: int = 0):
        if (codec.k, codec.m) != (layout.k, layout.m):
            raise ValueError(f"codec ec:{codec.k}+{codec.m} for a group of ec:{layout.k}+{layout.m}")
        _positive_int(stripe_bytes, "stripe_bytes", 1)
        self.codec, self.layout, self.read_data = codec, layout, read_data
        self.shard_bytes = shard_bytes_for(stream_bytes, layout.k)
        stripes = _ceil_div(self.shard_bytes, stripe_bytes)
        self._crc: list[list[tuple[int, ...]]] = [[() for _ in range(stripes)] for _ in range(layout.n)]
        self._base = dict(step=step, layout=layout, stream_bytes=tuple(stream_bytes),
                          manifest_bytes=tuple(manifest_bytes), shard_bytes=self.shard_bytes,
                          stripe_bytes=stripe_bytes, backend=codec.backend)
        self._lengths = dict(zip(layout.members, stream_bytes, strict=True))
        self.stripe_bytes = stripe_bytes
        self.ahead_stripes = ahead_stripes

    def stripes(self, rotations: Collection[int] | None = None) -> Iterator[ParityStripe]:
        """Every parity stripe (of ``rotations``, default all), rotation by rotation."""
        lay = self.layout
        plan = [(r, t) for r in sorted(range(lay.n) if rotations is None else rotations)
                for t in range(len(self._crc[r]))]

        def args(r: int, t: int, i: int) -> tuple[Any, ...]:
            off = t * self.stripe_bytes
            length = min(self.stripe_bytes, self.shard_bytes - off)
            holder = lay.holders(r)[i]
            return self.read_data, holder, i * self.shard_bytes + off, length, self._lengths[holder]

        with HolderThreads("ec-encode") as threads:
            def start(rt: tuple[int, int]) -> tuple[int, int, list[Any]]:
                r, t = rt
                if self.ahead_stripes <= 0:
                    return r, t, []
                return r, t, [threads.submit(lay.holders(r)[i], _padded, *args(r, t, i)) for i in range(lay.k)]

            for r, t, futures in lookahead(plan, start, max(0, self.ahead_stripes)):
                holders = lay.holders(r)
                off = t * self.stripe_bytes
                data = ([f.result() for f in futures] if futures
                        else [_padded(*args(r, t, i)) for i in range(lay.k)])
                parity = self.codec.encode(data)
                crcs = [crc32c(c) for c in data] + [crc32c(p) for p in parity]
                self._crc[r][t] = tuple(crcs)
                for j, p in enumerate(parity):
                    yield ParityStripe(holders[lay.k + j], r, j, t, off, p, crcs[lay.k + j])

    def manifest(self, rotations: Collection[int] | None = None) -> GroupManifest:
        """The manifest of ``rotations`` (default all): each must be encoded; the others' rows are empty (a
        parity holder's own manifest)."""
        want = set(range(self.layout.n) if rotations is None else rotations)
        if not want or any(not t for r in want for t in self._crc[r]):
            raise ValueError("GroupEncoder.manifest() before every stripe of its rotations was encoded")
        return GroupManifest(crc32c=tuple(tuple(r) if i in want else () for i, r in enumerate(self._crc)),
                             **self._base)


def _ahead_or_now(ahead: Mapping[int, Future[bytes | None]], read: Callable[[int], Future[bytes | None]],
                  index: int) -> bytes | None:
    """The fragment read ahead, or read now (on its holder's thread, after what it reads ahead)."""
    return (ahead[index] if index in ahead else read(index)).result()


def stream_plan(manifest: GroupManifest, rank: int) -> list[tuple[int, int, int]]:
    """The (rotation, stripe, fragment index) of each stripe of ``rank``'s step stream, in stream order: its K
    shards one after another, each cut in the manifest's stripes, up to the stream's end. ValueError when
    ``rank`` is not a member."""
    lay = manifest.layout
    left, plan = manifest.stream_bytes[lay.position(rank)], []
    for shard in range(lay.k):
        for t in range(manifest.stripes):
            if left > 0:
                plan.append((lay.data_rotation(rank, shard), t, shard))
                left -= manifest.stripe_range(t)[1]
    return plan


class GroupDecoder:
    """Rebuild what lost hosts held: a member's stream (:meth:`stream`) or the parity it held (:meth:`parity`).

    Each fragment read is checked against the manifest's crc32c; a corrupt one (``corrupt``) or one that
    cannot be read (``OSError``, ``unreadable``) is passed over, and :class:`NotEnoughFragmentsError` is
    raised for a stripe with fewer than K intact fragments. ``lost``: ranks not to read at all; ``local``: the
    rank read from this host's own RAM disk, whose fragments are used first.
    ``ahead_stripes``: read the fragments of up to that many stripes ahead (module docstring); a holder
    whose read failed (``OSError``) is not asked ahead again, its fragments are read only when needed.
    """

    def __init__(self, codec: StripeCodec, manifest: GroupManifest, read_data: ReadData, read_parity: ReadParity,
                 lost: Collection[int] = (), ahead_stripes: int = 0, local: int | None = None):
        lay = manifest.layout
        if (codec.k, codec.m, codec.backend) != (lay.k, lay.m, manifest.backend):
            raise ValueError(f"codec ec:{codec.k}+{codec.m} ({codec.backend}) for a group of "
                             f"ec:{lay.k}+{lay.m} ({manifest.backend})")
        self.codec, self.manifest = codec, manifest
        self.read_data, self.read_parity = read_data, read_parity
        self.lost = frozenset(lost)
        self.local = local  # the rank whose fragments are read from this host's RAM disk: used first
        self.corrupt: list[tuple[int, int, int, int]] = []  # (holder rank, rotation, stripe, fragment index)
        self.unreadable: list[tuple[int, int, int, int]] = []
        self._lengths = dict(zip(lay.members, manifest.stream_bytes, strict=True))
        self.ahead_stripes = ahead_stripes
        self._failed: set[int] = set()  # holders a read of failed (OSError): not read ahead

    def _fragment(self, rotation: int, stripe: int, index: int) -> bytes | None:
        man, lay = self.manifest, self.manifest.layout
        holder = lay.holders(rotation)[index]
        if holder in self.lost:
            return None
        off, length = man.stripe_range(stripe)
        where = (holder, rotation, stripe, index)
        if not man.covers(rotation):
            return None  # no crc32c to check it against: not intact (recover() says why)
        try:
            if index < lay.k:
                data = _padded(self.read_data, holder, index * man.shard_bytes + off, length, self._lengths[holder])
            else:
                data = self.read_parity(holder, rotation, index - lay.k, off, length)
        except ChecksumError as e:
            log.warning("ec fragment %s: %s", where, e)
            self.corrupt.append(where)
            return None
        except OSError as e:
            log.warning("ec fragment %s unreadable: %s", where, e)
            self.unreadable.append(where)
            self._failed.add(holder)
            return None
        expected = man.crc32c[rotation][stripe][index]
        actual = crc32c(data) if len(data) == length else -1
        if actual != expected:
            log.warning("ec fragment %s: crc32c %08x, expected %08x", where, actual & 0xFFFFFFFF, expected)
            self.corrupt.append(where)
            return None
        return data

    def _order(self, rotation: int) -> list[int]:
        """The fragment indices of ``rotation`` in the order they are read: the local rank's first (no network),
        then data before parity (hosts' own files)."""
        holders = self.manifest.layout.holders(rotation)
        return sorted(range(self.codec.n), key=lambda i: (holders[i] != self.local, i))

    def recover(self, rotation: int, stripe: int, want: Sequence[int],
                fetch: Callable[[int], bytes | None] | None = None) -> dict[int, memoryview]:
        """Fragments ``want`` of one stripe from the first K intact others (:meth:`_order`: the local rank's,
        then data first: hosts' own files).
        ``fetch(index)``: the checked fragment or None (default: :meth:`_fragment`, read here)."""
        fetch = fetch or (lambda i: self._fragment(rotation, stripe, i))
        if not self.manifest.covers(rotation):
            raise NotEnoughFragmentsError(
                f"step {self.manifest.step} rotation {rotation}: no crc32c rows (no GROUP.json of its parity "
                f"holders was read), so no fragment of it can be verified")
        have: dict[int, bytes] = {}
        for i in self._order(rotation):
            if len(have) == self.codec.k:
                break
            if i not in want and (frag := fetch(i)) is not None:
                have[i] = frag
        if len(have) < self.codec.k:
            raise NotEnoughFragmentsError(
                f"step {self.manifest.step} rotation {rotation} stripe {stripe}: {len(have)} intact fragment(s) of "
                f"ec:{self.codec.k}+{self.codec.m}, need {self.codec.k} (lost {sorted(self.lost)}, corrupt "
                f"{self.corrupt[-self.codec.n:]}, unreadable {self.unreadable[-self.codec.n:]})")
        out = self.codec.rebuild(have, want)
        man = self.manifest
        for i, frag in out.items():  # a wrong rebuild (a fragment corrupt yet matching its crc) is caught here
            if crc32c(frag) != man.crc32c[rotation][stripe][i]:
                raise ChecksumError(f"rebuilt fragment {i} of rotation {rotation} stripe {stripe}",
                                    man.crc32c[rotation][stripe][i], crc32c(frag))
        return out

    def stream(self, rank: int) -> Iterator[memoryview]:
        """``rank``'s step stream, rebuilt in order stripe by stripe (cut to its true length)."""
        left = self._lengths[rank]
        for piece in self.fragments(stream_plan(self.manifest, rank)):
            yield piece[:left]
            left -= len(piece)

    def fragments(self, plan: Sequence[tuple[int, int, int]]) -> Iterator[memoryview]:
        """Fragment ``index`` of stripe ``stripe`` of rotation ``rotation`` for each (rotation, stripe, index)
        of ``plan``, rebuilt in order, each checked against its crc32c."""
        for (_, _, index), out in self._recovered(plan):
            yield out[index]

    def parity(self, rank: int) -> Iterator[ParityStripe]:
        """The parity stripes ``rank`` held, rebuilt: to heal a lost or corrupt parity holder."""
        man, lay = self.manifest, self.manifest.layout
        plan = [(r, t, lay.k + j) for r, j in lay.parity_held(rank) for t in range(man.stripes)]
        for (r, t, idx), out in self._recovered(plan):
            yield ParityStripe(rank, r, idx - lay.k, t, man.stripe_range(t)[0], out[idx], man.crc32c[r][t][idx])

    def _recovered(self, plan: Sequence[tuple[int, int, int]]) -> Iterator[tuple[tuple[int, int, int],
                                                                                  dict[int, memoryview]]]:
        """(item, :meth:`recover` of it) for each (rotation, stripe, wanted index) of ``plan``, in order; the
        fragments read ahead when ``ahead_stripes`` > 0: the first K not wanted whose holder is not lost nor
        failed, each on its holder's thread (the others, needed when one of them is not intact, too)."""
        lay = self.manifest.layout
        with HolderThreads("ec-rebuild") as threads:
            def read(r: int, t: int, i: int) -> Future[bytes | None]:
                holder = lay.holders(r)[i]
                if holder in self.lost:  # not read at all: no thread for it
                    done: Future[bytes | None] = Future()
                    done.set_result(None)
                    return done
                return threads.submit(holder, self._fragment, r, t, i)

            def start(item: tuple[int, int, int]) -> dict[int, Future[bytes | None]]:
                r, t, want = item
                if self.ahead_stripes <= 0:
                    return {}
                ok = [i for i in self._order(r) if i != want and lay.holders(r)[i] not in self.lost
                      and lay.holders(r)[i] not in self._failed]
                return {i: read(r, t, i) for i in ok[:lay.k]}

            for item, futures in zip(plan, lookahead(plan, start, max(0, self.ahead_stripes)), strict=True):
                r, t, want = item
                got = functools.partial(_ahead_or_now, futures, functools.partial(read, r, t)) if futures else None
                yield item, self.recover(r, t, [want], got)
