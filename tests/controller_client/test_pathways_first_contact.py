"""What a first save on real Pathways meets, on the simulated Pathways (tests/kits/pathways_sim.py) and on CPU.

- Every save moves each leaf from its (simulated) accelerator devices to the host's colocated CPU devices,
  and every restore moves it back: each leaf kind a user has goes through that, or fails before anything is
  written with an error naming the leaf.
- A worker's exception reaches the controller as Pathways shows it (a ``JaxRuntimeError`` whose status
  pathwaysutils counts as a slice-down); our host functions therefore return their failures as data, and
  the controller raises them with their own type: pathwaysutils' own ``is_error_due_to_slice_down`` says
  "not a slice-down" for each, and the manager's fall-backs (which catch ``FileNotFoundError``) still work.
  A host lost during a call is a slice-down.
- The rank the controller assigns a host is cross-checked with the rank its replicator serves.
"""

from __future__ import annotations

import errno
import os
from concurrent import futures
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from pathwaysutils.elastic.elastic import is_error_due_to_slice_down

from controller_client.manager import CheckpointManager, CheckpointManagerOptions, StepAlreadyExistsError
from mtc_rpc import control_pb2, control_pb2_grpc
from sidecar import failures, host, layout
from sidecar.checksums import ChecksumError
from sidecar.reader import CorruptStepError
from tests.controller_client.test_pathways_sim import sim  # noqa: F401  (fixture)
from tests.kits.pathways_sim import PathwaysSim

pytestmark = pytest.mark.slow


def local_mgr(root: Path, **kw) -> CheckpointManager:
    """A manager on every device (the simulated Pathways' when it runs), RAM dirs only (no replicators)."""
    opts = CheckpointManagerOptions(local_directory=str(root / "{host}"), job_name="t", **kw)
    return CheckpointManager(opts, devices=jax.devices())


def every_leaf_kind(step: int) -> dict:
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    other = Mesh(np.array(devs[::-1]).reshape(4, 2), ("a", "b"))  # the same devices in another order
    rng = np.random.default_rng(step)
    return {
        "sharded": jax.device_put(rng.standard_normal((16, 64)).astype(np.float32), NamedSharding(mesh, P("data", "model"))),
        "other_mesh": jax.device_put(rng.integers(0, 9, (8, 8), dtype=np.int32), NamedSharding(other, P("a", None))),
        "replicated": jax.device_put(rng.standard_normal(6).astype(np.float32), NamedSharding(mesh, P())),
        "single_device": jax.device_put(np.arange(7, dtype=np.int32) * step, devs[3]),
        "bf16": jax.device_put(np.ones((4, 8), jax.numpy.bfloat16) * step, NamedSharding(mesh, P(None, "model"))),
        "key": jax.random.key(step),  # a single-device typed PRNG key, as JAX makes it
        "raw_key": jax.random.PRNGKey(step),  # the legacy uint32 key (a single-device array)
        "key_on_mesh": jax.device_put(jax.random.key(step + 1), NamedSharding(mesh, P())),
        "numpy": np.arange(5, dtype=np.int64) * step,
        "scalar_int": step,
        "scalar_float": 0.5 * step,
        "text": f"step {step}",
        "flag": True,
        "none": None,
    }


def target_of(tree: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if isinstance(v, jax.Array) else v
            for k, v in tree.items()}


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, x in a.items():
        y = b[k]
        if isinstance(x, jax.Array):
            assert isinstance(y, jax.Array) and y.sharding == x.sharding and y.dtype == x.dtype, k
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=k)
        else:
            assert x == y and type(x) is type(y), k


def test_readme_snippet_with_a_single_device_key_saves_on_cpu(tmp_path):
    """The README's snippet as a new user writes it (``jax.random.key(0)``, a single-device array, beside
    leaves on an 8-device mesh) saved with JAX's "All arguments must use the same device list" before."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    tree = {"params": jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data", "model"))),
            "rng": jax.random.key(0), "step": 3}
    with local_mgr(tmp_path) as mgr:
        assert mgr.save(3, tree)
        mgr.wait_until_finished()
        assert_same(tree, mgr.restore(3, target_of(tree)))


def test_every_leaf_kind_through_the_accelerator_to_cpu_transfer(sim, tmp_path):  # noqa: F811
    """Each leaf is moved to another device (its host's colocated CPU device) for the save and back for the
    restore; the host functions ran in the workers; a restore onto the targets' own shardings."""
    tree = every_leaf_kind(4)
    calls = len(sim.calls)
    with local_mgr(tmp_path) as mgr:
        assert not mgr.dispatcher._same_devices  # the simulated accelerators are not their CPU devices
        assert mgr.save(4, tree)
        mgr.wait_until_finished()
        got = mgr.restore(4, target_of(tree))
    assert_same(tree, got)
    assert {name for name, _ in sim.calls[calls:]} >= {"_coloc_save", "_coloc_restore"}
    # Onto another mesh (and a single-device target for a leaf saved sharded).
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(4, 2), ("data", "model"))
    target = {**target_of(tree), "sharded": jax.ShapeDtypeStruct((16, 64), np.float32, sharding=NamedSharding(mesh, P("model"))),
              "replicated": jax.ShapeDtypeStruct((6,), np.float32, sharding=jax.sharding.SingleDeviceSharding(devs[5]))}
    with local_mgr(tmp_path) as mgr:
        got = mgr.restore(4, target)
    assert got["sharded"].sharding == target["sharded"].sharding
    np.testing.assert_array_equal(np.asarray(got["sharded"]), np.asarray(tree["sharded"]))
    assert got["replicated"].sharding == target["replicated"].sharding
    np.testing.assert_array_equal(np.asarray(got["replicated"]), np.asarray(tree["replicated"]))


def test_a_leaf_that_cannot_move_fails_the_save_naming_it_and_writes_nothing(sim, tmp_path):  # noqa: F811
    tree = every_leaf_kind(5)
    tree["sharded"].delete()  # donated to a computation, say
    with local_mgr(tmp_path) as mgr, pytest.raises(RuntimeError) as e:
        mgr.save(5, tree)
    assert "leaf \"['sharded']\"" in str(e.value.__notes__) or "['sharded']" in " ".join(e.value.__notes__)
    assert not list(tmp_path.glob("*/steps/5*")) and not list(tmp_path.glob("*/steps/*.tmp*"))


# --------------------------------------------------------------------------- errors as Pathways shows them

def test_sim_surfaces_a_worker_exception_as_pathways_does(sim):  # noqa: F811
    """The worker's ValueError arrives as a JaxRuntimeError with a status and its text (INTERNAL, which
    pathwaysutils counts as a slice-down: why our host functions never let theirs cross a call)."""
    from jax.experimental import colocated_python

    def boom(x):
        raise ValueError("no such thing")

    cpu = colocated_python.colocated_cpu_devices(jax.devices()[:1])
    x = jax.device_put(np.zeros(1, np.int32), cpu[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: .*ValueError: no such thing") as e:
        colocated_python.colocated_python(boom).specialize(out_specs_fn=lambda x: x)(x)
    assert is_error_due_to_slice_down(e.value)


def not_slice_down(e: BaseException) -> None:
    assert not isinstance(e, jax.errors.JaxRuntimeError), e
    assert not is_error_due_to_slice_down(e)  # pathwaysutils' own rule: elastic_retry re-raises it
    assert any("raised by the host function of rank" in n for n in getattr(e, "__notes__", ())), e


def test_our_errors_keep_their_type_and_are_not_slice_downs(sim, tmp_path):  # noqa: F811
    tree = every_leaf_kind(6)
    with local_mgr(tmp_path) as mgr:
        mgr.save(6, tree)
        mgr.wait_until_finished()
        # A missing step: FileNotFoundError, as the manager's fall-back to an older step expects.
        with pytest.raises(FileNotFoundError) as e:
            mgr.dispatcher.restore(9, [mgr._leaf_for("['sharded']", tree["sharded"])], ["['sharded']"])
        not_slice_down(e.value)
        # A refused request: the step is saved on every host already (the host's own check).
        with pytest.raises(StepAlreadyExistsError) as e:
            mgr.dispatcher.save(host.SaveRequest(6, (), (), (), 1, False), [])
            mgr.dispatcher.finish_save()  # a colocated save's failure comes with the next call
        not_slice_down(e.value)
        assert isinstance(e.value, FileExistsError) and isinstance(e.value, ValueError)
    # Corrupt bytes in every copy: a checksum error, naming the file. Each host reads only its own copies
    # (cross_host_reads off): a host that drops another's bad copy in its own process would make that host's
    # read find its copy gone rather than corrupt (simulated hosts on one disk only; a test artefact).
    root = tmp_path / "corrupt"
    x = {"x": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                             NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")), P("a", "b")))}
    with local_mgr(root, cross_host_reads=False) as mgr:
        mgr.save(6, x)
        mgr.wait_until_finished()
        for f in root.glob("*/steps/6/*.bin"):
            with open(f, "r+b") as fh:
                b = fh.read(1)
                fh.seek(0)
                fh.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises((ChecksumError, CorruptStepError)) as e:
            mgr.restore(6, target_of(x))
        not_slice_down(e.value)
        assert ".bin" in str(e.value)


def test_disk_errors_keep_errno_and_are_not_slice_downs(sim, tmp_path):  # noqa: F811
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where a host's RAM disk should be")
    opts = CheckpointManagerOptions(local_directory=str(blocker / "{host}"), job_name="t")
    mgr = CheckpointManager(opts, devices=jax.devices())
    with pytest.raises(NotADirectoryError) as e:  # at the save's first question to the hosts
        mgr.save(1, {"x": jax.device_put(np.ones(8, np.float32), NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d")))})
    not_slice_down(e.value)
    assert e.value.errno == errno.ENOTDIR and "other hosts failed too" in " ".join(e.value.__notes__)
    # Disk full: the errno survives the trip (revived from the record a host function returns).
    full = failures.revive(failures.capture(OSError(errno.ENOSPC, "No space left on device", "/local/x"), [2]))
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC and full.filename == "/local/x"
    assert not is_error_due_to_slice_down(full)


def test_unreachable_replicator_is_not_a_slice_down(sim, tmp_path):  # noqa: F811
    """Replicators configured but none serving: a restore of a step no host holds fails with the product's
    FileNotFoundError after its wait, not a runtime error."""
    opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t",
                                    coordinator_address="127.0.0.1:1", restore_wait_seconds=1, newest_wait_seconds=0,
                                    rpc_timeout_seconds=1)
    tree = {"x": jax.device_put(np.ones(8, np.float32), NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d")))}
    mgr = CheckpointManager(opts, devices=jax.devices())
    try:
        with pytest.raises(FileNotFoundError) as e:
            mgr.restore(3, target_of(tree))
        assert not is_error_due_to_slice_down(e.value)
    finally:
        mgr._coordinator.close()


def test_a_host_lost_during_a_call_is_a_slice_down(tmp_path):
    """A worker gone mid-job (its process dead): the next call spanning it raises DATA_LOSS, which
    pathwaysutils retries; calls on the other hosts go on."""
    with PathwaysSim(2, 2, log_dir=tmp_path / "logs") as s:
        mgr = local_mgr(tmp_path / "ram")
        victim = s._procs[3]
        victim.kill()  # by its pid
        victim.wait(timeout=30)
        with pytest.raises(jax.errors.JaxRuntimeError) as e:
            mgr.latest_step()
        assert "DATA_LOSS" in str(e.value) and is_error_due_to_slice_down(e.value)
        s.lose_hosts([3])
        with pytest.raises(jax.errors.JaxRuntimeError) as e:
            mgr.latest_step()
        assert is_error_due_to_slice_down(e.value)
        survivors = [d for d in jax.devices() if s.host_of_id[d.id].slice_index == 0]
        opts = CheckpointManagerOptions(local_directory=str(tmp_path / "ram" / "{host}"), job_name="t")
        assert CheckpointManager(opts, devices=survivors, topology=mgr.topology).latest_step() is None


# --------------------------------------------------------------------------- ranks cross-checked

class RankServer(control_pb2_grpc.LocalControlServicer):
    """A stand-in replicator's local control service that serves ``rank``."""

    def __init__(self, rank: int):
        self.rank = rank

    def GetLocalStatus(self, request, context):
        return control_pb2.GetLocalStatusResponse(job="t", rank=self.rank, nodes=4)

    def StepCommitted(self, request, context):
        return control_pb2.StepCommittedResponse()


def serve_rank(root: Path, rank: int) -> grpc.Server:
    root.mkdir(parents=True, exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    control_pb2_grpc.add_LocalControlServicer_to_server(RankServer(rank), server)
    server.add_insecure_port(f"unix:{layout.control_socket(root)}")
    server.start()
    return server


def test_a_rank_mismatch_fails_the_first_call_naming_both_and_writes_nothing(sim, tmp_path):  # noqa: F811
    """Host 1's replicator serves rank 3 (its Pod index and the device order disagree): the first call on
    that host fails with both ranks and the likely cause, and no step directory is written anywhere."""
    servers = [serve_rank(tmp_path / str(r), 3 if r == 1 else r) for r in range(4)]
    try:
        opts = CheckpointManagerOptions(local_directory=str(tmp_path / "{host}"), job_name="t",
                                        coordinator_address="127.0.0.1:1", rpc_timeout_seconds=1)
        mgr = CheckpointManager(opts, devices=jax.devices())
        tree = {"x": jax.device_put(np.ones(8, np.float32), NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d")))}
        with pytest.raises(failures.RankMismatchError) as e:
            mgr.save(1, tree)  # its first question to the hosts fails, before any host writes
        text = str(e.value)
        assert "rank 1" in text and "rank 3" in text and "Pod index" in text
        assert not is_error_due_to_slice_down(e.value)
        assert not list(tmp_path.glob("*/steps/*"))
        # A host function acting for the mismatched host refuses before it writes (the others are theirs).
        with pytest.raises(failures.RankMismatchError):
            mgr.dispatcher.save(host.SaveRequest(1, (host.ArrayMeta("['x']", None),), (), (), 1), [tree["x"]])
            mgr.dispatcher.finish_save()
        assert not list((tmp_path / "1").glob("steps/*"))
        mgr._coordinator.close()
        # Ranks that agree are confirmed once and saved as usual.
        servers[1].stop(0)
        servers[1] = serve_rank(tmp_path / "1", 1)
        mgr = CheckpointManager(opts, devices=jax.devices())
        mgr.dispatcher.save(host.SaveRequest(2, (host.ArrayMeta("['x']", None),), (), (), 2), [tree["x"]])
        mgr.dispatcher.query(host.HostQuery.WAIT, 30)
        assert sorted(p.parent.parent.name for p in tmp_path.glob("*/steps/2")) == ["0", "1", "2", "3"]
        mgr._coordinator.close()
    finally:
        for s in servers:
            s.stop(0)
        for r in range(4):
            sock = layout.control_socket(tmp_path / str(r))
            if sock.exists():
                os.unlink(sock)
