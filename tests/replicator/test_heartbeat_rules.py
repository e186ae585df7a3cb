"""What a host reports and what it does with an answer's deletions: the host's rules
(:mod:`replicator.host_protocol`), which the daemon's heartbeat and the simulation's hosts both call."""

from __future__ import annotations

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator import host_protocol as hp
from replicator.tiers import Holding, Tier


def _h(owner: int, step: int, content_hash: str = "c", tier: Tier = Tier.PEER) -> Holding:
    return Holding(owner, step, content_hash, 10, tier, 1)


REPORT = hp.Report(job="j", rank=1, incarnation=7, address="a:1", report_seq=3, known_epoch=5, newest_saved_step=4,
                   backup_requests=(4,), preempting=True, fence_nodes=4)


def test_a_host_reports_everything_until_a_report_is_acknowledged_then_only_the_changes() -> None:
    current = {x.key: x for x in (_h(1, 4, tier=Tier.LOCAL), _h(0, 4))}
    full = hp.request(REPORT, current, "d1", None)
    assert full.full_report and not full.base_digest and len(full.holdings) == 2
    assert (full.job, full.rank, full.incarnation, full.report_seq, full.known_epoch) == ("j", 1, 7, 3, 5)
    assert (full.newest_saved_step, list(full.backup_requests), full.preempting, full.nodes) == (4, [4], True, 4)
    acked = hp.acknowledged(pb.HeartbeatResponse(acked_digest="d1"), "d1", current, {})
    assert acked == hp.Acked("d1", current, {})
    now = {x.key: x for x in (_h(1, 4, tier=Tier.LOCAL), _h(0, 5))}  # rank 0's step 4 gone, step 5 new
    delta = hp.request(REPORT, now, "d2", acked)
    assert not delta.full_report and delta.base_digest == "d1"
    assert [(x.owner_rank, x.step) for x in delta.holdings] == [(0, 5)]
    assert [(x.owner_rank, x.step) for x in delta.removed] == [(0, 4)]
    assert not hp.request(REPORT, current, "d1", acked).holdings  # nothing changed: nothing but the digest


def test_an_answer_without_the_reports_digest_means_the_coordinator_has_no_picture() -> None:
    assert hp.acknowledged(pb.HeartbeatResponse(acked_digest="other"), "d1", {}, {}) is None
    assert hp.acknowledged(pb.HeartbeatResponse(), "", {}, {}) is None


def test_copies_of_ranks_the_job_no_longer_has_are_not_reported() -> None:
    assert hp.reportable([_h(0, 1), _h(5, 1)], nodes=4) == [_h(0, 1)]


def test_deletions_skip_parity_and_pieces_a_task_is_using() -> None:
    resp = pb.HeartbeatResponse(deletions=[
        pb.Deletion(owner_rank=0, step=1, content_hash="c"),
        pb.Deletion(owner_rank=1, step=1, tier=tier_pb2.TIER_PARITY),  # the parity duty's
        pb.Deletion(owner_rank=0, step=2),  # a copy of it is running
        pb.Deletion(owner_rank=3, step=3),  # a backup of step 3 reads every rank's data of it
        pb.Deletion(owner_rank=2, step=4),
    ])
    in_flight = [("copy", 0, 2), ("backup", -1, 3)]
    assert hp.work(resp, 1, {}, in_flight).deletions == (hp.Delete(0, 1, "c"), hp.Delete(2, 4, None))


def test_an_answer_without_tasks_does_nothing() -> None:
    work = hp.work(pb.HeartbeatResponse(), 1, {}, ())
    assert work == hp.Work((), (), None, None, {})


class _Rec:
    def __init__(self, n: int) -> None:
        self.n = n

    def to_wire(self) -> tier_pb2.RestoreBreakdown:
        return tier_pb2.RestoreBreakdown(step=self.n)


class _Hs(_Rec):
    def to_wire(self) -> tier_pb2.HandshakeBreakdown:  # type: ignore[override]
        return tier_pb2.HandshakeBreakdown(number=self.n)


def test_the_last_restore_and_handshake_are_sent_once_and_again_to_a_coordinator_without_this_host() -> None:
    acked = hp.Acked("d", {}, {})
    first = hp.LastRecords(_Rec(1), _Hs(1))

    def sent(now: hp.LastRecords, taken: hp.LastRecords | None, ack: hp.Acked | None) -> tuple[bool, bool]:
        req = pb.HeartbeatRequest()
        hp.attach_last_records(req, now, taken, ack)
        return req.HasField("last_restore"), req.HasField("last_handshake")

    assert sent(hp.LastRecords(), None, None) == (False, False)  # nothing to show yet
    assert sent(first, None, acked) == (True, True)  # none answered yet
    assert sent(first, first, acked) == (False, False)  # the coordinator holds both: not on every beat
    assert sent(hp.LastRecords(_Rec(2), first.handshake), first, acked) == (True, False)  # a newer restore
    assert sent(first, first, None) == (True, True)  # a full report (a restarted or new coordinator)
