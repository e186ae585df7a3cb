"""Benchmark of the local (RAM-disk) tier: one JSON line of ratios measured side by side in one run.

    python -m bench.local [--mib 1024] [--repeats 3] [--skip-elastic | --only-elastic]

- save_vs_tmpfs: our save throughput / a plain preallocated write of the same bytes to the same tmpfs;
- blocking_vs_memcpy: time ``save()`` blocks / a plain host copy of the same shards (on CPU ``save()`` takes no
  copy, only views of the device buffers: well below 1);
- restore_vs_tmpfs_read: a plain read of the same bytes from the same tmpfs (every file of the step just
  restored, read one after another into one preallocated buffer: no checksum, no device copy) / our restore
  time, i.e. our restore throughput as a fraction of the read limit (target >= 0.8);
- save_vs_orbax, restore_vs_orbax: Orbax's standard CheckpointManager time / ours (same tree, same tmpfs).
- reshard_restore_vs_local (elastic; real replicators on loopback): time to restore onto a different mesh of
  the same 8 devices (4x2 instead of the saved 2x4), where each host needs another host's shards fetched
  from a peer, / time of a same-mesh restore from the hosts' own RAM disks (target <= 2);
  reshard_copy_vs_local: the copy alone that such a restore cannot avoid (every target shard built in fresh
  memory from the two saved shards it overlaps, plain numpy, no checksum, no fetch, no RPC) / the same-mesh
  restore;
- preemption_flush_seconds_per_gib: after SIGTERM to every replicator, the seconds until the newest
  complete step is committed in the bucket (a local folder), per GiB of the step (``--elastic-mib``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from bench.children import scratch_dir

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from controller_client.manager import CheckpointManager, CheckpointManagerOptions  # noqa: E402
from controller_client.topology import HostTopology  # noqa: E402
from sidecar import spares  # noqa: E402


def make_tree(total_mib: int) -> dict:
    """~total_mib MiB of mixed shapes and dtypes, sharded 2x4 over 8 devices."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    rng = np.random.default_rng(0)
    tree: dict = {"layers": [], "small": {}}
    n_big = 6
    per = (total_mib << 20) // n_big
    for i in range(n_big):
        cols = 1024 if i % 2 == 0 else 2048
        dtype = np.float32 if i % 3 else jnp.bfloat16
        item = np.dtype(dtype).itemsize
        rows = max(8, per // (cols * item) // 8 * 8)
        x = rng.standard_normal((rows, cols), dtype=np.float32).astype(dtype)
        tree["layers"].append(jax.device_put(x, NamedSharding(mesh, P("a", "b"))))
    for i in range(20):
        tree["small"][f"b{i}"] = jax.device_put(rng.standard_normal((64 * (i + 1),), dtype=np.float32),
                                                NamedSharding(mesh, P(("a", "b"))))
    tree["step"] = 1
    return tree


def nbytes(tree: dict) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def plain_copy(tree: dict) -> list[np.ndarray]:
    out = []
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            seen = set()
            for s in x.addressable_shards:
                key = (s.device.id // 2, str(s.index))
                if key not in seen:
                    seen.add(key)
                    out.append(np.array(s.data, copy=True))
    return out


def plain_write(buffers: list[np.ndarray], path: Path) -> None:
    total = sum(b.nbytes for b in buffers)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)
        off = 0
        for b in buffers:
            view = memoryview(b.reshape(-1).view(np.uint8))
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], off + done)
            off += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_read(root: Path) -> int:
    """Read every regular file of the saved steps under ``root`` into one preallocated buffer (not the spare
    pool's files, which no restore reads); returns the bytes read."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                   and spares.SPARE_DIR not in p.relative_to(root).parts)
    sizes = [p.stat().st_size for p in files]
    buf = np.empty(max(sizes, default=0), dtype=np.uint8)
    view = memoryview(buf)
    total = 0
    for path, size in zip(files, sizes, strict=True):
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                k = f.readinto(view[done:size])
                if not k:
                    raise EOFError(f"{path}: {done} of {size} bytes")
                done += k
        total += size
    return total


def abstract(tree: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree,
    )


def plain_assembly(restored: dict, target: dict, keep: list | None = None) -> int:
    """Build every target shard of ``target``'s shardings from ``restored`` (the same arrays on the saved
    mesh, their shards mapped from the RAM disks) in fresh aligned buffers by plain numpy slicing; returns
    the bytes built. The buffers are dropped at once, or appended to ``keep`` as (leaf, index, buffer)."""
    from sidecar.checksums import aligned_empty
    from sidecar.reader import normalize_index

    built = 0
    for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        if not isinstance(x, jax.Array):
            continue
        saved = [(s.index, np.asarray(s.data)) for s in x.addressable_shards if s.replica_id == 0]
        for idx in t.sharding.devices_indices_map(t.shape).values():
            box = normalize_index(idx, t.shape)
            shape = tuple(b - a for a, b in box)
            out = aligned_empty(int(np.prod(shape)) * x.dtype.itemsize).view(x.dtype).reshape(shape)
            for sidx, data in saved:
                sbox = normalize_index(sidx, t.shape)
                lo = [max(a, c) for (a, _), (c, _) in zip(box, sbox, strict=True)]
                hi = [min(b, d) for (_, b), (_, d) in zip(box, sbox, strict=True)]
                if all(a < b for a, b in zip(lo, hi, strict=True)):
                    out[tuple(slice(a - o, b - o) for a, b, (o, _) in zip(lo, hi, box, strict=True))] = \
                        data[tuple(slice(a - o, b - o) for a, b, (o, _) in zip(lo, hi, sbox, strict=True))]
            built += out.nbytes
            if keep is not None:
                keep.append((x, idx, out))
    return built


EXTRA = os.environ.get("MTC_BENCH_REPLICATOR_ARGS", "").split()


def elastic(mib: int, repeats: int) -> dict:
    """Reshard restore from peers vs local restore, and the preemption flush, with 4 real replicators."""
    import json as _json
    import signal

    from controller_client.demo.cluster import LocalCluster

    base = scratch_dir("mtc-bench-el-")
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)
    tree = make_tree(mib)
    size = nbytes(tree)
    other = Mesh(np.array(devs).reshape(4, 2), ("a", "b"))
    reshard_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, x.sharding.spec))
        if isinstance(x, jax.Array) else x, tree)
    t: dict[str, list[float]] = {"local_restore": [], "reshard_restore": [], "plain_assembly": []}
    flush = None
    cl = LocalCluster(base, nodes=4, data_parallelism=2, replicas=0,
                      extra=["--backup-url", f"file://{base / 'bucket'}", "--backup-interval-minutes", "60",
                             "--preemption-grace-seconds", "60", "--transfer-threads", "2", *EXTRA])
    try:
        cl.start_all()
        opts = CheckpointManagerOptions(local_directory=cl.local_template, job_name="t",
                                        coordinator_address=cl.coordinator, restore_wait_seconds=300)
        mgr = CheckpointManager(opts, devices=devs, topology=topo)
        for rep in range(repeats + 1):
            step = rep + 1
            mgr.save(step, tree, force=True)
            mgr.wait_until_finished()
            # A full collection before each timed part: one that falls inside a timing costs ~0.1 s here
            # (measured 0.118 s within a 0.23 s same-mesh restore), far more than either side's own noise.
            gc.collect()
            t0 = time.monotonic()
            restored = jax.block_until_ready(mgr.restore(step, abstract(tree)))
            t["local_restore"].append(time.monotonic() - t0)
            gc.collect()
            t0 = time.monotonic()
            if plain_assembly(restored, reshard_target) != size:
                raise AssertionError("the plain assembly did not build every target shard")
            t["plain_assembly"].append(time.monotonic() - t0)
            del restored
            gc.collect()
            t0 = time.monotonic()
            jax.block_until_ready(mgr.restore(step, reshard_target))
            t["reshard_restore"].append(time.monotonic() - t0)
        mgr.close()
        for p in cl.procs.values():
            p.proc.send_signal(signal.SIGTERM)
        for p in cl.procs.values():
            p.proc.wait(timeout=120)
        recs = [_json.loads((cl.ram(r) / "preemption.json").read_text()) for r in range(4)]
        done = [r["seconds"] for r in recs if r["finished"] and r["step"] > 0]
        if done:
            flush = min(done)  # the first host to see the step committed in the bucket
    finally:
        cl.stop_all(signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v[1:]) for k, v in t.items()}
    return {
        "reshard_restore_vs_local": round(med["reshard_restore"] / med["local_restore"], 3),
        "reshard_copy_vs_local": round(med["plain_assembly"] / med["local_restore"], 3),
        "preemption_flush_seconds_per_gib": None if flush is None else round(flush / (size / 2**30), 3),
        "elastic_bytes": size,
        "elastic_seconds": {**{k: round(v, 4) for k, v in med.items()}, "preemption_flush": flush},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--elastic-mib", type=int, default=256, help="step size of the elastic measurements")
    ap.add_argument("--skip-elastic", action="store_true", help="only the local-tier measurements")
    ap.add_argument("--only-elastic", action="store_true", help="only the elastic measurements")
    args = ap.parse_args()
    if args.only_elastic:
        print(json.dumps({"bench": "local", **elastic(args.elastic_mib, args.repeats)}))
        return

    from absl import flags

    flags.FLAGS(["bench"])  # Orbax outside absl.app needs parsed flags
    import orbax.checkpoint as ocp

    base = scratch_dir("mtc-bench-")
    tree = make_tree(args.mib)
    size = nbytes(tree)
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)
    t = {k: [] for k in ("copy", "plain_write", "save_block", "save", "restore", "orbax_save", "orbax_restore", "tmpfs_read")}
    try:
        # Round 0 warms allocator and page cache up and is not counted (first-touch page faults on this
        # VM run at ~0.3 GiB/s and would otherwise penalise whichever measurement comes first).
        for rep in range(args.repeats + 1):
            t0 = time.monotonic()
            bufs = plain_copy(tree)
            t["copy"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            plain_write(bufs, base / f"plain-{rep}")
            t["plain_write"].append(time.monotonic() - t0)
            del bufs
            os.unlink(base / f"plain-{rep}")

            ours = base / f"ours-{rep}"
            mgr = CheckpointManager(CheckpointManagerOptions(local_directory=str(ours / "{host}")),
                                    devices=devs, topology=topo)
            t0 = time.monotonic()
            mgr.save(1, tree)
            t["save_block"].append(time.monotonic() - t0)
            mgr.wait_until_finished()
            t["save"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            out = mgr.restore(1, abstract(tree))
            jax.block_until_ready(out)
            t["restore"].append(time.monotonic() - t0)
            del out
            t0 = time.monotonic()
            read_bytes = plain_read(ours)
            t["tmpfs_read"].append(time.monotonic() - t0)
            shutil.rmtree(ours)

            odir = base / f"orbax-{rep}"
            omgr = ocp.CheckpointManager(odir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
            t0 = time.monotonic()
            omgr.save(1, args=ocp.args.StandardSave(tree))
            omgr.wait_until_finished()
            t["orbax_save"].append(time.monotonic() - t0)
            t0 = time.monotonic()
            out = omgr.restore(1, args=ocp.args.StandardRestore(abstract(tree)))
            jax.block_until_ready(out)
            t["orbax_restore"].append(time.monotonic() - t0)
            del out
            omgr.close()
            shutil.rmtree(odir)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v[1:]) for k, v in t.items()}
    result = {
        "bench": "local",
        "bytes": size,
        "save_vs_tmpfs": round(med["plain_write"] / med["save"], 3),
        "blocking_vs_memcpy": round(med["save_block"] / med["copy"], 3),
        "save_vs_orbax": round(med["orbax_save"] / med["save"], 3),
        "restore_vs_orbax": round(med["orbax_restore"] / med["restore"], 3),
        "restore_vs_tmpfs_read": round(med["tmpfs_read"] / med["restore"], 3),
        "tmpfs_read_bytes": read_bytes,
        "seconds": {k: round(v, 4) for k, v in med.items()},
    }
    if not args.skip_elastic:
        result.update(elastic(args.elastic_mib, args.repeats))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
