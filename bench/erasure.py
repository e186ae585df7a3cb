"""Benchmark of erasure-coded redundancy (issue #35): one JSON line, every code measured side by side in one run.

    python -m bench.erasure [--mib 256] [--stripe-mib 1] [--codes 3+1,4+2] [--repeats 3]

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
``encode_seconds_per_host``, the median over the members), and the last member gets a whole copy of host 0's
step (untimed). Then host 0 is wiped: its server stops, its address leaves the code group, and an empty
RAM-disk root stands in for it (its old root is read by nobody, only to check the rebuilt bytes). Interleaved,
``--repeats`` times (after one warm-up round of each), medians reported:

- ec_recovery_seconds: :func:`replicator.erasure.host.rebuild_own` of host 0's step from the others (here,
  in the measuring process) into the empty root, committed as its step. A rebuild reads K fragments per
  rebuilt byte, from K hosts (data over the peer tier by byte range, parity from the parity holders), checks
  every fragment's crc32c, decodes, unpacks, checks every file's crc32c and the manifest's content hash;
- copy_recovery_seconds: ``replicator.peer.client.fetch_step`` of the same step from the host holding the
  whole copy into another empty root (1 byte read per restored byte, every file's crc32c checked), committed;
- ec_recovery_vs_copy_recovery: the first / the second (issue #35's target: <= 2);
- ec_recovery_two_lost_seconds (codes with M >= 2): hosts 0 and 1 wiped together, both rebuilt from the
  others; the time of host 0's rebuild.

Every rebuilt and copied step is compared byte for byte with the original (the benchmark fails otherwise);
``recovery_rebuilds_checked`` counts the rebuilds so checked.
"""

from __future__ import annotations

import argparse
import itertools
import json
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
from replicator.erasure.group import shard_bytes_for
from replicator.erasure.holder import ParityStore
from replicator.erasure.host import EcHost, compute_parity, rebuild_own
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


def _member(root: str, rank: int, nodes: int, stripe_bytes: int, conn: Any) -> None:
    """Child process: one host's ``Peer`` gRPC server and data port over ``root`` (with its parity store); on
    ``(step, CodeGroupSpec)`` it computes its parity and answers the seconds it took (or the error, a str);
    on "stop" (or the parent gone) it stops."""
    root_path = Path(root)
    store = ParityStore(root_path, rank)
    ts = peer_server.TransferServer()
    ts.start()
    servicer = peer_server.PeerServicer(root_path, rank, nodes, transfer_server=ts, parity=store)
    server, port = rpc.create_server("127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)],
                                     token=TOKEN)
    server.start()
    host = EcHost(rank, root_path, store, token=TOKEN, stripe_bytes=stripe_bytes)
    try:
        conn.send(port)
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg == "stop":
                return
            step, spec = msg
            t0 = time.monotonic()
            try:
                compute_parity(host, step, spec)
            except Exception as e:  # told to the parent, which fails the benchmark
                conn.send(f"{type(e).__name__}: {e}")
            else:
                conn.send(time.monotonic() - t0)
    finally:
        ts.stop()
        rpc.stop_server(server, 1.0)


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
                     repeats: int = 3, files: int = DEFAULT_RECOVERY_FILES) -> dict[str, Any]:
    """A wiped host's step rebuilt from parity vs copied whole from a peer, on K + M real hosts whose Peer
    servers run in child processes (see the module doc); seconds are medians of interleaved repeats."""
    (group,) = code_groups(1, k + m, k, m)
    ranks, n = list(group.members), group.n
    lost0, holder = ranks[0], ranks[-1]
    scratch = _scratch_dir()
    ctx = mp.get_context("spawn")
    children: dict[int, tuple[Any, Any]] = {}
    try:
        roots = {r: scratch / f"h{r}" for r in ranks}
        manifests = {r: make_step(roots[r], r, STEP, per_host_bytes, files, n, seed=1000 + r) for r in ranks}
        for r in ranks:
            conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_member, args=(str(roots[r]), r, n, stripe_bytes, child_conn), daemon=True)
            proc.start()
            children[r] = (proc, conn)
        addresses = {}
        for r, (_, conn) in children.items():
            if not conn.poll(CHILD_START_SECONDS):
                raise TimeoutError(f"host {r}'s Peer server did not start within {CHILD_START_SECONDS:.0f} s")
            addresses[r] = f"127.0.0.1:{conn.recv()}"

        def spec(lost: Collection[int] = ()) -> CodeGroupSpec:
            return CodeGroupSpec(k, m, tuple(ranks), tuple(manifests[r].content_hash for r in ranks),
                                 tuple("" if r in lost else addresses[r] for r in ranks))

        encode_s = []
        for r in ranks:  # one member at a time, in its own process, reading the others over the peer tier
            _, conn = children[r]
            conn.send((STEP, spec()))
            if not conn.poll(ENCODE_TIMEOUT_SECONDS):
                raise TimeoutError(f"host {r}'s parity took more than {ENCODE_TIMEOUT_SECONDS:.0f} s")
            got = conn.recv()
            if isinstance(got, str):
                raise RuntimeError(f"ec:{k}+{m}: host {r}'s parity failed: {got}")
            encode_s.append(got)
        # the copy baseline's source: a whole copy of host 0's step on another host (untimed), as copies:2 keeps
        peer_client.fetch_step(addresses[lost0], lost0, STEP, layout.peer_dir(roots[holder], lost0), token=TOKEN)
        _stop_child(*children.pop(lost0))  # host 0 is wiped: its server is gone, its root read by nobody
        fresh = (scratch / f"new-{i}" for i in itertools.count())
        checked = 0

        def timed(rank: int, restore: Callable[[Path], None]) -> float:
            """Seconds to restore ``rank``'s step into an empty root; checked byte for byte, then dropped."""
            nonlocal checked
            root = next(fresh)
            root.mkdir()
            t0 = time.monotonic()
            restore(root)
            dt = time.monotonic() - t0
            name = layout.step_name(STEP)
            _check_same(layout.steps_dir(roots[rank]) / name, layout.steps_dir(root) / name)
            checked += 1
            shutil.rmtree(root)
            return dt

        def ec(rank: int, lost: Collection[int]) -> Callable[[Path], None]:
            def restore(root: Path) -> None:
                host = EcHost(rank, root, ParityStore(root, rank), token=TOKEN, stripe_bytes=stripe_bytes)
                got = rebuild_own(host, STEP, spec(lost))
                if got != manifests[rank]:
                    raise RuntimeError(f"ec:{k}+{m}: host {rank}'s step rebuilt as {got.content_hash[:12]}")
            return restore

        def copy(root: Path) -> None:
            peer_client.fetch_step(addresses[holder], lost0, STEP, layout.steps_dir(root), token=TOKEN,
                                   expected_content_hash=manifests[lost0].content_hash)

        times: dict[str, list[float]] = {"ec": [], "copy": [], "ec2": []}
        two_lost = ranks[:2] if m >= 2 else []
        timed(lost0, ec(lost0, {lost0}))  # warm-up: imports, connections, first touch of the pages
        timed(lost0, copy)
        for i in range(repeats):
            rounds = [("ec", lambda: timed(lost0, ec(lost0, {lost0}))), ("copy", lambda: timed(lost0, copy))]
            for what, fn in rounds if i % 2 == 0 else rounds[::-1]:  # alternate which goes first
                times[what].append(fn())
            if two_lost:  # both rebuilt from the others (the second untimed), host 0's rebuild timed
                times["ec2"].append(timed(lost0, ec(lost0, set(two_lost))))
                timed(two_lost[1], ec(two_lost[1], set(two_lost)))
        ec_s, copy_s = statistics.median(times["ec"]), statistics.median(times["copy"])
        out = {
            "ec_recovery_vs_copy_recovery": round(ec_s / copy_s, 3),
            "ec_recovery_seconds": round(ec_s, 4),
            "copy_recovery_seconds": round(copy_s, 4),
            "encode_seconds_per_host": round(statistics.median(encode_s), 4),
            "ec_recovery_seconds_all": [round(x, 4) for x in times["ec"]],
            "copy_recovery_seconds_all": [round(x, 4) for x in times["copy"]],
            "recovery_rebuilds_checked": checked,
            "recovery_bytes_per_host": manifests[lost0].total_bytes,
        }
        if two_lost:
            out["ec_recovery_two_lost_seconds"] = round(statistics.median(times["ec2"]), 4)
        return out
    finally:
        for proc, conn in children.values():
            _stop_child(proc, conn)
        shutil.rmtree(scratch, ignore_errors=True)


RECOVERY_KEYS = ("ec_recovery_vs_copy_recovery", "ec_recovery_seconds", "copy_recovery_seconds",
                 "encode_seconds_per_host", "ec_recovery_two_lost_seconds", "ec_recovery_seconds_all",
                 "copy_recovery_seconds_all", "recovery_rebuilds_checked")


def run(mib: float = 256, stripe_bytes: int = DEFAULT_STRIPE_BYTES, codes: Sequence[tuple[int, int]] = ((3, 1), (4, 2)),
        repeats: int = 3, recovery_mib: float = DEFAULT_RECOVERY_MIB,
        recovery_files: int = DEFAULT_RECOVERY_FILES) -> dict[str, Any]:
    total = int(mib * MIB)
    per_code = {f"{k}+{m}": measure_code(k, m, total, stripe_bytes, repeats) for k, m in codes}
    if recovery_mib > 0:
        for k, m in codes:
            per_code[f"{k}+{m}"].update(measure_recovery(k, m, int(recovery_mib * MIB), stripe_bytes, repeats,
                                                         recovery_files))
    out: dict[str, Any] = {"bench": "erasure", "backend": DEFAULT_BACKEND, "mib": mib,
                           "stripe_bytes": stripe_bytes, "repeats": repeats}
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
    a = ap.parse_args()
    print(json.dumps(run(a.mib, int(a.stripe_mib * MIB), [_code(c) for c in a.codes.split(",")], a.repeats,
                         a.recovery_mib, a.recovery_files)))


if __name__ == "__main__":
    main()
