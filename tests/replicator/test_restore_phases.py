"""Restore phases (issue #34): timed per restore, observed as histograms, logged once, carried to `mtc status`."""

from __future__ import annotations

import logging
import time

from controller_client.admin.restores import restore_doc, restore_text
from mtc_rpc import admin_pb2 as apb
from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator import restore_phases
from replicator.metrics import ReplicatorMetrics
from replicator.peer.sinks import FileSink
from replicator.restore_phases import RestoreClock
from replicator.tiers import Tier
from sidecar import checksums
from sidecar.layout import FileEntry
from tests.replicator.coordinator.test_admin import Ctx, make


def _sample(m: ReplicatorMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_each_phase_is_observed_with_its_tier_logged_once_and_kept_as_the_last(caplog) -> None:
    m = ReplicatorMetrics()
    clock = RestoreClock(7, 3, "task", started=time.monotonic() - 0.5)
    clock.add("plan", None, 0.02)
    with clock.fetching(Tier.PEER):
        restore_phases.verified(0.01)
        restore_phases.verified(0.01)
    restore_phases.verified(5.0)  # outside any fetch: counted nowhere
    with caplog.at_level(logging.INFO, logger="replicator.restore_phases"):
        rec = restore_phases.report(clock, m, rank=3, tier=Tier.PEER, nbytes=4096, where="peer rank 1")
    assert _sample(m, "mtc_restore_phase_seconds_count", phase="plan", tier="") == 1
    assert _sample(m, "mtc_restore_phase_seconds_sum", phase="plan", tier="") == 0.02
    assert _sample(m, "mtc_restore_phase_seconds_count", phase="fetch", tier="peer") == 1
    assert _sample(m, "mtc_restore_phase_seconds_count", phase="verify", tier="peer") == 1
    assert abs(_sample(m, "mtc_restore_phase_seconds_sum", phase="verify", tier="peer") - 0.02) < 1e-9
    assert _sample(m, "mtc_restore_phase_seconds_count", phase="fetch", tier="bucket") is None
    assert m.last_restore is rec and rec.seconds >= 0.5  # from the plan's start, before the clock was made
    assert [p for p, _, _ in rec.phases] == ["plan", "fetch", "verify"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "step 7 (task) from peer rank 1: 4096 bytes" in lines[0]
    assert "plan 0.020s" in lines[0] and "fetch peer " in lines[0] and "verify peer 0.020s" in lines[0]


def test_a_repeated_task_for_data_just_restored_does_not_hide_the_restore_that_brought_it() -> None:
    """A restore task sent again while the first one landed finds the data on the RAM disk (tier local, no
    bytes): observed, but the restore shown as the host's last stays the one that moved the bytes (make test
    saw `mtc status` show host 3's last restore as local, its peer restore hidden)."""
    m = ReplicatorMetrics()

    def done(step: int, tier: Tier, nbytes: int) -> restore_phases.RestoreRecord:
        clock = RestoreClock(step, 3, "task")
        with clock.fetching(tier):
            pass
        return restore_phases.report(clock, m, rank=3, tier=tier, nbytes=nbytes, where="test")

    peer = done(4, Tier.PEER, 4096)
    done(4, Tier.LOCAL, 0)
    assert m.last_restore is peer
    assert _sample(m, "mtc_restore_phase_seconds_count", phase="fetch", tier="local") == 1  # still observed
    later = done(5, Tier.LOCAL, 0)  # another step: a restore from this host's RAM disk is the last one
    assert m.last_restore is later


def test_a_failed_tier_counts_as_fetch_time_of_that_tier() -> None:
    clock = RestoreClock(1, 0, "sidecar")
    try:
        with clock.fetching(Tier.PEER):
            time.sleep(0.01)
            raise ConnectionError("peer down")
    except ConnectionError:
        pass
    with clock.fetching(Tier.BUCKET):
        pass
    rec = clock.finish(Tier.BUCKET, 10)
    assert rec.phase_seconds("fetch", "peer") >= 0.01
    assert ("fetch", "bucket") in {(p, t) for p, t, _ in rec.phases}


def test_peer_crc32c_checks_count_as_verify(tmp_path) -> None:
    """The peer client's crc32c of arriving bytes is the verify phase of the restore fetching in the thread."""
    data = b"x" * (1 << 20)
    sink = FileSink(tmp_path, [FileEntry("a", len(data), checksums.crc32c(data))])
    clock = RestoreClock(1, 0, "task")
    with clock.fetching(Tier.PEER):
        sink.write(0, 0, data)  # the stream path: the sink computes the crc32c
        sink.finish(0)
    assert clock.finish(Tier.PEER, len(data)).phase_seconds("verify", "peer") > 0


def test_a_copy_on_its_owners_host_is_fetched_from_the_peer_tier() -> None:
    """The coordinator names the owner's own RAM disk ``local``; for the host restoring, that is another host."""
    from types import SimpleNamespace

    from replicator.fetch import fetched_tier

    assert fetched_tier(SimpleNamespace(tier=Tier.LOCAL)) is Tier.PEER
    assert fetched_tier(SimpleNamespace(tier=Tier.PEER)) is Tier.PEER
    assert fetched_tier(SimpleNamespace(tier=Tier.BUCKET)) is Tier.BUCKET


def test_the_wire_record_and_its_rendering() -> None:
    clock = RestoreClock(9, 2, "files")
    clock.add("plan", None, 0.004)
    clock.add("fetch", Tier.BUCKET, 1.5)
    wire = clock.finish(Tier.BUCKET, 2048).to_wire()
    assert wire.tier == tier_pb2.TIER_BUCKET and wire.bytes == 2048 and wire.trigger == "files"
    assert [(p.phase, p.tier) for p in wire.phases] == [(tier_pb2.RESTORE_PHASE_PLAN, tier_pb2.TIER_UNSPECIFIED),
                                                        (tier_pb2.RESTORE_PHASE_FETCH, tier_pb2.TIER_BUCKET)]
    doc = restore_doc(wire)
    assert doc["phases"] == [{"phase": "plan", "tier": None, "seconds": 0.004},
                             {"phase": "fetch", "tier": "bucket", "seconds": 1.5}]
    assert doc["step"] == 9 and doc["tier"] == "bucket" and doc["owner_rank"] == 2
    # The total is the clock's own wall time (a loaded machine may take a millisecond between start and finish).
    assert restore_text(wire, short=True) == (f"step 9 from bucket, 2.0 KiB in {wire.seconds:.3f}s: plan 0.004s, "
                                              "fetch bucket 1.500s")


def test_the_coordinator_keeps_each_hosts_last_restore_for_status() -> None:
    coord, admin, svc, clock = make()
    ctx = Ctx()
    first = RestoreClock(5, 1, "task")
    first.add("plan", None, 0.01)
    first.add("fetch", Tier.PEER, 0.2)
    rec = first.finish(Tier.PEER, 100).to_wire()
    svc.Heartbeat(pb.HeartbeatRequest(job="t", rank=0, incarnation=1, address="127.0.0.1:7000", full_report=True),
                  ctx)
    assert not admin.GetSummary(apb.GetSummaryRequest(), ctx).HasField("last_restore")
    svc.Heartbeat(pb.HeartbeatRequest(job="t", rank=1, incarnation=1, address="127.0.0.1:7001", full_report=True,
                                      last_restore=rec), ctx)
    hosts = {h.rank: h for h in admin.ListHosts(apb.ListHostsRequest(last_rank=-1), ctx).hosts}
    assert not hosts[0].HasField("last_restore")
    assert hosts[1].last_restore == rec
    s = admin.GetSummary(apb.GetSummaryRequest(), ctx)
    assert s.last_restore == rec and s.last_restore_rank == 1
    # A later report without one (an older replicator) keeps what was said.
    svc.Heartbeat(pb.HeartbeatRequest(job="t", rank=1, incarnation=1, address="127.0.0.1:7001", full_report=True),
                  ctx)
    assert admin.GetSummary(apb.GetSummaryRequest(), ctx).last_restore == rec
