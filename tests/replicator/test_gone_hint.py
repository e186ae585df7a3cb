"""A client that knows hosts are gone (on Pathways: their slice is counted down) says so, and the coordinator
does not wait out its heartbeat rules (replicator/coordinator/gone.py), with real `mtc replicator` processes.

Two slices of two hosts, candidates ranks 0 and 2, heartbeats every 0.3 s and a lost-host time of 20 s: without
the hint, losing slice 0 (the coordinator's) keeps every client waiting for the takeover (10 s of silence) and
then for hosts 0 and 1 to be declared lost (20 s more) before the new coordinator answers.
"""

from __future__ import annotations

import signal
import time

import pytest

from replicator.coordinator.client import CoordinatorClient
from tests.kits.cluster import manager, redundant, save_steps, status, wait_for
from tests.replicator.test_failover import FailoverCluster

pytestmark = pytest.mark.slow

LOST_SECONDS = 20.0


class SlowLossCluster(FailoverCluster):
    def _args(self, rank: int, listen: str) -> list[str]:
        return super()._args(rank, listen) + ["--host-lost-seconds", str(LOST_SECONDS)]  # the last one counts


@pytest.fixture
def cluster(tmp_path):
    cl = SlowLossCluster(tmp_path / "c", 4, 2)
    try:
        cl.start_all()
        mgr = manager(cl, 2, 2)
        save_steps(mgr, [1])
        wait_for(lambda: redundant(cl, 1), what="step 1 redundant", timeout=60)
        mgr.close()
        yield cl
    finally:
        cl.stop_all(signal.SIGKILL)


def test_the_survivors_are_answered_at_once_when_they_name_the_lost_coordinator_slice(cluster) -> None:
    for r in (0, 1):
        cluster.procs[r].stop(signal.SIGKILL)
    client = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=2, failover_seconds=60, gone_ranks=[0, 1])
    try:
        t0 = time.monotonic()
        resp = client.steps(wait_seconds=0)
        took = time.monotonic() - t0
        assert resp.newest_complete_step == 1, resp
        # Rank 2's candidate took over at once and declared the hosts it never heard lost: no 10 s takeover,
        # no 20 s lost-host wait.
        assert took < 5.0, took
        assert client.serving_address == cluster.candidate_addresses[2]
        assert sorted(status(cluster).lost_ranks.replace(",", " ").replace("-", " ").split()) == ["0", "1"]
        assert client.prepare_restore(None, wait_seconds=30) == 1  # the survivors hold step 1 for every rank
    finally:
        client.close()


def test_a_host_named_gone_that_still_reports_is_not_declared_lost(cluster) -> None:
    """A slice back but not yet rejoined: the client counts it out, its hosts report; they stay."""
    client = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=2, gone_ranks=[2, 3])
    try:
        for _ in range(10):
            assert client.steps(wait_seconds=0).newest_complete_step == 1
            time.sleep(0.3)
        st = status(cluster)
        # Never declared lost, not even for a moment (a host declared lost registers again: counted).
        assert st.hosts_lost == 0 and st.lost_ranks == "" and st.hosts_reregistered == 0, st
        assert client.serving_address == cluster.candidate_addresses[0]  # nobody took over
    finally:
        client.close()
