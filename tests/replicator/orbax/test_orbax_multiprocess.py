"""Unchanged Orbax 0.12.8 multi-tier checkpointing, 2 JAX processes on loopback, against our file contract."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from replicator.orbax import contract as oc
from tests.kits.orbax_harness import describe, fresh_start, restore_from, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _assert_ok(res) -> None:
    assert res.returncodes == [0, 0] and not res.responder_errors, describe(res)


def test_save_then_restart_restores_bit_exact(tmp_path: Path) -> None:
    first = run_job(tmp_path, "mtcjob", fresh_start, save_steps="1,2")
    _assert_ok(first)
    for rank in range(2):
        local = tmp_path / f"local{rank}"
        (cfg,) = first.configs[rank]
        assert cfg == oc.ReplicatorConfig(
            job_name="mtcjob", framework="orbax", assume_data_parallelism=1, node_rank=rank, nodes=2,
            peer_ranks=(), backup_interval_steps=5,
        )  # fmt: skip
        assert oc.committed_orbax_steps(local) == [1, 2]
        assert first.results[rank]["steps_at_end"] == [1, 2]
        # Orbax consumed the handshake and the step-0 marker; 0.12.8 never asks for a backup itself.
        assert not (local / oc.REPLICATOR_FILE).exists()
        assert not list(local.glob("*.restore"))
        assert not oc.backup_requested(local / "2")

    # "Restart": the daemon moves step 2 of each rank into its store, and the local dirs carry debris that
    # must not leak into the restore: a stale marker, an interrupted save and a step newer than the plan.
    targets = {}
    for rank in range(2):
        local = tmp_path / f"local{rank}"
        store = tmp_path / "store" / f"rank{rank}"
        store.mkdir(parents=True)
        os.rename(local / "2", store / "2")
        targets[rank] = store / "2"
        shutil.copytree(local / "1", local / "9")
        (local / "3.orbax-checkpoint-tmp").mkdir()
        (local / "old-s1-n0-w0.restore").touch()
    second = run_job(tmp_path, "mtcjob", restore_from(2, targets), restore_step=2, save_steps="3")
    _assert_ok(second)
    for rank in range(2):
        local = tmp_path / f"local{rank}"
        r = second.results[rank]
        assert r["steps_at_start"] == [1, 2] and r["latest_before_restore"] == 2, r
        assert r["restore_bit_exact"] is True, r
        # Orbax renamed our marker (hard links) to <local>/2; the data never moved out of the store.
        assert os.path.samefile(local / "2" / oc.COMMIT_SUCCESS_FILE, targets[rank] / oc.COMMIT_SUCCESS_FILE)
        assert oc.orbax_content_hash(local / "2") == oc.orbax_content_hash(targets[rank])
        assert oc.committed_orbax_steps(local) == [1, 2, 3]
        assert not (local / "9").exists() and not (local / "3.orbax-checkpoint-tmp").exists()
    print(
        f"orbax 2-process save run {first.seconds:.1f}s (init {first.results[0]['init_seconds']:.1f}s), "
        f"restore run {second.seconds:.1f}s (init {second.results[0]['init_seconds']:.1f}s)"
    )


def test_replicator_failed_makes_orbax_raise(tmp_path: Path) -> None:
    def failing(local: Path, rank: int, cfg: oc.ReplicatorConfig) -> None:
        oc.acknowledge(local, cfg)
        oc.report_error(local, f"peer {1 - rank} unreachable")
        oc.report_fatal(local, f"rank {rank}: no usable checkpoint store")

    # This run lets Orbax take the process id from the cluster environment (use_mtc_process_ids=False).
    res = run_job(tmp_path, "failjob", failing, save_steps="1", use_mtc_process_ids=False)
    assert res.returncodes == [3, 3], describe(res)
    for rank in range(2):
        err = res.results[rank]["init_error"]
        assert err == f"RuntimeError: Replicator fatal errors: rank {rank}: no usable checkpoint store\n", err
        assert f"peer {1 - rank} unreachable" in res.logs[rank]  # the non-fatal report was logged
        local = tmp_path / f"local{rank}"
        # Orbax consumed both reports; nothing was saved.
        assert not (local / oc.FAILED_FILE).exists() and not (local / oc.ERRORS_FILE).exists()
        assert oc.committed_orbax_steps(local) == []


def test_data_parallel_replicas_hash_equal_and_restore_from_each_other(tmp_path: Path) -> None:
    # Each process holds a full copy (processes along the "data" mesh axis) and is its own "slice"; at
    # step 2 process 1 saves a diverged value, as a replica with a flipped bit would.
    first = run_job(
        tmp_path,
        "dpjob",
        fresh_start,
        save_steps="1,2",
        layout="replicated",
        perturb_step={1: 2},
        num_slices=2,
    )
    _assert_ok(first)
    for rank in range(2):
        (cfg,) = first.configs[rank]
        # Peers = the same in-slice index in every other slice; data parallelism defaults to num_slices.
        assert (cfg.node_rank, cfg.peer_ranks, cfg.assume_data_parallelism) == (rank, (1 - rank,), 2)
    a, b = tmp_path / "local0", tmp_path / "local1"
    assert (a / "1/state/ocdbt.process_0").is_dir() and (b / "1/state/ocdbt.process_1").is_dir()
    assert (a / "1/_CHECKPOINT_METADATA").read_bytes() != (b / "1/_CHECKPOINT_METADATA").read_bytes()
    assert oc.orbax_content_hash(a / "1") == oc.orbax_content_hash(b / "1")
    assert oc.orbax_content_hash(a / "2") != oc.orbax_content_hash(b / "2")
    assert oc.orbax_content_hash(a / "1") != oc.orbax_content_hash(a / "2")
    _check_hash_scope(a / "1", tmp_path / "scratch")

    # Restart: rank 1's copy is "lost"; both ranks restore step 1 from rank 0's copy (equal hash).
    targets = {}
    for rank in range(2):
        target = tmp_path / "store" / f"for-rank{rank}" / "1"
        shutil.copytree(a / "1", target, symlinks=True)
        targets[rank] = target
    shutil.rmtree(b / "1")
    second = run_job(
        tmp_path, "dpjob", restore_from(1, targets), restore_step=1, layout="replicated", num_slices=2
    )
    _assert_ok(second)
    for rank in range(2):
        assert second.results[rank]["restore_bit_exact"] is True, second.results[rank]
        # prepare_for_restore removed step 2 (newer than the plan) on both ranks.
        assert oc.committed_orbax_steps(tmp_path / f"local{rank}") == [1]


def test_step_zero_is_an_ordinary_step_in_0_12_8(tmp_path: Path) -> None:
    # DESIGN.md expects this only from Orbax >= 0.12.10; 0.12.8 already saves step 0, and a *symlink*
    # marker with step 0 is restored (only an empty regular file with step 0 means "nothing to restore").
    first = run_job(tmp_path, "zerojob", fresh_start, save_steps="0")
    _assert_ok(first)
    targets = {}
    for rank in range(2):
        local = tmp_path / f"local{rank}"
        assert oc.committed_orbax_steps(local) == [0]
        targets[rank] = tmp_path / "store" / f"rank{rank}" / "0"
        targets[rank].parent.mkdir(parents=True)
        os.rename(local / "0", targets[rank])
    second = run_job(tmp_path, "zerojob", restore_from(0, targets), restore_step=0)
    _assert_ok(second)
    for rank in range(2):
        r = second.results[rank]
        assert r["latest_before_restore"] == 0 and r["restore_bit_exact"] is True, r


def _check_hash_scope(step_dir: Path, scratch: Path) -> None:
    """What the hash ignores (per-writer bytes) and what it must not (anything Orbax restores from)."""
    base = oc.orbax_content_hash(step_dir)

    def variant(name: str, edit) -> str:
        copy = scratch / name
        shutil.copytree(step_dir, copy, symlinks=True)
        edit(copy)
        return oc.orbax_content_hash(copy)

    def retime(d: Path) -> None:
        meta = json.loads((d / "_CHECKPOINT_METADATA").read_text())
        meta["commit_timestamp_nsecs"] += 12345
        (d / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))

    assert variant("retimed", retime) == base
    assert variant("recommitted", lambda d: (d / "state/commit_success.txt").write_text("elsewhere")) == base
    assert variant("uncommitted", lambda d: (d / "state/commit_success.txt").unlink()) != base
    assert (
        variant("remeshed", lambda d: (d / "process_metadata/mesh_metadata.json").write_text("[1, 0, 2, 3]"))
        != base
    )

    def lose_data(d: Path) -> None:
        # Small values are inlined into b-tree nodes, which live in d/ of the root and of each process db.
        for f in (d / "state").rglob("d/*"):
            f.unlink()

    with pytest.raises(ValueError, match="OCDBT"):
        variant("lost", lose_data)
    with pytest.raises(ValueError, match="manifest.ocdbt"):
        variant("unmanifested", lambda d: (d / "state/manifest.ocdbt").unlink())
    with pytest.raises(ValueError, match="symlinks"):
        variant("linked", lambda d: os.symlink("/etc/hostname", d / "state/extra"))
    # Hashing only reads: the step directory is unchanged.
    before = sorted((str(p), p.stat().st_size) for p in step_dir.rglob("*"))
    oc.orbax_content_hash(step_dir)
    assert sorted((str(p), p.stat().st_size) for p in step_dir.rglob("*")) == before
