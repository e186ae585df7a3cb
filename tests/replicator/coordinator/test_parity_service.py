"""The coordinator service in ec mode over real gRPC (loopback): parity holdings with their group in heartbeats,
ParityTasks with the members' addresses (not repeated while in flight), parity deletions (tier TIER_PARITY),
and a replaced host's restore task naming a TIER_PARITY source."""

import grpc
import pytest

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from mtc_rpc import tier_pb2
from replicator.coordinator.parity_answer import PARITY_RETRY_MIN_SECONDS
from replicator.coordinator.service import Coordinator
from replicator.coordinator.topology import JobTopology
from replicator.erasure.redundancy import Redundancy
from replicator.erasure.wire import CodeGroupSpec
from replicator.net import rpc
from replicator.tier_wire import holding_from_wire, holding_to_wire
from replicator.tiers import Holding, Tier, inventory_digest, inventory_key

SIZE = 300


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Host:
    """What a replicator reports: its inventory (parity included), as a full report or a delta."""

    def __init__(self, stub, rank, incarnation=1, address=""):
        self.stub, self.rank, self.incarnation = stub, rank, incarnation
        self.address = address or f"10.0.0.{rank}:7000"
        self.held: dict = {}
        self.acked: dict | None = None
        self.seq = 0
        self.epoch = 0

    def add(self, h):
        self.held[inventory_key(h)] = h

    def drop(self, key):
        self.held.pop(key, None)

    def beat(self):
        inv = list(self.held.values())
        self.seq += 1
        req = pb.HeartbeatRequest(job="t", rank=self.rank, incarnation=self.incarnation,
                                  address=self.address, inventory_digest=inventory_digest(inv),
                                  known_epoch=self.epoch, report_seq=self.seq, newest_saved_step=-1)
        if self.acked is None:
            req.full_report = True
            changed = inv
        else:
            req.base_digest = inventory_digest(self.acked.values())
            changed = [h for k, h in self.held.items() if self.acked.get(k) != h]
            for (o, s, parity) in self.acked:
                if (o, s, parity) not in self.held:
                    req.removed.add(owner_rank=o, step=s, tier=tier_pb2.TIER_PARITY if parity else 0)
        for h in changed:
            holding_to_wire(h, req.holdings.add())
        resp = self.stub.Heartbeat(req, timeout=10)
        self.epoch = resp.epoch
        self.acked = dict(self.held) if resp.acked_digest == req.inventory_digest else None
        return resp

    def do_parity(self, resp):
        for t in resp.parity:
            spec = CodeGroupSpec.from_proto(t.group)
            self.add(Holding(self.rank, t.step, spec.digest(), 100, Tier.PARITY, group=spec))


@pytest.fixture
def cluster():
    clock = Clock()
    coord = Coordinator(JobTopology(4, 1, 0), "t", keep_local=2, heartbeat_seconds=1.0, host_lost_seconds=30.0,
                        clock=clock, redundancy=Redundancy.ec(3, 1))
    server, port = rpc.create_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, coord)])
    server.start()
    channel = rpc.make_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        yield coord, clock, [Host(stub, r) for r in range(4)]
    finally:
        channel.close()
        server.stop(0)


def round_(hosts):
    return {h.rank: h.beat() for h in hosts}


def settle(hosts, rounds=3):
    """A few rounds of heartbeats, each host computing the parity it is told to."""
    for _ in range(rounds):
        for h in hosts:
            h.do_parity(h.beat())


def test_holding_wire_round_trip_keeps_the_group_and_drops_addresses():
    spec = CodeGroupSpec(3, 1, (0, 1, 2, 3), ("a", "b", "c", "d"), ("h0:1", "h1:1", "", ""))
    h = Holding(2, 5, spec.digest(), 10, Tier.PARITY, group=spec)
    back = holding_from_wire(holding_to_wire(h, pb.Holding()))
    assert back == h and back.group.addresses == ("",) * 4
    plain = Holding(2, 5, "c", 10, Tier.LOCAL, 3, ((0, 3),))
    assert holding_from_wire(holding_to_wire(plain, pb.Holding())) == plain
    with pytest.raises(ValueError, match="code group k must be"):
        holding_from_wire(pb.Holding(owner_rank=2, step=5, content_hash="x", tier=tier_pb2.TIER_PARITY))


def test_ec_heartbeats_parity_tasks_deletions_and_a_rebuild_restore(cluster):
    coord, clock, hosts = cluster
    for h in hosts:
        h.add(Holding(h.rank, 1, f"s1-r{h.rank}", SIZE))
    round_(hosts)  # registered; the coordinator's epoch learnt
    told: dict = {}
    for _ in range(2):  # full reports: a host is told once every member's report is in
        for r, resp in round_(hosts).items():
            assert resp.acked_digest and not resp.copies  # ec: no whole copies
            told.setdefault(r, []).extend(resp.parity)
    for tasks in told.values():
        (task,) = tasks
        assert task.step == 1 and list(task.group.members) == [0, 1, 2, 3]
        assert list(task.group.content_hashes) == [f"s1-r{x}" for x in range(4)]
        assert list(task.group.addresses) == [f"10.0.0.{x}:7000" for x in range(4)]
    assert all(not r.parity for r in round_(hosts).values())  # in flight: not told again
    clock.t += PARITY_RETRY_MIN_SECONDS
    again = round_(hosts)
    assert all(len(r.parity) == 1 for r in again.values())  # unanswered that long: sent again
    for h in hosts:
        h.do_parity(again[h.rank])
    answers = round_(hosts)  # the parity reported as deltas, with the group
    assert all(r.acked_digest and not r.parity for r in answers.values())
    st = coord.state
    assert st.is_redundant(1) and [p.step for p in st.ec.parity_of(3)] == [1]
    # A host drops its parity (a delta's removal of tier TIER_PARITY): its data stays, its task comes back.
    hosts[3].drop((3, 1, True))
    resp = hosts[3].beat()
    assert resp.acked_digest and [t.step for t in resp.parity] == [1]
    assert st.ec.parity_of(3) == [] and st.holding(3, (3, 1)) is not None
    hosts[3].do_parity(resp)
    hosts[3].beat()
    assert st.is_redundant(1)
    # Host 2 replaced, its RAM disk empty: the restore rebuilds its data from the other three.
    hosts[2] = Host(hosts[2].stub, 2, incarnation=2)
    hosts[2].beat()
    resp = hosts[2].beat()
    (src,) = resp.restore.sources
    assert resp.restore.step == 1 and not resp.parity
    assert (src.kind, src.holder_rank, src.owner_rank, src.content_hash) == (tier_pb2.TIER_PARITY, -1, 2, "s1-r2")
    assert list(src.group.addresses) == ["10.0.0.0:7000", "10.0.0.1:7000", "", "10.0.0.3:7000"]
    assert CodeGroupSpec.from_proto(src.group).hash_of(2) == "s1-r2"
    # It landed: no restore task any more, and its parity (lost with it) is asked for.
    hosts[2].add(Holding(2, 1, "s1-r2", SIZE))
    resp = hosts[2].beat()
    assert not resp.HasField("restore") and [t.step for t in resp.parity] == [1]
    hosts[2].do_parity(resp)
    hosts[2].beat()
    assert st.is_redundant(1)
    # Steps 2 and 3 saved with their parity: step 1's data and parity go (keep_local 2).
    for step in (2, 3):
        for h in hosts:
            h.add(Holding(h.rank, step, f"s{step}-r{h.rank}", SIZE))
        settle(hosts)
    assert st.is_redundant(3)
    answers = round_(hosts)
    for r, resp in answers.items():
        parity = [d for d in resp.deletions if d.tier == tier_pb2.TIER_PARITY]
        data = [d for d in resp.deletions if d.tier != tier_pb2.TIER_PARITY]
        assert [(d.owner_rank, d.step) for d in data] == [(r, 1)]
        assert [(d.owner_rank, d.step) for d in parity] == [(r, 1)]
        assert parity[0].content_hash == hosts[r].held[(r, 1, True)].content_hash
    for h in hosts:
        h.drop((h.rank, 1, False))
        h.drop((h.rank, 1, True))
    round_(hosts)
    assert coord.state.known_steps() == [2, 3] and st.ec.deletions_in_flight() == {}


def test_a_task_naming_a_restarted_members_old_address_is_sent_again_at_once(cluster):
    """Host 1's replicator restarts (RAM disk kept, another port) while the others compute their parity: their
    tasks name its old address, so an attempt reading from it failed; each is told again with the new address
    at once, not after the retry time (found by tests/crash/test_matrix.py's ec.parity.before_commit: 20 s)."""
    coord, clock, hosts = cluster
    for h in hosts:
        h.add(Holding(h.rank, 1, f"s1-r{h.rank}", SIZE))
    for _ in range(3):
        round_(hosts)  # registered, full reports, tasks sent (in flight: none computed)
    assert all(not r.parity for r in round_(hosts).values())
    hosts[1] = Host(hosts[1].stub, 1, incarnation=2, address="10.0.0.1:7001")
    hosts[1].add(Holding(1, 1, "s1-r1", SIZE))
    hosts[1].beat()  # registered anew: learns the epoch
    told = {1: hosts[1].beat()}  # its report counts: it is told (registered anew)
    told.update({h.rank: h.beat() for h in hosts if h.rank != 1})
    for r, resp in told.items():
        (task,) = resp.parity
        assert task.group.addresses[1] == "10.0.0.1:7001", r
    assert all(not r.parity for r in round_(hosts).values())  # in flight again: not repeated
    for h in hosts:
        h.do_parity(told[h.rank])
    round_(hosts)
    assert coord.state.is_redundant(1)


def test_ec_refuses_too_few_hosts_at_construction_and_an_elastic_save_on_the_wire(cluster):
    with pytest.raises(ValueError, match=r"ec:3\+1 needs at least 4 hosts"):
        Coordinator(JobTopology(3, 1, 0), "t", redundancy=Redundancy.ec(3, 1))
    with pytest.raises(ValueError, match="does not support elastic training"):
        Coordinator(JobTopology(4, 1, 0), "t", redundancy=Redundancy.ec(3, 1), elastic=True)
    coord, _, hosts = cluster
    hosts[0].beat()  # the epoch learnt
    hosts[0].add(Holding(0, 1, "a", SIZE, savers=((0, 1),)))
    with pytest.raises(grpc.RpcError) as e:
        hosts[0].beat()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "elastic save" in e.value.details()
    assert coord.state.holdings_of(0) == []


def test_a_restarted_coordinator_rebuilds_its_ec_view_from_the_hosts_full_reports(cluster):
    coord, clock, hosts = cluster
    for h in hosts:
        h.add(Holding(h.rank, 1, f"s1-r{h.rank}", SIZE))
    settle(hosts, rounds=4)
    assert coord.state.is_redundant(1)
    # Another coordinator (a restart, a failover) hears only the full reports of hosts 0, 1 and 3: host 2 is lost.
    again = Coordinator(JobTopology(4, 1, 0), "t", keep_local=2, heartbeat_seconds=1.0, host_lost_seconds=30.0,
                        clock=clock, redundancy=Redundancy.ec(3, 1), epoch=5)
    server, port = rpc.create_server("127.0.0.1:0", [(pb_grpc.add_CoordinatorServicer_to_server, again)])
    server.start()
    channel = rpc.make_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        for h in hosts:
            h.stub, h.acked = stub, None
        for _ in range(2):
            for r in (0, 1, 3):
                resp = hosts[r].beat()
                assert not resp.parity and not resp.deletions  # its parity counts: nothing to redo or delete
        for _ in range(3):  # host 2 silent past host_lost_seconds, the others reporting
            clock.t += 11.0
            for r in (0, 1, 3):
                hosts[r].beat()
        st = again.state
        assert list(st.lost) == [2]
        assert st.globally_complete_steps() == [1] and st.ec.rebuild_ranks(1) == [2]
        (src,) = st.rank_sources(1, 2)
        assert src.kind is Tier.PARITY and src.content_hash == "s1-r2" and src.helpers == (0, 1, 3)
    finally:
        channel.close()
        server.stop(0)
