"""Where a restoring host fetches from (:meth:`CoordinatorState.restore_sources`, issue #48): one bucket read per
group of byte-identical replicas (the others copy from its host, or fetch their own after a bounded wait), and a
restarting or itself-restoring peer never asked first."""

from __future__ import annotations

from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.restore_plan import Liveness
from replicator.coordinator.topology import JobTopology
from replicator.tiers import Holding, Tier

STEP = 10
SIZE = 100
WAIT = 3.0


def live(now: float) -> Liveness:
    return Liveness(now, silent_after_seconds=1.0, peer_wait_seconds=WAIT)


def started(nodes: int, d: int, now: float = 0.0) -> CoordinatorState:
    """Every host registered, reported (an empty RAM disk) and heard from at ``now``."""
    st = CoordinatorState(JobTopology(nodes, d, 1))
    for r in range(nodes):
        st.register(r, 1)
        st.report_inventory(r, [])
        st.seen(r, now)
    return st


def identical(st: CoordinatorState) -> dict[int, str]:
    return {r: f"h{st.topology.index_in_slice(r)}" for r in range(st.topology.nodes)}


def kinds(srcs: list) -> list[tuple[str, int | None, int]]:
    return [(str(s.kind), s.holder_rank, s.owner_rank) for s in srcs]


def every_host_wiped(nodes: int = 4, d: int = 2) -> CoordinatorState:
    """Step 10 only in the bucket, data-parallel replicas identical; every host back with an empty RAM disk."""
    st = started(nodes, d)
    st.report_backup(STEP, content_hashes=identical(st))
    assert st.is_complete(STEP)
    return st


def test_one_replica_fetches_from_the_bucket_the_others_wait_then_copy_from_it() -> None:
    st = every_host_wiped()
    # Replica groups {0, 2} and {1, 3}: the smaller rank of each fetches, the other waits (no source yet).
    assert kinds(st.restore_sources(STEP, 0, live(0.1))) == [("bucket", None, 0)]
    assert kinds(st.restore_sources(STEP, 1, live(0.1))) == [("bucket", None, 1)]
    assert st.restore_sources(STEP, 2, live(0.1)) == []
    assert st.restore_sources(STEP, 3, live(0.1)) == []
    # Host 0's fetch landed: host 2 copies it from there (the bucket after it).
    st.report_committed(0, Holding(0, STEP, "h0", SIZE))
    st.seen(0, 0.5)
    assert kinds(st.restore_sources(STEP, 2, live(0.6))) == [("peer", 0, 0), ("bucket", None, 2)]
    assert st.restore_sources(STEP, 3, live(0.6)) == []  # host 1's fetch has not landed yet


def test_a_waiting_replica_fetches_its_own_after_the_bound() -> None:
    st = every_host_wiped()
    assert st.restore_sources(STEP, 2, live(0.0)) == []
    for h in range(4):
        st.seen(h, WAIT - 0.5)
    assert st.restore_sources(STEP, 2, live(WAIT - 0.1)) == []
    for h in range(4):
        st.seen(h, WAIT)
    assert kinds(st.restore_sources(STEP, 2, live(WAIT))) == [("bucket", None, 2)]
    # Never held again for this step (no flapping between waiting and fetching).
    assert kinds(st.restore_sources(STEP, 2, live(WAIT + 0.1))) == [("bucket", None, 2)]


def test_no_wait_for_a_silent_or_lost_replica() -> None:
    st = every_host_wiped()
    st.seen(0, -5.0)  # host 0 silent since its report for longer than the bound: restarting again, or gone
    assert kinds(st.restore_sources(STEP, 2, live(0.0))) == [("bucket", None, 2)]
    st.register(1, 2)  # host 1 restarted, no inventory reported yet: it will fetch once it reports
    assert st.restore_sources(STEP, 3, live(0.0)) == []
    st.forget_host(1)
    assert kinds(st.restore_sources(STEP, 3, live(0.1))) == [("bucket", None, 3)]


def test_a_replica_that_has_not_registered_yet_is_waited_for() -> None:
    """A job's hosts start one by one: the replica asked first waits for the smaller rank's host to come."""
    st = CoordinatorState(JobTopology(4, 2, 1))
    st.report_backup(STEP, content_hashes=identical(st))
    st.watch(range(4), 0.0)
    for r in (2, 3):
        st.register(r, 1)
        st.report_inventory(r, [])
        st.seen(r, 0.1)
    assert st.restore_sources(STEP, 2, live(0.1)) == []
    st.register(0, 1)
    st.report_inventory(0, [])
    st.seen(0, 0.2)
    assert kinds(st.restore_sources(STEP, 0, live(0.2))) == [("bucket", None, 0)]
    assert st.restore_sources(STEP, 2, live(0.2)) == []
    # Host 1 never comes: host 3 fetches its own after the bound.
    assert st.restore_sources(STEP, 3, live(0.2)) == []
    assert kinds(st.restore_sources(STEP, 3, live(0.2 + WAIT))) == [("bucket", None, 3)]


def test_no_wait_when_the_bucket_does_not_prove_the_replicas_identical() -> None:
    st = started(4, 2)
    st.report_backup(STEP, content_hashes={r: f"r{r}" for r in range(4)})  # each rank its own content
    assert [kinds(st.restore_sources(STEP, r, live(0.0))) for r in range(4)] == [
        [("bucket", None, r)] for r in range(4)]
    st2 = started(4, 2)
    st2.report_backup(STEP)  # no hashes recorded: identity unproven
    assert kinds(st2.restore_sources(STEP, 2, live(0.0))) == [("bucket", None, 2)]


def test_three_replicas_wait_for_the_smallest_live_one() -> None:
    st = every_host_wiped(nodes=3, d=3)  # one host per slice: ranks 0, 1, 2 identical
    assert kinds(st.restore_sources(STEP, 0, live(0.0))) == [("bucket", None, 0)]
    assert st.restore_sources(STEP, 1, live(0.0)) == [] and st.restore_sources(STEP, 2, live(0.0)) == []
    st.forget_host(0)
    assert kinds(st.restore_sources(STEP, 1, live(0.1))) == [("bucket", None, 1)]
    assert st.restore_sources(STEP, 2, live(0.1)) == []


def test_a_restarting_peer_is_offered_after_a_settled_one() -> None:
    st = started(4, 1)  # one slice, each rank's own content, two copies of rank 0's data on hosts 1 and 2
    for r in range(4):
        st.report_committed(r, Holding(r, STEP, f"r{r}", SIZE))
    for holder in (1, 2):
        st.report_committed(holder, Holding(0, STEP, "r0", SIZE, Tier.PEER))
    st.forget_host(0)
    st.register(0, 2)
    st.report_inventory(0, [])
    for r in range(4):
        st.seen(r, 10.0)
    order = kinds(st.restore_sources(STEP, 0, live(10.0)))
    assert order[:2] == [("peer", 1, 0), ("peer", 2, 0)]
    st.seen(1, 8.0)  # host 1's daemon went down 2 s ago (restarting): host 2 first
    assert kinds(st.restore_sources(STEP, 0, live(10.0)))[:2] == [("peer", 2, 0), ("peer", 1, 0)]
    st.seen(1, 10.0)
    # Host 1 is itself restoring step 10 (it lost its own data but kept rank 0's copy): host 2 first.
    st.report_inventory(1, [Holding(0, STEP, "r0", SIZE, Tier.PEER)])
    st.report_backup(STEP, content_hashes={r: f"r{r}" for r in range(4)})
    assert kinds(st.restore_sources(STEP, 0, live(10.0)))[:2] == [("peer", 2, 0), ("peer", 1, 0)]
    # Not dropped: once it is the only holder it is offered (before the bucket).
    st.forget_host(2)
    assert kinds(st.restore_sources(STEP, 0, live(10.0))) == [("peer", 1, 0), ("bucket", None, 0)]


def test_a_host_restarting_with_a_new_incarnation_offers_nothing_until_it_reports() -> None:
    st = started(2, 2)  # two slices of one host, identical replicas
    for r in range(2):
        st.report_committed(r, Holding(r, STEP, "h", SIZE))
    st.report_backup(STEP, content_hashes={0: "h", 1: "h"})
    st.register(1, 2)  # host 1 restarted: what it held is not counted until its inventory says so
    st.forget_host(0)
    st.register(0, 2)
    st.report_inventory(0, [])
    st.seen(0, 0.0)
    assert kinds(st.restore_sources(STEP, 0, live(0.0))) == [("bucket", None, 0)]
    st.report_inventory(1, [Holding(1, STEP, "h", SIZE)])
    st.seen(1, 0.0)
    assert kinds(st.restore_sources(STEP, 0, live(0.0))) == [("peer", 1, 1), ("bucket", None, 0)]
