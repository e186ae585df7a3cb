"""Erasure coding in the coordinator's state (``--redundancy ec:K+M``, issue 35): parity tasks, completeness by
rebuildability, parity GC, restore plans naming a parity source, and a restarted coordinator's view."""

import itertools

import pytest

from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.erasure.placement import code_groups
from replicator.erasure.redundancy import Redundancy
from replicator.tiers import Holding, Tier, inventory_digest, inventory_key

SIZE = 300
PARITY_SIZE = 100

# (slices, hosts per slice, K, M): 3+1 on one slice of 4 hosts; 4+2 on 6 hosts in 2 and in 3 slices.
SHAPES = [(1, 4, 3, 1), (2, 3, 4, 2), (3, 2, 4, 2)]


def ec_state(d, h, k, m, incarnation=1):
    st = CoordinatorState(JobTopology(d * h, d, 0), Redundancy.ec(k, m))
    for r in range(d * h):
        st.register(r, incarnation)
        st.report_inventory(r, [], incarnation)
    return st


def save(st, step, ranks=None, tag=""):
    for r in ranks if ranks is not None else range(st.topology.nodes):
        st.report_committed(r, Holding(r, step, f"s{step}-r{r}{tag}", SIZE))


def parity_holding(rank, step, spec, content_hash=None):
    return Holding(rank, step, content_hash or spec.digest(), PARITY_SIZE, Tier.PARITY, group=spec)


def compute_parity(st, ranks=None):
    """What the daemons do with their ParityTasks: compute and report the parity."""
    done = []
    for r in ranks if ranks is not None else range(st.topology.nodes):
        for step, spec in st.ec.tasks_for(r):
            st.report_committed(r, parity_holding(r, step, spec))
            done.append((r, step))
    return done


def lose(st, ranks):
    for r in ranks:
        st.forget_host(r)


def assert_same_view(a, b, steps):
    for step in steps:
        assert a.sources(step) == b.sources(step)
        assert a.is_complete(step) == b.is_complete(step)
        assert a.is_redundant(step) == b.is_redundant(step)
        assert a.ec.rebuild_ranks(step) == b.ec.rebuild_ranks(step)
    assert a.globally_complete_steps() == b.globally_complete_steps()
    for r in range(a.topology.nodes):
        assert a.ec.tasks_for(r) == b.ec.tasks_for(r)
        assert a.ec.gc_for(r, 2) == b.ec.gc_for(r, 2)
        assert a.gc_for(r, 2) == b.gc_for(r, 2)
    assert a.restore_plan(restoring=False) == b.restore_plan(restoring=False)


# ------------------------------------------------------------------------------------------ construction


def test_redundancy_defaults_to_the_topologys_copies_and_is_checked():
    assert str(CoordinatorState(JobTopology(4, 2, 1)).redundancy) == "copies:1"
    assert CoordinatorState(JobTopology(4, 2, 1), Redundancy.copies_of(1)).redundancy.copies == 1
    with pytest.raises(ValueError, match="contradicts the topology's 1 replicas"):
        CoordinatorState(JobTopology(4, 2, 1), Redundancy.copies_of(2))
    with pytest.raises(ValueError, match=r"ec:3\+1 needs at least 4 hosts \(K \+ M\); the job has 3"):
        CoordinatorState(JobTopology(3, 1, 0), Redundancy.ec(3, 1))
    with pytest.raises(ValueError, match="does not support elastic training"):
        CoordinatorState(JobTopology(4, 1, 0), Redundancy.ec(3, 1), elastic=True)
    CoordinatorState(JobTopology(4, 1, 0), Redundancy.copies_of(0), elastic=True)  # copies: fine


def test_an_elastic_save_is_refused_in_ec_mode_with_a_clear_error():
    st = ec_state(1, 4, 3, 1)
    with pytest.raises(ValueError, match="elastic save.*does not support elastic saves"):
        st.report_committed(0, Holding(0, 1, "a", SIZE, savers=((0, 2),)))
    st.report_committed(0, Holding(0, 1, "a", SIZE, savers=((0, 3),)))  # every rank saved it: fine


def test_parity_holding_validation():
    g = code_groups(1, 4, 3, 1)[0]
    from replicator.erasure.wire import CodeGroupSpec
    spec = CodeGroupSpec(3, 1, g.members, ("a", "b", "c", "d"), ("x:1", "", "", ""))
    h = parity_holding(1, 5, spec)
    assert h.group.addresses == ("",) * 4  # addresses are not part of what is held
    assert Holding.from_dict(h.to_dict()) == h
    assert inventory_key(h) != inventory_key(Holding(1, 5, "b", SIZE))
    assert inventory_digest([h]) != inventory_digest([parity_holding(1, 5, spec, content_hash="ec1-other")])
    with pytest.raises(ValueError, match="needs its code group"):
        Holding(1, 5, spec.digest(), 1, Tier.PARITY)
    with pytest.raises(ValueError, match="not in"):
        parity_holding(7, 5, spec)
    with pytest.raises(ValueError, match="only a parity holding"):
        Holding(1, 5, "b", 1, Tier.LOCAL, group=spec)
    st = ec_state(1, 4, 3, 1)
    with pytest.raises(ValueError, match="reports parity as rank 1's"):
        st.report_committed(0, h)


# ------------------------------------------------------------------------------------------ parity tasks


@pytest.mark.parametrize("d,h,k,m", SHAPES)
def test_parity_tasks_once_every_member_holds_the_step_and_no_whole_copies(d, h, k, m):
    st = ec_state(d, h, k, m)
    nodes = d * h
    save(st, 1, range(nodes - 1))
    assert all(st.ec.tasks_for(r) == [] for r in range(nodes))  # a member lacks the step
    assert not st.is_complete(1)
    save(st, 1, [nodes - 1])
    assert st.is_complete(1) and not st.is_redundant(1) and not st.ec.parity_complete(1)
    assert st.replication_plan(1) == []  # ec mode: no whole copies of differing data
    for r in range(nodes):
        ((step, spec),) = st.ec.tasks_for(r)
        assert step == 1 and (spec.k, spec.m) == (k, m) and r in spec.members
        assert spec.hash_of(r) == f"s1-r{r}" and spec.addresses == ("",) * len(spec.members)
    compute_parity(st, range(nodes - 1))
    assert not st.is_redundant(1)  # the last member's parity is missing
    assert [st.ec.tasks_for(r) for r in range(nodes - 1)] == [[]] * (nodes - 1)
    compute_parity(st)
    assert st.is_redundant(1) and st.ec.parity_complete(1) and st.newest_redundant_step() == 1
    assert all(st.ec.tasks_for(r) == [] for r in range(nodes))


def test_identical_data_parallel_replicas_still_get_hash_only_attestations_in_ec_mode():
    st = ec_state(2, 3, 4, 2)
    for r in range(6):
        st.report_committed(r, Holding(r, 1, f"i{r % 3}", SIZE))
    tasks = st.replication_plan(1)
    assert tasks and all(t.hash_only for t in tasks)


# ------------------------------------------------------------------------------------------ completeness


@pytest.mark.parametrize("d,h,k,m", SHAPES)
def test_complete_with_up_to_m_members_lost_and_not_with_m_plus_1(d, h, k, m):
    nodes = d * h
    for lost_count in range(m + 2):
        for lost in itertools.combinations(range(nodes), lost_count):
            st = ec_state(d, h, k, m)
            save(st, 1)
            compute_parity(st)
            lose(st, lost)
            if lost_count <= m:
                assert st.is_complete(1), lost
                assert st.ec.rebuild_ranks(1) == sorted(lost)
                for x in lost:
                    (src,) = st.rank_sources(1, x)
                    assert src.kind is Tier.PARITY and src.content_hash == f"s1-r{x}"
                    assert src.holder_rank is None and x in src.group.members
                    assert set(src.helpers) == set(src.group.members) - set(lost)  # n = K + M: all the others
                assert not st.is_redundant(1) or lost_count == 0
            else:
                assert not st.is_complete(1), lost
                assert st.missing_ranks(1), lost


def test_two_code_groups_are_coded_and_lost_apart():
    st = ec_state(2, 4, 3, 1)  # 8 hosts at 3+1: two groups of 4, each across both slices
    groups = code_groups(2, 4, 3, 1)
    assert [g.members for g in groups] == [(0, 4, 1, 5), (2, 6, 3, 7)]
    save(st, 1, groups[0].members)  # only the first group's members saved so far
    # Every group codes the same step (ParityView.coding_step): none before each group holds it.
    assert {r for r in range(8) if st.ec.tasks_for(r)} == set()
    save(st, 1, groups[1].members)
    assert {r for r in range(8) if st.ec.tasks_for(r)} == set(range(8))
    compute_parity(st)
    assert st.is_redundant(1)
    lose(st, [0, 7])  # one member of each group: both rebuildable
    assert st.is_complete(1) and st.ec.rebuild_ranks(1) == [0, 7]
    assert set(st.rank_sources(1, 0)[0].helpers) == {1, 4, 5}
    lose(st, [5])  # a second member of the first group
    assert not st.is_complete(1) and st.missing_ranks(1) == [0, 5]


def test_a_group_wider_than_k_plus_m_survives_m_losses():
    st = ec_state(1, 5, 3, 1)  # one group of 5 at 3+1: rotations of 4 hosts among 5
    save(st, 1)
    compute_parity(st)
    for x in range(5):
        other = ec_state(1, 5, 3, 1)
        save(other, 1)
        compute_parity(other)
        lose(other, [x])
        (src,) = other.rank_sources(1, x)
        assert src.kind is Tier.PARITY and x not in src.helpers and other.is_complete(1)


def test_a_lost_parity_holder_counts_against_rebuilding():
    st = ec_state(1, 4, 3, 1)
    save(st, 1)
    compute_parity(st)
    # Rank 0 lost: each of ranks 1, 2, 3 holds the parity of one of the three rotations rank 0 gives data to.
    st.ec.report_removed(1, [1])
    lose(st, [0])
    assert not st.is_complete(1) and st.missing_ranks(1) == [0]
    st.report_committed(1, parity_holding(1, 1, st_group_spec(st, 1, {0: "s1-r0"})))
    assert st.is_complete(1) and st.ec.rebuild_ranks(1) == [0]


def st_group_spec(st, step, lost_hashes):
    """The planned spec of the code group of ``step`` as it was before ``lost_hashes``' owners were lost."""
    from replicator.erasure.wire import CodeGroupSpec
    g = code_groups(st.topology.data_parallelism, st.topology.hosts_per_slice, 3, 1)[0]
    hashes = tuple(lost_hashes.get(r, f"s{step}-r{r}") for r in g.members)
    return CodeGroupSpec(3, 1, g.members, hashes, ("",) * g.n)


def test_corrupt_parity_does_not_count_and_is_deleted():
    st = ec_state(1, 4, 3, 1)
    save(st, 1)
    compute_parity(st, [0, 2, 3])
    ((_, spec),) = st.ec.tasks_for(1)
    bad = parity_holding(1, 1, spec, content_hash="ec1-00000000000000000000000000000000")
    st.report_committed(1, bad)
    assert not st.is_redundant(1)
    assert st.ec.tasks_for(1) == [(1, spec)]  # still lacks parity that counts
    assert st.ec.gc_for(1, 2) == [bad]  # deleted whatever protects its step (the newest complete one)
    lose(st, [0])
    assert not st.is_complete(1)  # the corrupt parity is no fragment


def test_a_resave_makes_old_parity_obsolete_new_tasks_go_out_and_the_old_parity_is_deleted():
    st = ec_state(1, 4, 3, 1)
    save(st, 1)
    compute_parity(st)
    old = {r: st.ec.parity_of(r)[0] for r in range(4)}
    st.report_committed(2, Holding(2, 1, "s1-r2-again", SIZE))  # rank 2 saved step 1 again, other bytes
    assert not st.is_redundant(1)
    for r in range(4):
        ((_, spec),) = st.ec.tasks_for(r)
        assert spec.hash_of(2) == "s1-r2-again" and spec.digest() != old[r].content_hash
        assert st.ec.gc_for(r, 2) == [old[r]]
    lose(st, [0])
    assert not st.is_complete(1)  # the old parity rebuilds nothing of the new save
    st2 = ec_state(1, 4, 3, 1)
    save(st2, 1)
    compute_parity(st2)
    st2.report_committed(2, Holding(2, 1, "s1-r2-again", SIZE))
    compute_parity(st2)  # the new parity replaces the old one (same step: one parity holding per host)
    assert st2.is_redundant(1) and all(st2.ec.gc_for(r, 2) == [] for r in range(4))


def test_a_parity_deletion_in_flight_counts_for_nothing_until_the_holder_reports():
    st = ec_state(1, 4, 3, 1)
    save(st, 1)
    compute_parity(st)
    lose(st, [0])
    assert st.is_complete(1)
    st.ec.deleting(1, [1])
    assert not st.is_complete(1) and st.ec.deletions_in_flight() == {1: [1]}
    assert st.ec.gc_for(1, 2) == []  # not ordered twice
    st.deletions_acted(1)  # it kept it (e.g. a task was using it)
    assert st.is_complete(1) and st.ec.deletions_in_flight() == {}


# ------------------------------------------------------------------------------------------ GC


def test_gc_removes_parity_with_its_step_and_keeps_the_newest_redundant_steps():
    st = ec_state(1, 4, 3, 1)
    for step in (1, 2, 3):
        save(st, step)
        compute_parity(st)
    for r in range(4):
        assert st.gc_for(r, 2) == [(r, 1)]
        assert [(h.owner_rank, h.step, h.tier) for h in st.ec.gc_for(r, 2)] == [(r, 1, Tier.PARITY)]
    for r in range(4):
        st.report_removed(r, [(r, 1)])
        st.ec.report_removed(r, [1])
    save(st, 4)  # step 4 complete, no parity yet: step 3 (every group with its parity) stays
    assert st.newest_complete_step() == 4 and st.newest_redundant_step() == 3
    for r in range(4):
        assert st.gc_for(r, 2) == [(r, 2)]
        assert [h.step for h in st.ec.gc_for(r, 2)] == [2]


def test_parity_in_copies_mode_counts_for_nothing_and_is_deleted():
    st = CoordinatorState(JobTopology(4, 1, 1))
    for r in range(4):
        st.register(r, 1)
        st.report_inventory(r, [])
    save(st, 1)
    spec = st_group_spec(st, 1, {})
    h = parity_holding(0, 1, spec)
    st.report_committed(0, h)
    assert st.ec.tasks_for(0) == [] and st.ec.gc_for(0, 2) == [h]
    assert st.holdings_of(0) == [Holding(0, 1, "s1-r0", SIZE)]  # the parity is not a data holding


# ------------------------------------------------------------------------------------------ restore


@pytest.mark.parametrize("d,h,k,m", SHAPES)
def test_restore_plan_names_a_parity_source_for_a_replaced_host(d, h, k, m):
    st = ec_state(d, h, k, m)
    save(st, 1)
    compute_parity(st)
    save(st, 2)  # step 2 has no parity yet: not rebuildable once a host is lost
    lose(st, [1])
    st.register(1, 2)  # the replacement, its RAM disk empty
    st.report_inventory(1, [], 2)
    assert st.globally_complete_steps() == [1]
    plan = st.restore_plan(restoring=False)
    assert plan.step == 1 and "1 parity" in plan.reason
    src = plan.sources[1]
    assert src.kind is Tier.PARITY and src.owner_rank == 1 and src.content_hash == "s1-r1"
    assert 1 not in src.helpers and len(src.helpers) >= k
    assert all(plan.sources[r].kind is Tier.LOCAL for r in range(d * h) if r != 1)
    # With the bucket holding step 1 too, the rebuild comes before the download.
    st.report_backup(1, content_hashes={r: f"s1-r{r}" for r in range(d * h)})
    assert [s.kind for s in st.rank_sources(1, 1)] == [Tier.PARITY, Tier.BUCKET]
    # The restore landed: rank 1 holds its data again and gets its parity task (its parity was lost with it).
    st.report_committed(1, Holding(1, 1, "s1-r1", SIZE), 2)
    assert [s.kind for s in st.rank_sources(1, 1)] == [Tier.LOCAL, Tier.BUCKET]
    assert [step for step, _ in st.ec.tasks_for(1)] == [1]  # not step 2: rank 1 does not hold it
    compute_parity(st)
    assert st.is_redundant(1) and not st.is_complete(2)


def test_a_definitive_hash_other_than_the_groups_is_not_rebuilt():
    st = ec_state(1, 4, 3, 1)
    save(st, 1)
    compute_parity(st)
    lose(st, [0])
    st.report_backup(1, content_hashes={r: ("other" if r == 0 else f"s1-r{r}") for r in range(4)})
    assert [s.kind for s in st.rank_sources(1, 0)] == [Tier.BUCKET]


# ------------------------------------------------------------------------------------------ restart


@pytest.mark.parametrize("d,h,k,m", SHAPES)
def test_a_restarted_coordinator_reaches_the_same_view_from_full_reports(d, h, k, m):
    st = ec_state(d, h, k, m)
    for step in (1, 2):
        save(st, step)
        compute_parity(st)
    save(st, 3)
    compute_parity(st, [0])
    lose(st, range(m))  # M hosts lost: steps 1 and 2 rebuildable, step 3 not (it lacks parity)
    reports = {r: st.holdings_of(r) + st.ec.parity_of(r) for r in range(d * h) if r >= m}
    again = CoordinatorState(JobTopology(d * h, d, 0), Redundancy.ec(k, m))
    for r, held in reports.items():
        again.register(r, 7)
        again.report_inventory(r, held, 7)
    for r in range(m):
        again.forget_host(r)  # not heard from: declared lost
    assert again.globally_complete_steps() == [1, 2] == st.globally_complete_steps()
    assert again.ec.rebuild_ranks(2) == list(range(m))
    assert_same_view(st, again, [1, 2, 3])
    assert_same_view(st, st.rebuilt(), [1, 2, 3])


def test_incremental_views_equal_recomputation_through_losses_resaves_and_deletions():
    st = ec_state(2, 3, 4, 2)
    save(st, 1)
    compute_parity(st, [0, 1, 2, 3])
    assert_same_view(st, st.rebuilt(), [1])
    compute_parity(st)
    save(st, 2)
    st.report_committed(4, Holding(4, 1, "s1-r4-again", SIZE))
    assert_same_view(st, st.rebuilt(), [1, 2])
    compute_parity(st)
    lose(st, [5])
    st.ec.deleting(0, [2])
    assert_same_view(st, st.rebuilt(), [1, 2])
    st.deletions_acted(0)
    lose(st, [3])
    assert_same_view(st, st.rebuilt(), [1, 2])


# ------------------------------------------------------------------------------------------ property test

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

from replicator.coordinator.model import NotRegisteredError, StaleIncarnationError  # noqa: E402
from replicator.erasure.wire import CodeGroupSpec  # noqa: E402
from tests.replicator.coordinator import test_incremental as inc  # noqa: E402

EC_SHAPES = [(JobTopology(4, 1, 0), 3, 1), (JobTopology(6, 2, 0), 4, 2), (JobTopology(6, 3, 0), 4, 2)]


def ec_event(n):
    rank, step = hst.integers(0, n - 1), hst.sampled_from(inc.STEPS)
    return hst.one_of(
        inc.event(n),
        # A host's parity of a step for the data saved with one of the hashes (corrupt: a wrong digest).
        hst.tuples(hst.just("parity"), rank, step, hst.sampled_from(inc.HASHES), hst.booleans()),
        hst.tuples(hst.just("parity"), rank, step, hst.sampled_from(inc.HASHES), hst.just(False)),
        # A whole save with every member's parity (so that losses leave ranks to rebuild).
        hst.tuples(hst.just("ec_save"), step, hst.sampled_from(inc.HASHES)),
        hst.tuples(hst.just("ec_save"), step, hst.sampled_from(inc.HASHES)),
        hst.tuples(hst.just("forget"), rank),
        hst.tuples(hst.just("parity_removed"), rank, hst.lists(step, max_size=2)),
        hst.tuples(hst.just("deleting_parity"), rank, hst.lists(step, max_size=2)),
    )


def ec_apply(s, ev, k, m):
    kind = ev[0]
    if kind == "parity":
        _, rank, step, h, corrupt = ev
        (g,) = [g for g in s._facts.code_groups if rank in g.members]
        spec = CodeGroupSpec(k, m, g.members, tuple(f"{h}{y}" for y in g.members), ("",) * g.n)
        s.report_committed(rank, parity_holding(rank, step, spec, content_hash="ec1-bad" if corrupt else None))
    elif kind == "ec_save":
        _, step, h = ev
        for r in s.registered:
            s.report_committed(r, Holding(r, step, f"{h}{r}", 10))
        for r in s.registered:
            ec_apply(s, ("parity", r, step, h, False), k, m)
    elif kind == "parity_removed":
        s.ec.report_removed(ev[1], ev[2])
    elif kind == "deleting_parity":
        s.ec.deleting(ev[1], ev[2])
    else:
        inc.apply(s, ev)


def ec_answers(s):
    n = s.topology.nodes
    return {**inc.answers(s),
            "parity_tasks": {r: s.ec.tasks_for(r) for r in range(n)},
            "parity_gc": {(r, k): s.ec.gc_for(r, k) for r in range(n) for k in (1, 2)},
            "rebuild": {step: s.ec.rebuild_ranks(step) for step in inc.STEPS},
            "parity_complete": {step: s.ec.parity_complete(step) for step in inc.STEPS}}


@hst.composite
def ec_scenario(draw):
    topo, k, m = draw(hst.sampled_from(EC_SHAPES))
    return topo, k, m, draw(hst.lists(ec_event(topo.nodes), min_size=8, max_size=40))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ec_scenario())
def test_ec_incremental_views_equal_recomputation_from_scratch(case):
    topo, k, m, events = case
    s = CoordinatorState(topo, Redundancy.ec(k, m))
    for r in range(topo.nodes):
        s.register(r, 2)
    for i, ev in enumerate(events):
        before = s.version
        try:
            ec_apply(s, ev, k, m)
        except (ValueError, NotRegisteredError, StaleIncarnationError):
            assert s.version == before, f"rejected event {ev} changed the state"
        if i % 7 == 6:
            assert ec_answers(s) == ec_answers(s.rebuilt()), events[: i + 1]
    assert ec_answers(s) == ec_answers(s.rebuilt()), events
