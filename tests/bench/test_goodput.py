"""``bench.goodput``: the arithmetic of its schedule, intervals and ETTR, and a smoke run of every system.

The smoke run (a 2 MiB state, 8 s per system) times nothing: it checks that the harness runs the whole job
for each system through real failures (4 real JAX processes per incarnation, our real replicators restarted
with every Pod) and reports every key; and that our system survives every failure it met. The fast tests
check the fair rules: the copy a corruption hits, the operator's roll-back, the comparison's keys.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from bench import goodput, goodput_faults, goodput_run, goodput_worker
from bench.children import bound_to_us, scratch_dir
from bench.emergency_common import REPO


def test_the_schedule_is_seeded_covers_every_kind_first_and_fails_whole_slices():
    a = goodput_run.schedule(4, 40, 8)
    assert a == goodput_run.schedule(4, 40, 8)
    assert a != goodput_run.schedule(5, 40, 8)
    assert all(0 < f.at_seconds < 40 for f in a)
    assert [f.at_seconds for f in a] == sorted(f.at_seconds for f in a)
    long = goodput_run.schedule(0, 100_000, 10)
    assert 9_500 <= len(long) <= 10_500  # exponential gaps of mean 10 s
    for i in range(0, 5 * 50, 5):  # each cycle of 5 holds every kind once
        assert sorted(f.kind for f in long[i:i + 5]) == sorted(goodput_run.KINDS)
    for f in long[:200]:
        if f.kind in ("slice_lost", "preemption"):
            assert f.hosts in ((0, 1), (2, 3))
        elif f.kind == "job_restart":
            assert f.hosts == ()
        else:
            assert len(f.hosts) == 1 and 0 <= f.hosts[0] < 4
    with pytest.raises(ValueError):
        goodput_run.schedule(0, 10, 0)


def test_young_daly_interval_from_the_blocking_save_cost_never_below_a_whole_save():
    seconds, steps = goodput_worker.young_daly(0.5, 1.0, 120, 1.0)
    assert seconds == pytest.approx(math.sqrt(2 * 0.5 * 120))  # 10.95 s
    assert steps == 11
    assert goodput_worker.young_daly(0.01, 3.0, 8, 0.3) == (3.0, 10)  # sqrt(0.16) = 0.4 s < the 3 s save
    assert goodput_worker.young_daly(0.0, 0.0, 8, 0.3) == (0.0, 1)
    assert goodput_worker.bucket_interval_steps(32, 0.3, 6) == 108  # 106.7 steps -> a multiple of 6
    assert goodput_worker.bucket_interval_steps(1, 0.3, 6) == 6
    with pytest.raises(ValueError):
        goodput_worker.young_daly(0.1, 0.2, 0, 1)


def test_ettr_and_the_comparison_with_the_best_orbax_manager():
    assert goodput.ettr(100, 0.3, 40) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        goodput.ettr(1, 0.3, 0)

    def rec(kind, downtime, lost, failed=None, detected=None):
        r = {"kind": kind, "downtime_seconds": downtime, "steps_lost": lost, "fetch_verify_load_seconds": 0.5,
             "phases": {p: downtime / 6 for p in goodput.PHASES if p != "failed_attempt"}}
        r |= {"corruption_detected": detected} if kind == "corrupt_copy" else {}
        return r | ({"failed": failed} if failed else {})

    systems = {
        "ours": {"ettr": 0.8, "failures": [rec("host_lost", 2.0, 1), rec("corrupt_copy", 3.0, 0, detected=True),
                                           rec("job_restart", 1.0, 0)]},
        "orbax_p2p": {"ettr": 0.7, "failures": [rec("host_lost", 4.0, 2),
                                                rec("corrupt_copy", 9.0, 9, "WrongRestore: x", detected=False),
                                                rec("job_restart", 1.5, 1)]},
        "orbax_emergency": {"ettr": 0.6, "failures": [rec("host_lost", 5.0, 3), rec("host_lost", 3.0, 1),
                                                      rec("corrupt_copy", 6.0, 1, detected=True)]},
        "orbax_standard": {"error": "RuntimeError: calibration"},
    }
    for r in systems.values():
        if "failures" in r:
            r["by_kind"] = goodput.by_kind(r["failures"])
    emergency = systems["orbax_emergency"]["by_kind"]["host_lost"]
    assert (emergency["count"], emergency["downtime_seconds"], emergency["steps_lost"]) == (2, 4.0, 4)
    assert emergency["fetch_verify_load_seconds"] == 0.5
    assert systems["orbax_p2p"]["by_kind"]["corrupt_copy"]["failed"] == "WrongRestore: x"
    got = goodput.compare(systems, replace_seconds=0.5)
    assert got["ettr_minus_best_orbax"] == pytest.approx(0.1)
    assert got["best_orbax"]["ettr"] == "orbax_p2p"
    assert got["downtime_host_lost_vs_best_orbax"] == 0.5  # 2.0 / min(4.0, mean(5.0, 3.0))
    # Every recovery finishes under the operator's policy: p2p's roll-back (9.0 s) counts, the least is 6.0 s.
    assert got["downtime_corrupt_copy_vs_best_orbax"] == 0.5
    assert got["best_orbax"]["corrupt_copy"] == "orbax_emergency"
    # The platform's replacement wait subtracted alike: (2.0 - 0.5) / (4.0 - 0.5), (1.0 - 0.5) / (1.5 - 0.5).
    assert got["controllable_downtime_host_lost_vs_best_orbax"] == round(1.5 / 3.5, 3)
    assert got["controllable_downtime_job_restart_vs_best_orbax"] == 0.5
    for kind in ("slice_lost", "preemption"):
        assert got[f"downtime_{kind}_vs_best_orbax"] is None
        assert got[f"controllable_downtime_{kind}_vs_best_orbax"] is None
    assert "controllable_downtime_corrupt_copy_vs_best_orbax" not in got
    corrupt = goodput.corruption(systems)
    assert corrupt["corrupt_copy_detected"] == {"ours": True, "orbax_p2p": False, "orbax_emergency": True,
                                                "orbax_standard": None}
    assert corrupt["corrupt_copy_steps_lost"] == {"ours": 0, "orbax_p2p": 9, "orbax_emergency": 1,
                                                  "orbax_standard": None}


def test_a_corrupt_copy_flips_bytes_of_the_largest_file_of_the_newest_committed_step(tmp_path):
    for rel, size in (("3/a.bin", 4000), ("3/b.bin", 100), ("4/x/small.bin", 10), ("4/x/big.bin", 2000),
                      ("5.orbax-checkpoint-tmp-1/huge.bin", 9000)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(bytes(size))
    got = goodput_faults.corrupt_newest(tmp_path)
    assert got.describe(tmp_path).startswith("step 4: 4/x/big.bin") and got.step_dir == tmp_path / "4"
    data = (tmp_path / "4/x/big.bin").read_bytes()
    assert data[1000:1064] == b"\xff" * 64 and data.count(0) == 2000 - 64
    assert (tmp_path / "3/a.bin").read_bytes() == bytes(4000)
    assert goodput_faults.corrupt_newest(tmp_path / "3/missing") is None


def _step(root, rel, size=100):
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(bytes(size))


def test_the_corruption_hits_the_copy_each_system_restores_first(tmp_path):
    _step(tmp_path, "local2/steps/6/0.0.bin")
    _step(tmp_path, "local2/peer/1/8/0.0.bin", 900)  # a peer's copy, newer and larger: not what host 2 reads
    _step(tmp_path, "local3/6/state/d/f")
    _step(tmp_path, "persistent/0/state/d/f")
    root = goodput_faults.restore_first_root
    assert root("ours", tmp_path, 2) == tmp_path / "local2/steps"
    assert root("orbax_p2p", tmp_path, 3) == tmp_path / "local3"
    # Orbax's emergency manager keeps no local copy on its primary slice: host 1's place in slice 1 is host 3.
    assert root("orbax_emergency", tmp_path, 1) == tmp_path / "local3"
    assert root("orbax_standard", tmp_path, 1) == tmp_path / "persistent"
    assert root("ours", tmp_path, 0) == tmp_path / "persistent"  # a replaced RAM disk: the bucket's copy
    with pytest.raises(ValueError):
        root("other", tmp_path, 0)


def test_the_operator_removes_the_bad_copy_then_every_copy_of_a_failed_step_then_everything(tmp_path):
    """The operator's policy after a failed or wrong restore: the newest intact step in any tier."""
    opts = goodput_run.RunOptions(system="orbax_p2p", mib=1, seconds=1, step_seconds=1, mtbf_seconds=1,
                                  replace_seconds=0, grace_seconds=0, bucket_seconds=1, failures=())
    h = goodput_run.Harness(opts, tmp_path)
    s = h.storage
    for rel in ("local0/8/f", "local1/8/f", "local0/6/f", "persistent/8/f", "persistent/1/4/f"):
        _step(s, rel)
    rec = {"kind": "corrupt_copy", "corrupt_step_dir": s / "local1/8", "planned_step": 8, "rolled_back": []}
    assert h._remove_bad(rec) == "copy local1/8"
    assert not (s / "local1/8").exists() and (s / "local0/8").exists()
    rec["rolled_back"].append("copy local1/8")
    assert h._remove_bad(rec) == "step 8: local0/8, persistent/8"
    assert (s / "local0/6").exists()
    rec = {"kind": "unprovoked", "rolled_back": []}
    assert h._remove_bad(rec) == "nothing (a restart)"
    rec = {"kind": "unprovoked", "rolled_back": ["a", "b"]}
    assert h._remove_bad(rec) == "everything (from scratch)"
    assert list(s.iterdir()) == []
    _step(s, "local2/peer/1/8/f")
    _step(s, "local2/steps/1/f")
    assert goodput_faults.remove_step(s, 1) == ["local2/steps/1"]  # peer/1 is a rank's folder, not a step
    assert (s / "local2/peer/1/8/f").exists()


def test_fetch_verify_load_counts_every_span_of_data_work_once():
    assert goodput_run.covered([(5.0, 6.0), (1.0, 2.0), (1.5, 3.0)], 0.0) == pytest.approx(3.0)
    assert goodput_run.covered([(0.0, 2.0), (4.0, 5.0)], 1.0) == pytest.approx(2.0)
    assert goodput_run.covered([], 0.0) == 0.0


def _recording_harness(tmp_path, trainer_start: str, serving_after: float) -> tuple[goodput_run.Harness, list]:
    """A harness of ours whose Pods only record when they start (the slow test below runs the real ones)."""
    import time

    opts = goodput_run.RunOptions(system="ours", mib=1, seconds=1, step_seconds=1, mtbf_seconds=1, replace_seconds=0,
                                  grace_seconds=1, bucket_seconds=1, failures=(), probe_seconds=0.1,
                                  trainer_start=trainer_start)
    h = goodput_run.Harness(opts, tmp_path)
    log: list = []
    started: dict[int, float] = {}

    def start(host: int) -> None:
        started[host] = time.monotonic()
        h.reps.procs[host] = None
        log.append(("replicator", host, started[host]))

    def serving(host: int) -> bool:
        return time.monotonic() >= started[host] + serving_after

    def start_rank(rank: int) -> None:
        h.job.procs.append(None)
        log.append(("train", rank, time.monotonic()))

    h.reps.start, h.reps.serving, h.job.start_rank = start, serving, start_rank
    return h, log


@pytest.mark.parametrize("trainer_start", goodput_run.TRAINER_STARTS)
def test_our_trainers_start_with_their_replicators_or_after_the_startup_probe(tmp_path, trainer_start):
    h, log = _recording_harness(tmp_path, trainer_start, serving_after=0.25)
    t0 = h._start_pods()
    assert [host for kind, host, _ in log if kind == "replicator"] == [0, 1, 2, 3]
    assert [host for kind, host, _ in log if kind == "train"] == [0, 1, 2, 3]
    rep = {host: t for kind, host, t in log if kind == "replicator"}
    for kind, host, t in log:
        if kind != "train":
            continue
        if trainer_start == "with-replicator":  # the Pod's sidecar process first, then at once its trainer
            assert t - rep[host] < 0.2
        else:  # the first probe (every 0.1 s from the Pods' start) after its replicator served
            assert t >= rep[host] + 0.25 and t >= t0 + 0.3
    assert goodput_run.deploy("csi", 0.1, trainer_start)["trainer_start"] == trainer_start
    assert ("startup_probe_seconds" in goodput_run.deploy("csi", 0.1, trainer_start)) == (trainer_start == "after-probe")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_every_system_runs_the_same_failures_and_reports_every_key():
    """Seed 3 at 8 s: host 0 lost (ours: the coordinator's host) at 1.1 s, a preemption of slice 1 due at
    4.8 s (injected if the job is up again before the end)."""
    run = scratch_dir("mtc-gp-")
    try:
        proc = subprocess.run(bound_to_us([sys.executable, "-m", "bench.goodput", "--mib", "2", "--seconds", "8",
                               "--step-seconds", "0.3", "--mtbf-seconds", "4", "--replace-seconds", "0.2",
                               "--grace-seconds", "5", "--seed", "3", "--keep", str(run / "run")]),
                              capture_output=True, text=True, timeout=400, cwd=str(REPO))
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["schedule"][0] == {"at_seconds": 1.087, "kind": "host_lost", "hosts": [0]}
    assert set(result["systems"]) == set(goodput_worker.SYSTEMS)
    for name, r in result["systems"].items():
        assert "error" not in r, (name, r["error"])
        assert r["interval_steps"] >= 1 and r["save_full_seconds"] >= r["save_block_seconds"] > 0
        assert 0 <= r["ettr"] <= 1
        # Host 0 lost, 1.1 s in: a finished recovery, or one the end cut (a slow box: CI once took Orbax's
        # emergency manager more than the 6.9 s left to its first step).
        recovered = r["failures"] + ([r["cut_at_deadline"]] if "cut_at_deadline" in r else [])
        assert recovered and recovered[0]["kind"] == "host_lost" and recovered[0]["hosts"] == [0], name
        for f in r["failures"]:
            assert f["downtime_seconds"] > 0 and f["phases"]["restart"] > 0
            assert f["steps_lost"] >= 0
        assert set(r["by_kind"]) <= set(goodput_run.KINDS)
    assert not any("failed" in f for f in result["systems"]["ours"]["failures"])
    assert result["deploy"]["mode"] == "multi-controller-native" and result["deploy"]["ramdisk"] == "csi"
    assert result["deploy"]["trainer_start"] == "with-replicator"  # as rendered: the manager waits for it
    for name, r in result["systems"].items():
        for f in r["failures"]:
            assert set(f["phases"]) <= set(goodput.PHASES) and "restore" in f["phases"], name
            assert 0 <= f["fetch_verify_load_seconds"] <= f["downtime_seconds"], name
    assert set(result["corrupt_copy_detected"]) == set(result["corrupt_copy_steps_lost"]) == set(result["systems"])
    for kind in goodput.CONTROLLABLE_KINDS:
        assert f"controllable_downtime_{kind}_vs_best_orbax" in result
    assert -1 <= result["ettr_minus_best_orbax"] <= 1
    ours_kinds = result["systems"]["ours"]["by_kind"]
    if "host_lost" in ours_kinds and any("host_lost" in r["by_kind"] for n, r in result["systems"].items()
                                         if n != "ours"):
        assert result["downtime_host_lost_vs_best_orbax"] > 0
    for kind in goodput_run.KINDS:
        assert f"downtime_{kind}_vs_best_orbax" in result
