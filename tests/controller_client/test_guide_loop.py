"""The Pathways guide's elastic loop as written, with our CheckpointManager directly underneath, on the
simulated Pathways (2 slices x 2 hosts x 2 devices, real replicators, real pathwaysutils and Orbax's real
Snapshotter): controller_client/demo/guide_loop.py.

The story: slice 1 lost after step 9's checkpoint (the newest snapshot is step 8) -> the retry restores the
snapshot and trains forward, re-saving steps already saved (skipped, as Orbax's manager skips them; before,
``FileExistsError`` ended the job) -> slice 1 back, in-place scale-up -> the controller process restarts (no
snapshot: restore from the RAM disks) with slice 1 replaced by empty hosts (ranks 2-3 restore from their
peers). Losses equal an uninterrupted run's.
"""

from __future__ import annotations

import logging

import pytest

from controller_client.demo.guide_loop import GuideSchedule, train_guide_loop
from tests.controller_client.test_pathways_sim import sim  # noqa: F401  (fixture)
from tests.controller_client.test_pathways_sim_elastic import assert_losses_equal, slices  # noqa: F401  (fixture)
from tests.replicator.conftest import cluster_factory  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def test_guide_loop_as_written_through_loss_scale_up_restart_and_replacement(sim, slices, caplog):  # noqa: F811
    pytest.importorskip("orbax.checkpoint.experimental.v1.training.pathways")
    caplog.set_level(logging.INFO)
    sched = GuideSchedule()
    events: list[str] = []
    got = train_guide_loop(slices.cluster, sched, slices, events)
    assert events[:6] == ["attempt on slices [0, 1]", "save(3) -> True", "save(6) -> True", "save(9) -> True",
                          "slice 1 lost before step 10", "attempt on slices [0]"], events
    assert events[6] == "restored step 8 from the snapshot onto 1 slice(s)", events
    # Training forward from the snapshot: step 9 is saved already (skipped, not an error), 12 is new.
    assert events[7] == "save(9) -> False", events
    assert "slice 1 is back before step 12" in events and "scale up in place at step 11: slices [0, 1]" in events
    assert "save(12) -> True" in events
    restart = next(i for i, e in enumerate(events) if e.startswith("controller restarts"))
    assert events[restart + 1:restart + 3] == ["attempt on slices [0, 1]",
                                               "restored step 12 from the checkpoint onto 2 slice(s)"], events
    assert events[-1] == "save(15) -> True", events
    assert_losses_equal(got, "replicated", sched.total_steps)
    # Skipped once, logged once; the elastic event was the loop's own slice-down error.
    skipped = [r for r in caplog.records if "not saved again" in r.getMessage()]
    assert len(skipped) == 1 and "step 9" in skipped[0].getMessage()
    retried = [r.getMessage() for r in caplog.records
               if r.name == "pathwaysutils.elastic.manager" and "Elastic event" in r.getMessage()]
    assert retried == ["Elastic event detected: DATA_LOSS: slice 1 is down (simulated)"], retried
