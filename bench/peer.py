"""Peer-tier benchmark (``python -m bench.peer``): prints one JSON line of measurements.

``peer_vs_tcp``: throughput of ``replicator.peer.client.fetch_step`` (a verified, committed copy of a
~512 MiB step between two RAM-disk roots, server in another process; the previous copy is deleted the
way GC deletes a step, so its tmpfs pages are recycled — ``peer_fresh_pages_*``: into fresh pages
instead) divided by a plain TCP transfer
of the same bytes over loopback in the same run (sender ``sendall`` from memory, receiver
``recv_into`` a reused buffer, no disk, no checksum) — the ceiling of any copy. ``peer_vs_tcp_to_file``
compares with plain TCP written unverified to a file on the same RAM disk instead. ``recovery_vs_local``:
time to restore a wiped host from its peer / from its own RAM disk (real replicators, CheckpointManager);
``recovery_vs_tcp``: the same recovery / a plain loopback TCP transfer of the host's bytes in the same run;
``recovery_floor_vs_tcp``: that plain transfer written (unverified) to a new file on the RAM disk, the least
a recovery that keeps its copy must do, / the plain transfer; ``recovery_vs_floor``: our recovery / that
floor (``recovery_floor_seconds``). ``peer_vs_floor``: the floor of a peer copy (``peer_floor_seconds``: the
step's files sent back to back with ``sendfile`` over one loopback stream, received into a reused buffer and
``pwrite`` into files of the same sizes on the same RAM disk whose pages are already faulted in, as the spare
pool's are; no protocol, no checksum, one thread) / our copy's time, both medians of the same run.
Medians of interleaved
repeats, because the machines are noisy. Add a measurement by writing a function that returns a dict
and listing it in ``MEASUREMENTS``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.children import scratch_dir

DEFAULT_TOTAL_BYTES = 512 << 20
DEFAULT_FILES = 8
DEFAULT_REPEATS = 9
TOKEN = "bench-token"
RECV_CHUNK_BYTES = 4 << 20


def _scratch_dir() -> Path:
    return scratch_dir("mtc-bench-")


def make_step(root: Path, rank: int, step: int, total_bytes: int, files: int, nodes: int = 2,
              seed: int | None = None) -> Any:
    """Commit ``rank``'s step of ``files`` random files totalling ``total_bytes`` under ``root/steps`` (the bytes
    from ``seed``, default the step: give each rank its own seed for distinct data)."""
    from sidecar import checksums, commit, layout

    tmp = commit.make_tmp_dir(layout.steps_dir(root), step)
    rng = np.random.default_rng(step if seed is None else seed)
    entries = []
    per = total_bytes // files
    for i in range(files):
        size = per if i < files - 1 else total_bytes - per * (files - 1)
        data = np.frombuffer(rng.bytes(size), np.uint8)
        name = f"state/{i}.{rank}.bin"
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        data.tofile(tmp / name)
        entries.append(layout.FileEntry(name, size, checksums.crc32c(data)))
    manifest = layout.StepManifest(job="bench", step=step, rank=rank, nodes=nodes, files=tuple(entries))
    commit.write_manifest(tmp, manifest)
    commit.commit_dir(tmp, layout.steps_dir(root) / str(step))
    return manifest


def _serve(root: str, step_files: list[str], conn: Any) -> None:
    """Child process: a Peer gRPC server + data port over ``root`` and a raw TCP sender of the same bytes."""

    from mtc_rpc import peer_pb2_grpc
    from replicator.net import rpc
    from replicator.peer import server as peer_server

    ts = peer_server.TransferServer("127.0.0.1", 0)
    ts.start()
    servicer = peer_server.PeerServicer(Path(root), 0, 2, transfer_server=ts)
    server, port = rpc.create_server(
        "127.0.0.1:0", [(peer_pb2_grpc.add_PeerServicer_to_server, servicer)], token=TOKEN
    )
    server.start()
    # The raw sender holds the bytes in memory so that the baseline pays for no file reads at all.
    payload = bytearray()
    for f in step_files:
        payload += Path(f).read_bytes()
    raw, stop, t = _serve_raw(payload)
    floor, floor_stop, floor_t = _serve_files([Path(f) for f in step_files])
    conn.send((port, raw.getsockname()[1], len(payload), floor.getsockname()[1]))
    conn.recv()  # wait for "stop"
    stop.set()
    floor_stop.set()
    t.join(timeout=2)
    floor_t.join(timeout=2)
    ts.stop()
    rpc.stop_server(server, 1.0)


def _serve_raw(payload: bytes | bytearray) -> tuple[socket.socket, Any, Any]:
    """A plain TCP server on loopback sending ``payload`` from memory once per connection, in a thread:
    (its socket, the event that stops it, the thread)."""
    raw = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def loop() -> None:
        raw.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = raw.accept()
            except TimeoutError:
                continue
            with c:
                c.sendall(payload)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return raw, stop, t


def _serve_files(paths: list[Path]) -> tuple[socket.socket, Any, Any]:
    """A plain TCP server on loopback sending the files ``paths`` back to back with ``sendfile`` (as our data
    port does: page references, no copy on the sender) once per connection, in a thread: (its socket, the
    event that stops it, the thread)."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def loop() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            with c:
                c.settimeout(None)
                for p in paths:
                    with open(p, "rb") as f:
                        c.sendfile(f)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return srv, stop, t


def _floor_receive(port: int, dests: list[tuple[Path, int]]) -> None:
    """The floor of a peer copy: one plain TCP stream of the files' bytes, back to back, each ``recv_into`` a
    reused buffer and ``pwrite`` into its destination file, overwritten in place (no truncation), so its
    tmpfs pages are already faulted in from the previous round, as a spare-pool file's are. No protocol,
    no checksum, no commit, one thread."""
    view = memoryview(bytearray(RECV_CHUNK_BYTES))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for path, size in dests:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                got = 0
                while got < size:
                    k = s.recv_into(view[: min(RECV_CHUNK_BYTES, size - got)])
                    if not k:
                        raise ConnectionError(f"floor sender closed in {path} at {got} of {size} bytes")
                    done = 0
                    while done < k:
                        done += os.pwrite(fd, view[done:k], got + done)
                    got += k
            finally:
                os.close(fd)


def _raw_sender(nbytes: int, conn: Any) -> None:
    """Child process: a plain TCP sender of ``nbytes`` random bytes from memory, once per connection."""
    payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    raw, stop, t = _serve_raw(payload)
    conn.send(raw.getsockname()[1])
    conn.recv()  # wait for "stop"
    stop.set()
    t.join(timeout=2)


def _raw_receive(port: int, nbytes: int, into_file: Path | None = None) -> None:
    """Plain TCP receive of ``nbytes``: discarded, or written (no checksum) to a new file ``into_file``."""
    buf = bytearray(RECV_CHUNK_BYTES)
    view = memoryview(buf)
    got = 0
    fd = os.open(into_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if into_file else -1
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            while got < nbytes:
                k = s.recv_into(view)
                if not k:
                    raise ConnectionError(f"raw sender closed after {got} of {nbytes} bytes")
                if fd >= 0:
                    os.write(fd, view[:k])
                got += k
    finally:
        if fd >= 0:
            os.close(fd)


def measure_peer_vs_tcp(
    total_bytes: int = DEFAULT_TOTAL_BYTES, files: int = DEFAULT_FILES, repeats: int = DEFAULT_REPEATS
) -> dict[str, Any]:
    from replicator.peer import client as peer_client
    from sidecar import checksums, commit, layout, spares

    scratch = _scratch_dir()
    parent_conn, child_conn = mp.get_context("spawn").Pipe()
    proc = None
    try:
        src, dst = scratch / "src", scratch / "dst-root" / "peer" / "0"
        manifest = make_step(src, 0, 1, total_bytes, files)
        step_files = [str(layout.steps_dir(src) / "1" / f.name) for f in manifest.files]
        proc = mp.get_context("spawn").Process(
            target=_serve, args=(str(src), step_files, child_conn), daemon=True
        )
        proc.start()
        if not parent_conn.poll(60):
            raise TimeoutError("benchmark server did not start within 60 s")
        grpc_port, raw_port, nbytes, floor_port = parent_conn.recv()
        address = f"127.0.0.1:{grpc_port}"
        peer_s, tcp_s, tcp_file_s, stream_s, floor_s = [], [], [], [], []
        raw_file = scratch / "raw.bin"
        # The floor's files: the step's names and sizes on the same RAM disk, kept from round to round.
        floor_dir = scratch / "floor"
        floor_dests = [(floor_dir / f"{i}.bin", f.size) for i, f in enumerate(manifest.files)]
        floor_dir.mkdir()

        def floor() -> float:
            t0 = time.monotonic()
            _floor_receive(floor_port, floor_dests)
            return time.monotonic() - t0

        def raw_to_file() -> float:
            raw_file.unlink(missing_ok=True)
            t0 = time.monotonic()
            _raw_receive(raw_port, nbytes, raw_file)
            return time.monotonic() - t0

        spare = spares.spare_dir(scratch / "dst-root")

        def fetch(use_data_port: bool, recycle: bool = True) -> float:
            # The previous copy goes the way GC removes a step on a replicator: its files' tmpfs pages
            # wait in the RAM disk's spare pool and the next copy overwrites them (recycle=False: fresh
            # pages, as on a host whose RAM disk never held a step).
            if recycle:
                commit.delete_step(dst / "1", spare=spare)
            else:
                shutil.rmtree(dst, ignore_errors=True)
                shutil.rmtree(spare, ignore_errors=True)
            t0 = time.monotonic()
            peer_client.fetch_step(
                address, 0, 1, dst, token=TOKEN, timeout_seconds=120, use_data_port=use_data_port,
                spare_dir=spare if recycle else None,
            )
            return time.monotonic() - t0

        # Warm-up: imports, connections, and first-touch of fresh guest memory on a VM (the first
        # fetches into never-used RAM-disk pages run 3-5x slower here, then settle).
        # (The floor's first round also faults its files' pages in.)
        for _ in range(2):
            fetch(True)
            _raw_receive(raw_port, nbytes)
            floor()
        for _ in range(repeats):
            t0 = time.monotonic()
            _raw_receive(raw_port, nbytes)
            tcp_s.append(time.monotonic() - t0)
            peer_s.append(fetch(True))
            tcp_file_s.append(raw_to_file())
            floor_s.append(floor())
        fresh_s = [fetch(True, recycle=False) for _ in range(max(1, repeats // 2))]
        for _ in range(max(1, repeats // 2)):
            stream_s.append(fetch(False))
        checksums.verify_step_dir(dst / "1")
        gib = nbytes / 2**30
        peer, tcp, tcp_file, stream, fresh = (
            gib / statistics.median(x) for x in (peer_s, tcp_s, tcp_file_s, stream_s, fresh_s)
        )
        peer_median, floor_median = statistics.median(peer_s), statistics.median(floor_s)
        return {
            "peer_vs_tcp": round(peer / tcp, 3),
            # The floor of a peer copy (see _floor_receive): its time / ours; 1.0 = we do no more than it.
            "peer_vs_floor": round(floor_median / peer_median, 3),
            "peer_floor_seconds": round(floor_median, 4),
            "peer_median_seconds": round(peer_median, 4),
            "peer_floor_seconds_all": [round(x, 4) for x in floor_s],
            # Secondary: against plain TCP written (unverified, one thread) to a file on the same RAM disk.
            "peer_vs_tcp_to_file": round(peer / tcp_file, 3),
            "tcp_to_file_gib_per_s": round(tcp_file, 3),
            "peer_gib_per_s": round(peer, 3),
            # Secondary: copies into fresh tmpfs pages (no recycled files), e.g. a replacement host.
            "peer_fresh_pages_gib_per_s": round(fresh, 3),
            "peer_fresh_pages_vs_tcp": round(fresh / tcp, 3),
            "tcp_gib_per_s": round(tcp, 3),
            "grpc_stream_gib_per_s": round(stream, 3),
            "grpc_stream_vs_tcp": round(stream / tcp, 3),
            "peer_seconds": [round(x, 4) for x in peer_s],
            "tcp_seconds": [round(x, 4) for x in tcp_s],
            "bytes": nbytes,
            "files": files,
            "repeats": repeats,
        }
    finally:
        if proc is not None:
            _stop_child(proc, parent_conn)
        shutil.rmtree(scratch, ignore_errors=True)


def _stop_child(proc: Any, conn: Any) -> None:
    """Tell a benchmark child process to stop; kill it by its own handle (pid) when it does not."""
    try:
        conn.send("stop")
    except OSError:
        pass
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()  # by its own handle (pid), never by name
        proc.join(timeout=5)


def measure_recovery_vs_local(total_bytes: int = DEFAULT_TOTAL_BYTES, repeats: int = 3) -> dict[str, Any]:
    """Restore a wiped host from its peer / restore the same host from its own RAM disk / a raw TCP copy.

    Two real replicators on loopback (2 slices x 1 host, data-parallel replicas), the controller here
    with 8 CPU devices. "local": ``CheckpointManager.restore`` with every RAM disk intact. "peer": host 1's
    RAM disk wiped and its replicator restarted; the clock runs from the moment it serves again until
    ``restore`` returns (its data comes from host 0 and is read while it lands, each block verified; the
    copy is committed on the RAM disk for next time). "tcp": a plain loopback TCP transfer of the same byte
    count (sender ``sendall`` from memory in another process, receiver ``recv_into`` a reused buffer),
    interleaved with the rounds: ``recovery_vs_tcp`` = peer / tcp. "floor": the same plain transfer written
    unverified to a new file on the RAM disk (fresh tmpfs pages, as on a wiped host), also interleaved: the
    least work of a recovery that keeps a RAM-disk copy, done the plain way. ``recovery_floor_vs_tcp`` =
    floor / tcp is what ``recovery_vs_tcp`` cannot go much below on the machine that ran it. Garbage is
    collected before each timed restore: the previous restore's arrays are freed outside the clocks.
    """
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from controller_client.demo.cluster import LocalCluster
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.topology import HostTopology
    from sidecar import commit, layout

    devs = jax.devices()[:8]
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    per_host = total_bytes // 2  # each host holds one full replica
    cols = 4096
    rows = max(8, per_host // (cols * 4) // 8 * 8)
    sharding = NamedSharding(mesh, P(None, "model"))
    tree = {"w": jax.device_put(np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32), sharding)}
    target = {"w": jax.ShapeDtypeStruct(tree["w"].shape, tree["w"].dtype, sharding=sharding)}
    scratch = _scratch_dir()
    cluster = LocalCluster(scratch / "cluster", nodes=2, data_parallelism=2, heartbeat_seconds=0.1)
    times: dict[str, list[float]] = {"local": [], "peer": [], "tcp": [], "floor": []}
    nbytes = rows * cols * 4
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    sender = ctx.Process(target=_raw_sender, args=(nbytes, child_conn), daemon=True)
    try:
        sender.start()
        if not parent_conn.poll(60):
            raise TimeoutError("raw TCP sender did not start within 60 s")
        raw_port = parent_conn.recv()
        cluster.start_all()
        opts = CheckpointManagerOptions(local_directory=cluster.local_template, coordinator_address=cluster.coordinator,
                                        job_name="t", restore_wait_seconds=300)
        mgr = CheckpointManager(opts, devices=devs, topology=HostTopology.simulated(devs, 2, 1))
        mgr.save(1, tree)
        mgr.wait_until_finished()
        deadline = time.monotonic() + 60
        while mgr.latest_step() != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(repeats + 1):  # round 0 warms up
            t0 = time.monotonic()
            _raw_receive(raw_port, nbytes)
            times["tcp"].append(time.monotonic() - t0)
            floor_file = scratch / "floor.bin"
            t0 = time.monotonic()
            _raw_receive(raw_port, nbytes, into_file=floor_file)
            times["floor"].append(time.monotonic() - t0)
            floor_file.unlink()
            # The previous round's recovered copy is committed on host 1's RAM disk (the replicator commits it
            # after the restore returned; as its own step, or as rank 0's identical replica under peer/):
            # else this "local" restore would join that copy still landing.
            deadline = time.monotonic() + 60
            while not any(1 in commit.committed_steps(d) for d in [layout.steps_dir(cluster.ram(1)),
                                                                   *(cluster.ram(1) / layout.PEER_DIR).glob("*")]):
                if time.monotonic() > deadline:
                    raise TimeoutError("host 1 did not commit its recovered copy of step 1 within 60 s")
                time.sleep(0.02)
            gc.collect()  # the previous round's arrays (see below), not in this restore's clock
            t0 = time.monotonic()
            jax.block_until_ready(mgr.restore(1, target))
            times["local"].append(time.monotonic() - t0)
            # The arrays just restored map host 1's files (zero-copy) and JAX frees them only at a garbage
            # collection: one falling inside the next restore's clock freed them there, and with host 1 wiped
            # below that is 256 MiB of tmpfs pages freed (perf: 0.04-0.06 CPU-s of the restoring process inside
            # the recovery's clock; a collection after the wipe took 0.12-0.15 s), work of the previous round
            # that a replaced host's fresh process never does.
            gc.collect()
            cluster.procs[1].stop()
            cluster.wipe(1)
            cluster.start(1)
            t0 = time.monotonic()
            jax.block_until_ready(mgr.restore(1, target))
            times["peer"].append(time.monotonic() - t0)
        mgr.close()
    finally:
        cluster.stop_all()
        _stop_child(sender, parent_conn)
        shutil.rmtree(scratch, ignore_errors=True)
    local, peer, tcp, floor = (statistics.median(times[k][1:]) for k in ("local", "peer", "tcp", "floor"))
    return {
        "recovery_vs_local": round(peer / local, 3),
        "recovery_vs_tcp": round(peer / tcp, 3),
        "recovery_floor_vs_tcp": round(floor / tcp, 3),
        "recovery_floor_vs_local": round(floor / local, 3),
        # Our recovery / its floor in the same run (the floor's raw seconds: recovery_seconds["floor"]).
        "recovery_vs_floor": round(peer / floor, 3),
        "recovery_floor_seconds": round(floor, 4),
        "recovery_bytes_per_host": nbytes,
        "recovery_seconds": {"local": round(local, 4), "peer": round(peer, 4), "tcp": round(tcp, 4),
                             "floor": round(floor, 4)},
        "recovery_peer_seconds": [round(x, 4) for x in times["peer"][1:]],
    }


MEASUREMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "peer_vs_tcp": measure_peer_vs_tcp,
    "recovery_vs_local": measure_recovery_vs_local,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MEASUREMENTS), action="append", help="run only these")
    parser.add_argument("--total-mib", type=int, default=DEFAULT_TOTAL_BYTES >> 20)
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    args = parser.parse_args(argv)
    if args.total_mib < 1 or args.repeats < 1:
        parser.error("--total-mib and --repeats must be >= 1")
    result: dict[str, Any] = {}
    for name in args.only or list(MEASUREMENTS):
        fn = MEASUREMENTS[name]
        if name == "peer_vs_tcp":
            result.update(fn(total_bytes=args.total_mib << 20, repeats=args.repeats))
        else:
            result.update(fn(total_bytes=args.total_mib << 20))
    print(json.dumps(result, sort_keys=True))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.exit(main())
