"""The coordinator service in-process: what it hands out before and after every host has reported."""

import grpc
import pytest

from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.tier_wire import to_wire


class Ctx:
    """The two ServicerContext methods the coordinator uses."""

    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")

    def is_active(self):
        return True


def beat(coord, rank, holdings):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                              newest_saved_step=3, full_report=True, known_epoch=coord.epoch,
                              holdings=[pb.Holding(owner_rank=o, step=s, content_hash=h, size=10, tier=to_wire(t))
                                        for o, s, h, t in holdings])
    return coord.Heartbeat(req, Ctx())


# After a restart, 2 slices x 2 hosts, replicas identical (0~2, 1~3). Host 0 attests rank 2's step 3 only,
# host 1 rank 3's step 3: with just hosts 0 and 1 reported, step 3 looks complete and step 2 does not.
HOLDINGS = {
    0: [(0, 2, "A2", "local"), (0, 3, "A3", "local"), (2, 3, "A3", "replica")],
    1: [(1, 2, "B2", "local"), (1, 3, "B3", "local"), (3, 3, "B3", "replica")],
    2: [(2, 2, "A2", "local"), (2, 3, "A3", "local")],
    3: [(3, 2, "B2", "local"), (3, 3, "B3", "local")],
}


def test_no_deletion_until_every_rank_reported():
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=2)
    for r in (0, 1):
        assert not beat(coord, r, HOLDINGS[r]).deletions
    assert coord.state.newest_complete_step() == 3  # the premature picture
    for r in (2, 3):
        beat(coord, r, HOLDINGS[r])
    # Everyone reported: steps 2 and 3 are both complete and within keep_local=2; nothing to delete.
    assert coord.state.globally_complete_steps() == [2, 3]
    for r in range(4):
        assert not beat(coord, r, HOLDINGS[r]).deletions


def test_unknown_rank_and_wrong_job_are_rejected():
    coord = Coordinator(JobTopology(2, 1, 1), "t")
    with pytest.raises(grpc.RpcError, match="unknown rank 5"):
        beat(coord, 5, [])
    with pytest.raises(grpc.RpcError, match="FAILED_PRECONDITION"):
        coord.Heartbeat(pb.HeartbeatRequest(job="x", rank=0, incarnation=1), Ctx())
    assert coord.state.registered == {}


# ----------------------------------------------------------------------- digests, liveness, failover, limits

from replicator.tiers import Holding, inventory_digest  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class LateCtx(Ctx):
    def time_remaining(self):
        return -0.5


def pb_holdings(rank, items):
    return [pb.Holding(owner_rank=o, step=s, content_hash=h, size=10, tier=to_wire(t)) for o, s, h, t in items]


def digest(items):
    return inventory_digest([Holding(o, s, h, 10, t) for o, s, h, t in items])


def full(coord, rank, items, epoch=None):
    """A full report by a host that accepted ``epoch`` (by default this coordinator's, learnt from an answer)."""
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, address=f"127.0.0.1:{7000 + rank}",
                              newest_saved_step=-1, full_report=True, holdings=pb_holdings(rank, items),
                              inventory_digest=digest(items),
                              known_epoch=coord.epoch if epoch is None else epoch)
    return coord.Heartbeat(req, Ctx())


def delta(coord, rank, base, items, added=(), removed=(), ctx=None):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=1, newest_saved_step=-1, base_digest=base,
                              known_epoch=coord.epoch,
                              inventory_digest=digest(items), holdings=pb_holdings(rank, added),
                              removed=[pb.Deletion(owner_rank=o, step=s) for o, s in removed])
    return coord.Heartbeat(req, ctx or Ctx())


def test_unchanged_heartbeat_is_a_digest_and_a_mismatch_asks_for_a_full_report():
    coord = Coordinator(JobTopology(4, 2, 1), "t")
    for r in range(4):
        assert full(coord, r, HOLDINGS[r]).acked_digest == digest(HOLDINGS[r])
    v = coord.state.version
    resp = delta(coord, 2, digest(HOLDINGS[2]), HOLDINGS[2])
    assert resp.acked_digest == digest(HOLDINGS[2]) and coord.state.version == v
    # A delta: rank 2 committed step 4.
    new = [*HOLDINGS[2], (2, 4, "A4", "local")]
    assert delta(coord, 2, digest(HOLDINGS[2]), new, added=[(2, 4, "A4", "local")]).acked_digest == digest(new)
    assert coord.state.holding(2, (2, 4)) is not None
    # A base the coordinator does not hold (e.g. after its restart): nothing applied, full report asked.
    resp = delta(coord, 2, "bogus", new, removed=[(2, 4)])
    assert resp.acked_digest == "" and not resp.copies and not resp.deletions
    assert coord.state.holding(2, (2, 4)) is not None


def test_expired_heartbeat_is_dropped_unanswered():
    coord = Coordinator(JobTopology(2, 1, 1), "t")
    req = pb.HeartbeatRequest(job="t", rank=0, incarnation=1, full_report=True)
    with pytest.raises(grpc.RpcError, match="DEADLINE_EXCEEDED"):
        coord.Heartbeat(req, LateCtx())
    assert coord.state.registered == {}


def test_silent_hosts_are_lost_and_restore_does_not_wait_for_them():
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock)
    for r in range(4):
        full(coord, r, HOLDINGS[r])
    for _ in range(2):
        clock.t += 3.0
        for r in (0, 1):
            full(coord, r, HOLDINGS[r])
    st = coord.GetStatus(pb.GetStatusRequest(hosts=True), Ctx())
    assert [h.rank for h in coord.GetStatus(pb.GetStatusRequest(hosts=True, rank_first=3, rank_count=1),
                                            Ctx()).hosts] == [3]
    assert st.hosts_lost == 2 and st.lost_ranks == "2-3" and st.lost[0].ranks == "2-3"
    assert [h.rank for h in st.hosts if h.lost] == [2, 3]
    assert coord.state.newest_complete_step() == 3  # 0 and 1 attest their replicas' step 3
    resp = coord.PrepareRestore(pb.PrepareRestoreRequest(step=-1, wait_seconds=300), Ctx())
    assert resp.step == 3 and resp.ready and list(resp.lost_ranks) == [2, 3]
    assert "lost hosts not waited for: ranks 2-3" in resp.reason
    # Rank 3 returns: a new registration, counted.
    full(coord, 3, [])
    st = coord.GetStatus(pb.GetStatusRequest(), Ctx())
    assert st.hosts_lost == 1 and st.hosts_reregistered == 1


def test_standby_and_deposed_coordinators_answer_unavailable():
    coord = Coordinator(JobTopology(2, 1, 1), "t", active=False)
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*standby"):
        full(coord, 0, [])
    coord.activate(50)
    assert full(coord, 0, []).epoch == 50
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*deposed"):
        full(coord, 1, [], epoch=60)
    assert not coord.active
    coord.activate(10)  # re-activation: above every epoch seen
    assert coord.epoch == 61


def test_callers_of_another_node_count_are_sent_to_the_next_candidate():
    """Orbax mode: a coordinator left from an incarnation with another node count (e.g. on a host of a lost
    slice) is skipped like a standby; its registrations and epoch are not touched by the other job's hosts."""
    coord = Coordinator(JobTopology(4, 2, 1), "t", active=False)
    coord.activate(50)
    req = pb.HeartbeatRequest(job="t", rank=1, incarnation=1, address="127.0.0.1:7001", full_report=True,
                              known_epoch=99, nodes=2)
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*serves 4 hosts, the caller's job 2"):
        coord.Heartbeat(req, Ctx())
    assert coord.state.registered == {} and coord.active and coord.epoch == 50
    for method, request in (("GetStatus", pb.GetStatusRequest(nodes=2)),
                            ("PrepareRestore", pb.PrepareRestoreRequest(step=-1, nodes=2))):
        with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*serves 4 hosts"):
            getattr(coord, method)(request, Ctx())
    # The same node count, or none said (native hosts, the CLI): served as before.
    req.nodes, req.known_epoch = 4, 50
    assert coord.Heartbeat(req, Ctx()).epoch == 50
    for r in (0, 2, 3):  # GetStatus answers once every host reported (issue #33)
        full(coord, r, [])
    assert coord.GetStatus(pb.GetStatusRequest(), Ctx()).topology.nodes == 4


def test_waiters_are_bounded_and_oversized_reports_refused():
    coord = Coordinator(JobTopology(2, 1, 1), "t", max_waiters=0)
    with pytest.raises(grpc.RpcError, match="RESOURCE_EXHAUSTED"):
        coord.PrepareRestore(pb.PrepareRestoreRequest(step=-1, wait_seconds=1), Ctx())
    answered = Coordinator(JobTopology(2, 1, 1), "t", max_waiters=0)
    for r in range(2):  # GetSteps answers once every host reported (issue #33)
        full(answered, r, [])
    assert answered.GetSteps(pb.GetStepsRequest(wait_seconds=0), Ctx()).newest_complete_step == -1
    limit = coord.max_pieces_per_host()
    many = [(0, s, f"h{s}", "local") for s in range(limit + 1)]
    with pytest.raises(grpc.RpcError, match="INVALID_ARGUMENT.*at most"):
        full(coord, 0, many)
    assert coord.state.registered == {}


def test_client_fails_over_to_the_serving_candidate_and_honours_retry_advice():
    import time as _time

    from mtc_rpc import coordinator_pb2_grpc as pb_grpc
    from replicator.coordinator.client import CoordinatorClient
    from replicator.net import rpc

    standby = Coordinator(JobTopology(2, 1, 1), "t", active=False)
    busy = Coordinator(JobTopology(2, 1, 1), "t", heartbeat_seconds=0.3, max_waiters=0, address="busy")
    servers = []
    addrs = []
    for c in (standby, busy):
        server, port = rpc.create_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, c)])
        server.start()
        servers.append(server)
        addrs.append(f"127.0.0.1:{port}")
    for r in range(2):  # answers once every host reported (issue #33)
        full(busy, r, [])
    dead = "127.0.0.1:1"  # nothing listens: refused at once
    client = CoordinatorClient(",".join([dead, *addrs]), rpc_timeout_seconds=2, failover_seconds=1.5)
    try:
        st = client.status()
        assert st.coordinator_address == "busy" and client.serving_address == addrs[1]
        t0 = _time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.prepare_restore(None, wait_seconds=0)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(e.value.trailing_metadata())["retry-after-seconds"] == "0.50"
        assert _time.monotonic() - t0 >= 0.5  # retried after the advised delay before giving up
    finally:
        client.close()
        for s in servers:
            s.stop(0)


def test_an_unchanged_heartbeat_rederives_nothing(monkeypatch):
    from replicator.coordinator.copies import CopyPlanner
    from replicator.coordinator.coverage import Coverage

    coord = Coordinator(JobTopology(8, 2, 1), "t")
    items = {r: [(r, 1, f"h{r % 4}", "local")] for r in range(8)}
    for r in range(8):
        full(coord, r, items[r])
    for r in range(8):  # hand out (and forget) the first answers: views now derived
        delta(coord, r, digest(items[r]), items[r])
    calls = []
    for part, name in ((Coverage, "_derive_coverage"), (CopyPlanner, "_derive_tasks")):
        real = part._derive
        monkeypatch.setattr(part, "_derive",
                            lambda self, *a, n=name, f=real: (calls.append((n, *a)), f(self, *a))[1])
    for _ in range(5):
        for r in range(8):
            assert delta(coord, r, digest(items[r]), items[r]).acked_digest == digest(items[r])
    assert calls == []
    new = [*items[5], (5, 2, "x", "local")]
    delta(coord, 5, digest(items[5]), new, added=[(5, 2, "x", "local")])
    # One new fact: only rank 5's replica group of step 2 is re-derived.
    assert sorted(calls) == [("_derive_coverage", 2, 1), ("_derive_tasks", 2, 1)]


def test_a_deletion_names_the_content_of_the_copy_it_means():
    """The host deletes only that content: a save of the step committed since the answer left is kept."""
    coord = Coordinator(JobTopology(4, 2, 1), "t", keep_local=1)
    for r in range(4):
        beat(coord, r, HOLDINGS[r])
    resp = beat(coord, 0, HOLDINGS[0])
    assert {(d.owner_rank, d.step, d.content_hash) for d in resp.deletions} == {(0, 2, "A2")}


def test_an_isolated_coordinator_decides_nothing_and_answers_no_client_until_a_host_reports():
    """Issue #33: the coordinator's host cut off from every other host (a partition) while another candidate
    takes over. Its view goes stale: it hands out no deletion and answers no client (they try the next
    candidate) until another host reports again, whose newer epoch then deposes it."""
    clock = Clock()
    items = {r: [(r, s, f"h{r}-{s}", "local") for s in (1, 2, 3, 4)] for r in range(3)}
    coord = Coordinator(JobTopology(3, 1, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock,
                        keep_local=2, other_candidates=True, epoch=10)
    for r in range(3):
        full(coord, r, items[r])
    assert list(full(coord, 0, items[0]).deletions)  # the whole picture: steps 1-2 go
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).newest_complete_step == 4
    for _ in range(3):  # only its own host's reports arrive (it has not acted on those deletions yet)
        clock.t += 6.0
        resp = full(coord, 0, items[0])
        assert not resp.deletions and not resp.copies and not resp.HasField("restore")
    assert coord.isolated()
    for call, req in (("GetSteps", pb.GetStepsRequest()), ("GetStatus", pb.GetStatusRequest()),
                      ("PrepareRestore", pb.PrepareRestoreRequest(step=-1)),
                      ("LocateStep", pb.LocateStepRequest(step=4))):
        with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*isolated"):
            getattr(coord, call)(req, Ctx())
    # The admin service (`mtc status`, the operator's commands) as the daemon serves it: refused too.
    from mtc_rpc import admin_pb2 as apb
    from replicator.coordinator.admin import AdminServicer
    from replicator.daemon import _ServingOnly

    admin = _ServingOnly(AdminServicer(coord), coord)
    for call, req in (("GetSummary", apb.GetSummaryRequest()), ("ListSteps", apb.ListStepsRequest())):
        with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*isolated"):
            getattr(admin, call)(req, Ctx())
    # A host that never moved to another coordinator reports again: it serves again.
    full(coord, 1, items[1])
    assert not coord.isolated()
    # It was the one cut off: the hosts it declared lost are expected again, and clients are answered once
    # they reported (or were declared lost afresh), not from a view without them (nothing complete).
    assert not coord.state.lost
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*rebuilding.*1 not heard yet"):
        coord.GetSteps(pb.GetStepsRequest(wait_seconds=0), Ctx())
    # One that accepted a newer epoch deposes it.
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*deposed"):
        full(coord, 2, items[2], epoch=11)
    assert not coord.active


def test_asking_whether_a_coordinator_is_isolated_changes_nothing():
    """STYLE.md 21: ``isolated()`` is a question. Asked of a coordinator that was isolated and no longer is (here
    it stepped down), it used to leave isolation on the spot: the hosts it had declared lost were expected again.
    Now only a heartbeat's answer or a client's call (``_follow_isolation``, the one command) does that."""
    clock = Clock()
    items = {r: [(r, s, f"h{r}-{s}", "local") for s in (1, 2)] for r in range(3)}
    coord = Coordinator(JobTopology(3, 1, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock,
                        keep_local=2, other_candidates=True, epoch=10)
    for r in range(3):
        full(coord, r, items[r])
    for _ in range(3):  # only its own host's reports arrive
        clock.t += 6.0
        full(coord, 0, items[0])
    assert coord.isolated() and set(coord.state.lost) == {1, 2}
    coord.deactivate("a newer candidate serves")
    version = coord.state.version
    for _ in range(3):
        assert not coord.isolated()
    assert set(coord.state.lost) == {1, 2} and coord.state.version == version


def test_a_cut_off_coordinator_is_isolated_from_the_first_host_it_declares_lost():
    """make test-faults, coordinator-host-cut (issue #33): the serving coordinator's host is cut off; the other
    hosts fall silent together but are declared lost one by one, a beat apart. Once hosts 1 and 3 (the only
    holders of rank 1's and 3's data of step 3) were lost and host 2 not yet, it answered newest complete step
    1 (an older copy on its own host) to a client it had told 3. It is isolated from the first loss on: no
    client answer, no task, until another host reports again."""
    clock = Clock()
    items = {0: [(0, 1, "a1", "local"), (1, 1, "b1", "peer"), (0, 3, "a3", "local"), (2, 3, "a3", "replica")],
             1: [(1, 3, "b3", "local")], 2: [(2, 1, "a1", "local"), (3, 1, "b1", "replica"), (2, 3, "a3", "local")],
             3: [(3, 3, "b3", "local"), (1, 3, "b3", "replica")]}
    coord = Coordinator(JobTopology(4, 2, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=6.0, clock=clock,
                        keep_local=2, other_candidates=True, epoch=10)
    for r in (1, 3, 0):
        full(coord, r, items[r])
    clock.t += 0.5
    full(coord, 2, items[2])
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).newest_complete_step == 3
    # The cut: only its own host reports, every second.
    answered = []
    for _ in range(11):
        clock.t += 0.5
        resp = full(coord, 0, items[0])
        try:
            answered.append(coord.GetSteps(pb.GetStepsRequest(), Ctx()).newest_complete_step)
        except grpc.RpcError as e:
            assert "isolated" in str(e)
            assert not resp.deletions and not resp.copies and not resp.HasField("restore")
    assert set(coord.state.lost) == {1, 3}  # host 2 not yet declared lost
    assert answered and min(answered) == 3, answered  # never an older step than it answered before
    assert coord.isolated()
    clock.t += 0.5
    full(coord, 0, items[0])
    assert set(coord.state.lost) == {1, 2, 3} and coord.isolated()
    # A host that never moved to another coordinator reports again: it serves again, once the others reported.
    full(coord, 2, items[2])
    assert not coord.isolated() and not coord.state.lost


def test_a_coordinator_hearing_other_hosts_is_not_isolated_by_one_host_lost():
    """One host really lost while the others keep reporting: the coordinator keeps answering."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=6.0, clock=clock,
                        other_candidates=True, epoch=10)
    for r in range(4):
        beat(coord, r, HOLDINGS[r])
    for _ in range(7):
        clock.t += 1.0
        for r in (0, 1, 2):
            beat(coord, r, HOLDINGS[r])
    assert set(coord.state.lost) == {3} and not coord.isolated()
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).newest_complete_step == 3


def test_a_coordinator_rebuilding_its_view_answers_get_steps_only_once_every_live_host_reported():
    """Issue #33 (tests/faults): a candidate that just took over (or came back) rebuilds its view from the
    hosts' next reports. Answered from some of them, GetSteps said newest complete step -1 to a client that
    had been told 3 (and a partial view can also say a step not complete yet). It answers UNAVAILABLE
    (callers retry, or try the next candidate) until every live host reported or was declared lost."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock,
                        other_candidates=True, epoch=10)
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*rebuilding"):
        coord.GetSteps(pb.GetStepsRequest(), Ctx())
    for r in (0, 1):
        beat(coord, r, HOLDINGS[r])
    assert coord.state.newest_complete_step() == 3  # the premature picture is not handed out
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*rebuilding"):
        coord.GetSteps(pb.GetStepsRequest(), Ctx())
    beat(coord, 2, HOLDINGS[2])
    for _ in range(6):  # rank 3 stays silent: declared lost, no longer waited for
        clock.t += 1.0  # the others report every interval (silent for the takeover delay, they may have moved)
        for r in (0, 1, 2):
            beat(coord, r, HOLDINGS[r])
    assert set(coord.state.lost) == {3}
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).newest_complete_step == 3


def test_a_successor_counts_the_old_coordinators_silence_from_before_its_takeover():
    """restart-while-cut-0 (tests/faults): candidate 1 (rank 2) takes over once candidate 0 (rank 0) has been
    silent to it for the takeover time; rank 0, cut off, reports nowhere. Counted from the activation, clients
    waited a whole lost-host time more for rank 0 to be declared lost (10-13 s after the cut). Its clock starts
    when it fell silent: rank 0 is lost 5 - 3 = 2 s after the takeover, the other hosts still get 5 s."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock,
                        other_candidates=True, active=False, candidate=1, lower_candidates=[0])
    coord.activate(10, lower_silent_seconds=3.0)
    for r in (1, 2, 3):
        beat(coord, r, HOLDINGS[r])
    with pytest.raises(grpc.RpcError, match="UNAVAILABLE.*rebuilding.*1 not heard yet"):
        coord.GetSteps(pb.GetStepsRequest(), Ctx())
    clock.t += 1.0
    for r in (1, 2, 3):
        beat(coord, r, HOLDINGS[r])
    assert not coord.state.lost
    clock.t += 1.0
    for r in (1, 2):  # rank 3 silent for 2 s: not lost (its clock started at the takeover)
        beat(coord, r, HOLDINGS[r])
    assert set(coord.state.lost) == {0}
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).epoch == coord.epoch  # answered


def test_a_coordinator_without_other_candidates_keeps_serving_alone():
    clock = Clock()
    coord = Coordinator(JobTopology(2, 1, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock)
    full(coord, 0, [(0, 1, "a", "local")])
    full(coord, 1, [(1, 1, "b", "local")])
    clock.t += 9.0
    full(coord, 0, [(0, 1, "a", "local")])
    assert not coord.isolated() and set(coord.state.lost) == {1}
    assert coord.GetSteps(pb.GetStepsRequest(), Ctx()).newest_complete_step == -1  # answered: rank 1 is lost


def test_a_client_refuses_answers_of_an_epoch_older_than_one_it_was_answered_with():
    """Issue #33: after a partition heals, the old coordinator (candidate 0, epoch 5) answers again from its
    stale view before it hears of its successor (epoch 9). A client that was answered with epoch 9 fails over
    past it instead of believing an older newest step; a fresh client (no epoch seen) may still be answered
    by it, and the coordinator side's fence (isolation, deposition by a host's report) covers that one."""
    from mtc_rpc import admin_pb2 as apb
    from mtc_rpc import admin_pb2_grpc as apb_grpc
    from mtc_rpc import coordinator_pb2_grpc as pb_grpc
    from replicator.coordinator.admin import AdminServicer
    from replicator.coordinator.client import Candidates, CoordinatorClient, StaleEpochError
    from replicator.daemon import _ServingOnly
    from replicator.net import rpc

    old = Coordinator(JobTopology(2, 1, 1), "t", active=False, address="old")
    new = Coordinator(JobTopology(2, 1, 1), "t", active=False, address="new")
    new.activate(9)
    for r in range(2):  # the successor's view: step 3 complete on both hosts
        full(new, r, [(r, 3, f"h{r}", "local")])
    servers, addrs = [], []
    for c in (old, new):
        server, port = rpc.create_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, c),
                                                         (apb_grpc.add_AdminServicer_to_server,
                                                          _ServingOnly(AdminServicer(c), c))])
        server.start()
        servers.append(server)
        addrs.append(f"127.0.0.1:{port}")
    client = CoordinatorClient(",".join(addrs), rpc_timeout_seconds=2, failover_seconds=1.0)
    admin = Candidates(addrs, rpc.make_channel, stub_class=apb_grpc.AdminStub, fence_epochs=True)
    try:
        steps = client.steps(wait_seconds=0)  # old is a standby: the successor answers
        assert (steps.newest_complete_step, steps.epoch, client.highest_epoch) == (3, 9, 9)
        assert admin.call("GetSummary", apb.GetSummaryRequest(), timeout=2).epoch == 9
        # The old one serves again with its stale view (it never heard of epoch 9): nothing complete.
        old.activate(5)
        for r in range(2):
            full(old, r, [])
        assert old.active and old.epoch == 5
        assert old.GetSteps(pb.GetStepsRequest(wait_seconds=0), Ctx()).newest_complete_step == -1
        for _ in range(3):
            got = client.steps(wait_seconds=0)
            assert (got.newest_complete_step, got.epoch) == (3, 9) and client.serving_address == addrs[1]
        assert client.status().epoch == 9
        assert client.prepare_restore(None, wait_seconds=0) == 3
        summary = admin.call("GetSummary", apb.GetSummaryRequest(), timeout=2)
        assert (summary.epoch, summary.newest_complete_step) == (9, 3)
        # With the successor gone, the stale one is refused outright: an error, not an older answer.
        servers[1].stop(0)
        with pytest.raises(grpc.RpcError) as e:
            client.steps(wait_seconds=0)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        with pytest.raises(StaleEpochError, match="epoch 5, older than epoch 9"):
            admin.call_one(0, "ListSteps", apb.ListStepsRequest(), timeout=2, probe_timeout=2)
        # A fresh client has seen no epoch: the old coordinator's answer is the best it has.
        fresh = CoordinatorClient(addrs[0], rpc_timeout_seconds=2, failover_seconds=1.0)
        try:
            assert fresh.steps(wait_seconds=0).epoch == 5
        finally:
            fresh.close()
    finally:
        client.close()
        admin.close()
        for s in servers:
            s.stop(0)


def _noticing(coord, rank, preempting, incarnation=1):
    req = pb.HeartbeatRequest(job="t", rank=rank, incarnation=incarnation, address=f"127.0.0.1:{7000 + rank}",
                              newest_saved_step=-1, full_report=True, holdings=pb_holdings(rank, HOLDINGS[rank]),
                              inventory_digest=digest(HOLDINGS[rank]), known_epoch=coord.epoch,
                              preempting=preempting)
    return coord.Heartbeat(req, Ctx()).preemption_noticed


def test_a_preemption_notice_ends_when_the_preempted_hosts_are_replaced_or_lost():
    """The job's notice is told to every host while a preempted host's process lives; its replacement (a new
    process, no notice) or its loss ends it, so a job restarted beside replicators that kept running (the
    coordinator's among them) is not told to stop again at its first step (bench.goodput found it: the
    notice stuck for the coordinator's life)."""
    clock = Clock()
    coord = Coordinator(JobTopology(4, 2, 1), "t", heartbeat_seconds=1.0, host_lost_seconds=5.0, clock=clock)
    assert not any(_noticing(coord, r, False) for r in range(4))
    assert _noticing(coord, 2, True) and _noticing(coord, 3, True)  # slice 1 preempted
    assert _noticing(coord, 0, False) and _noticing(coord, 1, False)  # told to every host
    assert _noticing(coord, 2, False, incarnation=2)  # host 2 replaced; host 3 still preempting
    assert not _noticing(coord, 3, False, incarnation=2)  # both replaced: over
    assert not _noticing(coord, 0, False)
    assert _noticing(coord, 3, True, incarnation=3)  # preempted again; this time never replaced
    for _ in range(3):
        clock.t += 3.0
        for r, inc in ((0, 1), (1, 1), (2, 2)):
            _noticing(coord, r, False, incarnation=inc)
    assert 3 in coord.lost_ranks()
    assert not _noticing(coord, 0, False)  # host 3 declared lost: over


def test_the_coordinators_flush_knows_when_every_preempting_host_was_told():
    """A JobSet restart: every host's replicator flushes on its SIGTERM and asks GetSteps (``asker_rank``). The
    coordinator's host may go once each other preempting host was told the step is in the bucket (it lingered a
    fixed 7 s before, holding every Pod and so the JobSet's re-creation); a host not preempting is not waited for."""
    coord = Coordinator(JobTopology(4, 2, 1), "t")
    for r in range(4):
        full(coord, r, HOLDINGS[r])
    for r in (0, 1, 2):
        _noticing(coord, r, True)
    assert not coord.flush_told(-1, me=0)  # hosts 1 and 2 asked nothing yet
    coord.in_bucket = lambda step: step == 3  # step 3 committed in the bucket (how is the scheduler's business)
    coord.GetSteps(pb.GetStepsRequest(wait_seconds=0, asker_rank=1), Ctx())
    assert not coord.flush_told(3, me=0)
    coord.GetSteps(pb.GetStepsRequest(wait_seconds=0), Ctx())  # a trainer's client: no asker
    coord.GetSteps(pb.GetStepsRequest(wait_seconds=0, asker_rank=99), Ctx())  # not a rank: ignored
    assert not coord.flush_told(3, me=0)
    coord.GetSteps(pb.GetStepsRequest(wait_seconds=0, asker_rank=2), Ctx())
    assert coord.flush_told(3, me=0)  # host 3 got no notice: not waited for
    assert not coord.flush_told(2, me=0)  # told of step 3, not of step 2


def test_a_small_jobs_restore_plan_is_answered_within_10ms_of_the_last_fresh_report():
    """PrepareRestore trusts only reports made after it was asked; a small job's waiter looks again every 10 ms,
    not every 0.1 s (each Orbax handshake waited up to two such polls: the fresh reports, then the data)."""
    import threading
    import time

    coord = Coordinator(JobTopology(4, 2, 1), "t")
    for r in range(4):
        full(coord, r, HOLDINGS[r])
    got = {}

    def ask():
        got["resp"] = coord.PrepareRestore(pb.PrepareRestoreRequest(step=-1, wait_seconds=10), Ctx())
        got["at"] = time.monotonic()

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.05)
    for r in range(4):  # the fresh reports, the last one at `last`
        full(coord, r, HOLDINGS[r])
    last = time.monotonic()
    t.join(timeout=10)
    assert got["resp"].ready and got["resp"].step == 3
    assert got["at"] - last < 0.06, f"answered {got['at'] - last:.3f}s after the last report"
    assert Coordinator(JobTopology(400, 2, 1), "t")._restore_poll() == pytest.approx(0.1)
