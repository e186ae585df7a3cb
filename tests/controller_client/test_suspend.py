"""Suspend-resume from the controller with real replicators on loopback: ``backup_now(wait=True)`` returns once the
step just saved is durable (the bucket, else peers) or raises naming it; ``noticed_slices()`` tells a notice to
some slices from one to every active slice, and ``preemption_scope="slices"`` stops the job only for the latter."""

from __future__ import annotations

import time

import jax
import pytest

from controller_client import preemption_exit
from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.suspend import DurableStep
from controller_client.topology import HostTopology
from tests.controller_client.test_elastic import fsdp_state
from tests.kits.cluster import status, step_summary, wait_for
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def mgr_for(cl, devices=None, **kw) -> CheckpointManager:
    devs = jax.devices()
    topo = HostTopology.simulated(devs, 2, 2)  # the full allocation: 2 slices of 2 hosts, ranks never change
    opts = CheckpointManagerOptions(local_directory=cl.local_template, job_name="t", coordinator_address=cl.coordinator,
                                    restore_wait_seconds=60, rpc_timeout_seconds=10, **kw)
    return CheckpointManager(opts, devices=devices if devices is not None else devs, topology=topo)


def test_backup_now_waits_until_the_step_just_saved_is_in_the_bucket(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.extra = ["--backup-url", f"file://{cl.base / 'bucket'}", "--backup-interval-minutes", "60"]
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    try:
        mgr.save(1, fsdp_state(1, devs))  # the first backup goes out at once (no previous one)
        mgr.wait_until_finished()
        wait_for(lambda: 1 in status(cl).backup.committed_steps, what="backup of step 1", timeout=60)
        mgr.save(2, fsdp_state(2, devs))  # no wait_until_finished: backup_now waits for the save itself
        got = mgr.backup_now(wait=True, timeout_seconds=60)
        # Read at once, no polling: without the wait the backup of step 2 had only been asked for.
        st = status(cl)
        assert isinstance(got, DurableStep) and (got.step, got.tier) == (2, "bucket"), got
        assert 2 in st.backed_up_steps and 2 in st.backup.committed_steps, st
        assert mgr.backup_now() is None  # without wait: asks and returns
    finally:
        mgr.close()


def test_backup_now_without_a_bucket_waits_for_peer_redundancy(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    mgr = mgr_for(cl)
    try:
        mgr.save(3, fsdp_state(3, devs))
        got = mgr.backup_now(wait=True, timeout_seconds=60)
        s = step_summary(status(cl), 3)
        assert (got.step, got.tier) == (3, "peers") and s.complete and s.redundant, (got, s)
    finally:
        mgr.close()


def test_backup_now_times_out_naming_the_step_and_the_loop_still_exits_75(cluster_factory, tmp_path):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    cl.extra = ["--backup-url", f"file://{bucket}", "--backup-interval-minutes", "60"]
    cl.start_all()
    bucket.rmdir()
    bucket.write_text("a file where the bucket's folder was: every upload fails from now on")
    devs = jax.devices()
    mgr = mgr_for(cl)
    try:
        mgr.save(4, fsdp_state(4, devs))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="step 4 is not durable"):
            mgr.backup_now(wait=True, timeout_seconds=4)
        assert time.monotonic() - t0 < 4 + 6  # bounded: the timeout, plus one status call at most
        assert preemption_exit.finish_preempted(mgr, timeout_seconds=2) == preemption_exit.PREEMPTED_EXIT_CODE == 75
    finally:
        mgr.close()


def test_a_notice_to_one_slice_stops_only_that_slice(cluster_factory):  # noqa: F811
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    devs = jax.devices()
    per_slice = mgr_for(cl, preemption_scope="slices")
    whole_job = mgr_for(cl)  # preemption_scope="job": any notice stops everything
    survivors = mgr_for(cl, devices=devs[:4], preemption_scope="slices")  # slice 0 alone, as after a drop
    try:
        per_slice.save(5, fsdp_state(5, devs))
        per_slice.wait_until_finished()
        assert per_slice.noticed_slices() == frozenset() and not per_slice.reached_preemption(5)
        for rank in (2, 3):  # slice 1's Pods get their notice (preStop: mtc preempt); the replicators keep serving
            cl.notice(rank)
        # The coordinator tells every host of the job's notice: the whole-job view stops ...
        wait_for(lambda: whole_job.reached_preemption(5), what="the job's notice on every host", timeout=30)
        assert whole_job.noticed_slices() == frozenset({1})
        # ... the per-slice view does not: slice 1 goes, slice 0 goes on.
        assert per_slice.noticed_slices() == frozenset({1}) and per_slice.active_slices == frozenset({0, 1})
        assert not per_slice.reached_preemption(5)
        assert survivors.active_slices == frozenset({0})
        assert survivors.noticed_slices() == frozenset() and not survivors.reached_preemption(5)
        cl.notice(0)  # then slice 0's notice: every active slice of the survivors has one
        assert survivors.noticed_slices() == frozenset({0}) and survivors.reached_preemption(5)
        assert per_slice.noticed_slices() == frozenset({0, 1}) and per_slice.reached_preemption(5)
    finally:
        for m in (per_slice, whole_job, survivors):
            m.close()


def test_preemption_exit_codes() -> None:
    from controller_client import manifests as mf
    from controller_client import preemption_exit
    from controller_client.manifests_jobsets import preemption_budget

    assert preemption_exit.exit_code(preempted=True) == preemption_exit.PREEMPTED_EXIT_CODE == 75
    assert preemption_exit.exit_code(preempted=False) == 0
    assert preemption_exit.exit_code(preempted=True, steps_left=False) == 0
    # The loop's wait for its last step to be durable is the default grace period's flush share.
    assert preemption_exit.DURABLE_WAIT_SECONDS == preemption_budget(mf.ManifestOptions(job="demo")).flush == 30
