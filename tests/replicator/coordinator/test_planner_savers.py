"""The planner's elastic rules: completeness over each step's savers, newer saves supersede older ones."""

from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding, Tier


def state() -> CoordinatorState:
    st = CoordinatorState(JobTopology(4, 2, 1))
    for r in range(4):
        st.register(r, 1)
    return st


def test_step_saved_by_one_slice_is_complete_over_its_savers():
    st = state()
    for r in (0, 1):
        st.report_inventory(r, [Holding(r, 6, f"h{r}", 10, Tier.LOCAL, 7, ((0, 1),))])
    assert st.expected_ranks(6) == [0, 1]
    assert st.is_complete(6) and st.newest_complete_step() == 6
    assert sorted(st.restore_plan(restoring=False).sources) == [0, 1]
    # Without savers the same holdings would be incomplete (ranks 2, 3 missing).
    st2 = state()
    for r in (0, 1):
        st2.report_inventory(r, [Holding(r, 6, f"h{r}", 10, Tier.LOCAL)])
    assert not st2.is_complete(6)


def test_newer_save_of_a_step_supersedes_and_rollback_abandons_newer_steps():
    st = state()
    inv = {r: [Holding(r, s, f"old{r}{s}", 10, Tier.LOCAL, s) for s in (4, 8)] for r in range(4)}
    for r in range(4):
        st.report_inventory(r, inv[r])
    assert st.newest_complete_step() == 8
    # Rolled back to 4 on slice 0 and saved step 6 there (generation 100 > 8): step 8 is abandoned.
    for r in (0, 1):
        st.report_inventory(r, inv[r] + [Holding(r, 6, f"new{r}", 10, Tier.LOCAL, 100, ((0, 1),))])
    assert st.is_abandoned(8) and not st.is_complete(8)
    assert st.newest_complete_step() == 6
    gc = st.gc_plan(keep_local=5)
    assert all((r, 8) in gc.get(r, []) for r in range(4))
    # Step 4 saved again (generation 200): the copies of the old save no longer count.
    for r in (0, 1):
        st.report_inventory(r, [Holding(r, 4, f"again{r}", 10, Tier.LOCAL, 200, ((0, 1),))])
    assert st.expected_ranks(4) == [0, 1]
    assert {s.content_hash for srcs in st.sources(4).values() for s in srcs} == {"again0", "again1"}


def test_copies_of_an_abandoned_save_of_the_newest_step_are_collected():
    """Step 6 saved again after a rollback is the newest complete step, which GC never touches; a peer copy
    of its abandoned save (a copy that was landing while the step was saved again) still goes, or hosts
    lacking that rank's data are handed the abandoned manifest."""
    st = state()
    for r in range(4):
        st.report_inventory(r, [Holding(r, 6, f"old{r}", 10, Tier.LOCAL, 5)])
    assert st.newest_complete_step() == 6
    for r in range(4):
        held = [Holding(r, 6, f"new{r}", 10, Tier.LOCAL, 9)]
        if r == 0:
            held.append(Holding(2, 6, "old2", 10, Tier.PEER, 5))
        st.report_inventory(r, held)
    assert st.newest_complete_step() == 6 and st.step_generation(6) == 9
    assert st.gc_for(0, keep_local=2) == [(2, 6)]
    assert all(st.gc_for(r, keep_local=2) == [] for r in (1, 2, 3))
    st.pin(6)
    assert st.gc_for(0, keep_local=2) == [(2, 6)]
