"""Elastic training and suspend-resume with real replicators on loopback: stable ranks, savers, reshard
restores from peers and the bucket, rollback, healing a bad copy within one restore, preemption flush."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from sidecar import checksums, layout
from tests.kits.cluster import assert_equal, redundant, status, step_summary, wait_for
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def mgr_for(cl, devices=None, **kw) -> CheckpointManager:
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)  # the full allocation: ranks never change
    kw = {"restore_wait_seconds": 60, "rpc_timeout_seconds": 10, **kw}
    opts = CheckpointManagerOptions(local_directory=cl.local_template, job_name="t",
                                    coordinator_address=cl.coordinator, **kw)
    return CheckpointManager(opts, devices=devices if devices is not None else devs, topology=topo)


FSDP = P("data", "model")


def fsdp_state(step: int, devices, shape=(2, 4), spec=FSDP) -> dict:
    mesh = Mesh(np.array(devices).reshape(shape), ("data", "model"))
    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal((16, 64)).astype(np.float32), NamedSharding(mesh, spec)),
            "v": jax.device_put(rng.standard_normal((8, 32)).astype(np.float32),
                                NamedSharding(mesh, P(None, "model"))),
            "step": step}


def target_on(tree: dict, devices, shape, spec=FSDP) -> dict:
    mesh = Mesh(np.array(devices).reshape(shape), ("data", "model"))
    return {"w": jax.ShapeDtypeStruct(tree["w"].shape, tree["w"].dtype, sharding=NamedSharding(mesh, spec)),
            "v": jax.ShapeDtypeStruct(tree["v"].shape, tree["v"].dtype,
                                      sharding=NamedSharding(mesh, P(None, "model"))),
            "step": tree["step"]}


def test_from_devices_keeps_ranks_for_a_subset_of_slices():
    devs = [SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 2) for i in range(8)]
    full = HostTopology.from_devices(devs)
    only_slice1 = HostTopology.from_devices(devs[4:], slices=2)
    assert only_slice1.device_rank == {i: full.device_rank[i] for i in range(4, 8)}
    assert sorted(set(only_slice1.device_rank.values())) == [2, 3]
    assert full.check_active(devs[4:]) == [2, 3]
    with pytest.raises(ValueError, match="partly active"):
        full.check_active(devs[4:7])


def test_reshard_restores_across_meshes_from_peers_and_one_slice(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(4, devs)
    assert mgr.save(4, tree)
    mgr.wait_until_finished()
    assert mgr.latest_step() == 4  # truthful at once, before any heartbeat
    # A different mesh of the same devices: 4x2 needs shards that live on other hosts (peers).
    assert_equal(tree, mgr.restore(4, target_on(tree, devs, (4, 2))))
    # Onto one slice (ranks 0, 1 active): every shard of slice 1's ranks comes from a peer.
    small = mgr_for(cl, devices=devs[:4])
    assert small.active_ranks == [0, 1]
    assert small.latest_step() == 4  # saved by all four hosts and waited for: known from slice 0 at once
    assert_equal(tree, small.restore(None, target_on(tree, devs[:4], (1, 4))))
    # Onto slice 1 alone, 4x1: ranks 2 and 3 keep their ranks and fetch ranks 0/1's shards.
    other = mgr_for(cl, devices=devs[4:])
    assert other.active_ranks == [2, 3]
    assert_equal(tree, other.restore(4, target_on(tree, devs[4:], (4, 1))))
    # Saved by one slice: complete over its savers at once, restorable onto both slices.
    t6 = fsdp_state(6, devs[:4], shape=(1, 4))
    assert small.save(6, t6)
    small.wait_until_finished()
    assert small.latest_step() == 6
    assert mgr.latest_step() == 6
    wait_for(lambda: (s := step_summary(status(cl), 6)) and s.complete, what="coordinator: step 6 complete")
    assert step_summary(status(cl), 6).savers == "0-1"
    assert_equal(t6, mgr.restore(6, target_on(t6, devs, (2, 4))))
    for m in (mgr, small, other):
        m.close()


def swapped_target(x: np.ndarray, step: int) -> dict:
    """Devices 0 (host 0) and 2 (host 1) swap places in the saved 2x4 FSDP mesh: host 0 needs exactly one
    shard of host 1's step (rows 0-8, column block 2) and host 1 one of host 0's; hosts 2 and 3 none."""
    devs = jax.devices()
    swapped = Mesh(np.array([devs[i] for i in (2, 1, 0, 3, 4, 5, 6, 7)]).reshape(2, 4), ("data", "model"))
    return {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(swapped, FSDP)), "step": step}


def spy_fetches(monkeypatch) -> list:
    """Record every call the sidecars make to their replicators: (root, method, request, response)."""
    from sidecar.remote import ReplicatorFetcher

    calls = []
    orig = ReplicatorFetcher._call

    def spy(self, method, request, timeout):
        resp = orig(self, method, request, timeout)
        calls.append((Path(self.root).resolve(), method, request, resp))
        return resp

    monkeypatch.setattr(ReplicatorFetcher, "_call", spy)
    return calls


def shard_file(cl, rank: int, step: int, index) -> layout.FileEntry:
    m = layout.read_manifest(cl.ram(rank) / "steps" / str(step))
    name = next(s.file for a in m.arrays for s in a.shards if s.index == index)
    return next(f for f in m.files if f.name == name)


def fetched_files(cl, calls) -> dict:
    """host rank -> [(owner, [file names], source)] of its FetchFiles calls."""
    out: dict = {}
    for root, method, req, resp in calls:
        if method == "FetchFiles":
            host = next(r for r in range(cl.nodes) if cl.ram(r).resolve() == root)
            out.setdefault(host, []).append((req.owner_rank, sorted(f.name for f in req.files), resp.source))
    return out


def saved_fsdp(cluster_factory, shape: tuple[int, int], seed: int, step: int, bucket: bool = False):  # noqa: F811
    """4 hosts, 2 slices, no peer copies (only a rank's own host holds its data; ``bucket``: every step backed
    up to a local folder too): ``x`` of ``shape`` saved as step ``step`` on the 2x4 FSDP mesh. Returns
    (cluster, manager, x, tree)."""
    cl = cluster_factory(nodes=4, data_parallelism=2, replicas=0)
    if bucket:
        cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-steps", "1"]
    cl.start_all()
    mgr = mgr_for(cl)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    tree = {"w": jax.device_put(x, NamedSharding(mesh, FSDP)), "step": step}
    mgr.save(step, tree)
    mgr.wait_until_finished()
    return cl, mgr, x, tree


def test_reshard_fetches_only_the_files_of_the_shards_it_needs(cluster_factory, monkeypatch):  # noqa: F811
    cl, mgr, x, tree = saved_fsdp(cluster_factory, (16, 4096), 3, 3)  # only host 1 has rank 1's data
    calls = spy_fetches(monkeypatch)
    assert_equal(tree, mgr.restore(3, swapped_target(x, 3)))
    need0 = shard_file(cl, 1, 3, ((0, 8), (2048, 3072)))  # host 0's device 0 now holds this shard of rank 1
    need1 = shard_file(cl, 0, 3, ((0, 8), (0, 1024)))
    assert need0.size == 8 * 1024 * 4
    assert fetched_files(cl, calls) == {0: [(1, [need0.name], "peer rank 1")],
                                        1: [(0, [need1.name], "peer rank 0")]}
    assert not [c for c in calls if c[1] == "FetchStep" and not c[2].manifest_only]  # never a whole step
    assert len(layout.read_manifest(cl.ram(1) / "steps" / "3").files) == 2  # of which one was fetched
    for r in range(4):  # no step copy was made for the restore, and its scratch files are gone
        assert not list(cl.ram(r).glob("peer/*/3"))
        assert not list(cl.ram(r).glob("fetch/*"))
    mgr.close()


def test_reshard_fetches_only_the_blocks_of_the_rows_it_needs(cluster_factory, monkeypatch):  # noqa: F811
    # Saved on a 2x4 mesh (each shard 2048 rows x 256 columns, 2 MiB: two 1 MiB blocks), restored onto 4x2: a
    # host needs half of the rows of each of its partner host's two shards. Only those blocks cross the wire.
    cl, mgr, x, tree = saved_fsdp(cluster_factory, (4096, 1024), 8, 8)
    devs = jax.devices()
    calls = spy_fetches(monkeypatch)
    other = Mesh(np.array(devs).reshape(4, 2), ("data", "model"))
    assert_equal(tree, mgr.restore(8, {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, FSDP)),
                                       "step": 8}))
    got = {}
    for root, method, req, resp in calls:
        if method == "FetchFiles":
            host = next(r for r in range(cl.nodes) if cl.ram(r).resolve() == root)
            got[host] = (req.owner_rank, sorted(f.name for f in req.files), sorted((pc.name, pc.offset, pc.length)
                                                                                   for pc in req.pieces), resp.bytes)
    assert sorted(got) == [0, 1, 2, 3]
    for host, (owner, files, pieces, moved) in got.items():
        assert owner == host ^ 1  # its partner in the slice
        m = layout.read_manifest(cl.ram(owner) / "steps" / "8")
        w = next(a for a in m.arrays if a.path == "['w']")
        assert len(files) == 2 and {f.size for f in m.files if f.name in files} == {2 << 20}
        # Rows [1024 h, 1024 (h + 1)) of the saved half: the first or the second block of each shard.
        half = (host % 2) << 20
        assert pieces == sorted((sh.file, half, 1 << 20) for sh in w.shards if sh.file in files)
        assert moved == 2 << 20  # half of the two files' bytes
    for r in range(4):
        assert not list(cl.ram(r).glob("fetch/*"))  # the scratch copies are gone
    mgr.close()


def test_reshard_fetch_heals_a_corrupt_peer_file_from_the_bucket(cluster_factory, monkeypatch):  # noqa: F811
    cl, mgr, x, tree = saved_fsdp(cluster_factory, (16, 4096), 4, 5, bucket=True)
    wait_for(lambda: 5 in status(cl).backup.committed_steps, what="backup of step 5", timeout=60)
    # Host 1's copy of the one shard host 0 will fetch goes bad (host 1 itself does not read it).
    need0 = shard_file(cl, 1, 5, ((0, 8), (2048, 3072)))
    victim = cl.ram(1) / "steps" / "5" / need0.name
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x04
    victim.write_bytes(bytes(data))
    calls = spy_fetches(monkeypatch)
    assert_equal(tree, mgr.restore(5, swapped_target(x, 5)))
    # The peer's bytes failed their crc32c on arrival; the same file came from the bucket (ranged reads).
    assert fetched_files(cl, calls)[0] == [(1, [need0.name], "bucket")]
    mgr.close()


def test_rollback_then_save_forward(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    trees = {}
    for s in (2, 4, 6):
        trees[s] = fsdp_state(s, devs)
        mgr.save(s, trees[s])
        mgr.wait_until_finished()
    assert mgr.latest_step() == 6
    assert_equal(trees[4], mgr.restore(4, target_on(trees[4], devs, (2, 4))))
    # Training goes on from step 4 with other data: step 6 is saved again, never FileExistsError.
    new6 = fsdp_state(60, devs)
    new6["step"] = 6
    assert mgr.save(6, new6)
    mgr.wait_until_finished()
    assert mgr.latest_step() == 6
    assert_equal(new6, mgr.restore(6, target_on(new6, devs, (4, 2))))
    # The coordinator agrees: the newer save supersedes the abandoned one.
    wait_for(lambda: status(cl).newest_complete_step == 6, what="coordinator newest 6")
    fresh = mgr_for(cl)
    assert_equal(new6, fresh.restore(None, target_on(new6, devs, (2, 4))))
    fresh.close()
    mgr.close()


def test_rollback_backs_up_the_new_save_of_a_step_already_in_the_bucket(cluster_factory):  # noqa: F811
    """Step 6 is in the bucket; the job rolls back to 4 and saves 6 again with other data: the new save
    supersedes the abandoned backup (never skipped because step 6 "is already backed up", never mixed), and
    a restore from the bucket alone returns the new contents."""
    cl = cluster_factory(nodes=4, data_parallelism=2)
    bucket = cl.base / "bucket"
    cl.extra = ["--backup-url", f"file://{bucket}", "--backup-interval-steps", "1"]
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    trees = {}
    for s in (2, 4, 6):
        trees[s] = fsdp_state(s, devs)
        mgr.save(s, trees[s])
        mgr.wait_until_finished()
    wait_for(lambda: 6 in status(cl).backup.committed_steps, what="backup of the first step 6", timeout=60)
    store = BackupStore(open_store(f"file://{bucket}"), "t")
    old = {r: store.read_manifest(6, r).content_hash for r in range(4)}
    assert_equal(trees[4], mgr.restore(4, target_on(trees[4], devs, (2, 4))))
    new6 = fsdp_state(60, devs)
    new6["step"] = 6
    assert mgr.save(6, new6)
    mgr.wait_until_finished()
    fresh = {r: layout.read_manifest(cl.ram(r) / "steps" / "6").content_hash for r in range(4)}
    assert all(fresh[r] != old[r] for r in range(4))

    def bucket_hashes() -> dict[int, str] | None:
        try:
            return {r: store.read_manifest(6, r).content_hash for r in range(4)}
        except (OSError, layout.ManifestError):
            return None  # between the superseded backup's removal and the new commit

    wait_for(lambda: bucket_hashes() == fresh, what="the new save of step 6 in the bucket", timeout=60)
    assert store.committed_steps()[-1] == 6
    mgr.close()
    cl.stop_all(signal.SIGKILL)  # no preemption flush: the bucket alone must hold the new step 6
    for r in range(4):
        cl.wipe(r)
    cl.start_all()
    mgr = mgr_for(cl)
    wait_for(lambda: mgr.latest_step() == 6, what="step 6 known from the bucket", timeout=60)
    assert_equal(new6, mgr.restore(None, target_on(new6, devs, (4, 2))))
    mgr.close()


def test_same_mesh_restore_fetches_no_manifest_and_a_reshard_each_once(cluster_factory, monkeypatch):  # noqa: F811
    """A host whose own copies cover its target shards asks its replicator for no other saver's manifest
    (before: every rank fetched every other rank's, N-1 round trips per host); a reshard fetches each other
    saver's manifest once per call, shared by the ranks it acts for."""
    from sidecar.remote import ReplicatorFetcher

    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(5, devs)
    mgr.save(5, tree)
    mgr.wait_until_finished()
    asked: list[tuple[int, int]] = []
    real = ReplicatorFetcher._call

    def counting(self, method, request, timeout):
        if method == "FetchStep" and request.manifest_only:
            asked.append((request.owner_rank, request.step))
        return real(self, method, request, timeout)

    monkeypatch.setattr(ReplicatorFetcher, "_call", counting)
    assert_equal(tree, mgr.restore(5, target_on(tree, devs, (2, 4))))
    assert asked == []
    assert_equal(tree, mgr.restore(5, target_on(tree, devs, (4, 2))))
    assert asked and len(asked) == len(set(asked)), asked
    mgr.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_bad_shard_healed_within_one_restore(cluster_factory, damage):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(8, devs)
    mgr.save(8, tree)
    mgr.wait_until_finished()
    # Wait until rank 0's data has a copy on another host.
    wait_for(lambda: redundant(cl, 8), what="step 8 redundant", timeout=60)
    step_dir = cl.ram(0) / "steps" / "8"
    m = layout.read_manifest(step_dir)
    victim = step_dir / m.files[0].name
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.write_bytes(bytes(data[: len(data) // 2]))
    try:
        out = mgr.restore(8, target_on(tree, devs, (2, 4)))
    except Exception:
        print(cl.logs())
        raise
    assert_equal(tree, out)

    def healed() -> bool:
        for d in [step_dir, *cl.ram(0).glob("peer/*/8")]:
            try:
                got = layout.read_manifest(d)
            except (OSError, layout.ManifestError):
                continue
            if got.rank == 0 and got.content_hash == m.content_hash:
                return True
        return False

    # The bad copy is no longer listed as it was; a good copy of rank 0's data is back on host 0 (fetched
    # by the restore, or, when that fetch failed on a loaded machine, by the replicator's heal just after).
    wait_for(healed, what="rank 0's data of step 8 back on host 0", timeout=60)
    mgr.close()


def test_sigterm_flushes_newest_step_to_bucket_then_resume_on_empty_ram(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    bucket = cl.base / "bucket"
    # A 30-minute interval: without the emergency flush nothing would be in the bucket.
    cl.extra = ["--backup-url", f"file://{bucket}", "--backup-interval-minutes", "30",
                "--preemption-grace-seconds", "20"]
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(10, devs)
    mgr.save(10, tree)
    mgr.wait_until_finished()
    assert not mgr.reached_preemption(10)
    wait_for(lambda: status(cl).newest_complete_step == 10, what="step 10 complete")
    # Rank 3 gets the notice first: every host learns of it through the coordinator.
    cl.procs[3].proc.send_signal(signal.SIGTERM)
    wait_for(lambda: mgr.reached_preemption(10), what="preemption noticed by the controller", timeout=30)
    for r in (0, 1, 2):
        cl.procs[r].proc.send_signal(signal.SIGTERM)
    for r in range(4):
        cl.procs[r].proc.wait(timeout=40)
    recs = [json.loads((cl.ram(r) / "preemption.json").read_text()) for r in range(4)]
    assert any(rec["finished"] and rec["step"] == 10 for rec in recs), recs
    mgr.close()
    for r in range(4):
        cl.wipe(r)
    cl.start_all()
    mgr = mgr_for(cl)
    wait_for(lambda: mgr.latest_step() == 10, what="step 10 known from the bucket", timeout=60)
    assert_equal(tree, mgr.restore(None, target_on(tree, devs, (4, 2))))
    mgr.close()
    # Every RAM disk empty again, and only slice 1 comes back: ranks 0/1's shards come from the bucket.
    cl.stop_all()
    for r in range(4):
        cl.wipe(r)
    cl.start_all()
    one = mgr_for(cl, devices=devs[4:])
    assert_equal(tree, one.restore(10, target_on(tree, devs[4:], (1, 4))))
    one.close()


def test_bad_shard_healed_from_the_bucket(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2, replicas=0)  # no peer copies: the bucket is the other tier
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-steps", "1"]
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(5, devs)
    mgr.save(5, tree)
    mgr.wait_until_finished()
    wait_for(lambda: 5 in status(cl).backup.committed_steps, what="backup of step 5", timeout=60)
    assert not list(cl.ram(0).glob("peer/*/5")) and not list(cl.ram(2).glob("peer/0/5"))
    step_dir = cl.ram(0) / "steps" / "5"
    victim = step_dir / layout.read_manifest(step_dir).files[0].name
    data = bytearray(victim.read_bytes())
    data[0] ^= 0x01
    victim.write_bytes(bytes(data))
    assert_equal(tree, mgr.restore(5, target_on(tree, devs, (2, 4))))
    checksums.verify_step_dir(step_dir)  # the good copy from the bucket is back in place
    mgr.close()


def test_reshard_without_coordinator(tmp_path):
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)

    def mgr(devices):
        opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t")
        return CheckpointManager(opts, devices=devices, topology=topo)

    full, small = mgr(devs), mgr(devs[:4])
    tree = fsdp_state(2, devs)
    full.save(2, tree)
    full.wait_until_finished()
    assert small.latest_step() == 2
    assert_equal(tree, full.restore(2, target_on(tree, devs, (4, 2))))
    assert_equal(tree, small.restore(2, target_on(tree, devs[:4], (1, 4))))
    # Saved by slice 0 alone (ranks 2 and 3 did not save): complete, restorable on both slices.
    t3 = fsdp_state(3, devs[:4], shape=(1, 4))
    small.save(3, t3)
    small.wait_until_finished()
    assert full.latest_step() == 3 and small.latest_step() == 3
    assert layout.read_manifest(tmp_path / "0" / "steps" / "3").savers == (0, 1)
    assert_equal(t3, full.restore(None, target_on(t3, devs, (2, 4))))


@pytest.mark.parametrize("kind", ["replicated", "fsdp"])
def test_elastic_loop_slice_fails_and_returns(cluster_factory, kind):  # noqa: F811
    from controller_client.demo.elastic import Schedule, SimulatedSlices, train_elastic, train_plain

    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    sched = Schedule(total_steps=18, save_every=3, fail_at=8, return_at=12)
    events: list[str] = []
    got = train_elastic(cl, kind, sched, SimulatedSlices(devs), events)
    # Slice 1 fails after step 7: training goes on on slice 0 from step 6 (saved on both and waited for),
    # then scales back up to both slices from the step saved on slice 0 alone.
    assert events[:4] == ["attempt on slices [0, 1]", "slice 1 fails before step 8", "attempt on slices [0]",
                          'restored step 6 onto 1 slice(s), data iterator state {"global_next_index": 384}'], events
    assert "slice 1 is back before step 12" in events
    assert events[-2:] == ["attempt on slices [0, 1]",
                           'restored step 11 onto 2 slice(s), data iterator state {"global_next_index": 704}'], events
    ref = train_plain(kind, sched.total_steps, devs)
    assert sorted(got) == sorted(ref)
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=1e-5)


def test_backup_now_skips_the_interval(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-minutes", "60"]
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    mgr.save(1, fsdp_state(1, devs))  # the first backup goes out at once (no previous one)
    mgr.wait_until_finished()
    wait_for(lambda: 1 in status(cl).backup.committed_steps, what="backup of step 1", timeout=60)
    tree = fsdp_state(2, devs)
    mgr.save(2, tree)
    mgr.wait_until_finished()
    assert 2 not in status(cl).backup.committed_steps  # 60 minutes to go
    mgr.backup_now()
    wait_for(lambda: 2 in status(cl).backup.committed_steps, what="backup_now of step 2", timeout=60)
    mgr.close()


def test_unreachable_rank_is_named_not_step_not_found(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2, replicas=0)  # FSDP data: no copy on another host
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(3, devs)
    mgr.save(3, tree)
    mgr.wait_until_finished()
    mgr.close()
    for r in (2, 3):  # slice 1 is lost with its RAM disks; the coordinator still lists their data
        cl.procs[r].kill()
        cl.wipe(r)
    # The coordinator still counts step 3 complete: the restore retries for restore_wait_seconds (the
    # slice may be coming back), then names what is missing.
    small = mgr_for(cl, devices=devs[:4], restore_wait_seconds=6)
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError) as info:
        small.restore(3, target_on(tree, devs[:4], (1, 4)))
    assert time.monotonic() - t0 < 40
    msg = str(info.value)
    assert "step 3" in msg and "unreachable" in msg and "not found in" not in msg, msg
    assert "[2, 3]" in msg or "rank 2" in msg, msg  # names what is missing
    small.close()


def test_unreadable_own_manifest_healed_within_one_restore(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    tree = fsdp_state(4, devs)
    mgr.save(4, tree)
    mgr.wait_until_finished()
    wait_for(lambda: redundant(cl, 4), what="step 4 redundant", timeout=60)
    manifest = cl.ram(0) / "steps" / "4" / layout.MANIFEST_NAME
    good = layout.read_manifest(manifest.parent)
    manifest.write_bytes(manifest.read_bytes()[:40])  # no longer valid JSON
    assert_equal(tree, mgr.restore(4, target_on(tree, devs, (2, 4))))

    def healed() -> list:
        out = []
        for d in [cl.ram(0) / "steps" / "4", *cl.ram(0).glob("peer/*/4")]:
            try:
                if layout.read_manifest(d).content_hash == good.content_hash:
                    out.append(d)
            except (OSError, layout.ManifestError):
                pass
        return out

    # The restore read rank 0's data as it streamed in; the RAM-disk copy alongside commits when the last
    # bytes have landed, which may be just after the restore returned.
    wait_for(healed, what="rank 0's data of step 4 back on host 0", timeout=30)
    mgr.close()


def test_job_restarted_on_fewer_hosts_is_accepted(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    mgr.save(2, fsdp_state(2, devs))
    mgr.wait_until_finished()
    wait_for(lambda: redundant(cl, 2), what="step 2 redundant", timeout=60)
    mgr.close()
    assert any(cl.ram(r).glob("peer/[23]/2") for r in (0, 1))  # copies of ranks 2, 3 on slice 0
    cl.stop_all()
    # The job comes back on slice 0 only, as a 2-host job: copies of ranks 2 and 3 must not get every
    # heartbeat rejected ("holding of unknown rank").
    cl.nodes, cl.data_parallelism = 2, 1
    cl.start_all()
    wait_for(lambda: status(cl).hosts_reported == 2, what="both hosts reporting", timeout=30)
    topo = HostTopology.simulated(devs[:4], 1, 2)
    opts = CheckpointManagerOptions(local_directory=cl.local_template, job_name="t",
                                    coordinator_address=cl.coordinator, rpc_timeout_seconds=10)
    small = CheckpointManager(opts, devices=devs[:4], topology=topo)
    t = fsdp_state(3, devs[:4], shape=(1, 4))
    small.save(3, t)
    small.wait_until_finished()
    assert small.latest_step() == 3
    assert_equal(t, small.restore(3, target_on(t, devs[:4], (1, 4))))
    small.close()
