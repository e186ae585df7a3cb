"""Coordinator defects found by the control-plane simulation (tests/simulation), each as a focused test.

The simulation seeds that found them are the guards in tests/simulation (they replay the whole schedule).
"""

import grpc
import pytest

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology


class Ctx:
    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")

    def is_active(self):
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def beat(coord, rank, holdings):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                              newest_saved_step=3, full_report=True, known_epoch=coord.epoch,
                              holdings=[pb.Holding(owner_rank=rank, step=s, content_hash=f"h{s}.{rank % 2}",
                                                   size=10, tier=tier_pb2.TIER_LOCAL) for s in holdings])
    return coord.Heartbeat(req, Ctx())


def _full_reporter(coord: Coordinator):
    """``report(rank, holdings, incarnation=7)``: host ``rank``'s full-report heartbeat to ``coord``."""
    def report(rank, holdings, incarnation=7):
        req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=incarnation, address=f"127.0.0.1:{7000 + rank}",
                                  full_report=True, known_epoch=coord.epoch, holdings=holdings)
        return coord.Heartbeat(req, Ctx())
    return report


def test_no_deletion_on_a_picture_of_lost_hosts_without_a_complete_step():
    """Simulation seeds 158 and 486: a coordinator (e.g. a deposed one, still answering the one host that
    has not heard of its successor's epoch) that hears only from host 1 declares the others lost; with
    them lost no step is complete, and it used to tell host 1 to delete step 1 (beyond keep_local 2), the
    newest step complete on the hosts that moved to the successor."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    assert not beat(coord, 1, [1, 2, 3]).deletions
    clock.now += 10.0  # hosts 0, 2 and 3 silent: declared lost
    resp = beat(coord, 1, [1, 2, 3])
    assert sorted(coord.state.lost) == [0, 2, 3]
    assert coord.state.newest_complete_step() is None
    assert [(d.owner_rank, d.step) for d in resp.deletions] == []
    # A host that comes back (its RAM disk kept) completes step 1 again: nothing was lost.
    for r in (0, 2, 3):
        beat(coord, r, [1])
    assert coord.state.newest_complete_step() == 1


def test_gc_still_runs_with_lost_hosts_once_a_step_is_complete():
    clock = Clock()
    coord = Coordinator(JobTopology(2, 1, 1), "t", keep_local=1, clock=clock, host_lost_seconds=4.0)
    peer = [pb.Holding(owner_rank=1, step=2, content_hash="h2.1", size=10, tier=tier_pb2.TIER_PEER)]
    req = pb.HeartbeatRequest(job="t", rank=0, incarnation=1, address="127.0.0.1:7000", full_report=True,
                              known_epoch=coord.epoch,
                              holdings=[pb.Holding(owner_rank=0, step=s, content_hash=f"h{s}.0", size=10,
                                                   tier=tier_pb2.TIER_LOCAL) for s in (1, 2)] + peer)
    coord.Heartbeat(req, Ctx())
    beat(coord, 1, [1, 2])
    clock.now += 10.0  # host 1 lost; its step 2 survives as host 0's peer copy
    resp = coord.Heartbeat(req, Ctx())
    assert sorted(coord.state.lost) == [1]
    assert coord.state.newest_complete_step() == 2
    assert [(d.owner_rank, d.step) for d in resp.deletions] == [(0, 1)]


def _holding(owner, step, rank_hash, tier=tier_pb2.TIER_LOCAL, size=10):
    return pb.Holding(owner_rank=owner, step=step, content_hash=f"h{step}.{rank_hash}", size=size, tier=tier)


def test_pieces_being_deleted_do_not_make_an_older_step_complete():
    """complete-is-restorable (simulation seed 239): GC told every host to delete step 1; before their next
    reports, host 1 was replaced, so steps 2 and 3 lost rank 1, and the coordinator fell back to step 1,
    counting the pieces it had just ordered deleted (host 3's attestation of rank 1 among them): for a
    heartbeat interval latest_step() named a step whose restore failed."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)

    def report(rank, incarnation=1, steps=(1, 2, 3)):
        held = [_holding(rank, s, rank % 2) for s in steps]
        if rank == 3 and 1 in steps:  # host 3 attested that its step 1 is rank 1's too (not yet 2 and 3)
            held.append(_holding(1, 1, 1, tier_pb2.TIER_REPLICA, size=0))
        req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=incarnation, address=f"127.0.0.1:{7000 + rank}",
                                  newest_saved_step=max(steps, default=-1), full_report=True,
                                  known_epoch=coord.epoch, holdings=held)
        return coord.Heartbeat(req, Ctx())

    for r in range(4):
        report(r)
    ordered = {r: sorted((d.owner_rank, d.step) for d in report(r).deletions) for r in range(4)}
    assert ordered == {0: [(0, 1)], 1: [(1, 1)], 2: [(2, 1)], 3: [(1, 1), (3, 1)]}
    st = coord.state
    assert st.newest_complete_step() == 3
    assert not st.is_complete(1) and st.sources(1) == {}  # the doomed pieces count for nothing
    assert st.deletions_in_flight() == ordered
    report(1, incarnation=2, steps=())  # host 1 replaced with an empty RAM disk
    assert st.newest_complete_step() is None  # (was step 1, being deleted on every host)
    assert coord.restore_target() is None
    # A host that skipped a deletion (a task used the piece) still reports it: the order is repeated ...
    assert [(d.owner_rank, d.step) for d in report(0).deletions] == [(0, 1)]
    # ... and what a host still holds once it acted on an answer counts again.
    st.deletions_acted(0)
    assert st.holding(0, (0, 1)) is not None and [s.holder_rank for s in st.rank_sources(1, 0)] == [0]


def test_a_rank_restored_from_its_replica_stays_covered_when_the_replica_is_lost():
    """newest-complete-regressed / complete-step-lost (simulation seed 273, the issue's "lost replica
    proof"): host 0 restored rank 0's data from rank 2's byte-identical data and keeps it as a copy of rank
    2's directory; host 2's attestation (rank 0 == rank 2) was the only record that it is rank 0's data too.
    Host 0 reports that record itself (a REPLICA holding of its own rank), so when slice 1 (hosts 2 and 3)
    is replaced, hosts 0 and 1 still cover every rank."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    held = {
        0: [_holding(2, 4, 0, tier_pb2.TIER_PEER), _holding(0, 4, 0, tier_pb2.TIER_REPLICA, size=0)],
        1: [_holding(1, 4, 1), _holding(3, 4, 1, tier_pb2.TIER_REPLICA, size=0)],
    }
    for r in (0, 1, 2, 3):
        req = pb.HeartbeatRequest(job="t", rank=r, incarnation=7, address=f"127.0.0.1:{7000 + r}",
                                  full_report=True, known_epoch=coord.epoch, holdings=held.get(r, []))
        resp = coord.Heartbeat(req, Ctx())
    st = coord.state
    assert st.newest_complete_step() == 4, st.missing_ranks(4)
    src = st.rank_sources(4, 0)[0]
    assert (src.kind, src.holder_rank, src.owner_rank, src.content_hash) == ("local", 0, 2, "h4.0")
    plan = st.restore_plan(restoring=False)
    assert plan.step == 4 and {r: (s.holder_rank, s.owner_rank) for r, s in plan.sources.items()} == {
        0: (0, 2), 1: (1, 1), 2: (0, 2), 3: (1, 1)}
    # Redundancy comes back from the bytes there are (host 0's copy of rank 2's data, host 1's own).
    copies = {(t.owner_rank, t.source_rank) for t in st.replication_plan(4) if not t.hash_only}
    assert copies == {(2, 0), (1, 1)}, copies
    assert resp.newest_complete_step == 4
    # Without its own record, host 0's copy of rank 2's data proves nothing about rank 0.
    req = pb.HeartbeatRequest(job="t", rank=0, incarnation=7, address="127.0.0.1:7000", full_report=True,
                              known_epoch=coord.epoch,
                              holdings=held[0][:1])
    coord.Heartbeat(req, Ctx())
    assert st.newest_complete_step() is None and st.missing_ranks(4) == [0]


def test_a_copy_of_a_replicas_data_witnesses_the_identical_replica():
    """newest-complete-regressed / complete-step-lost / gc-protected (simulation seeds 12979, 18572, 32504 and
    their class, issue #33, "lost replica identity"): rank 2's data is byte-identical to rank 0's, recorded
    by hash on hosts 0 and 2 only. Host 2 was replaced and rank 0's data copied to host 3; then host 0 was
    replaced too: host 3's copy is rank 2's data as well, but nothing said so, so the coordinator counted
    step 4 incomplete (and GC deleted it). The copy task now comes with a hash-only task: host 3 records
    itself as a witness of rank 2 (a REPLICA holding), which outlives hosts 0 and 2."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)

    report = _full_reporter(coord)

    replica = tier_pb2.TIER_REPLICA
    held = {r: [_holding(r, 4, r % 2), _holding((r + 2) % 4, 4, r % 2, replica, size=0)] for r in range(4)}
    for r in range(4):
        report(r, held[r])
    st = coord.state
    assert st.newest_complete_step() == 4 and st.is_redundant(4)
    clock.now += 10.0  # host 2 silent (replaced): declared lost; rank 2's identity rests on host 0's record
    for r in (0, 1, 3):
        report(r, held[r])
    assert set(st.lost) == {2} and st.newest_complete_step() == 4 and not st.is_redundant(4)
    clock.now += 10.0  # the copies go out (every live host reported, the step settled)
    for r in (0, 1):
        report(r, held[r])
    tasks = {(t.owner_rank, t.source_rank, t.content_hash) for t in report(3, held[3]).copies}
    assert tasks == {(0, 0, "h4.0"), (2, 3, "h4.0")}, tasks  # the copy, and host 3 witnesses rank 2
    held[3] += [_holding(0, 4, 0, tier_pb2.TIER_PEER), _holding(2, 4, 0, replica, size=0)]
    report(3, held[3])
    assert st.is_redundant(4)
    assert not [t for t in st.replication_plan(4) if t.owner_rank in (0, 2)]
    report(0, [], incarnation=8)  # host 0 replaced: host 3's witness is the only record of rank 2's identity
    assert st.newest_complete_step() == 4, st.missing_ranks(4)
    assert {(s.holder_rank, s.owner_rank) for s in st.rank_sources(4, 2)} == {(3, 0)}
    assert not [d for d in report(3, held[3]).deletions if d.step == 4]


def test_no_deletion_of_a_step_newer_than_the_newest_complete_while_hosts_are_lost():
    """gc-protected (simulation seed 1005, issue #33): a partition cut host 2 from candidate 0, candidate 1
    took over for it and, once hosts 1 and 3 reached it too, counted step 2 complete. Candidate 0, hearing
    only from hosts 0, 1 and 3, declared host 2 lost, saw step 1 as its newest complete step and told host 0
    to delete its step 2 (beyond keep_local 2 of its own steps 1-4): a piece of the step the serving
    coordinator would restore. With hosts lost, steps newer than the newest complete one are kept."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    copy = _holding(2, 1, 0, tier=tier_pb2.TIER_PEER)  # host 3's copy of rank 2's step 1

    def report(rank, steps, extra=()):
        req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                                  full_report=True, known_epoch=coord.epoch,
                                  holdings=[_holding(rank, s, rank % 2) for s in steps])
        req.holdings.extend(extra)
        return coord.Heartbeat(req, Ctx())

    report(2, [1, 2])
    for r in (0, 1, 3):
        report(r, [1, 2, 3], [copy] if r == 3 else ())
    clock.now += 10.0  # host 2 silent: declared lost; step 2 lacks rank 2, step 1 is the newest complete
    for r in (1, 3):
        report(r, [1, 2, 3, 4], [copy] if r == 3 else ())
    resp = report(0, [1, 2, 3, 4])
    assert sorted(coord.state.lost) == [2]
    assert coord.state.newest_complete_step() == 1
    assert (0, 2) not in [(d.owner_rank, d.step) for d in resp.deletions]
    # Once host 2 reports again, step 2 is complete and GC goes on as before (keep_local 2 of 4 and 3).
    report(2, [1, 2, 3, 4])
    assert coord.state.newest_complete_step() == 4
    resp = report(0, [1, 2, 3, 4])
    assert sorted((d.owner_rank, d.step) for d in resp.deletions) == [(0, 1), (0, 2)]


def test_a_report_counts_only_from_a_host_that_accepted_this_epoch():
    """complete-is-restorable (simulation seed 46583, issue #33): in a partition host 3's heartbeat reached
    candidate 0 (epoch 1) and, its answer lost, candidate 1 (epoch 2) in the same beat, whose answer was lost
    too. Host 3, still under epoch 1, went back to candidate 0 and deleted its copy of rank 1's step 1 on its
    order, while candidate 1 kept counting that copy: step 1 "complete" with no source of rank 1. A report
    counts only once the host accepted this coordinator's epoch (it learns it from the answer)."""
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=Clock(), host_lost_seconds=4.0, epoch=2)
    copy = _holding(1, 1, 1, tier=tier_pb2.TIER_PEER)  # host 3's copy of rank 1's step 1

    def report(rank, known_epoch, extra=()):
        req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                                  full_report=True, known_epoch=known_epoch, inventory_digest=f"d{rank}",
                                  holdings=[_holding(rank, 1, rank % 2), *extra])
        return coord.Heartbeat(req, Ctx())

    for r in (0, 2):
        report(r, 2)
    resp = report(3, 1, [copy])  # still under candidate 0's epoch: its pieces may go on that one's order
    assert resp.epoch == 2 and resp.acked_digest == ""  # not acknowledged: it reports again under epoch 2
    assert not resp.deletions and not resp.copies
    assert coord.state.newest_complete_step() is None and coord.state.rank_sources(1, 1) == []
    resp = report(3, 2, [copy])  # it accepted epoch 2: candidate 0's orders no longer reach it
    assert resp.acked_digest == "d3"
    assert coord.state.newest_complete_step() == 1


def test_no_deletion_of_a_step_newer_than_the_newest_complete_while_a_host_is_silent():
    """gc-protected (simulation seed 15775, issue #33): after a failover candidate 0 (epoch 1) still answered
    hosts 0 and 2, which had not heard of epoch 2, while hosts 1 and 3 already reported to epoch 2 (not yet
    declared lost by epoch 1: silent for 2-3 s of an 8 s limit). Epoch 2 counted step 5 complete with their
    reports; epoch 1, without them, saw step 4 as the newest complete one and told host 0 to delete its step 5
    (beyond keep_local 2 of its steps 4-7). A host silent for longer than a beat's jitter may be reporting to
    another candidate: while one is, steps newer than the newest complete one are kept."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=8.0,
                        heartbeat_seconds=1.0)

    def report(rank, steps):
        req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                                  full_report=True, known_epoch=coord.epoch,
                                  holdings=[_holding(rank, s, rank % 2) for s in steps])
        return coord.Heartbeat(req, Ctx())

    for r in range(4):
        report(r, [4])
    assert coord.state.newest_complete_step() == 4
    clock.now += 3.0  # hosts 1 and 3 silent for 3 s (2 intervals of 1 s and more): not yet lost
    report(2, [4, 5, 6, 7])
    resp = report(0, [4, 5, 6, 7])
    assert not coord.state.lost and coord.state.newest_complete_step() == 4
    assert not resp.deletions  # step 5, beyond keep_local, stays: with hosts 1 and 3 it may be complete
    # Once every host reports again within a beat, GC of those steps goes on (keep_local 2: 7 and 6 stay).
    for r in (1, 3):
        report(r, [4, 5, 6, 7])
    resp = report(0, [4, 5, 6, 7])
    assert coord.state.newest_complete_step() == 7
    assert sorted((d.owner_rank, d.step) for d in resp.deletions) == [(0, 4), (0, 5)]


def _restore(coord, step=-1):
    return coord.PrepareRestore(pb.PrepareRestoreRequest(step=step, wait_seconds=0.0), Ctx())


@pytest.mark.parametrize("asked", [-1, 1])
def test_a_newest_restore_does_not_hold_back_a_step_that_completes_after_it(asked):
    """restore-older-than-newest (simulation seed 14687): the job restored step 1, the newest complete one,
    because host 3's step 2 was not reported yet (a partition); host 3 came back and step 2 completed; the
    job failed again before its next save, and the next restore still got step 1, pinned by the first one
    until a step newer than every step known then (step 3) completed: step 2, complete and held everywhere,
    was passed over. ``asked`` 1: as ``CheckpointManager.restore()`` pins the newest step it chose (its next
    ``restore()`` reads the pin as GetSteps' forced_restore_step)."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    for r in range(3):
        beat(coord, r, [1, 2])
    beat(coord, 3, [1])
    assert coord.state.newest_complete_step() == 1
    first = _restore(coord, asked)
    assert (first.step, first.ready) == (1, True)
    beat(coord, 3, [1, 2])  # host 3's late report: step 2 completes
    assert coord.state.newest_complete_step() == 2
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).forced_restore_step == -1
    again = _restore(coord)
    assert (again.step, again.ready) == (2, True)
    assert coord.restore_target() == 2


@pytest.mark.parametrize("asked", [-1, 3])
def test_a_newest_restore_of_a_step_no_longer_recoverable_takes_the_newest_complete_one(asked):
    """scratch-beside-backup (simulation seeds 4358, 14189, 19547, 23952, 52847): the job restored step 3,
    the newest complete one; then the hosts holding ranks 1 and 3's step 3 were replaced (empty RAM disks)
    and only step 1 stayed complete. The pin kept step 3 the restore target (GetSteps' forced_restore_step),
    so every PrepareRestore of the newest step failed ("step 3 is not recoverable") until the job started
    from scratch beside a complete step 1. ``asked`` 3: as ``CheckpointManager.restore()`` pins the step."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    for r in range(4):
        beat(coord, r, [1, 3])
    first = _restore(coord, asked)
    assert (first.step, first.ready) == (3, True)
    for r in range(4):  # every host reported: ranks 1 and 3's step 3 are on none of them
        beat(coord, r, [1] if r in (1, 3) else [1, 3])
    assert coord.state.newest_complete_step() == 1
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).forced_restore_step == -1
    again = _restore(coord)
    assert (again.step, again.ready) == (1, True), again.reason
    assert coord.restore_target() == 1


def test_a_newest_restore_stays_pinned_while_a_host_that_registered_again_has_not_reported():
    """The other side of the rule above (the in-flight cells gc-host and gc-restart): a host that registers
    again (restarted, perhaps with its RAM disk) drops what its previous process held until it reports, so
    the pinned step is briefly incomplete; it is not lost, and the pin stays the target meanwhile."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    peer = _holding(1, 1, 1, tier=tier_pb2.TIER_PEER)  # rank 1's step 1 also on host 0: step 1 stays complete
    coord.Heartbeat(pb.HeartbeatRequest(job="t", rank=0, incarnation=1, address="127.0.0.1:7000",
                                        full_report=True, known_epoch=coord.epoch,
                                        holdings=[_holding(0, 1, 0), _holding(0, 3, 0), peer]), Ctx())
    for r in (1, 2, 3):
        beat(coord, r, [1, 3])
    assert _restore(coord).step == 3
    # Host 1's new process registers (no inventory yet): its step 3 no longer counts, step 1 does.
    coord.Heartbeat(pb.HeartbeatRequest(job="t", rank=1, incarnation=2, address="127.0.0.1:7001",
                                        known_epoch=coord.epoch), Ctx())
    assert not coord.state.is_reported(1)
    assert coord.state.newest_complete_step() == 1
    assert coord.restore_target() == 3
    # It reports its RAM disk, kept: step 3 is complete again and still the target.
    coord.Heartbeat(pb.HeartbeatRequest(job="t", rank=1, incarnation=2, address="127.0.0.1:7001",
                                        full_report=True, known_epoch=coord.epoch,
                                        holdings=[_holding(1, 1, 1), _holding(1, 3, 1)]), Ctx())
    assert coord.state.newest_complete_step() == 3
    assert coord.restore_target() == 3
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).forced_restore_step == 3
    assert _restore(coord).step == 3


def test_a_restore_of_a_chosen_step_still_holds_back_newer_known_steps():
    """The other side of the rule above: a restore that names its step (a rollback past step 2) keeps that
    step the restore target until a step newer than every step known then completes."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)
    for r in range(4):
        beat(coord, r, [1, 2])
    assert _restore(coord, step=1).step == 1
    assert _restore(coord).step == 1
    for r in range(4):
        beat(coord, r, [1, 2, 3])
    assert _restore(coord).step == 3


def _serve(coord):
    from mtc_rpc import coordinator_pb2_grpc as pb_grpc
    from replicator.net import rpc

    server, port = rpc.create_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, coord)])
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, pb_grpc.CoordinatorStub(channel)


def _report(coord, rank, seq, steps):
    return pb.HeartbeatRequest(job="t", rank=rank, incarnation=7, address=f"127.0.0.1:{7000 + rank}",
                               full_report=True, known_epoch=coord.epoch, report_seq=seq,
                               holdings=[_holding(rank, s, rank) for s in steps])


def test_an_older_report_delivered_late_is_refused_not_taken_as_the_hosts_inventory():
    """complete-is-restorable and restore-not-held (simulation seeds 22603, 34231): the network delivered a
    host's older report again after a newer one (a duplicate, or one queued behind it), and the coordinator
    took its inventory as current: a step the host had deleted since counted as complete with it as the
    source, and a restore was declared ready on data the host no longer held. Now reports are numbered
    (``report_seq``) and one not above the last taken from the same incarnation is answered ABORTED and
    counts for nothing; unnumbered reports (an older daemon, seq 0) are taken as before."""
    coord = Coordinator(JobTopology(2, 1, 1), "t", keep_local=2)
    server, channel, stub = _serve(coord)
    try:
        for r in (0, 1):
            stub.Heartbeat(_report(coord, r, 1, [1]), timeout=10)
        assert coord.state.newest_complete_step() == 1
        stub.Heartbeat(_report(coord, 0, 2, []), timeout=10)  # host 0 deleted step 1
        assert coord.state.newest_complete_step() is None
        for seq in (1, 2):  # the first report again, late; the newest one duplicated
            with pytest.raises(grpc.RpcError) as e:
                stub.Heartbeat(_report(coord, 0, seq, [1]), timeout=10)
            assert e.value.code() == grpc.StatusCode.ABORTED
            assert coord.state.newest_complete_step() is None
        stub.Heartbeat(_report(coord, 0, 3, []), timeout=10)  # the next report is taken
        assert coord.state.newest_complete_step() is None
        stub.Heartbeat(_report(coord, 0, 0, [1]), timeout=10)  # unnumbered: taken as before
        assert coord.state.newest_complete_step() == 1
    finally:
        channel.close()
        server.stop(0)


def test_report_numbers_are_per_incarnation():
    """A restarted replicator (new incarnation) numbers its reports from 1 again: they are taken."""
    coord = Coordinator(JobTopology(2, 1, 1), "t", keep_local=2)
    server, channel, stub = _serve(coord)
    try:
        stub.Heartbeat(_report(coord, 1, 1, [1]), timeout=10)
        stub.Heartbeat(_report(coord, 0, 5, [1]), timeout=10)
        assert coord.state.newest_complete_step() == 1
        req = _report(coord, 0, 1, [])
        req.incarnation = 8
        stub.Heartbeat(req, timeout=10)
        assert coord.state.registered[0] == 8
        assert coord.state.newest_complete_step() is None
        with pytest.raises(grpc.RpcError) as e:  # the old incarnation's report, late: superseded
            stub.Heartbeat(_report(coord, 0, 6, [1]), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert coord.state.newest_complete_step() is None
    finally:
        channel.close()
        server.stop(0)


def test_two_candidates_whose_clocks_are_behind_never_share_an_epoch():
    """Equal epochs (simulation seed 81300, there a defect of the model's clock): candidates activate with
    ``max(time_ns, highest epoch accepted + 1)``, so two whose clocks are behind an epoch E they both
    accepted (clock skew; e.g. two standbys taking over on either side of a partition) both chose E + 1,
    and the fence could not tell them apart: a host that accepted one's epoch was taken by the other as
    its own. Now an epoch's low bits name its candidate: the epochs differ, and a host that accepted the
    newer one deposes the other."""
    e = 1_700_000_000_000_000_000
    cands = [Coordinator(JobTopology(2, 1, 1), "t", active=False, other_candidates=True, candidate=i)
             for i in range(3)]
    cands[0].activate(e)
    assert cands[0].epoch % 256 == 0 and cands[0].epoch >= e
    accepted = cands[0].epoch
    for c in cands[1:]:  # both clocks behind: time_ns < accepted
        c.activate(max(e - 5 * 10**9, accepted + 1))
    assert cands[1].epoch != cands[2].epoch
    assert [c.epoch % 256 for c in cands] == [0, 1, 2]
    newer, older = sorted(cands[1:], key=lambda c: c.epoch, reverse=True)
    served = [_serve(c) for c in (newer, older)]
    try:
        req = _report(newer, 0, 0, [])
        req.known_epoch = accepted
        answer = served[0][2].Heartbeat(req, timeout=10)
        assert answer.epoch == newer.epoch
        req.known_epoch = answer.epoch  # the host accepted the newer epoch; then reaches the other candidate
        with pytest.raises(grpc.RpcError) as err:
            served[1][2].Heartbeat(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # deposed
        assert not older.active and newer.active
    finally:
        for server, channel, _ in served:
            channel.close()
            server.stop(0)


def test_no_deletion_while_a_host_is_silent_and_no_step_is_complete():
    """gc-protected (simulation seed 42569, issue #33): after a failover candidate 0 (epoch 1) still answered
    host 0, while hosts 1-3 already reported to epoch 2 (silent to epoch 1, not yet declared lost). Epoch 2
    counted step 1 complete; epoch 1, without their reports, saw no complete step and told host 0 to delete
    its step 1 (beyond keep_local 2 of its steps 1-3). The rule "no deletion of a step newer than the newest
    complete one while a host is silent" holds when no step is complete too: then nothing goes."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=8.0,
                        heartbeat_seconds=1.0)

    def report(rank, steps):
        req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                                  full_report=True, known_epoch=coord.epoch,
                                  holdings=[_holding(rank, s, rank % 2) for s in steps])
        return coord.Heartbeat(req, Ctx())

    for r in range(1, 4):
        report(r, [])
    report(0, [1, 2, 3])
    clock.now += 3.0  # hosts 1-3 silent for 3 s (2 intervals of 1 s and more): not yet lost
    resp = report(0, [1, 2, 3])
    assert not coord.state.lost and coord.state.newest_complete_step() is None
    assert [(d.owner_rank, d.step) for d in resp.deletions] == []
    # Once every host reports again within a beat, GC goes on (no step complete: keep_local 2 of 3 stay).
    for r in range(1, 4):
        report(r, [])
    resp = report(0, [1, 2, 3])
    assert [(d.owner_rank, d.step) for d in resp.deletions] == [(0, 1)]


def _gc_of(resp):
    return {(d.owner_rank, d.step) for d in resp.deletions}


def test_a_restored_step_stays_held_against_gc_after_the_target_moves_on():
    """gc-protected (simulation seeds 44803, 62014, 82150, issue #33): the job's PrepareRestore pinned step
    1, the newest complete step while host 3's step 2 was not reported (a partition); host 3 came back and
    step 2 completed, so the restore target moved on to step 2 (seed 14687) and the pin of step 1 went with
    it: GC told the hosts to delete step 1 (beyond keep_local 1) while the job was still restoring it. The
    GC hold stays until a step newer than every step known at the pin completes, or another restore."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=1, clock=clock, host_lost_seconds=4.0)
    for r in range(3):
        beat(coord, r, [1, 2])
    beat(coord, 3, [1])
    assert _restore(coord).step == 1
    beat(coord, 3, [1, 2])  # host 3's late report: step 2 completes
    assert coord.state.newest_complete_step() == 2 and coord.restore_target() == 2
    assert coord.state.pinned_steps() == [1]
    assert all((r, 1) not in _gc_of(beat(coord, r, [1, 2])) for r in range(4))
    # A step newer than every step known at the pin (step 2) completes: the hold ends.
    for r in range(4):
        beat(coord, r, [1, 2, 3])
    assert coord.restore_target() == 3 and coord.state.pinned_steps() == []
    assert (0, 1) in _gc_of(beat(coord, 0, [1, 2, 3]))


def test_a_restored_step_is_released_by_the_next_restore():
    """The other way a restore's GC hold ends: the job's next PrepareRestore pins the step it restores."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=1, clock=clock, host_lost_seconds=4.0)
    for r in range(3):
        beat(coord, r, [1, 2])
    beat(coord, 3, [1])
    assert _restore(coord).step == 1
    beat(coord, 3, [1, 2])
    again = _restore(coord)
    assert (again.step, again.ready) == (2, True)
    assert coord.state.pinned_steps() == [2]
    assert (0, 1) in _gc_of(beat(coord, 0, [1, 2]))
    assert coord.release_restore_pin(2) and coord.state.pinned_steps() == []


def test_a_restore_of_a_replicas_identical_data_comes_with_its_witness_task():
    """newest-complete-regressed / complete-step-lost (simulation seed 95210, issue #33): rank 0's data is
    byte-identical to rank 2's, recorded only on hosts 0 and 2. Host 2 was replaced and restored its rank's
    data from host 0's copy; 15 ms after the restore landed, host 0 and the coordinator were replaced. The
    coordinator would have told host 2 to attest rank 0 on its next report, but the new one never learnt rank
    0's hash: no step complete although every byte was there. The restore's answer now names host 2 rank 0's
    witness (recorded at once, reported once the restore lands, as for a coming copy)."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2, clock=clock, host_lost_seconds=4.0)

    report = _full_reporter(coord)

    replica = tier_pb2.TIER_REPLICA
    held = {r: [_holding(r, 4, r % 2), _holding((r + 2) % 4, 4, r % 2, replica, size=0)] for r in range(4)}
    # Copies of rank 0's data on host 1 and of rank 2's on host 3: no byte copy is needed when host 2 goes.
    held[1].append(_holding(0, 4, 0, tier_pb2.TIER_PEER))
    held[3].append(_holding(2, 4, 0, tier_pb2.TIER_PEER))
    for r in range(4):
        report(r, held[r])
    assert coord.state.newest_complete_step() == 4
    resp = report(2, [], incarnation=8)  # host 2 replaced: its RAM disk is empty
    assert resp.HasField("restore") and resp.restore.step == 4
    assert {s.content_hash for s in resp.restore.sources} == {"h4.0"}
    tasks = [(c.owner_rank, c.step, c.source_rank, c.content_hash) for c in resp.copies]
    assert tasks == [(0, 4, 2, "h4.0")], tasks  # hash only: host 2 records rank 0's identity
    # A host that already holds a record of rank 0 is not told again.
    resp = report(2, [_holding(0, 4, 0, replica, size=0)], incarnation=8)
    assert not [c for c in resp.copies if c.source_rank == 2 and c.owner_rank == 0]


def test_gc_keeps_the_durable_step_while_a_replicas_identity_rests_on_one_report():
    """newest-complete-regressed (simulation seed 19, issue #45 item 3): step 3 was durable (each host holds its
    data and attests its replica's identical data). Step 4 was saved everywhere, rank 2's data equal to rank
    0's, but host 0's witness of rank 2 was in a delayed answer: only host 2's own report said that rank 2's
    data is that hash. Rank 2 had two holders of its bytes (host 2's, host 0's rank 0 data), so the coordinator
    counted step 4 redundant and told host 0 to delete step 3 (keep_local 1); host 2 was replaced, its empty
    report made step 4 incomplete, and with step 3 gone the newest complete step fell to 1. Redundant now means
    durable: each rank's data and the record that it is that rank's survive any one host, and GC keeps the
    newest durable step until a newer one is."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=1, clock=clock, host_lost_seconds=4.0)

    report = _full_reporter(coord)

    replica = tier_pb2.TIER_REPLICA
    held = {r: [_holding(r, 3, r % 2), _holding((r + 2) % 4, 3, r % 2, replica, size=0), _holding(r, 4, r % 2)]
            for r in range(4)}
    for r in (1, 3):  # slice 1's attestations of step 4 are in; host 0's witness of rank 2 is not
        held[r].append(_holding((r + 2) % 4, 4, 1, replica, size=0))
    ordered = set()
    for _ in range(2):
        for r in range(4):
            ordered |= _gc_of(report(r, held[r]))
    assert not {k for k in ordered if k[1] == 3}, ordered
    st = coord.state
    assert st.newest_complete_step() == 4 and st.is_redundant(3)
    assert len({s.holder_rank for s in st.rank_sources(4, 2)}) == 2  # two holders of rank 2's bytes ...
    assert not st.is_redundant(4) and st.newest_redundant_step() == 3  # ... its identity on host 2 alone
    report(2, [], incarnation=8)  # host 2 replaced: its RAM disk is empty
    assert st.newest_complete_step() == 3, st.missing_ranks(3)
    # Host 0's witness lands (and host 2's replacement restored step 4): step 4 is durable, step 3 may go.
    held[0].append(_holding(2, 4, 0, replica, size=0))
    report(0, held[0])
    report(2, [_holding(2, 4, 0), _holding(0, 4, 0, replica, size=0)], incarnation=8)
    assert st.is_redundant(4)
    assert {(0, 3), (2, 3)} <= _gc_of(report(0, held[0]))


def test_gc_keeps_the_newest_ec_step_that_survives_a_loss_without_all_its_parity():
    """newest-complete-regressed (simulation seed 15977, ec:2+2): step 4 had all its parity, then bit rot took
    host 2's; step 5 completed (no parity yet) on the facts of host 1, replaced and not yet declared lost. GC
    held only the newest step with all its parity (none now) and deleted step 4; host 1 was declared lost,
    step 5 could not be rebuilt, and no step was complete. With three of four parity blocks step 4 still
    survives any one host (M = 2): it is the newest durable step, and GC keeps it."""
    from replicator.coordinator.planner import CoordinatorState
    from replicator.erasure.redundancy import Redundancy
    from replicator.tiers import Holding, Tier

    st = CoordinatorState(JobTopology(4, 2, 0), Redundancy.ec(2, 2))
    for r in range(4):
        st.register(r, 1)
        st.report_inventory(r, [], 1)
    for r in range(4):
        st.report_committed(r, Holding(r, 4, f"s4-r{r}", 300))
    for r in range(4):
        for step, spec in st.ec.tasks_for(r):
            st.report_committed(r, Holding(r, step, spec.digest(), 100, Tier.PARITY, group=spec))
    assert st.is_redundant(4)
    st.ec.report_removed(2, [4])  # bit rot: host 2 drops its parity of step 4
    for r in range(4):
        st.report_committed(r, Holding(r, 5, f"s5-r{r}", 300))
    assert st.newest_complete_step() == 5 and st.newest_redundant_step() is None
    assert all(st.gc_for(r, 1) == [] for r in range(4))  # step 4 stays: it survives any one host
    st.forget_host(1)  # host 1 was replaced: declared lost
    assert st.newest_complete_step() == 4 and st.ec.rebuild_ranks(4) == [1]
