"""Property test: the planner's incrementally maintained views equal a from-scratch recomputation."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.coordinator.model import NotRegisteredError, StaleIncarnationError
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding, Tier

TOPOLOGIES = [JobTopology(4, 2, 1), JobTopology(6, 3, 1), JobTopology(4, 1, 2), JobTopology(6, 2, 0)]
STEPS = [1, 2, 3]
HASHES = ["a", "b", "c"]


def answers(s: CoordinatorState) -> dict:
    """Every query a coordinator answers, for every host and step."""
    n = s.topology.nodes
    try:
        plan = s.restore_plan(restoring=False)
        restore = (plan.step, dict(plan.sources), plan.reason, plan.waiting_for)
    except ValueError as e:
        restore = str(e)
    return {
        "complete": s.globally_complete_steps(),
        "newest": s.newest_complete_step(),
        "sources": {step: s.sources(step) for step in s.known_steps()},
        "rank_sources": {(step, r): s.rank_sources(step, r) for step in STEPS for r in range(n)},
        "covered": {step: s.covered_count(step) for step in STEPS},
        "redundant": [step for step in s.known_steps() if s.is_redundant(step)],
        "replication": {step: s.replication_plan(step) for step in s.known_steps()},
        "tasks_for": {(step, r): s.tasks_for(r, step) for step in STEPS for r in range(n)},
        "gc": {k: s.gc_plan(k) for k in (1, 2)},
        "gc_for": {(r, k): s.gc_for(r, k) for r in range(n) for k in (1, 2)},
        "restore": restore,
        "status": s.status(),
    }


def event(n: int):
    rank = st.integers(0, n - 1)
    step = st.sampled_from(STEPS)
    tier = st.sampled_from([Tier.LOCAL, Tier.PEER, Tier.REPLICA])
    # Elastic saves too: a generation (a re-save after a rollback) and the savers' rank ranges.
    savers = st.sampled_from([(), ((0, 0),), ((0, n // 2 - 1),), ((n // 2, n - 1),), ((0, 0), (2, n - 1))])
    holding = st.builds(lambda o, s, h, t, g, sv: (o, s, h, t, g, sv), rank, step, st.sampled_from(HASHES), tier,
                        st.sampled_from([0, 0, 1, 2]), savers)
    return st.one_of(
        st.tuples(st.just("register"), rank, st.integers(1, 3)),
        st.tuples(st.just("commit"), rank, holding),
        st.tuples(st.just("commit"), rank, holding),
        st.tuples(st.just("commit"), rank, holding),
        # A whole save: every rank of a range commits its own data of a step (so steps often complete).
        st.tuples(st.just("save"), step, st.sampled_from(HASHES), st.sampled_from([0, 0, 1]), savers),
        st.tuples(st.just("save"), step, st.sampled_from(HASHES), st.just(0), st.just(())),
        st.tuples(st.just("remove"), rank, st.lists(st.tuples(rank, step), max_size=3)),
        st.tuples(st.just("inventory"), rank, st.lists(holding, max_size=4)),
        st.tuples(st.just("forget"), rank),
        st.tuples(st.just("backup"), step, st.booleans(), st.dictionaries(rank, st.sampled_from(HASHES))),
        st.tuples(st.just("backup_ranks"), step, st.dictionaries(rank, st.sampled_from(HASHES + [None]))),
        st.tuples(st.just("pin"), step, st.booleans()),
        st.tuples(st.just("backing_up"), step, st.booleans()),
        st.tuples(st.just("query"), step, rank),
        # GC answers: pieces with a deletion in flight until the holder's next report.
        st.tuples(st.just("deleting"), rank, st.lists(st.tuples(rank, step), max_size=3)),
        st.tuples(st.just("acted"), rank),
    )


def apply(s: CoordinatorState, ev: tuple) -> None:
    kind = ev[0]
    if kind == "register":
        s.register(ev[1], ev[2])
    elif kind == "commit":
        o, step, h, t, g, sv = ev[2]
        s.report_committed(ev[1], Holding(o, step, h, 10, t, g, sv))
    elif kind == "save":
        _, step, h, g, sv = ev
        ranks = [r for a, b in sv for r in range(a, b + 1)] or range(s.topology.nodes)
        for r in ranks:
            try:
                s.report_committed(r, Holding(r, step, f"{h}{r}", 10, Tier.LOCAL, g, sv))
            except NotRegisteredError:
                pass
    elif kind == "remove":
        s.report_removed(ev[1], ev[2])
    elif kind == "inventory":
        s.report_inventory(ev[1], [Holding(o, step, h, 10, t, g, sv) for o, step, h, t, g, sv in ev[2]])
    elif kind == "forget":
        s.forget_host(ev[1], 1.0)
    elif kind == "backup":
        s.report_backup(ev[1], ev[2], ev[3])
    elif kind == "backup_ranks":
        s.report_backup_ranks(ev[1], ev[2])
    elif kind == "pin":
        (s.pin if ev[2] else s.unpin)(ev[1])
    elif kind == "backing_up":
        (s.mark_backup_in_progress if ev[2] else s.clear_backup_in_progress)(ev[1])
    elif kind == "deleting":
        s.deleting(ev[1], ev[2])
    elif kind == "acted":
        s.deletions_acted(ev[1])
    elif kind == "query":  # refreshes part of the derived views mid-sequence
        s.rank_sources(ev[1], ev[2])
        s.tasks_for(ev[2], ev[1])
        s.newest_complete_step()


@st.composite
def scenario(draw):
    topo = draw(st.sampled_from(TOPOLOGIES))
    return topo, draw(st.lists(event(topo.nodes), min_size=8, max_size=40))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_incremental_views_equal_recomputation_from_scratch(case):
    topo, events = case
    s = CoordinatorState(topo)
    for r in range(topo.nodes):
        s.register(r, 2)
    for i, ev in enumerate(events):
        before = s.version
        try:
            apply(s, ev)
        except (ValueError, NotRegisteredError, StaleIncarnationError):
            assert s.version == before, f"rejected event {ev} changed the state"
        if i % 7 == 6:
            assert answers(s) == answers(s.rebuilt()), events[: i + 1]
    assert answers(s) == answers(s.rebuilt()), events


def test_version_and_memo_do_not_change_on_a_repeated_report():
    s = CoordinatorState(JobTopology(4, 2, 1))
    for r in range(4):
        s.register(r, 1)
        s.report_inventory(r, [Holding(r, 1, f"h{r % 2}", 10)])
    plan = s.restore_plan(restoring=False)
    v = s.version
    s.report_inventory(2, [Holding(2, 1, "h0", 10)])  # nothing new
    s.report_committed(3, Holding(3, 1, "h1", 10))
    assert s.version == v
    assert s.restore_plan(restoring=False) is plan  # memoised per version
    s.report_committed(3, Holding(3, 2, "h1", 10))
    assert s.version != v


def test_liveness_declares_silent_hosts_lost_in_order():
    s = CoordinatorState(JobTopology(4, 2, 1))
    s.watch(range(4), now=0.0)
    for r in range(4):
        s.register(r, 1)
        s.report_inventory(r, [Holding(r, 1, f"h{r % 2}", 10)])
    for t in s.replication_plan(1):  # the replicas attest each other (hash only)
        assert t.hash_only
        s.report_committed(t.dest_rank, Holding(t.owner_rank, 1, t.content_hash, 10, Tier.REPLICA))
    s.seen(0, 5.0)
    s.seen(1, 6.0)
    assert s.expire(7.0, 4.0) == [2, 3]  # silent since 0.0
    assert s.expire(7.0, 4.0) == []
    assert sorted(s.lost) == [2, 3] and s.registered == {0: 1, 1: 1}
    assert s.is_complete(1)  # ranks 2 and 3 are covered by their attested replicas 0 and 1
    assert not s.is_redundant(1)
    # Re-replication: the lost hosts are no destinations; the survivors copy each other's data.
    assert {(t.owner_rank, t.dest_rank) for t in s.replication_plan(1) if not t.hash_only} == {(0, 1), (1, 0)}
    assert s.register(2, 1) is True and 2 not in s.lost and s.reregistered == 1


def test_a_lost_slice_of_identical_replicas_regains_redundancy_through_the_survivors_copies():
    s = CoordinatorState(JobTopology(6, 2, 1))
    for r in range(6):
        s.register(r, 1)
        s.report_inventory(r, [Holding(r, 1, f"h{r % 3}", 10)])
    for t in s.replication_plan(1):
        s.report_committed(t.dest_rank, Holding(t.owner_rank, 1, t.content_hash, 10, Tier.REPLICA))
    for r in (0, 1, 2):
        s.forget_host(r)
    assert s.is_complete(1) and not s.is_redundant(1)
    tasks = s.replication_plan(1)
    copies = [t for t in tasks if not t.hash_only]
    assert copies and all(t.dest_rank in (3, 4, 5) for t in copies)
    # Each host a survivor's data is copied to witnesses the lost replica's identical data (its identity
    # rests on the survivors' attestations alone, then).
    assert {(t.owner_rank, t.dest_rank) for t in tasks if t.hash_only} == {
        ((t.owner_rank + 3) % 6, t.dest_rank) for t in copies}
    for t in tasks:
        s.report_committed(t.dest_rank, Holding(t.owner_rank, 1, t.content_hash, 10,
                                                Tier.REPLICA if t.hash_only else Tier.PEER))
    assert s.is_redundant(1) and s.replication_plan(1) == []
