"""CheckpointManager on 8 CPU devices as 4 simulated hosts (2 slices x 2): round trips, meshes, faults."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.dispatch import InProcessDispatcher
from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from sidecar import checksums, commit, faults, layout, writer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ram_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="mtc-test-", dir=base)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def make_manager(ram_dir, **kw):
    devs = jax.devices()
    topo = HostTopology.simulated(devs, slices=2, hosts_per_slice=2)
    opts = CheckpointManagerOptions(local_directory=str(ram_dir / "{host}"), job_name="t", **kw)
    return CheckpointManager(opts, devices=devs, topology=topo)


MESHES = {
    "replicated": lambda d: (Mesh(np.array(d), ("x",)), P()),
    "2x4": lambda d: (Mesh(np.array(d).reshape(2, 4), ("a", "b")), P("a", "b")),
    "4x2": lambda d: (Mesh(np.array(d).reshape(4, 2), ("a", "b")), P("a", "b")),
}


def make_tree(mesh, spec, seed=0):
    rng = np.random.default_rng(seed)
    s2 = NamedSharding(mesh, spec)
    s1 = NamedSharding(mesh, P(spec[0]) if len(spec) else P())

    def put(x, s=s2):
        return jax.device_put(x, s)

    keys = jax.random.split(jax.random.key(seed), 8)
    return {
        "params": {
            "w": put(rng.standard_normal((16, 8)).astype(np.float32)),
            "b16": put(jnp.asarray(rng.standard_normal((8, 16)), dtype=jnp.bfloat16)),
            "layers": [put(rng.integers(-128, 127, (8, 8), dtype=np.int8)),
                       (put(rng.integers(0, 2**32 - 1, (8, 4), dtype=np.uint32)), put(rng.random((8, 8)) > 0.5))],
        },
        "rng": jax.device_put(keys, s1),
        "step": 7,
        "lr": 0.125,
        "name": "run-a",
        "nothing": None,
        "host_np": np.arange(5, dtype=np.int64),
    }


def abstract(tree, mesh, spec):
    """Target: ShapeDtypeStructs on ``mesh``/``spec`` for arrays, plain leaves as they are."""
    def conv(x):
        if isinstance(x, jax.Array):
            s = P(*tuple(spec)[: x.ndim]) if len(spec) else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
        return x
    return jax.tree.map(conv, tree, is_leaf=lambda x: x is None)


def assert_same(a, b):
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert y.dtype == x.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray)):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y and type(x) is type(y)


@pytest.mark.parametrize("save_mesh", list(MESHES))
@pytest.mark.parametrize("restore_mesh", list(MESHES))
def test_round_trip_across_meshes(ram_dir, save_mesh, restore_mesh):
    devs = jax.devices()
    m1, s1 = MESHES[save_mesh](devs)
    m2, s2 = MESHES[restore_mesh](devs)
    tree = make_tree(m1, s1)
    with make_manager(ram_dir) as mgr:
        assert mgr.save(10, tree)
        mgr.wait_until_finished()
        assert mgr.latest_step() == 10
        out = mgr.restore(10, abstract(tree, m2, s2))
    assert_same(tree, out)
    leaf = out["params"]["w"]
    assert leaf.sharding == NamedSharding(m2, P(*tuple(s2)[:2]) if len(s2) else P())


def test_every_host_writes_its_own_shards(ram_dir):
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    tree = make_tree(mesh, spec)
    with make_manager(ram_dir) as mgr:
        mgr.save(1, tree)
    for rank in range(4):
        m = layout.read_manifest(ram_dir / str(rank) / "steps" / "1")
        assert m.rank == rank and m.nodes == 4
        w = next(a for a in m.arrays if a.path == "['params']['w']")
        # 2x4 mesh, 2 devices per host: each host holds 2 distinct (8x2)... shards of the (16, 8) array.
        assert len(w.shards) == 2
        checksums.verify_step_dir(ram_dir / str(rank) / "steps" / "1")


def test_save_interval_keep_and_latest(ram_dir):
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    tree = make_tree(mesh, spec)
    with make_manager(ram_dir, save_interval_steps=2, max_to_keep=2) as mgr:
        assert mgr.latest_step() is None
        saved = [s for s in range(1, 8) if mgr.save(s, tree)]
        assert saved == [2, 4, 6]
        assert mgr.save(7, tree, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [6, 7]
        with pytest.raises(FileExistsError):
            mgr.save(7, tree, force=True)  # saved on every host already: a mistake
        old = layout.read_manifest(ram_dir / "0" / "steps" / "7").generation
        # After restoring step 6 (a rollback) step 7 is abandoned: saving it again replaces it.
        mgr.restore(6, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                    if isinstance(x, jax.Array) else x, tree))
        assert mgr.save(7, tree, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [6, 7]
        assert layout.read_manifest(ram_dir / "0" / "steps" / "7").generation > old


def test_restore_errors_name_the_problem(ram_dir):
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    tree = make_tree(mesh, spec)
    with make_manager(ram_dir) as mgr:
        with pytest.raises(FileNotFoundError, match="no committed step"):
            mgr.restore(None, abstract(tree, mesh, spec))
        mgr.save(3, tree)
        target = abstract(tree, mesh, spec)
        with pytest.raises(FileNotFoundError, match=r"step 4.*" + str(ram_dir)):
            mgr.restore(4, target)
        bad_shape = dict(target, params=dict(target["params"], w=jax.ShapeDtypeStruct((16, 4), jnp.float32)))
        with pytest.raises(ValueError, match=r"\['params'\]\['w'\].*shape"):
            mgr.restore(3, bad_shape)
        bad_dtype = dict(target, params=dict(target["params"], w=jax.ShapeDtypeStruct((16, 8), jnp.int32)))
        with pytest.raises(ValueError, match=r"\['params'\]\['w'\].*dtype"):
            mgr.restore(3, bad_dtype)
        extra = dict(target, more=jax.ShapeDtypeStruct((2,), jnp.float32))
        with pytest.raises(ValueError, match=r"\['more'\]"):
            mgr.restore(3, extra)
        fewer = {k: v for k, v in target.items() if k != "lr"}
        with pytest.raises(ValueError, match=r"\['lr'\]"):
            mgr.restore(3, fewer)
        with pytest.raises(TypeError, match="object"):
            mgr.save(4, {"x": object()})
        # Still usable after all that.
        assert_same(tree, mgr.restore(3, target))


@pytest.mark.parametrize("big", [False, True], ids=["read", "mapped"])
def test_flipped_byte_is_detected(ram_dir, big):
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    tree = make_tree(mesh, spec)
    if big:  # shards of >= 1 MiB are memory-mapped rather than read
        w = np.random.default_rng(5).standard_normal((2048, 1024)).astype(np.float32)
        tree["params"]["w"] = jax.device_put(w, NamedSharding(mesh, spec))
    with make_manager(ram_dir, cross_host_reads=False) as mgr:
        mgr.save(5, tree)
        mgr.wait_until_finished()
        sdir = ram_dir / "2" / "steps" / "5"
        m = layout.read_manifest(sdir)
        victim = next(a for a in m.arrays if a.path == "['params']['w']").shards[0].file
        raw = bytearray((sdir / victim).read_bytes())
        raw[3] ^= 0x10
        (sdir / victim).write_bytes(bytes(raw))
        with pytest.raises(checksums.ChecksumError, match=victim):
            mgr.restore(5, abstract(tree, mesh, spec))


def test_corrupt_copy_falls_back_to_an_intact_replica(ram_dir):
    """With replicated data, a corrupt copy is a missing piece fetched from another copy, never used."""
    devs = jax.devices()
    mesh, spec = MESHES["replicated"](devs)
    tree = {"w": jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, P()))}
    with make_manager(ram_dir) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        f = ram_dir / "0" / "steps" / "1" / "0.0.bin"
        raw = bytearray(f.read_bytes())
        raw[0] ^= 1
        f.write_bytes(bytes(raw))
        out = mgr.restore(1, {"w": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P()))})
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64, dtype=np.float32))


def test_in_process_dispatcher(ram_dir):
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)
    opts = CheckpointManagerOptions(local_directory=str(ram_dir / "{host}"), dispatcher="in_process")
    mgr = CheckpointManager(opts, devices=devs, topology=topo)
    assert isinstance(mgr.dispatcher, InProcessDispatcher)
    mesh, spec = MESHES["4x2"](devs)
    tree = make_tree(mesh, spec, seed=3)
    mgr.save(2, tree)
    mgr.wait_until_finished()
    assert mgr.latest_step() == 2
    assert_same(tree, mgr.restore(None, abstract(tree, mesh, spec)))
    mgr.close()


def test_enospc_keeps_previous_step_and_manager_usable(ram_dir, monkeypatch):
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    small = make_tree(mesh, spec, seed=1)
    root = ram_dir
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        root = ram_dir / "tiny"
        root.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)], capture_output=True)
        mounted = r.returncode == 0
    if not mounted:
        # No way to mount a small tmpfs here: inject the fault at the write call instead.
        real = writer._write_file

        def failing(path, data):
            if data.nbytes > 1 << 20:
                raise OSError(28, "No space left on device")
            return real(path, data)

        monkeypatch.setattr(writer, "_write_file", failing)
    try:
        with make_manager(root) as mgr:
            mgr.save(1, small)
            mgr.wait_until_finished()
            big = {**small, "params": {**small["params"],
                                       "w": jax.device_put(np.ones((4096, 1024), np.float32),
                                                           NamedSharding(mesh, P("a", "b")))}}
            mgr.save(2, big)
            with pytest.raises(Exception, match="RAM disk full"):
                mgr.wait_until_finished()
            for rank in range(4):
                names = os.listdir(root / str(rank) / "steps")
                assert names == ["1"], names  # no temporary directory, no step 2
            assert mgr.latest_step() == 1
            assert_same(small, mgr.restore(1, abstract(small, mesh, spec)))
            assert mgr.save(3, small)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 3]
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.topology import HostTopology
    from sidecar import writer
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
    s = NamedSharding(mesh, P("a", "b"))
    mgr = CheckpointManager(CheckpointManagerOptions(local_directory=sys.argv[1] + "/{host}"),
                            devices=devs, topology=HostTopology.simulated(devs, 2, 2))
    mgr.save(1, {"w": jax.device_put(np.full((64, 64), 1.0, np.float32), s)})
    mgr.wait_until_finished()
    real = writer._write_file
    def slow(path, data):
        crc = real(path, data)
        print("WRITING", flush=True)
        time.sleep(60)
        return crc
    writer._write_file = slow
    mgr.save(2, {"w": jax.device_put(np.full((64, 64), 2.0, np.float32), s)})
    time.sleep(120)
    """
)


def test_sigkill_mid_save_leaves_previous_step(ram_dir):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(ram_dir)], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "WRITING" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "WRITING" in line, "writer never started step 2"
        tmp_dirs = [p for r in range(4) for p in (ram_dir / str(r) / "steps").iterdir()
                    if p.name.startswith(layout.TMP_PREFIX)]
        assert tmp_dirs, "expected an in-flight temporary directory"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    for rank in range(4):
        assert commit.committed_steps(ram_dir / str(rank) / "steps") == [1]
    with make_manager(ram_dir) as mgr:
        assert mgr.latest_step() == 1
        devs = jax.devices()
        s = NamedSharding(Mesh(np.array(devs).reshape(2, 4), ("a", "b")), P("a", "b"))
        out = mgr.restore(None, {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=s)})
        np.testing.assert_array_equal(np.asarray(out["w"]), np.full((64, 64), 1.0, np.float32))
    # Opening the hosts again removed the crashed writer's temporary directories.
    for rank in range(4):
        assert os.listdir(ram_dir / str(rank) / "steps") == ["1"]


def test_restored_shards_never_share_memory(ram_dir):
    """Restore hands aligned buffers to the CPU devices without a copy; replicas must still be distinct,
    or a donated input updated in place on one device would change another's."""
    devs = jax.devices()
    mesh, spec = MESHES["replicated"](devs)
    s = NamedSharding(mesh, spec)
    with make_manager(ram_dir) as mgr:
        mgr.save(1, {"w": jax.device_put(np.arange(1 << 16, dtype=np.float32), s)})
        out = mgr.restore(1, {"w": jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=s)})
    ptrs = {sh.data.unsafe_buffer_pointer() for sh in out["w"].addressable_shards}
    assert len(ptrs) == len(devs)
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(out["w"])
    for sh in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(sh.data), np.arange(1 << 16, dtype=np.float32) + 1)


def test_host_queries_stay_small_at_10000_hosts(ram_dir):
    """8 real hosts of a 10,000-host job: a STEPS answer carries rank ranges, not every rank, so it fits
    (before, the savers of an all-rank save travelled as range(nodes) and overflowed the 64 KiB buffer)."""
    import dataclasses

    from controller_client.dispatch import QUERY_BYTES, ColocatedDispatcher
    from sidecar import host, saves

    devs = sorted(jax.devices(), key=lambda d: d.id)
    topo = HostTopology({d.id: i for i, d in enumerate(devs)}, slices=1250, hosts_per_slice=8)
    assert topo.nodes == 10_000
    opts = CheckpointManagerOptions(local_directory=str(ram_dir / "{host}"), job_name="t")
    mesh = Mesh(np.array(devs), ("x",))
    x = jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, P("x")))
    with CheckpointManager(opts, devices=devs, topology=topo) as mgr:
        # Two saves by every rank of the job (savers "all"), of which only these 8 hosts' data exist here.
        every = ColocatedDispatcher(dataclasses.replace(mgr.config, savers=()), devs)
        for step in (1, 2):
            every.save(host.SaveRequest(step, (host.ArrayMeta("x", None),), (), (), generation=step), [x])
        every.query(host.HostQuery.WAIT, 30.0)
        assert mgr.all_steps() == []  # 9,992 savers' data are nowhere: incomplete, and no ValueError
        answers = mgr.dispatcher.query(host.HostQuery.STEPS)
        assert sorted(answers) == list(range(8))
        for r, a in answers.items():
            assert [h.step for h in a.held] == [1, 2]
            assert all(h.savers == saves.RankRanges.every(10_000) for h in a.held)
            assert len(host.encode_result(host.HostQuery.STEPS, {r: a}, 1024)) == 1024  # fits in 1 KiB
        # The controller's rule over 10,000 hosts' answers (as the dispatcher decodes them): complete once
        # every saver's data is held somewhere.
        row = answers[0]
        rows = {r: host.decode_result(host.HostQuery.STEPS, host.encode_result(host.HostQuery.STEPS, {r: dataclasses.replace(
                row, held=tuple(dataclasses.replace(h, held=saves.RankRanges.of([r])) for h in row.held))},
                QUERY_BYTES))[r] for r in range(10_000)}
        assert saves.complete_steps(h for a in rows.values() for h in a.held) == [1, 2]
        del rows[4321]
        assert saves.complete_steps(h for a in rows.values() for h in a.held) == []
        # A save by the 8 active hosts (savers 0..7) is complete from their own answers.
        mgr.save(3, {"x": x}, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]


class CountingDispatcher:
    """Wraps a real dispatcher and counts its fan-outs (each call reaches every host)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def save(self, *a, **k):
        self.calls.append("save")
        return self.inner.save(*a, **k)

    def restore(self, *a, **k):
        self.calls.append("restore")
        return self.inner.restore(*a, **k)

    def query(self, query, arg=None):
        self.calls.append(query.name)
        return self.inner.query(query, arg)


def test_restore_right_after_a_save_makes_few_fan_outs(ram_dir):
    """Documented in docs/elastic.md and CheckpointManager's docstring: WAIT, STEPS, one restore fan-out
    returning arrays and plain values (before, a VALUES query opened the whole step a second time)."""
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    tree = make_tree(mesh, spec)
    with make_manager(ram_dir) as mgr:
        mgr.dispatcher = counting = CountingDispatcher(mgr.dispatcher)
        mgr.save(1, tree, force=True)
        counting.calls.clear()
        assert_same(mgr.restore(target=abstract(tree, mesh, spec)), tree)
        assert counting.calls == ["WAIT", "STEPS", "restore"]
        counting.calls.clear()
        assert_same(mgr.restore(1, target=abstract(tree, mesh, spec)), tree)
        assert counting.calls == ["WAIT", "restore"]


def test_restore_does_not_quietly_go_back_past_the_reported_latest_step(ram_dir, caplog):
    """Issue #19: while a host's copy of the newest step is briefly gone (a replicator restarting), a
    restore() right after latest_step() said 3 returned step 2 without a word. Now it waits for step 3
    (newest_wait_seconds) and, when it stays gone, restores step 2 with a warning naming both."""
    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    trees = {s: make_tree(mesh, spec, seed=s) for s in (1, 2, 3)}
    with make_manager(ram_dir, max_to_keep=3, newest_wait_seconds=20.0) as mgr:
        for s, t in trees.items():
            assert mgr.save(s, t)
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3
        step3 = ram_dir / "1" / "steps" / "3"
        aside = ram_dir / "aside-3"
        step3.rename(aside)  # host 1's copy of step 3 is gone for a moment ...
        back = threading.Timer(1.5, lambda: aside.rename(step3))  # ... and back (the host refilled)
        back.start()
        try:
            got = mgr.restore(target=abstract(trees[3], mesh, spec))
        finally:
            back.join()
        assert mgr.last_restored_step == 3
        assert_same(got, trees[3])

    with make_manager(ram_dir, max_to_keep=3, newest_wait_seconds=1.0) as mgr:
        assert mgr.latest_step() == 3
        step3.rename(aside)  # gone for good: the older step, said out loud
        with caplog.at_level("WARNING", logger="controller_client.manager"):
            got = mgr.restore(target=abstract(trees[2], mesh, spec))
        assert mgr.last_restored_step == 2
        assert_same(got, trees[2])
        assert any("step 3, which latest_step() reported" in r.getMessage() and "restoring step 2" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_corrupt_manifest_is_reported_as_corruption_not_absence(ram_dir):
    """Issue #19: the only copy of host 1's data with a corrupt manifest made restore say the data "lives on
    another host" (FileNotFoundError); now it names the corrupt copy and what is wrong with it."""
    from sidecar import reader

    devs = jax.devices()
    mesh, spec = MESHES["2x4"](devs)
    tree = make_tree(mesh, spec)
    with make_manager(ram_dir) as mgr:
        assert mgr.save(1, tree)
        mgr.wait_until_finished()
        m = ram_dir / "1" / "steps" / "1" / layout.MANIFEST_NAME
        m.write_text(m.read_text()[:-20] + "garbage")
        assert mgr.latest_step() is None  # rank 1's data is not held: the step is not complete
        with pytest.raises(reader.CorruptStepError, match=r"corrupt copies \(dropped\): .*/1/steps/1: manifest is not valid JSON"):
            mgr.restore(1, abstract(tree, mesh, spec))


def test_a_step_that_donates_and_deletes_the_saved_arrays_does_not_change_the_saved_bytes(ram_dir):
    """save() blocks only for the host transfer (on CPU a view of the device buffers, no copy): a jitted
    step that donates the saved state right after save() and then deletes it, while the write runs, must
    not change what is written."""
    mesh, spec = MESHES["2x4"](jax.devices())
    sh = NamedSharding(mesh, spec)
    want = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    state = jax.device_put(want, sh)
    assert np.shares_memory(writer.device_to_host(state.addressable_shards[0].data),
                            np.asarray(state.addressable_shards[0].data))  # no copy on CPU
    mgr = make_manager(ram_dir)
    step = jax.jit(lambda x: x * 0 - 7, donate_argnums=0)
    step.lower(state).compile()
    try:
        faults.arm("save.after_tmp_dir", 1, pause_seconds=1.0)  # the write waits while the step runs
        assert mgr.save(1, {"w": state})
        out = step(state)  # donation declined while the write holds the buffers: a new output
        state.delete()
        junk = [jax.device_put(np.full_like(want, -1), sh) for _ in range(4)]
        jax.block_until_ready((out, junk))
        mgr.wait_until_finished()
    finally:
        faults.arm(None)
    got = mgr.restore(1, {"w": jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=sh)})
    np.testing.assert_array_equal(np.asarray(got["w"]), want)
    np.testing.assert_array_equal(np.asarray(out), np.full_like(want, -7))
    mgr.close()
