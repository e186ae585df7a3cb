"""Prometheus metrics: the typed counters, and /metrics scraped over HTTP from real replicators."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtc_rpc import control_pb2, control_pb2_grpc
from replicator.metrics import HostCounters, ReplicatorMetrics
from sidecar.layout import control_socket
from tests.kits.cluster import assert_equal, manager, redundant, save_steps, state, target, wait_for


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def metrics_address(local_dir) -> str:
    with grpc.insecure_channel(f"unix:{control_socket(local_dir)}") as ch:
        resp = control_pb2_grpc.LocalControlStub(ch).GetLocalStatus(control_pb2.GetLocalStatusRequest(), timeout=5)
    return resp.metrics_address


def test_counters_are_typed_and_locked() -> None:
    c = HostCounters()
    with pytest.raises(KeyError):
        c.add("copies_typo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        c.add("copies", -1)

    def bump() -> None:
        for _ in range(5000):
            c.add("copy_bytes", 3)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.snapshot()["copy_bytes"] == 4 * 5000 * 3


def test_endpoint_serves_own_registry_on_a_free_port(tmp_path) -> None:
    m = ReplicatorMetrics(tmp_path)
    port = m.serve("127.0.0.1", 0)
    try:
        assert port > 0 and m.metrics_address == f"127.0.0.1:{port}"
        m.counters.add("copy_bytes", 123)
        m.observe_transfer("peer_copy", 0.2)
        s = scrape(m.metrics_address)
        assert value(s, "mtc_copy_bytes_total", kind="peer_copy") == 123
        assert value(s, "mtc_transfer_seconds_count", kind="peer_copy") == 1
        assert value(s, "mtc_ramdisk_bytes", state="free") > 0
        assert value(s, "mtc_newest_complete_step") == -1
        # The job-wide metrics come only from the coordinator.
        assert value(s, "mtc_hosts_lost") is None
    finally:
        m.stop()


@pytest.mark.slow
def test_metrics_move_after_a_save_and_a_backup(cluster_factory, tmp_path) -> None:
    bucket = tmp_path / "bucket"
    cl = cluster_factory(nodes=4, data_parallelism=2,
                         extra=["--metrics-port", "0", "--backup-url", f"file://{bucket}",
                                "--backup-interval-steps", "1"])
    cl.start_all()
    coord = metrics_address(cl.ram(0))
    other = metrics_address(cl.ram(3))
    before = scrape(coord)
    assert value(before, "mtc_newest_complete_step") == -1
    assert value(before, "mtc_step_redundant") == 0
    assert value(before, "mtc_hosts", ) == 4
    assert value(before, "mtc_backup_failures_total") == 0
    assert value(before, "mtc_backup_last_success_timestamp_seconds") is None

    mgr = manager(cl, 2, 2)
    save_steps(mgr, [7])
    wait_for(lambda: value(scrape(coord), "mtc_newest_complete_step") == 7, what="metric: step 7 complete")
    wait_for(lambda: value(scrape(coord), "mtc_backup_last_success_timestamp_seconds"), timeout=60,
             what="metric: a backup committed")
    wait_for(lambda: value(scrape(coord), "mtc_step_redundant") == 1, timeout=60, what="metric: redundant")
    after = scrape(coord)
    assert value(after, "mtc_hosts_lost") == 0
    assert value(after, "mtc_hosts_registered") == 4
    assert value(after, "mtc_coordinator_heartbeat_seconds_count") > value(before,
                                                                             "mtc_coordinator_heartbeat_seconds_count")
    # Every host saw its own save; uploads moved bytes and were timed somewhere in the job.
    uploaded = 0.0
    for r in range(4):
        s = scrape(metrics_address(cl.ram(r)))
        assert value(s, "mtc_saves_total") == 1, r
        assert value(s, "mtc_save_bytes_total") > 0
        assert value(s, "mtc_ramdisk_bytes", state="used") > 0
        uploaded += value(s, "mtc_copy_bytes_total", kind="backup_upload")
    assert uploaded > 0
    wait_for(lambda: value(scrape(other), "mtc_newest_complete_step") == 7, what="host 3 heard of step 7")
    # Host 3 is lost and comes back empty: its restore is timed and its bytes counted.
    cl.procs[3].stop()
    cl.wipe(3)
    cl.start(3)
    wait_for(lambda: value(scrape(coord), "mtc_hosts_registered") == 4, what="host 3 back")
    trees = {7: state(7)}
    assert_equal(trees[7], mgr.restore(None, target(trees[7])))
    # The manager read what it needed through the sidecar; the daemon's own restore of the step (the
    # coordinator's restore task, in the background) is timed once it lands.
    s3 = wait_for(lambda: (s := scrape(metrics_address(cl.ram(3)))) and value(s, "mtc_restore_seconds_count") >= 1
                  and s, what="metric: host 3's restore timed")
    assert value(s3, "mtc_copy_bytes_total", kind="restore") > 0
    assert value(s3, "mtc_saves_total") == 0  # a restored step is not a save
    assert value(scrape(coord), "mtc_coordinator_plan_seconds_count") >= 1
    mgr.close()


@pytest.mark.slow
def test_a_wiped_hosts_restore_shows_its_phases(cluster_factory) -> None:
    """Host 3 comes back empty and the operator restores step 4 (`mtc restore`): its replicator times the
    restore's plan (the heartbeat that carried the task), its fetch from a peer and the crc32c checks, as
    histograms on its /metrics and as its last restore in `mtc status` (issue #34)."""
    from tests.kits.admin import mtc

    cl = cluster_factory(nodes=4, data_parallelism=2, extra=["--metrics-port", "0"])
    cl.start_all()
    mgr = manager(cl, 2, 2)
    # Each rank's data its own (not replicated over slices): host 3 cannot hold it already as a replica's copy.
    save_steps(mgr, [4], replicated_over_slices=False)
    wait_for(lambda: redundant(cl, 4), timeout=60, what="step 4 redundant")
    cl.procs[3].stop()
    cl.wipe(3)
    cl.start(3)

    def metrics_of_3() -> str | None:
        try:
            return metrics_address(cl.ram(3))
        except grpc.RpcError:  # not listening yet
            return None

    address = wait_for(metrics_of_3, what="host 3 back")
    # The coordinator sends host 3 its restore task on its first reports already; `mtc restore` waits for it.
    r = mtc("restore", "4", "--wait-seconds", "60", "-o", "json", "--coordinator", cl.coordinator)
    assert r.code == 0 and r.json()["ready"], r
    s = wait_for(lambda: (s := scrape(address))
                 and value(s, "mtc_restore_phase_seconds_count", phase="verify", tier="peer") and s,
                 what="host 3's restore phases observed")
    for phase in ("plan", "fetch", "verify"):
        tier = "" if phase == "plan" else "peer"
        assert value(s, "mtc_restore_phase_seconds_count", phase=phase, tier=tier) >= 1, phase
        assert value(s, "mtc_restore_phase_seconds_sum", phase=phase, tier=tier) > 0, phase
    assert value(s, "mtc_restore_seconds_count") >= 1  # the older metric stays

    def breakdown():
        hosts = mtc("status", "--hosts", "-o", "json", "--coordinator", cl.coordinator).json()["hosts"]
        return next(h for h in hosts if h["rank"] == 3)["last_restore"]

    last = wait_for(breakdown, what="host 3's last restore in `mtc status`")
    assert last["step"] == 4 and last["owner_rank"] == 3 and last["tier"] == "peer" and last["bytes"] > 0
    assert last["trigger"] == "task" and last["finished_unix"] > 0
    phases = {(p["phase"], p["tier"]): p["seconds"] for p in last["phases"]}
    assert phases[("plan", None)] > 0 and phases[("fetch", "peer")] > 0 and phases[("verify", "peer")] > 0
    summary = mtc("status", "-o", "json", "--coordinator", cl.coordinator).json()
    assert summary["last_restore"]["rank"] == 3 and summary["last_restore"]["step"] == 4
    table = mtc("status", "--coordinator", cl.coordinator)
    assert "last restore" in table.out and "verify peer" in table.out, table
    local = mtc("status", "--local-dir", str(cl.ram(3)), "-o", "json").json()
    assert local["last_restore"]["step"] == 4 and local["last_restore"]["trigger"] == "task"
    # A sidecar's fetch of a rank's data host 3 does not hold is a restore too: its plan is the LocateStep.
    # Once the job is redundant again and host 3 copies nothing, what it holds stays as it is.
    wait_for(lambda: redundant(cl, 4), timeout=60, what="step 4 redundant again")
    local = wait_for(lambda: (d := mtc("status", "--local-dir", str(cl.ram(3)), "-o", "json").json())
                     and not d["in_flight"] and d, what="host 3 idle")
    held = {o for o, step in local["peer_steps"] if step == 4} | {3}
    owner = min(set(range(4)) - held)
    with grpc.insecure_channel(f"unix:{control_socket(cl.ram(3))}") as ch:
        control_pb2_grpc.LocalControlStub(ch).FetchStep(
            control_pb2.FetchStepRequest(owner_rank=owner, step=4, timeout_seconds=30), timeout=60)
    local = mtc("status", "--local-dir", str(cl.ram(3)), "-o", "json").json()["last_restore"]
    assert (local["trigger"], local["owner_rank"], local["tier"]) == ("sidecar", owner, "peer"), local
    phases = {(p["phase"], p["tier"]): p["seconds"] for p in local["phases"]}
    assert phases[("plan", None)] > 0 and phases[("fetch", "peer")] > 0 and phases[("verify", "peer")] > 0
    assert value(scrape(address), "mtc_restore_phase_seconds_count", phase="plan", tier="") >= 2
    mgr.close()
