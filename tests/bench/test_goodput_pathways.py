"""``bench.goodput --pathways``: its seeded loss schedule and summary, and a short run of both systems.

The short run (a 2 MiB state, 20 s per system, slice 1 lost 6.2 s in and back 3 s later) times nothing: it
checks that both loops run on the simulated Pathways through a real slice loss (the survivors paused, were
restored and trained on, the slice rejoined) and that the JSON carries every key.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import goodput_pathways
from bench.children import bound_to_us, scratch_dir
from bench.emergency_common import REPO


def test_the_loss_schedule_is_seeded_and_leaves_each_slice_time_to_rejoin():
    a = goodput_pathways.slice_losses(3, 120, 120, 10)
    assert a == goodput_pathways.slice_losses(3, 120, 120, 10) == [(32.611, 0), (88.047, 1)]
    long = goodput_pathways.slice_losses(0, 50_000, 30, 5)
    gaps = [b[0] - a[0] for a, b in zip(long, long[1:], strict=False)]
    assert min(gaps) >= 5 + goodput_pathways.REJOIN_MARGIN_SECONDS
    assert {s for _, s in long} == {0, 1} and all(0 < t < 50_000 for t, _ in long)
    with pytest.raises(ValueError):
        goodput_pathways.slice_losses(0, 10, 0, 1)


def test_the_summary_is_ours_against_the_guides_orbax_path():
    ours = {"ettr": 0.9, "slice_lost_pause_median_seconds": 0.8}
    got = goodput_pathways.summary({"ours": ours, "orbax": {"ettr": 0.85}})
    assert got == {
        "pathways_slice_lost_pause_seconds": 0.8,
        "pathways_ettr": 0.9,
        "pathways_ettr_minus_orbax": 0.05,
    }
    got = goodput_pathways.summary({"ours": ours, "orbax": {"error": "exit 1"}})
    assert got["pathways_ettr"] == 0.9 and got["pathways_ettr_minus_orbax"] is None
    assert goodput_pathways.summary({"ours": {"error": "x"}})["pathways_ettr"] is None


def test_the_platform_ceiling_charges_each_loss_its_replacement_wait_on_one_slice_of_two():
    opts = goodput_pathways.PathwaysOptions(mib=1, seconds=120, step_seconds=0.3, mtbf_seconds=120,
                                            replace_seconds=10, poll_seconds=1, bucket_seconds=480,
                                            losses=((32.611, 0), (115.0, 1)))  # the second cut by the end
    assert goodput_pathways.platform_ceiling(opts) == round(1 - (10 + 5) / 2 / 120, 4)


def _assert_lost_paused_resumed_rejoined(name: str, r: dict) -> None:
    assert "error" not in r, (name, r["error"])
    lost, rejoins = ([e for e in r["events"] if e["kind"] == k] for k in ("slice_lost", "rejoin"))
    assert len(lost) == 1 and lost[0]["slice"] == 1 and lost[0]["at"] >= 6.218, (name, r["events"])
    loss = lost[0]
    # Paused: the survivors' next step came after a restore (re-jit included), not through the failure.
    assert r["slice_lost_pause_seconds"] == [loss["pause_seconds"]] and loss["pause_seconds"] > 0.3
    assert {"detect", "restore", "first_step"} <= set(loss["phases"]), (name, loss)
    assert loss["source"] == ("checkpoint" if name == "ours" else "snapshot")
    # The newest save, or the one before when the newest was not complete yet.
    assert (
        0 <= loss["steps_lost"] <= 2 * r["interval_steps"]
        and loss["restored_step"] <= loss["step_at_failure"]
    )
    # Resumed on the survivor, then on both slices again (in place for the guide's loop).
    assert len(rejoins) == 1 or "rejoined" in loss, (name, r["events"])
    if rejoins:
        assert rejoins[0]["step_at_rejoin"] > loss["restored_step"]
        assert rejoins[0]["source"] == "in place"  # both loops: mesh, device_put, no restore
    assert r["final_step"] > loss["step_at_failure"] + 5
    # Steps on one slice count half: fewer kept than trained since the clock started.
    assert r["steps_kept"] < r["final_step"] - 2 and 0 < r["ettr"] < 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_both_systems_lose_slice_1_pause_resume_and_rejoin():
    # A short folder: the replicators' control sockets live in it, and a Unix socket's path has at most 107
    # characters (pytest-xdist's tmp_path under /tmp/pytest-of-root/pytest-N/popen-gwK/... was one too long).
    keep = scratch_dir("mtc-gpw-test-")
    try:
        _run_and_check(keep)
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def _run_and_check(keep: Path) -> None:
    proc = subprocess.run(
        bound_to_us(
            [
                sys.executable,
                "-m",
                "bench.goodput",
                "--pathways",
                "--mib",
                "2",
                "--seconds",
                "20",
                "--mtbf-seconds",
                "10",
                "--replace-seconds",
                "3",
                "--poll-seconds",
                "0.5",
                "--seed",
                "9",
                "--keep",
                str(keep / "run"),
            ]
        ),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mode"] == "pathways" and result["deploy"]["mode"] == "pathways-simulated"
    assert result["schedule"] == [{"at_seconds": 6.218, "slice": 1}]
    assert set(result["systems"]) == {"ours", "orbax"}
    for name, r in result["systems"].items():
        _assert_lost_paused_resumed_rejoined(name, r)
    ours, orbax = result["systems"]["ours"], result["systems"]["orbax"]
    assert result["pathways_slice_lost_pause_seconds"] == ours["slice_lost_pause_median_seconds"]
    assert result["pathways_ettr"] == ours["ettr"]
    assert result["pathways_ettr_minus_orbax"] == pytest.approx(ours["ettr"] - orbax["ettr"], abs=1e-4)
    assert result["pathways_ettr_platform_ceiling"] == round(1 - 3 / 2 / 20, 4)
    assert max(ours["ettr"], orbax["ettr"]) < result["pathways_ettr_platform_ceiling"]
