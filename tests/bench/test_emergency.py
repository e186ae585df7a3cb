"""Smoke tests of ``bench.emergency`` (a 2 MiB state, one round): the benchmark code cannot rot unnoticed.

They time nothing (no timed unit tests): they check that every system runs the whole scenario on 4 real JAX
processes — our multi-controller front door with real replicators, Orbax's p2p and emergency managers, and
our Orbax mode (unchanged Orbax ``ReplicatorCheckpointManager``, real daemons, one job incarnation per
phase) — restores bit for bit (the benchmark checks every restore) and that every ratio key is reported.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from bench import emergency, emergency_common
from bench.children import bound_to_us, scratch_dir

pytestmark = pytest.mark.slow


def test_state_has_the_requested_size_and_mixed_dtypes():
    specs = emergency_common.leaf_specs(64)
    size = sum(math.prod(shape) * (2 if dtype == "bfloat16" else 4) for _, shape, dtype, _ in specs)
    assert 0.95 * (64 << 20) <= size <= 64 << 20
    assert {dtype for _, _, dtype, _ in specs} == {"float32", "bfloat16", "int32"}
    assert {len(shape) for _, shape, _, _ in specs} == {1, 2}


def test_a_collective_cut_by_a_failed_peer_is_not_named_as_the_cause():
    """CI saw only rank 0's "Connection closed by peer" once: the failing host's own error is the cause."""
    cut = ("JaxRuntimeError: UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] "
           "Connection closed by peer [127.0.0.1]:6299")
    assert emergency._is_consequence(cut)
    assert not emergency._is_consequence("ValueError: restore_one_lost: leaf w differs")


def _run(systems: tuple[str, ...]) -> dict:
    """One round at 2 MiB of ``systems``; its JSON line."""
    # A short base: the replicators' control sockets live under it (a unix socket path has <= 107
    # characters; pytest-xdist's tmp_path is deeper than that).
    run = scratch_dir("mtc-em-")
    try:
        proc = subprocess.run(bound_to_us([sys.executable, "-m", "bench.emergency", "--mib", "2", "--repeats", "1",
                               "--systems", ",".join(systems), "--timeout", "180", "--keep", str(run / "run")]),
                              capture_output=True, text=True, timeout=220, cwd=str(emergency_common.REPO))
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "errors" not in result, (result["errors"], result.get("errors_by_rank"))
    assert set(result["seconds"]) == set(systems)
    for system in systems:
        assert all(result["seconds"][system][m] > 0 for m in emergency_common.MEASURES), result["seconds"][system]
    return result


@pytest.mark.timeout(240)
def test_one_round_of_every_system_reports_every_ratio():
    """Ours against Orbax's emergency manager in one job, Orbax's p2p manager in a job of its own: twice
    (CI once, make test once) Orbax's emergency manager, run in the same processes right after the p2p
    manager, lost a host without an error of its own and every other host saw its collective cut ("Gloo
    AllGather failed ... Connection closed by peer"); not understood yet (docs/benchmarks.md)."""
    result = _run(("ours", "orbax_emergency"))
    for m in emergency_common.MEASURES:
        assert result[f"{m}_vs_best_orbax"] > 0
        assert result["best_orbax"][m] == "orbax_emergency"
    assert not any(k.startswith("ours_orbax") for k in result)
    _run(("orbax_p2p",))


@pytest.mark.timeout(240)
def test_our_orbax_mode_runs_every_measure_in_job_incarnations_of_its_own():
    """``ours_orbax``: Orbax's initialize + ReplicatorCheckpointManager against real daemons, a save job and
    one incarnation per restore (~55 s of the ~75 s here). A restore that is not step 2 or not bit for bit
    what was saved is an error of the system, so ``errors`` would name it."""
    assert "ours_orbax" in emergency.SYSTEMS
    result = _run(("ours_orbax", "orbax_emergency"))
    for m in emergency_common.MEASURES:
        assert result[f"ours_orbax_{m}_vs_best_orbax"] > 0
        assert result["best_orbax"][m] == "orbax_emergency"
        assert f"{m}_vs_best_orbax" not in result  # those are ours (the native front door), not run here
    assert "ours_orbax" not in result.get("zero_sign_lost", {})
    split = result["ours_orbax_safe_after_split"]
    assert set(split) == {"orbax_save_seconds", "our_share_seconds"}
    assert split["orbax_save_seconds"] > 0 and split["our_share_seconds"] >= 0
    untimed = result["ours_orbax_untimed"]
    restores = [m for m in emergency_common.MEASURES if m.startswith("restore")]
    assert set(untimed) == {"init_seconds", "handshake_seconds", "after_init_seconds", "open_seconds"}
    for m in restores:
        # Orbax's initialize holds our daemons' handshake; the restore's clock is the handshake + the span
        # after initialize, and the manager's construction is inside that span.
        assert 0 < untimed["handshake_seconds"][m] < untimed["init_seconds"][m]
        assert 0 < untimed["open_seconds"][m] < untimed["after_init_seconds"][m]
        assert untimed["handshake_seconds"][m] < result["seconds"]["ours_orbax"][m]


def test_check_state_counts_zeros_that_lost_their_sign_and_refuses_any_other_difference(monkeypatch):
    """At 32 MiB the random state holds a bfloat16 -0.0; Orbax's managers restore it as +0.0 (their replica
    broadcast sums with zeros). That is counted, not fatal; one other flipped bit is."""
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    saved = np.arange(1, 16 * 8 + 1, dtype=np.float32).reshape(16, 8).astype(ml_dtypes.bfloat16)
    saved[3, 5] = -0.0
    monkeypatch.setattr(emergency_common, "_value", lambda name, shape, dtype, index: saved[index])
    sh = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model")), P(None, "model"))
    abstract = {"attn": jax.ShapeDtypeStruct((16, 8), saved.dtype, sharding=sh)}

    def restored(values):
        return {"attn": jax.make_array_from_callback((16, 8), sh, lambda idx: values[idx])}

    assert emergency_common.check_state(restored(saved), abstract) == 0
    plus = saved.copy()
    plus[3, 5] = 0.0
    assert emergency_common.check_state(restored(plus), abstract) == 2  # both slices hold that column
    other = saved.copy()
    other.view(np.uint16)[0, 0] ^= 1
    with pytest.raises(ValueError, match="attn: shard .* differs from what was saved"):
        emergency_common.check_state(restored(other), abstract)
