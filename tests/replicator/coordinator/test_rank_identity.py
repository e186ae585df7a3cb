"""Mutual TLS binds reports to ranks: the coordinator (with its admin layer) on a real gRPC server on 127.0.0.1.

A client with rank 1's certificate may heartbeat as rank 1 only; an admin certificate reads status but
never reports; a certificate naming no rank is refused for reports when the job requires identities.
A refused report changes nothing: not the planner's state, not the admin layer's bad-copy list.
Admin actions (pin, restore, backup, bad-copy reports) need the admin certificate then.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mtc_rpc import admin_pb2, tier_pb2
from mtc_rpc import coordinator_pb2 as pb
from replicator.coordinator.topology import JobTopology
from replicator.net.security import RankAuthorizer
from tests.kits.certs import CertAuthority
from tests.kits.tls_coordinator import ServedCoordinator, beat, picture

NODES = 3


def served_coordinator(tmp: Path, authorizer: RankAuthorizer | None, server_tls: str = "mutual") -> ServedCoordinator:
    ca = CertAuthority(tmp / "ca")
    return ServedCoordinator(ca, JobTopology(NODES, 1, 1), authorizer, ca.issue_rank("t", 0),
                             mutual=server_tls == "mutual")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedCoordinator]:
    s = served_coordinator(tmp_path, RankAuthorizer("t", require=True))
    yield s
    s.close()


def test_each_rank_reports_with_its_own_certificate(served: ServedCoordinator) -> None:
    for r in range(NODES):
        coord_stub, _ = served.stubs(served.ca.issue_rank("t", r))
        resp = beat(coord_stub, r)
        assert resp.epoch == served.coord.epoch
    assert served.coord.state.reported_count == NODES
    assert served.coord.state.globally_complete_steps() == [5]


def test_a_report_for_another_rank_is_denied_and_changes_nothing(served: ServedCoordinator) -> None:
    stubs = {r: served.stubs(served.ca.issue_rank("t", r))[0] for r in range(NODES)}
    for r in range(NODES):
        beat(stubs[r], r)
    # A bad copy noted by an operator for rank 2: a forged full report would make the admin filter forget it.
    served.admin.bad.add(2, 2, 5)
    before = picture(served.coord, NODES)
    with pytest.raises(grpc.RpcError) as e:
        beat(stubs[1], 2, step=9, address="10.9.9.9:1")  # rank 1's certificate claims rank 2
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "rank 2" in e.value.details() and "names rank 1" in e.value.details()
    assert picture(served.coord, NODES) == before
    assert served.admin.bad._bad == {2: {(2, 5)}}
    # A deposing epoch in a forged report does not depose the coordinator either.
    req = pb.HeartbeatRequest(job="t", rank=0, incarnation=7, known_epoch=served.coord.epoch + 10**12)
    with pytest.raises(grpc.RpcError) as e:
        stubs[1].Heartbeat(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert served.coord.active and picture(served.coord, NODES) == before
    # The real rank 2 still reports.
    beat(stubs[2], 2)


def test_certificates_without_a_rank_are_refused_for_reports(served: ServedCoordinator) -> None:
    for pair, why in ((served.ca.issue("plain-host"), "names no rank"),
                      (served.ca.issue_admin("t"), "administrator"),
                      (served.ca.issue("other-job", ["mtc://u/rank/1"]), "job 'u'"),
                      (served.ca.issue("bad-id", ["mtc://t/rank/one"]), "not an mtc identity")):
        coord_stub, _ = served.stubs(pair)
        with pytest.raises(grpc.RpcError) as e:
            beat(coord_stub, 1)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, pair
        assert why in e.value.details()
    assert served.coord.state.registered == {}


def test_admin_certificate_reads_status_and_calls_admin_rpcs(served: ServedCoordinator) -> None:
    coord_stub, _ = served.stubs(served.ca.issue_rank("t", 0))
    beat(coord_stub, 0)
    admin_coord, admin_stub = served.stubs(served.ca.issue_admin("t"))
    with pytest.raises(grpc.RpcError, match="rebuilding"):  # answers once every host reported (issue #33)
        admin_coord.GetStatus(pb.GetStatusRequest(hosts=True), timeout=10)
    for rank in range(1, NODES):
        beat(served.stubs(served.ca.issue_rank("t", rank))[0], rank)
    st = admin_coord.GetStatus(pb.GetStatusRequest(hosts=True), timeout=10)
    assert st.hosts_registered == NODES and st.hosts[0].address == "127.0.0.1:7000"
    assert admin_stub.GetSummary(admin_pb2.GetSummaryRequest(), timeout=10).job == "t"
    # Hosts read too (Orbax mode and multi-controller managers plan restores with their own certificate).
    assert coord_stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts_registered == NODES
    assert admin_coord.GetSteps(pb.GetStepsRequest(), timeout=10).newest_complete_step == 5
    assert list(admin_stub.Pin(admin_pb2.PinRequest(step=5), timeout=10).pinned_steps) == [5]


def test_admin_actions_need_the_admin_certificate(served: ServedCoordinator) -> None:
    for pair in (served.ca.issue_rank("t", 1), served.ca.issue("plain-host"), served.ca.issue_admin("u")):
        _, admin_stub = served.stubs(pair)
        for call, req in ((admin_stub.Pin, admin_pb2.PinRequest(step=5)),
                          (admin_stub.ReportBadCopy, admin_pb2.ReportBadCopyRequest(
                              tier=tier_pb2.TIER_PEER, holder_rank=2, owner_rank=2, step=5))):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "needs the job's admin certificate (mtc://t/admin)" in e.value.details()
        # Reads stay open to every certificate of the CA.
        assert admin_stub.GetSummary(admin_pb2.GetSummaryRequest(), timeout=10).job == "t"
    assert served.coord.state.pinned_steps() == []
    assert served.admin.bad._bad == {}


def test_a_job_wide_certificate_reports_for_any_rank_when_identities_are_not_required(tmp_path: Path) -> None:
    s = served_coordinator(tmp_path, RankAuthorizer("t", require=False))
    try:
        shared, _ = s.stubs(s.ca.issue("job-wide"))
        for r in range(NODES):
            beat(shared, r)
        assert s.coord.state.reported_count == NODES
        # One certificate for the whole job: it may also pin (as before rank identities).
        _, shared_admin = s.stubs(s.ca.issue("job-wide-2"))
        assert list(shared_admin.Pin(admin_pb2.PinRequest(step=5), timeout=10).pinned_steps) == [5]
        # A certificate that does name a rank stays bound to it.
        named, _ = s.stubs(s.ca.issue_rank("t", 1))
        with pytest.raises(grpc.RpcError) as e:
            beat(named, 2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        s.close()


def test_without_client_certificates_nothing_changes(tmp_path: Path) -> None:
    # TLS without --tls-ca: no client certificates, no authorizer (the daemon builds none): any rank reports.
    s = served_coordinator(tmp_path, None, server_tls="server-only")
    try:
        anonymous, _ = s.stubs(None)
        for r in range(NODES):
            beat(anonymous, r)
        assert s.coord.state.reported_count == NODES
    finally:
        s.close()
