"""Tests for replicator.coordinator.planner: replication, completeness, restore and GC decisions from hosts' reports."""

import collections
import json
import random
import time

import pytest

from replicator.coordinator.model import (
    CopyTask,
    NotRegisteredError,
    RestorePlan,
    Source,
    StaleIncarnationError,
)
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding, Tier

SIZE = 100


def make(nodes, d=1, replicas=1, incarnation=1):
    st = CoordinatorState(JobTopology(nodes, d, replicas))
    for r in range(nodes):
        st.register(r, incarnation)
    return st


def save(st, step, hashes, ranks=None):
    for r in ranks if ranks is not None else range(len(hashes)):
        st.report_committed(r, Holding(r, step, hashes[r], SIZE))


def identical(st, step):
    """Hashes of a pure data-parallel job: one per in-slice index."""
    t = st.topology
    return [f"s{step}-i{t.index_in_slice(r)}" for r in range(t.nodes)]


def differing(st, step):
    return [f"s{step}-r{r}" for r in range(st.topology.nodes)]


def apply_copies(st, tasks):
    """What the daemons do: copy bytes (PEER holding) or record a verified identical replica (REPLICA)."""
    for t in tasks:
        tier = Tier.REPLICA if t.hash_only else Tier.PEER
        st.report_committed(t.dest_rank, Holding(t.owner_rank, t.step, t.content_hash, t.size, tier))


def byte_copies(tasks):
    return [t for t in tasks if not t.hash_only]


def apply_gc(st, plan):
    for holder, keys in plan.items():
        st.report_removed(holder, keys)


def kinds(plan: RestorePlan):
    return {r: (str(s.kind), s.holder_rank, s.owner_rank) for r, s in plan.sources.items()}


# ------------------------------------------------------------------------------------------ value objects


def test_holding_validation_and_round_trip():
    h = Holding(1, 5, "abc", 10, "peer")
    assert h.tier is Tier.PEER and h.key == (1, 5)
    assert Holding.from_dict(h.to_dict()) == h
    assert json.loads(json.dumps(h.to_dict()))["tier"] == "peer"
    for args, match in [
        ((1, -1, "x"), "step"),
        ((-1, 1, "x"), "owner_rank"),
        ((True, 1, "x"), "owner_rank"),
        ((1, 1, ""), "content_hash"),
        ((1, 1, None), "content_hash"),
        ((1, 1, "x", -5), "size"),
        ((1, 1, "x", 0, "tape"), "unknown tier"),
        ((1, 1, "x", 0, "bucket"), "report_backup"),
    ]:
        with pytest.raises(ValueError, match=match):
            Holding(*args)
    with pytest.raises(ValueError, match="lacks field"):
        Holding.from_dict({"owner_rank": 1, "step": 2})


def test_state_rejects_non_topology():
    with pytest.raises(ValueError, match="JobTopology"):
        CoordinatorState(4)


# ------------------------------------------------------------------------------------- 2 slices x 2 hosts


def test_two_by_two_identical_content_needs_no_copies():
    st = make(4, d=2)
    save(st, 10, identical(st, 10))
    tasks = st.replication_plan(10)
    # Only hashes: each replica records that it holds its peer's data.
    assert tasks == [
        CopyTask(0, 10, 2, 2, "s10-i0", SIZE, hash_only=True),
        CopyTask(1, 10, 3, 3, "s10-i1", SIZE, hash_only=True),
        CopyTask(2, 10, 0, 0, "s10-i0", SIZE, hash_only=True),
        CopyTask(3, 10, 1, 1, "s10-i1", SIZE, hash_only=True),
    ]
    apply_copies(st, tasks)
    assert st.replication_plan(10) == []
    assert st.globally_complete_steps() == [10]
    assert st.newest_complete_step() == 10
    assert st.is_redundant(10)
    assert st.verified_replicas(10) == [
        (0, 2, "s10-i0"),
        (1, 3, "s10-i1"),
        (2, 0, "s10-i0"),
        (3, 1, "s10-i1"),
    ]
    plan = st.restore_plan(restoring=False)
    assert plan.step == 10
    assert kinds(plan) == {r: ("local", r, r) for r in range(4)}


def test_two_by_two_lost_host_restores_from_identical_replica():
    st = make(4, d=2)
    save(st, 10, identical(st, 10))
    apply_copies(st, st.replication_plan(10))
    st.forget_host(0)
    assert st.is_complete(10) and not st.is_redundant(10)
    plan = st.restore_plan(restoring=False)
    # Rank 0 gets its replica's (rank 2's) byte-identical data from host 2.
    assert plan.sources[0] == Source(Tier.PEER, 2, 2, "s10-i0", SIZE)
    assert kinds(plan)[1] == ("local", 1, 1)


def test_two_by_two_differing_content_copies_to_other_slice():
    st = make(4, d=2)
    save(st, 10, differing(st, 10))
    assert st.verified_replicas(10) == []
    assert not st.is_redundant(10)
    tasks = st.replication_plan(10)
    assert tasks == [
        CopyTask(0, 10, 0, 2, "s10-r0", SIZE),
        CopyTask(1, 10, 1, 3, "s10-r1", SIZE),
        CopyTask(2, 10, 2, 0, "s10-r2", SIZE),
        CopyTask(3, 10, 3, 1, "s10-r3", SIZE),
    ]
    apply_copies(st, tasks)
    assert st.is_redundant(10)
    assert st.replication_plan(10) == []  # idempotent once done
    st.forget_host(0)
    plan = st.restore_plan(restoring=False)
    assert plan.sources[0] == Source(Tier.PEER, 2, 0, "s10-r0", SIZE)
    assert plan.sources[2] == Source(Tier.LOCAL, 2, 2, "s10-r2", SIZE)


def test_replica_with_different_content_is_not_a_copy():
    st = make(4, d=2)
    hashes = identical(st, 10)
    hashes[2] = "other"
    save(st, 10, hashes)
    tasks = st.replication_plan(10)
    assert {t.owner_rank for t in byte_copies(tasks)} == {0, 2}
    assert {(t.owner_rank, t.dest_rank) for t in tasks if t.hash_only} == {(1, 3), (3, 1)}
    st.forget_host(0)
    assert st.missing_ranks(10) == [0]
    assert st.restore_plan(restoring=False).empty


def test_replica_that_has_not_saved_yet_triggers_a_copy():
    st = make(4, d=2)
    save(st, 10, identical(st, 10), ranks=[0, 1])
    assert {(t.owner_rank, t.dest_rank) for t in st.replication_plan(10)} == {(0, 2), (1, 3)}
    assert not st.is_complete(10)


# ---------------------------------------------------------------------------------- 1 slice x 4 hosts ring


def test_one_slice_ring_replication_and_lost_host():
    st = make(4, replicas=1)
    save(st, 7, differing(st, 7))
    tasks = st.replication_plan(7)
    assert [(t.owner_rank, t.source_rank, t.dest_rank) for t in tasks] == [
        (0, 0, 1),
        (1, 1, 2),
        (2, 2, 3),
        (3, 3, 0),
    ]
    apply_copies(st, tasks)
    assert st.is_redundant(7)
    st.forget_host(1)
    assert st.is_complete(7) and not st.is_redundant(7)
    plan = st.restore_plan(restoring=False)
    assert plan.sources[1] == Source(Tier.PEER, 2, 1, "s7-r1", SIZE)
    # Self-healing: rank 1's data (now only on host 2) and rank 0's copy (was on host 1) are re-copied,
    # never to the lost host.
    heal = st.replication_plan(7)
    assert [(t.owner_rank, t.source_rank, t.dest_rank) for t in heal] == [(0, 0, 2), (1, 2, 3)]
    apply_copies(st, heal)
    assert st.replication_plan(7) == []


def test_one_slice_two_replicas_each_host_receives_two():
    st = make(4, replicas=2)
    save(st, 3, differing(st, 3))
    tasks = st.replication_plan(3)
    assert collections.Counter(t.dest_rank for t in tasks) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert {(t.owner_rank, t.dest_rank) for t in tasks} == {
        (0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 0), (3, 0), (3, 1)
    }  # fmt: skip
    apply_copies(st, tasks)
    st.forget_host(0)
    st.forget_host(1)
    assert st.is_complete(3)


def test_sources_are_spread_across_holders():
    # Rank 0's data is on hosts 0 and 1; with replicas=3 it needs two more copies: one from each.
    st = make(4, replicas=3)
    save(st, 1, differing(st, 1), ranks=[0])
    st.report_committed(1, Holding(0, 1, "s1-r0", SIZE, Tier.PEER))
    tasks = st.replication_plan(1)
    assert sorted((t.source_rank, t.dest_rank) for t in tasks) == [(0, 3), (1, 2)]


def test_single_host_job_has_nothing_to_copy():
    st = make(1, replicas=1)
    save(st, 1, ["h"])
    assert st.replication_plan(1) == []
    assert st.is_complete(1) and not st.is_redundant(1)
    st.report_backup(1)
    assert st.is_redundant(1)


# -------------------------------------------------------------------------------------- 4 slices x 1 host


def test_four_slices_of_one_identical_survives_three_losses():
    st = make(4, d=4)
    save(st, 5, identical(st, 5))
    assert len(set(identical(st, 5))) == 1
    tasks = st.replication_plan(5)
    assert len(tasks) == 12 and all(t.hash_only for t in tasks)
    apply_copies(st, tasks)
    for r in (0, 1, 2):
        st.forget_host(r)
    plan = st.restore_plan(restoring=False)
    assert plan.step == 5
    assert kinds(plan) == {0: ("peer", 3, 3), 1: ("peer", 3, 3), 2: ("peer", 3, 3), 3: ("local", 3, 3)}


def test_restore_spreads_load_across_identical_replicas():
    st = make(8, d=8)
    save(st, 5, identical(st, 5))
    apply_copies(st, st.replication_plan(5))
    for r in range(4):
        st.forget_host(r)
    plan = st.restore_plan(restoring=False)
    served = collections.Counter(s.holder_rank for r, s in plan.sources.items() if r < 4)
    assert sorted(served) == [4, 5, 6, 7] and set(served.values()) == {1}


def test_restore_spreads_load_by_bytes():
    # Ranks 0 and 1 are lost; their data is on both host 2 and host 3.
    st = make(4, replicas=2)
    save(st, 9, differing(st, 9))
    for owner in (0, 1):
        for holder in (2, 3):
            st.report_committed(holder, Holding(owner, 9, f"s9-r{owner}", SIZE, Tier.PEER))
    st.forget_host(0)
    st.forget_host(1)
    plan = st.restore_plan(restoring=False)
    assert {plan.sources[0].holder_rank, plan.sources[1].holder_rank} == {2, 3}


# ------------------------------------------------------------------------------------ completeness, bucket


def test_newest_complete_step_ignores_partial_newer_steps():
    st = make(4, d=2)
    save(st, 10, differing(st, 10))
    save(st, 20, differing(st, 20), ranks=[0, 1, 2])
    assert st.globally_complete_steps() == [10]
    assert st.missing_ranks(20) == [3]
    assert st.restore_plan(restoring=False).step == 10
    save(st, 20, differing(st, 20), ranks=[3])
    assert st.newest_complete_step() == 20


def test_bucket_only_recovery_after_every_host_is_wiped():
    st = make(4, d=2)
    save(st, 10, differing(st, 10))
    st.report_backup(10)
    save(st, 20, differing(st, 20), ranks=[0, 1])  # partial newer step, lost with the hosts
    for r in range(4):
        st.forget_host(r)
    assert st.globally_complete_steps() == [10]
    plan = st.restore_plan(restoring=False)
    assert plan.step == 10
    assert all(s.kind is Tier.BUCKET and s.holder_rank is None for s in plan.sources.values())
    assert [plan.sources[r].content_hash for r in range(4)] == [None] * 4  # nobody reported them
    assert plan.reason.endswith("4 bucket")
    st.report_backup(10, content_hashes=dict(enumerate(differing(st, 10))))
    plan = st.restore_plan(restoring=False)
    assert [plan.sources[r].content_hash for r in range(4)] == differing(st, 10)


def test_mixed_tiers_fastest_first():
    st = make(4, replicas=1)
    save(st, 10, differing(st, 10))
    apply_copies(st, st.replication_plan(10))
    st.report_backup(10, content_hashes={r: h for r, h in enumerate(differing(st, 10))})
    st.forget_host(1)  # rank 1 from host 2 (peer); host 1 held rank 0's copy
    st.forget_host(2)  # rank 2 only in the bucket now
    plan = st.restore_plan(restoring=False)
    assert kinds(plan) == {0: ("local", 0, 0), 1: ("bucket", None, 1), 2: ("peer", 3, 2), 3: ("local", 3, 3)}


def test_partial_bucket_ranks_fill_gaps():
    st = make(4, d=2)
    save(st, 10, differing(st, 10), ranks=[0, 1, 2])
    st.report_backup_ranks(10, {3: "s10-r3"})
    assert st.is_complete(10)
    assert st.restore_plan(restoring=False).sources[3].kind is Tier.BUCKET
    st.report_backup(10, committed=False)
    assert not st.is_complete(10)


def test_bucket_with_a_different_hash_does_not_count():
    st = make(2)
    save(st, 10, ["a", "b"])
    st.report_backup(10, content_hashes={0: "a", 1: "old"})
    srcs = st.sources(10)
    assert [s.kind for s in srcs[0]] == [Tier.LOCAL, Tier.BUCKET]
    assert [s.kind for s in srcs[1]] == [Tier.LOCAL]


def test_stale_peer_copy_of_a_resaved_step_is_not_a_source():
    st = make(4, replicas=1)
    save(st, 10, differing(st, 10))
    apply_copies(st, st.replication_plan(10))
    st.report_committed(0, Holding(0, 10, "resaved", SIZE))  # the job restarted and saved step 10 again
    assert [s.holder_rank for s in st.sources(10)[0]] == [0]
    assert [(t.owner_rank, t.dest_rank) for t in st.replication_plan(10)] == [(0, 1)]


def test_nothing_recoverable_gives_an_empty_plan_with_reason():
    st = make(4, d=2)
    plan = st.restore_plan()
    assert plan.empty and plan.sources == {} and "nothing reported" in plan.reason
    save(st, 10, differing(st, 10), ranks=[0, 3])
    plan = st.restore_plan()
    assert plan.step is None and "lacks ranks 1-2" in plan.reason
    assert st.pinned_steps() == []


def test_force_step_override():
    st = make(4, d=2)
    save(st, 10, identical(st, 10))
    save(st, 20, identical(st, 20))
    save(st, 30, identical(st, 30), ranks=[0])
    assert st.restore_plan(restoring=False).step == 20
    assert st.restore_plan(restoring=False, force_step=10).step == 10
    with pytest.raises(ValueError, match=r"step 30 is not recoverable: no tier holds ranks 1-3"):
        st.restore_plan(force_step=30)
    with pytest.raises(ValueError):
        st.restore_plan(force_step=-1)


def test_waiting_for_lists_hosts_without_inventory():
    st = make(3)
    st.report_inventory(0, [])
    assert st.restore_plan(restoring=False).waiting_for == (1, 2)
    st.report_inventory(1, [])
    st.report_inventory(2, [])
    assert st.restore_plan(restoring=False).waiting_for == ()


# ------------------------------------------------------------------------------------ registration, input


def test_registration_and_incarnations():
    st = CoordinatorState(JobTopology(2))
    with pytest.raises(NotRegisteredError):
        st.report_committed(0, Holding(0, 1, "h"))
    assert st.register(0, 5) is True
    assert st.register(0, 5) is False
    st.report_committed(0, Holding(0, 1, "h"))
    with pytest.raises(StaleIncarnationError):
        st.report_committed(0, Holding(0, 2, "h"), incarnation=4)
    assert st.holdings_of(0) == [Holding(0, 1, "h")]
    assert st.register(0, 5) is False and st.holdings_of(0) == [Holding(0, 1, "h")]
    # Incarnations are nonces, not clock readings: a smaller number is a new process (a host restarted
    # with its clock stepped back), which must report its inventory again.
    assert st.register(0, 4) is True
    assert st.holdings_of(0) == []
    # The superseded process is stale from now on (it picks a new nonce and registers again).
    with pytest.raises(StaleIncarnationError):
        st.register(0, 5)
    with pytest.raises(StaleIncarnationError):
        st.report_committed(0, Holding(0, 2, "h"), incarnation=5)
    assert st.register(0, 6) is True
    with pytest.raises(StaleIncarnationError):
        st.register(0, 4)
    with pytest.raises(ValueError):
        st.register(2, 1)
    with pytest.raises(ValueError):
        st.register(0, -1)


def test_bad_inventory_changes_nothing():
    st = make(4, d=2)
    save(st, 10, differing(st, 10))
    st.report_inventory(0, [Holding(0, 10, "s10-r0", SIZE)])
    before = st.status()
    bad_inventories = [
        [Holding(0, 11, "x"), Holding(1, 11, "y")],  # rank 1's data reported as host 0's local
        [Holding(0, 11, "x"), Holding(0, 11, "z")],  # the same piece twice, different hashes
        [Holding(0, 11, "x"), Holding(0, 12, "y", 0, Tier.PEER)],  # own data as a peer copy
        [Holding(0, 11, "x"), Holding(9, 11, "y", 0, Tier.PEER)],  # unknown rank
        [Holding(0, 11, "x"), Holding(9, 11, "y", 0, Tier.REPLICA)],  # unknown rank (any host may attest a known one)
        [Holding(0, 11, "x"), {"owner_rank": 0}],
    ]
    for inv in bad_inventories:
        with pytest.raises(ValueError):
            st.report_inventory(0, inv)
    for bad in [lambda: st.report_removed(0, [(0, -1)]), lambda: st.report_removed(0, [5])]:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError):
        st.report_backup_ranks(10, {7: "h"})
    with pytest.raises(ValueError):
        st.report_backup(10, content_hashes={0: ""})
    with pytest.raises(ValueError):
        st.report_backup(-1)
    assert st.status() == before
    st.report_inventory(0, [Holding(0, 10, "s10-r0", SIZE), Holding(0, 10, "s10-r0", SIZE)])  # exact dup ok
    assert st.status() == before


def test_report_inventory_replaces_and_report_removed_deletes():
    st = make(2)
    st.report_inventory(0, [Holding(0, 1, "a"), Holding(1, 1, "b", 0, Tier.PEER)])
    st.report_inventory(0, [Holding(0, 2, "c")])
    assert st.holdings_of(0) == [Holding(0, 2, "c")]
    st.report_removed(0, [(0, 2), (1, 99)])
    assert st.holdings_of(0) == [] and st.known_steps() == []


# ------------------------------------------------------------------------------- attestations, rebuilding


def rebuild(st):
    """A fresh coordinator fed only what the hosts (and the backup agent) would report, shuffled."""
    rng = random.Random(7)
    fresh = CoordinatorState(st.topology)
    events = []
    for rank, inc in st.registered.items():
        events.append(
            lambda r=rank, i=inc: (fresh.register(r, i), fresh.report_inventory(r, st.holdings_of(r)))
        )
    for step in st.known_steps():
        ranks = st.backup_ranks(step)
        if ranks:
            events.append(lambda s=step, b=ranks: fresh.report_backup_ranks(s, b))
    for step in st.backups_in_progress():
        events.append(lambda s=step: fresh.mark_backup_in_progress(s))
    # A host that stays silent is declared lost by the fresh coordinator too (after --host-lost-seconds).
    for rank, since in st.lost.items():
        events.append(lambda r=rank, t=since: fresh.forget_host(r, t))
    for step in st.pinned_steps():
        events.append(lambda s=step: fresh.pin(s))
    rng.shuffle(events)
    for event in events:
        event()
    return fresh


def answers(st):
    status = st.status()
    for host in status["hosts"].values():
        host.pop("inventory_reported")
    plan = st.restore_plan(restoring=False)
    return {
        "status": status,
        "complete": st.globally_complete_steps(),
        "newest": st.newest_complete_step(),
        "redundant": [s for s in st.known_steps() if st.is_redundant(s)],
        "replication": {s: st.replication_plan(s) for s in st.known_steps()},
        "restore": (plan.step, dict(plan.sources), plan.reason),
        "gc": {k: st.gc_plan(k) for k in (1, 2, 3)},
    }


def test_replica_attestation_survives_owner_loss_and_coordinator_restart():
    st = make(4, d=2)
    save(st, 10, identical(st, 10))
    # Before the hash-only tasks are done, losing host 0 loses the proof that rank 2 equals rank 0.
    st.forget_host(0)
    assert st.missing_ranks(10) == [0]
    st = make(4, d=2)
    save(st, 10, identical(st, 10))
    apply_copies(st, st.replication_plan(10))
    st.forget_host(0)
    fresh = rebuild(st)
    assert fresh.is_complete(10)
    assert fresh.restore_plan(restoring=False).sources[0] == Source(Tier.PEER, 2, 2, "s10-i0", SIZE)
    assert answers(fresh) == answers(st)
    # Host 2 re-saving step 10 with other content voids its attestation.
    st.report_committed(2, Holding(2, 10, "changed", SIZE))
    assert st.missing_ranks(10) == [0]


def test_coordinator_restart_gives_the_same_answers():
    # Many random event histories; a coordinator rebuilt from the final reports must agree on everything.
    for seed in range(40):
        rng = random.Random(seed)
        st, _ = random_history(rng, attest=True)
        assert answers(rebuild(st)) == answers(st), f"seed {seed}"


# ------------------------------------------------------------------------------------------------------ GC


def test_gc_keeps_newest_complete_backups_and_pins():
    st = make(2, replicas=1)
    for step in (1, 2, 3, 4):
        save(st, step, [f"a{step}", f"b{step}"])
        apply_copies(st, st.replication_plan(step))
    save(st, 5, ["a5", "b5"], ranks=[0])  # in flight
    assert st.newest_complete_step() == 4
    plan = st.gc_plan(keep_local=2)
    # Host 0 keeps 5 and 4; host 1 keeps 4 and 3 (it has no step 5).
    assert plan == {0: [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)], 1: [(0, 1), (1, 1), (0, 2), (1, 2)]}
    st.mark_backup_in_progress(2)
    st.pin(1)
    plan = st.gc_plan(keep_local=1)
    assert plan == {0: [(0, 3), (1, 3)], 1: [(0, 3), (1, 3)]}
    st.report_backup(2)  # backup done: step 2 no longer protected
    st.unpin(1)
    plan = st.gc_plan(keep_local=1)
    assert {s for keys in plan.values() for _, s in keys} == {1, 2, 3}
    apply_gc(st, plan)
    assert st.newest_complete_step() == 4
    assert st.globally_complete_steps() == [2, 4]  # 2 survives in the bucket
    with pytest.raises(ValueError):
        st.gc_plan(0)


def test_gc_keeps_the_newest_redundant_step_until_a_newer_one_is_redundant():
    """Issue #33 (found by make test-faults): a newer step is complete but some rank has one copy (its copies
    in flight, or their holder cut off and not yet lost): the newest step with two copies of every rank is the
    one that survives a loss, so it stays whatever keep_local says, until the newer step has its copies."""
    st = make(2, replicas=1)
    for step in (1, 2):
        save(st, step, [f"a{step}", f"b{step}"])
        apply_copies(st, st.replication_plan(step))
    for step in (3, 4):
        save(st, step, [f"a{step}", f"b{step}"])  # complete, not yet copied
    assert st.newest_complete_step() == 4 and st.is_redundant(2) and not st.is_redundant(4)
    assert {s for keys in st.gc_plan(keep_local=1).values() for _, s in keys} == {1, 3}
    apply_copies(st, st.replication_plan(4))
    assert st.is_redundant(4)
    assert {s for keys in st.gc_plan(keep_local=1).values() for _, s in keys} == {1, 2, 3}


def test_gc_deletes_incomplete_steps_older_than_newest_complete():
    st = make(4, d=2)
    save(st, 10, differing(st, 10), ranks=[0, 1])  # never completed
    save(st, 20, differing(st, 20))
    plan = st.gc_plan(keep_local=5)
    assert plan == {0: [(0, 10)], 1: [(1, 10)]}


def test_gc_drops_stale_copies_and_restore_pins():
    st = make(2, replicas=1)
    save(st, 1, ["a", "b"])
    apply_copies(st, st.replication_plan(1))
    st.report_committed(0, Holding(0, 1, "a2", SIZE))  # re-saved: host 1's copy of rank 0 is stale
    save(st, 2, ["c", "d"])
    assert st.newest_complete_step() == 2
    assert st.gc_plan(keep_local=5) == {1: [(0, 1)]}
    plan = st.restore_plan(restoring=True, force_step=1)
    assert plan.step == 1 and st.status()["in_flight"]["pinned"] == [1]
    assert st.gc_plan(keep_local=1) == {}
    st.unpin(1)
    assert st.gc_plan(keep_local=1) == {0: [(0, 1), (1, 1)], 1: [(0, 1), (1, 1)]}


# -------------------------------------------------------------------------------- randomized properties

SHAPES = [(4, 2, 1), (4, 1, 1), (4, 4, 1), (6, 3, 1), (4, 1, 2), (8, 2, 2), (3, 1, 1), (2, 2, 1)]


def random_history(rng, attest=False, check=None):
    """Play a random sequence of saves, copies, losses, restarts, backups, pins and GCs."""
    nodes, d, replicas = rng.choice(SHAPES)
    st = make(nodes, d, replicas)
    same_content = rng.random() < 0.5
    incarnation = dict.fromkeys(range(nodes), 1)
    step = 0
    for _ in range(rng.randint(10, 40)):
        op = rng.random()
        if op < 0.35:
            step += rng.randint(1, 3)
            for r in range(nodes):
                if rng.random() < 0.9 and r in st.registered:
                    key = st.topology.index_in_slice(r) if same_content else r
                    st.report_committed(r, Holding(r, step, f"s{step}-{key}", SIZE + r))
            if attest:
                apply_copies(st, [t for t in st.replication_plan(step) if t.hash_only])
        elif op < 0.55 and st.known_steps():
            s = rng.choice(st.known_steps())
            tasks = st.replication_plan(s)
            apply_copies(st, [t for t in tasks if rng.random() < 0.8])
        elif op < 0.62:
            r = rng.randrange(nodes)
            if rng.random() < 0.5:
                st.forget_host(r)
            else:
                incarnation[r] += 1
            st.register(r, incarnation[r])
        elif op < 0.70 and st.globally_complete_steps():
            s = rng.choice(st.globally_complete_steps())
            if rng.random() < 0.5:
                st.mark_backup_in_progress(s)
            else:
                st.report_backup(s)
        elif op < 0.75 and st.known_steps():
            s = rng.choice(st.known_steps())
            st.pin(s) if rng.random() < 0.6 else st.unpin(s)
        elif op < 0.80 and st.known_steps():
            s = rng.choice(st.known_steps())
            st.report_backup(s, committed=False)
        else:
            keep = rng.randint(1, 3)
            plan = st.gc_plan(keep)
            if check is not None:
                check(st, plan, keep)
            apply_gc(st, plan)
        if check is not None:
            check_restore(st)
    return st, step


def check_restore(st):
    plan = st.restore_plan(restoring=False)
    newest = st.newest_complete_step()
    assert plan.step == newest
    if newest is None:
        assert plan.sources == {}
        return
    assert sorted(plan.sources) == list(range(st.topology.nodes))
    for rank, src in plan.sources.items():
        assert src.owner_rank == rank or src.owner_rank in st.topology.replicas_of(rank)
        if src.kind is Tier.BUCKET:
            assert rank in st.backup_ranks(newest)
            continue
        held = {h.key: h for h in st.holdings_of(src.holder_rank)}
        h = held[(src.owner_rank, newest)]
        assert h.tier is not Tier.REPLICA and h.content_hash == src.content_hash
        assert (src.kind is Tier.LOCAL) == (src.holder_rank == rank)
        # A faster tier is never skipped.
        if src.kind is Tier.PEER:
            assert all(s.kind is not Tier.LOCAL for s in st.sources(newest)[rank])


def check_gc(st, plan, keep):
    newest = st.newest_complete_step()
    protected = set(st.backups_in_progress()) | set(st.pinned_steps()) | ({newest} if newest is not None else set())
    redundant = st.newest_redundant_step()
    if redundant is not None:
        protected.add(redundant)
    before = {r: {h.key for h in st.holdings_of(r)} for r in st.registered}
    complete = set(st.globally_complete_steps())
    for holder, keys in plan.items():
        assert keys and set(keys) <= before[holder]
        assert not {s for _, s in keys} & protected
    after = {r: before[r] - set(plan.get(r, ())) for r in before}
    shadow = CoordinatorState(st.topology)
    for r, inc in st.registered.items():
        shadow.register(r, inc)
        shadow.report_inventory(r, [h for h in st.holdings_of(r) if h.key in after[r]])
    for s in st.known_steps():
        shadow.report_backup_ranks(s, st.backup_ranks(s))
    # The newest complete step keeps every copy and stays the newest complete step.
    assert shadow.newest_complete_step() == newest
    if newest is not None:
        assert shadow.sources(newest) == st.sources(newest)
    if redundant is not None:  # the newest step with two copies of every rank keeps them
        assert shadow.is_redundant(redundant)
    for keys in after.values():
        steps = {s for _, s in keys}
        assert len(steps - protected) <= keep
        if newest is not None:
            assert not {s for s in steps - protected if s < newest and s not in complete}
    assert st.gc_plan(keep) == plan  # deterministic and side-effect free


def test_randomized_gc_and_restore_invariants():
    start = time.monotonic()
    gcs = 0
    for seed in range(300):
        rng = random.Random(1000 + seed)

        def counting_check(st, plan, keep):
            nonlocal gcs
            gcs += 1
            check_gc(st, plan, keep)

        random_history(rng, attest=seed % 2 == 0, check=counting_check)
    assert gcs > 300
    assert time.monotonic() - start < 20


# ------------------------------------------------------------------------------------------------ status


def test_status_is_plain_json_data():
    st = make(4, d=2)
    save(st, 10, differing(st, 10))
    apply_copies(st, st.replication_plan(10))
    save(st, 20, differing(st, 20), ranks=[0])
    st.report_backup(10)
    st.mark_backup_in_progress(10)
    st.pin(10)
    status = json.loads(json.dumps(st.status()))
    assert status["topology"] == {"nodes": 4, "data_parallelism": 2, "replicas": 1}
    assert status["complete_steps"] == [10] and status["newest_complete_step"] == 10
    assert status["hosts"]["0"]["steps"] == [10, 20] and status["hosts"]["0"]["pieces"] == 3
    assert status["steps"]["10"]["redundant"] is True
    assert status["steps"]["20"]["missing_ranks"] == [1, 2, 3]
    assert status["steps"]["10"]["ranks"]["0"][0] == {"kind": "local", "holder": 0, "owner": 0}
    assert status["backups"]["10"] == {"ranks": [0, 1, 2, 3], "complete": True}
    assert status["in_flight"] == {"saving": [20], "backing_up": [10], "pinned": [10]}


# ------------------------------------------------------------------------------------------------- scale


def test_planning_a_thousand_hosts_is_fast():
    st = make(1024, d=4, replicas=1)
    for step in (100, 200, 300):
        hashes = [f"s{step}-{st.topology.index_in_slice(r)}" for r in range(1024)]
        hashes[5] = "odd-one-out"
        save(st, step, hashes)
    start = time.monotonic()
    tasks = st.replication_plan(300)
    complete = st.globally_complete_steps()
    plan = st.restore_plan(restoring=False)
    gc = st.gc_plan(keep_local=2)
    elapsed = time.monotonic() - start
    assert {(t.owner_rank, t.dest_rank) for t in byte_copies(tasks)} == {(5, 261)}
    assert sum(t.hash_only for t in tasks) == 1024 * 3 - 6
    assert complete == [100, 200, 300] and plan.step == 300
    assert gc == {r: [(r, 100)] for r in range(1024)}
    assert elapsed < 5, elapsed
