"""Benchmark of erasure-coded redundancy (issue #35): one JSON line, every code measured side by side in one run.

    python -m bench.erasure [--mib 256] [--stripe-mib 1] [--codes 3+1,4+2] [--repeats 3]
                            [--recovery-mib 128] [--recovery-files 8] [--link-mbit 0]

For each code ec:K+M, one code group of K + M hosts (:func:`replicator.erasure.code_groups` on one slice)
whose steps together are ``--mib`` MiB (distinct bytes per host, in memory: reads are copies, like a pread
from tmpfs), through the real :class:`GroupEncoder` / :class:`GroupDecoder` (crc32c of every fragment
included), in one thread:

- encode_gib_per_s_per_core: data bytes encoded / CPU seconds of the encoding thread (``time.thread_time``:
  what one core does, however busy the box); ``encode_gib_per_s_wall``: the same over wall time;
- decode_gib_per_s_per_core (and ``_wall``): bytes of M lost hosts' steps rebuilt / CPU seconds, every
  rebuilt byte checked equal to the original (bit-exact or the benchmark fails);
- ram_for_redundancy_vs_copy: parity bytes the group holds / one whole copy of every host's step;
- losses_survived: M, checked by the rebuild above;
- memcpy_gib_per_s_per_core: a plain copy of the same bytes in the same run, for scale.

Rates are the best of ``--repeats`` (the least disturbed run on a shared box).

Recovery of a wiped host, the real host-side code on real hosts (``--recovery-mib`` per host, 0 skips it):
per code, K + M hosts, each a RAM-disk root on /dev/shm with a real ``Peer`` gRPC server and data port in a
child process of its own (the serving hosts do not share the measuring process's GIL), each holding a
committed step of ``--recovery-files`` files of distinct random bytes. Each member computes its parity of
the step in its own process (:func:`replicator.erasure.host.compute_parity`, one member at a time:
``encode_seconds_per_host``, the median over the members), and the last member fetches a whole copy of host
0's step (untimed). Then host 0 is wiped: its server stops, its address leaves the code group, and an empty
RAM-disk root stands in for it (its old root is read by nobody, only to check the rebuilt bytes). Interleaved,
``--repeats`` times (after one warm-up round of each), medians reported:

- ec_recovery_seconds: :func:`replicator.erasure.rebuild.rebuild_own` of host 0's step from the others (on
  loopback in the measuring process, with ``--link-mbit`` in the replacement host's own) into the empty
  root, committed as its step. A rebuild reads K fragments per rebuilt byte, from K hosts (data over the
  peer tier by byte range, parity from the parity holders), checks every fragment's crc32c, decodes,
  unpacks, checks every file's crc32c and the manifest's content hash;
- copy_recovery_seconds: ``replicator.peer.client.fetch_step`` of the same step from the host holding the
  whole copy into another empty root (1 byte read per restored byte, every file's crc32c checked), committed;
- ec_recovery_vs_copy_recovery: the first / the second (issue #35's target: <= 2);
- ec_pipelined_recovery_seconds (and ``_vs_copy_recovery``): the same rebuild pipelined along chains of the
  other members (``EcHost(pipeline=True)``, :mod:`replicator.erasure.pipeline`), and ec_direct_...: decoded in
  the replacement itself (K fragments per rebuilt byte);
- rebuild_mode: the mode each timed rebuild ran in (``rebuild_own``'s last log record: pipelined, spread or
  here), by kind (ec, pipelined, direct, ec2); a rebuild asked to be pipelined or spread that ran here fails
  the benchmark;
- ec_recovery_two_lost_seconds (codes with M >= 2): hosts 0 and 1 wiped together, both rebuilt from the
  others; the time of host 0's rebuild.

Every rebuilt and copied step is compared byte for byte with the original (the benchmark fails otherwise);
``recovery_rebuilds_checked`` counts the rebuilds so checked.

By default every host is on 127.0.0.1 and the restores run in the measuring process: on a small box that
measures the shared CPU more than any network. ``--link-mbit N`` (N > 0) gives every host a link of its own
instead, as each host of a cluster has its own NIC: one network namespace per member and one more for the
replacement of host 0, joined by veth pairs to a bridge (``tests/kits/faultnet.py``), each link limited to N
Mbit/s each way (``tc tbf`` on both ends). The members' children enter their namespaces (setns) before
serving on their namespace's address; the restores run in a child process inside the replacement's
namespace, which times them (the bytes are still checked here: the roots are on /dev/shm). Adds
``copy_recovery_floor_seconds``: the step's bytes * 8 / (N * 10**6), what no copy can beat on such a link, and
``link_bytes_vs_copy`` / ``pipelined_link_bytes_vs_copy``: per host (member rank, "new" for the replacement),
the larger of the bytes its link sent and received during the last timed spread / pipelined rebuild
(interface counters: frames, headers included) over what the copy source's link sent during the last copy. The
namespaces are deleted at the end (and those of a killed earlier run before starting). Needs root, ``ip``,
``iptables`` and ``tc``; the JSON line's ``link_mbit`` is N (0: loopback).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.peer import _scratch_dir, _stop_child, make_step
from mtc_rpc import peer_pb2_grpc
from replicator.erasure import (
    DEFAULT_BACKEND,
    DEFAULT_STRIPE_BYTES,
    GroupDecoder,
    GroupEncoder,
    StripeCodec,
    code_groups,
)
from replicator.erasure import spread as ec_spread
from replicator.erasure.group import shard_bytes_for
from replicator.erasure.holder import ParityStore
from replicator.erasure.host import EcHost, compute_parity
from replicator.erasure.rebuild import rebuild_own
from replicator.erasure.wire import CodeGroupSpec
from replicator.net import rpc
from replicator.peer import client as peer_client
from replicator.peer import server as peer_server
from sidecar import layout

GIB = 1 << 30
MIB = 1 << 20
TOKEN = "bench-ec-token"
STEP = 1
DEFAULT_RECOVERY_MIB = 128
DEFAULT_RECOVERY_FILES = 8
CHILD_START_SECONDS = 120.0
ENCODE_TIMEOUT_SECONDS = 600.0
RESTORE_TIMEOUT_SECONDS = 600.0


def _timed(fn: Any) -> tuple[Any, float, float]:
    """(result, CPU seconds of this thread, wall seconds)."""
    c0, w0 = time.thread_time(), time.monotonic()
    out = fn()
    return out, time.thread_time() - c0, time.monotonic() - w0


def measure_code(k: int, m: int, total_bytes: int, stripe_bytes: int, repeats: int = 3) -> dict[str, Any]:
    """One code group of ec:K+M: encode, lose M hosts, rebuild them; rates and ratios (see the module doc)."""
    (group,) = code_groups(1, k + m, k, m)
    n = group.n
    per_host = max(1, total_bytes // n)
    base = os.urandom(per_host + 4096 * n)
    offsets = {r: 4096 * i for i, r in enumerate(group.members)}  # distinct bytes per host

    def read(rank: int, off: int, length: int) -> bytes:
        start = offsets[rank] + off
        return base[start:start + min(length, per_host - off)]

    codec = StripeCodec(k, m)
    lengths = [per_host] * n
    mlens = [min(per_host, 1)] * n
    best: dict[str, float] = {}
    # parity lands in buffers written once before, as in a parity file of recycled tmpfs pages
    shard = shard_bytes_for(lengths, k)
    parity = {(rank, r, j): np.ones(shard, np.uint8) for rank in group.members for r, j in group.parity_held(rank)}
    manifest = None

    def encode(enc: GroupEncoder) -> None:
        for p in enc.stripes():
            parity[(p.holder, p.rotation, p.index)][p.offset:p.offset + len(p.data)] = np.frombuffer(p.data, np.uint8)

    for _ in range(repeats):
        enc = GroupEncoder(codec, group, 1, lengths, mlens, read, stripe_bytes=stripe_bytes)
        _, cpu, wall = _timed(lambda enc=enc: encode(enc))
        manifest = enc.manifest()
        best["encode_cpu"] = max(best.get("encode_cpu", 0.0), per_host * n / cpu / GIB)
        best["encode_wall"] = max(best.get("encode_wall", 0.0), per_host * n / wall / GIB)
    assert manifest is not None
    lost = group.members[:m]

    def read_parity(rank: int, rot: int, j: int, off: int, length: int) -> bytes:
        return parity[(rank, rot, j)][off:off + length].tobytes()

    # the rebuilt bytes land in buffers written once before (as a restore lands in recycled tmpfs pages): a
    # fresh b"".join of the pieces cost more than the rebuild itself (page faults of new memory)
    rebuilt = {r: np.ones(per_host, np.uint8) for r in lost}

    def rebuild(dec: GroupDecoder) -> None:
        for r in lost:
            at = 0
            for piece in dec.stream(r):
                rebuilt[r][at:at + len(piece)] = np.frombuffer(piece, np.uint8)
                at += len(piece)
            if at != per_host:
                raise RuntimeError(f"ec:{k}+{m}: host {r}'s step rebuilt to {at} bytes, not {per_host}")

    for _ in range(repeats):
        for buf in rebuilt.values():
            buf.fill(1)
        dec = GroupDecoder(codec, manifest, read, read_parity, lost)
        _, cpu, wall = _timed(lambda dec=dec: rebuild(dec))
        for r in lost:
            if rebuilt[r].tobytes() != read(r, 0, per_host):
                raise RuntimeError(f"ec:{k}+{m}: host {r}'s step rebuilt wrong")
        best["decode_cpu"] = max(best.get("decode_cpu", 0.0), per_host * m / cpu / GIB)
        best["decode_wall"] = max(best.get("decode_wall", 0.0), per_host * m / wall / GIB)
    return {
        "encode_gib_per_s_per_core": round(best["encode_cpu"], 3),
        "encode_gib_per_s_wall": round(best["encode_wall"], 3),
        "decode_gib_per_s_per_core": round(best["decode_cpu"], 3),
        "decode_gib_per_s_wall": round(best["decode_wall"], 3),
        "ram_for_redundancy_vs_copy": round(manifest.ram_vs_copy, 4),
        "losses_survived": m,
        "hosts": n,
    }


def memcpy_rate(nbytes: int, repeats: int = 3) -> float:
    """GiB/s per core of a plain copy of ``nbytes`` into a buffer already written once (``numpy.copyto``: a
    ``bytearray`` slice assignment of 256 MiB ran at 1.6 GiB/s here against numpy's 11.9)."""
    src = np.frombuffer(os.urandom(nbytes), np.uint8)
    dst = np.ones_like(src)
    best = 0.0
    for _ in range(repeats):
        _, cpu, _ = _timed(lambda: np.copyto(dst, src))
        best = max(best, nbytes / max(cpu, 1e-9) / GIB)
    return round(best, 3)


@dataclasses.dataclass(frozen=True)
class ParityJob:
    """A member computes its parity of ``step`` for ``spec``."""

    step: int
    spec: CodeGroupSpec


@dataclasses.dataclass(frozen=True)
class CopyJob:
    """``rank``'s step fetched whole from the host at ``address`` into the steps directory ``dest``, committed."""

    address: str
    rank: int
    dest: str
    content_hash: str


@dataclasses.dataclass(frozen=True)
class RebuildJob:
    """``rank``'s step rebuilt from ``spec``'s other members into the empty RAM-disk root ``root``, committed;
    RuntimeError unless it is ``want``."""

    rank: int
    root: str
    spec: CodeGroupSpec
    want: layout.StepManifest
    # "spread" (the other members decode it: replicator.erasure.spread; the replicator's default), "pipelined"
    # (along chains of them: replicator.erasure.pipeline, then spread if that fails) or "here" (decoded here)
    mode: str = "spread"


Job = ParityJob | CopyJob | RebuildJob


class _Modes(logging.Handler):
    """The ``rebuild_mode`` of the records logged while it is attached (rebuild_own's last line), and the
    warnings (why a mode fell back)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.modes: list[str] = []
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "rebuild_mode"):
            self.modes.append(record.rebuild_mode)
        elif record.levelno >= logging.WARNING:
            self.warnings.append(record.getMessage())


def _do(job: Job, stripe_bytes: int, host: EcHost | None = None) -> str:
    """Do ``job`` in this process (a :class:`ParityJob` needs the member's ``host``); the rebuild mode that ran
    for a :class:`RebuildJob` (RuntimeError when it was "here" though another was asked for), else ""."""
    if isinstance(job, ParityJob):
        if host is None:
            raise ValueError("a parity job needs the member's EcHost")
        compute_parity(host, job.step, job.spec)
        return ""
    if isinstance(job, CopyJob):
        peer_client.fetch_step(job.address, job.rank, STEP, Path(job.dest), token=TOKEN,
                               expected_content_hash=job.content_hash)
        return ""
    root = Path(job.root)
    seen = _Modes()
    log = logging.getLogger("replicator.erasure.rebuild")
    log.addHandler(seen)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        got = rebuild_own(EcHost(job.rank, root, ParityStore(root, job.rank), token=TOKEN, stripe_bytes=stripe_bytes,
                                 spread=job.mode != "here", pipeline=job.mode == "pipelined"), STEP, job.spec)
    finally:
        log.removeHandler(seen)
        log.setLevel(level)
    mode = seen.modes[-1] if seen.modes else "?"
    if mode == "here" != job.mode:  # a rebuild that decoded here would time the wrong thing
        raise RuntimeError(f"host {job.rank}'s rebuild asked {job.mode} ran here: {seen.warnings[:2]}")
    if got != job.want:
        raise RuntimeError(f"host {job.rank}'s step rebuilt as {got.content_hash[:12]}")
    return mode


def _answer_jobs(conn: Any, stripe_bytes: int, host: EcHost | None = None) -> None:
    """Child side: each job received is done and answered with (its seconds, the rebuild mode or ""), or the
    error (a str) when it failed; until "stop" or the parent is gone."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job == "stop":
            return
        t0 = time.monotonic()
        try:
            mode = _do(job, stripe_bytes, host)
        except Exception as e:  # told to the parent, which fails the benchmark
            conn.send(f"{type(e).__name__}: {e}")
        else:
            conn.send((time.monotonic() - t0, mode))


def _enter(netns: str) -> None:
    """This process into the host's network namespace ``netns`` (none: stay), first thing in a child: setns
    moves only the calling thread, and the threads that open sockets (gRPC's, the data port's) are started
    after it, from this one. This module's imports of grpc came before, but an import starts no gRPC thread
    (only the first server or channel does)."""
    if netns:
        from tests.kits import faultnet

        faultnet.enter(netns)


def _member(root: str, rank: int, nodes: int, stripe_bytes: int, netns: str, ip: str, conn: Any) -> None:
    """Child process: one host's ``Peer`` gRPC server and data port on ``ip`` over ``root`` (with its parity
    store), inside network namespace ``netns`` when one is given; answers its gRPC port, then does the jobs
    it is sent (:func:`_answer_jobs`)."""
    _enter(netns)
    root_path = Path(root)
    store = ParityStore(root_path, rank)
    ts = peer_server.TransferServer(ip)
    ts.start()
    host = EcHost(rank, root_path, store, token=TOKEN, stripe_bytes=stripe_bytes)
    servicer = peer_server.PeerServicer(root_path, rank, nodes, transfer_server=ts, parity=store,
                                        rebuild=functools.partial(ec_spread.serve, host))  # as the daemon serves
    server, port = rpc.create_server(f"{ip}:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)],
                                     token=TOKEN)
    server.start()
    try:
        conn.send(port)
        _answer_jobs(conn, stripe_bytes, host)
    finally:
        ts.stop()
        rpc.stop_server(server, 1.0)


def _restorer(stripe_bytes: int, netns: str, conn: Any) -> None:
    """Child process: the replacement of a wiped host, inside network namespace ``netns`` (a link of its
    own); answers None when ready, then does the restores it is sent (:func:`_answer_jobs`)."""
    _enter(netns)
    conn.send(None)
    _answer_jobs(conn, stripe_bytes)


def _start(ctx: Any, target: Callable[..., None], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """(process, parent's end of its pipe): ``target(*args, conn)`` started in a spawned child."""
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child_conn), daemon=True)
    proc.start()
    child_conn.close()  # the child's end now lives in the child only: its exit reads as EOF here
    return proc, conn


def _answer(child: tuple[Any, Any], what: str, timeout_seconds: float) -> Any:
    """The child's next answer; TimeoutError after ``timeout_seconds``, RuntimeError when it answers an
    error (a str) or exits first."""
    proc, conn = child
    if not conn.poll(timeout_seconds):
        raise TimeoutError(f"{what}: no answer within {timeout_seconds:.0f} s")
    try:
        got = conn.recv()
    except EOFError:
        proc.join(timeout=5)
        raise RuntimeError(f"{what}: its process exited (exit code {proc.exitcode})") from None
    if isinstance(got, str):
        raise RuntimeError(f"{what} failed: {got}")
    return got


def _check_same(want: Path, got: Path) -> None:
    """RuntimeError unless the step directories ``want`` and ``got`` hold the same files with the same bytes."""
    def files(d: Path) -> list[str]:
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())

    names = files(want)
    if files(got) != names:
        raise RuntimeError(f"{got} holds files {files(got)[:8]}, {want} holds {names[:8]}")
    for name in names:
        if (want / name).read_bytes() != (got / name).read_bytes():
            raise RuntimeError(f"{got / name} differs from {want / name}")


def measure_recovery(k: int, m: int, per_host_bytes: int, stripe_bytes: int = DEFAULT_STRIPE_BYTES,
                     repeats: int = 3, files: int = DEFAULT_RECOVERY_FILES, link_mbit: int = 0) -> dict[str, Any]:
    """A wiped host's step rebuilt from parity vs copied whole from a peer, on K + M real hosts whose Peer
    servers run in child processes (see the module doc); seconds are medians of interleaved repeats. With
    ``link_mbit`` > 0 every host, and the replacement that restores, is on a link of its own of that rate."""
    (group,) = code_groups(1, k + m, k, m)
    ranks, n = list(group.members), group.n
    lost0, holder = ranks[0], ranks[-1]
    code = f"ec:{k}+{m}"
    scratch = _scratch_dir()
    ctx = mp.get_context("spawn")
    children: dict[int, tuple[Any, Any]] = {}
    restorer: tuple[Any, Any] | None = None
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
        net: Any = None
        places = [("", "127.0.0.1")] * (n + 1)  # (network namespace, IP) of each member, then the replacement's
        if link_mbit > 0:
            from tests.kits import faultnet

            _require_links()
            faultnet.reap_stale()  # what a killed run left
            net = cleanup.enter_context(faultnet.FaultNetwork(n + 1))  # deleted after the children stop (LIFO)
            for i in range(n + 1):
                net.throttle(i, link_mbit)
            places = [(net.host_ns[i], net.ip(i)) for i in range(n + 1)]

        @cleanup.callback
        def _stop_all() -> None:
            for child in [*children.values(), *([restorer] if restorer else [])]:
                _stop_child(*child)

        roots = {r: scratch / f"h{r}" for r in ranks}
        manifests = {r: make_step(roots[r], r, STEP, per_host_bytes, files, n, seed=1000 + r) for r in ranks}
        for i, r in enumerate(ranks):
            children[r] = _start(ctx, _member, (str(roots[r]), r, n, stripe_bytes, *places[i]))
        if link_mbit > 0:  # the replacement of host 0 restores in a namespace of its own, over its own link
            restorer = _start(ctx, _restorer, (stripe_bytes, places[n][0]))
        addresses = {}
        for i, r in enumerate(ranks):
            port = _answer(children[r], f"host {r}'s Peer server", CHILD_START_SECONDS)
            addresses[r] = f"{places[i][1]}:{port}"
        if restorer is not None:
            _answer(restorer, "the replacement host", CHILD_START_SECONDS)

        def restore(job: Job, what: str) -> tuple[float, str]:
            """(seconds, rebuild mode) of ``job`` done by the replacement host: here on loopback, in its own
            process and network namespace with links."""
            if restorer is None:
                t0 = time.monotonic()
                try:
                    mode = _do(job, stripe_bytes)
                except Exception as e:
                    raise RuntimeError(f"{what} failed: {type(e).__name__}: {e}") from e
                return time.monotonic() - t0, mode
            restorer[1].send(job)
            return _answer(restorer, what, RESTORE_TIMEOUT_SECONDS)

        def spec(lost: Collection[int] = ()) -> CodeGroupSpec:
            return CodeGroupSpec(k, m, tuple(ranks), tuple(manifests[r].content_hash for r in ranks),
                                 tuple("" if r in lost else addresses[r] for r in ranks))

        encode_s = []
        for r in ranks:  # one member at a time, in its own process, reading the others over the peer tier
            children[r][1].send(ParityJob(STEP, spec()))
            encode_s.append(_answer(children[r], f"{code}: host {r}'s parity", ENCODE_TIMEOUT_SECONDS)[0])
        # the copy baseline's source: a whole copy of host 0's step on another host (untimed), as copies:2 keeps
        children[holder][1].send(CopyJob(addresses[lost0], lost0, str(layout.peer_dir(roots[holder], lost0)),
                                         manifests[lost0].content_hash))
        _answer(children[holder], f"{code}: host {holder}'s copy of host {lost0}'s step", RESTORE_TIMEOUT_SECONDS)
        _stop_child(*children.pop(lost0))  # host 0 is wiped: its server is gone, its root read by nobody
        fresh = (scratch / f"new-{i}" for i in itertools.count())
        checked = 0
        moved: dict[str, list[tuple[int, int]]] = {}  # the last run's bytes (sent, received) per link, by kind
        labels = [str(r) for r in ranks] + ["new"]

        def timed(rank: int, job: Callable[[Path], Job], kind: str = "") -> float:
            """Seconds to restore ``rank``'s step into an empty root; checked byte for byte, then dropped. With
            ``kind``, its rebuild mode is kept in ``modes`` and, on links, each link's bytes in ``moved``."""
            nonlocal checked
            root = next(fresh)
            root.mkdir()
            before = _link_bytes(net, n + 1) if link_mbit > 0 and kind else []
            dt, mode = restore(job(root), f"{code}: restoring host {rank}'s step")
            if before:
                moved[kind] = [(t1 - t0, r1 - r0) for (t0, r0), (t1, r1) in zip(before, _link_bytes(net, n + 1),
                                                                               strict=True)]
            if kind and mode:
                modes.setdefault(kind, []).append(mode)
            name = layout.step_name(STEP)
            _check_same(layout.steps_dir(roots[rank]) / name, layout.steps_dir(root) / name)
            checked += 1
            shutil.rmtree(root)
            return dt

        def ec(rank: int, lost: Collection[int], mode: str = "spread") -> Callable[[Path], Job]:
            return lambda root: RebuildJob(rank, str(root), spec(lost), manifests[rank], mode)

        def copy(root: Path) -> Job:
            return CopyJob(addresses[holder], lost0, str(layout.steps_dir(root)), manifests[lost0].content_hash)

        times: dict[str, list[float]] = {"ec": [], "copy": [], "ec2": [], "direct": [], "pipelined": []}
        modes: dict[str, list[str]] = {}
        two_lost = ranks[:2] if m >= 2 else []
        timed(lost0, ec(lost0, {lost0}))  # warm-up: imports, connections, first touch of the pages
        timed(lost0, ec(lost0, {lost0}, "pipelined"))
        timed(lost0, ec(lost0, {lost0}, "here"))
        timed(lost0, copy)
        for i in range(repeats):
            rounds = [("ec", lambda: timed(lost0, ec(lost0, {lost0}), "ec")),
                      ("copy", lambda: timed(lost0, copy, "copy")),
                      ("direct", lambda: timed(lost0, ec(lost0, {lost0}, "here"), "direct")),
                      ("pipelined", lambda: timed(lost0, ec(lost0, {lost0}, "pipelined"), "pipelined"))]
            for what, fn in rounds[i % 4:] + rounds[:i % 4]:  # rotate which goes first
                times[what].append(fn())
            if two_lost:  # both rebuilt from the others (the second untimed), host 0's rebuild timed
                times["ec2"].append(timed(lost0, ec(lost0, set(two_lost)), "ec2"))
                timed(two_lost[1], ec(two_lost[1], set(two_lost)))
        ec_s, copy_s = statistics.median(times["ec"]), statistics.median(times["copy"])
        direct_s, piped_s = statistics.median(times["direct"]), statistics.median(times["pipelined"])
        out = {
            "ec_recovery_vs_copy_recovery": round(ec_s / copy_s, 3),
            "ec_recovery_seconds": round(ec_s, 4),
            "copy_recovery_seconds": round(copy_s, 4),
            "ec_pipelined_recovery_vs_copy_recovery": round(piped_s / copy_s, 3),
            "ec_pipelined_recovery_seconds": round(piped_s, 4),
            "ec_direct_recovery_vs_copy_recovery": round(direct_s / copy_s, 3),
            "ec_direct_recovery_seconds": round(direct_s, 4),
            "rebuild_mode": modes,
            "encode_seconds_per_host": round(statistics.median(encode_s), 4),
            "ec_recovery_seconds_all": [round(x, 4) for x in times["ec"]],
            "copy_recovery_seconds_all": [round(x, 4) for x in times["copy"]],
            "recovery_rebuilds_checked": checked,
            "recovery_bytes_per_host": manifests[lost0].total_bytes,
        }
        if two_lost:
            out["ec_recovery_two_lost_seconds"] = round(statistics.median(times["ec2"]), 4)
        if link_mbit > 0:  # what no copy of the step can beat on such a link
            out["copy_recovery_floor_seconds"] = round(manifests[lost0].total_bytes * 8 / (link_mbit * 1e6), 4)
            copied = max(moved["copy"][ranks.index(holder)][0], 1)  # what the copy's source sent
            for kind, key in (("ec", "link_bytes_vs_copy"), ("pipelined", "pipelined_link_bytes_vs_copy")):
                out[key] = {label: round(max(sent, got) / copied, 3)
                            for label, (sent, got) in zip(labels, moved[kind], strict=True)}
        return out


RECOVERY_KEYS = ("ec_recovery_vs_copy_recovery", "ec_recovery_seconds", "copy_recovery_seconds",
                 "ec_pipelined_recovery_vs_copy_recovery", "ec_pipelined_recovery_seconds", "rebuild_mode",
                 "link_bytes_vs_copy", "pipelined_link_bytes_vs_copy",
                 "encode_seconds_per_host", "ec_recovery_two_lost_seconds", "ec_recovery_seconds_all",
                 "copy_recovery_seconds_all", "recovery_rebuilds_checked", "copy_recovery_floor_seconds",
                 "ec_direct_recovery_vs_copy_recovery", "ec_direct_recovery_seconds")


def run(mib: float = 256, stripe_bytes: int = DEFAULT_STRIPE_BYTES, codes: Sequence[tuple[int, int]] = ((3, 1), (4, 2)),
        repeats: int = 3, recovery_mib: float = DEFAULT_RECOVERY_MIB,
        recovery_files: int = DEFAULT_RECOVERY_FILES, link_mbit: int = 0) -> dict[str, Any]:
    if link_mbit > 0 and recovery_mib > 0:
        _require_links()  # before the codec's measurement, not after
    total = int(mib * MIB)
    per_code = {f"{k}+{m}": measure_code(k, m, total, stripe_bytes, repeats) for k, m in codes}
    if recovery_mib > 0:
        for k, m in codes:
            per_code[f"{k}+{m}"].update(measure_recovery(k, m, int(recovery_mib * MIB), stripe_bytes, repeats,
                                                         recovery_files, link_mbit))
    out: dict[str, Any] = {"bench": "erasure", "backend": DEFAULT_BACKEND, "mib": mib,
                           "stripe_bytes": stripe_bytes, "repeats": repeats, "link_mbit": link_mbit}
    for key in ("encode_gib_per_s_per_core", "decode_gib_per_s_per_core", "ram_for_redundancy_vs_copy",
                "losses_survived", "encode_gib_per_s_wall", "decode_gib_per_s_wall", "hosts"):
        out[key] = {code: v[key] for code, v in per_code.items()}
    if recovery_mib > 0:
        out["recovery_mib_per_host"] = recovery_mib
        out["recovery_files"] = recovery_files
        for key in RECOVERY_KEYS:
            out[key] = {code: v[key] for code, v in per_code.items() if key in v}
    out["memcpy_gib_per_s_per_core"] = memcpy_rate(min(total, 256 << 20), repeats)
    out["cpus"] = os.cpu_count()
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def _link_bytes(net: Any, hosts: int) -> list[tuple[int, int]]:
    """(bytes sent, bytes received) so far by each of the first ``hosts`` hosts' link (its interface's counters,
    Ethernet frames: headers included, as on the copy's source they are divided by)."""
    from tests.kits import faultnet

    out = []
    for ns in net.host_ns[:hosts]:
        stats = f"/sys/class/net/{faultnet.IFACE}/statistics"
        tx, rx = net.run(ns, ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]).split()
        out.append((int(tx), int(rx)))
    return out


def links_unavailable() -> str:
    """"" when ``--link-mbit`` can put each host on a link of its own here, else why not."""
    from tests.kits import faultnet

    return faultnet.available()


def _require_links() -> None:
    if why := links_unavailable():
        raise RuntimeError(f"--link-mbit needs a network namespace per host, which cannot be made here: {why}")


def _code(spec: str) -> tuple[int, int]:
    k, _, m = spec.partition("+")
    return int(k), int(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="MiB of all hosts' steps of one group together")
    ap.add_argument("--stripe-mib", type=float, default=DEFAULT_STRIPE_BYTES / (1 << 20),
                    help="MiB of one fragment of one stripe")
    ap.add_argument("--codes", default="3+1,4+2", help="comma-separated K+M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recovery-mib", type=float, default=DEFAULT_RECOVERY_MIB,
                    help="MiB of each host's step in the recovery measurement (0: skip it)")
    ap.add_argument("--recovery-files", type=int, default=DEFAULT_RECOVERY_FILES, help="files of each host's step")
    ap.add_argument("--link-mbit", type=int, default=0,
                    help="recovery with every host on a network link of its own of this many Mbit/s (network "
                         "namespaces, tc tbf; needs root, ip, iptables, tc); 0: all hosts on loopback")
    a = ap.parse_args()
    if a.link_mbit < 0:
        ap.error("--link-mbit must be >= 0")
    if a.link_mbit > 0 and a.recovery_mib <= 0:
        ap.error("--link-mbit applies to the recovery measurement: give --recovery-mib > 0")
    if a.link_mbit > 0 and (why := links_unavailable()):
        ap.error(f"--link-mbit needs a network namespace per host, which cannot be made here: {why}")
    print(json.dumps(run(a.mib, int(a.stripe_mib * MIB), [_code(c) for c in a.codes.split(",")], a.repeats,
                         a.recovery_mib, a.recovery_files, a.link_mbit)))


if __name__ == "__main__":
    main()
