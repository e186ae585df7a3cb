"""A host whose daemon starts just before the coordinator's (a job restart, every daemon of an Orbax
handshake) reports within a fraction of the heartbeat interval, not after a full backoff; and a host whose
heartbeats keep failing never backs off for so long that the coordinator declares it lost."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from controller_client.demo.ports import free_port as _free_port
from replicator.coordinator.client import CoordinatorClient
from replicator.coordinator.serving import lost_after_seconds
from replicator.daemon import Replicator
from replicator.heartbeat import (
    STARTUP_FAST_RETRIES,
    STARTUP_RETRIES,
    STARTUP_RETRY_MAX_SECONDS,
    Heartbeat,
    NoCoordinator,
    Reporter,
)
from replicator.net.retry import JITTER
from replicator.options import ReplicatorOptions

# The backoff after a failed heartbeat never goes below it: long, so that a host that waited one backoff
# (~20 s) is told apart from one that retried quickly (well under a second, a few seconds on a loaded box).
INTERVAL = 20.0


def _opts(root: Path, rank: int, listen: str, coordinator: str) -> ReplicatorOptions:
    return ReplicatorOptions(local_dir=root / str(rank), listen=listen, job="t", rank=rank, nodes=2,
                             coordinator=coordinator, heartbeat_seconds=INTERVAL, rpc_timeout_seconds=5,
                             transfer_timeout_seconds=10, bulk_priority="normal").validate()


def test_a_host_started_before_the_coordinator_registers_well_within_the_interval(tmp_path: Path) -> None:
    address = f"127.0.0.1:{_free_port()}"
    daemons: list[Replicator] = []
    client = None
    try:
        host = Replicator(_opts(tmp_path, 1, "127.0.0.1:0", address), rank=1, nodes=2, job="t")
        host.start()
        daemons.append(host)
        time.sleep(0.15)  # its first report finds nobody listening
        coordinator = Replicator(_opts(tmp_path, 0, address, ""), rank=0, nodes=2, job="t")
        coordinator.start()
        daemons.append(coordinator)
        t0 = time.monotonic()
        client = CoordinatorClient(address, rpc_timeout_seconds=5)
        registered = 0
        while time.monotonic() - t0 < INTERVAL / 4:
            registered = client.status().hosts_registered
            if registered == 2:
                break
            time.sleep(0.02)
        took = time.monotonic() - t0
        # Quiet, it takes ~0.2 s; make test measured 1.53 s once on its loaded box (a bound of 1.5 s failed).
        assert registered == 2, (f"rank 1 not registered {took:.1f}s after the coordinator started (interval "
                                 f"{INTERVAL}s): it waited a backoff instead of retrying at once")
    finally:
        if client is not None:
            client.close()
        for d in reversed(daemons):
            d.stop(grace_seconds=0.0)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(("interval", "host_lost"), [(0.3, 2.0), (1.0, 0.0), (50.0, 0.0), (0.5, 30.0)])
@pytest.mark.parametrize("error", [_Unavailable(), NoCoordinator("none answers")], ids=["unavailable", "none"])
def test_failed_heartbeats_back_off_but_retry_well_within_the_lost_host_time(tmp_path: Path, interval: float,
                                                                               host_lost: float,
                                                                               error: BaseException) -> None:
    opts = ReplicatorOptions(local_dir=tmp_path, listen="127.0.0.1:0", job="t", rank=1, nodes=2,
                             coordinator="127.0.0.1:1", heartbeat_seconds=interval,
                             host_lost_seconds=host_lost).validate()
    beat = Heartbeat(opts, Reporter(job="t", rank=1, nodes=2), SimpleNamespace(), incarnation=1)  # no parts used
    lost = lost_after_seconds(host_lost, interval)
    JITTER.seed(7)
    for answered in (False, True):
        beat._answered = answered
        delays = [beat.retry_delay(f, error) for f in range(1, 40) for _ in range(20)]
        later = [beat.retry_delay(f, error) for f in range(STARTUP_RETRIES + 1, 40) for _ in range(20)]
        assert max(delays) <= lost / 3, f"a {max(delays):.2f}s wait after a failure; lost after {lost}s"
        assert min(later) >= interval, "a retry sooner than the interval after the start-up tries"
    # Before any answer, an unreachable coordinator is tried again every 0.4 s at most for ~2.6 s (every daemon
    # restarting at once; the coordinator's host may come up last), whatever the interval; in the first second
    # every 0.05 s, so that the first retry after the channel's reconnect (~0.1 s) finds it, not one 0.2 s later.
    beat._answered = False
    quick = [beat.retry_delay(f, _Unavailable()) for f in range(1, STARTUP_RETRIES + 1) for _ in range(20)]
    assert max(quick) <= STARTUP_RETRY_MAX_SECONDS * 1.2
    fast = [beat.retry_delay(f, _Unavailable()) for f in range(1, STARTUP_FAST_RETRIES + 1) for _ in range(20)]
    assert max(fast) <= 0.06 and sum(fast) / 20 >= 0.9
    assert STARTUP_RETRIES >= 6
    # The backoff still grows (no retry storm on a struggling coordinator) when there is room for it.
    if lost / 3 >= 2 * interval:
        assert max(beat.retry_delay(STARTUP_RETRIES + 12, error) for _ in range(50)) > 1.5 * interval


def test_rings_set_for_later_wake_the_heartbeat_on_time_without_a_thread() -> None:
    """Orbax mode reports a few times right after asking for its restore plan: rings on the heartbeat's own
    doorbell (no thread per call), cancelled ones never ring."""
    import threading

    from replicator.heartbeat import Wakeup

    bell = Wakeup()
    threads = threading.active_count()
    t0 = time.monotonic()
    bell.ring_after([0.05, 0.1])
    cancel = bell.ring_after([0.15])
    assert threading.active_count() == threads
    woke = []
    for _ in range(2):
        bell.wait(5.0)
        woke.append(time.monotonic() - t0)
    cancel()
    bell.wait(0.3)  # nothing due any more: the full wait
    woke.append(time.monotonic() - t0)
    assert 0.04 <= woke[0] < 0.09 and 0.09 <= woke[1] < 0.14 and woke[2] >= 0.38, woke
    bell.ring()  # a plain ring still ends a wait at once
    t1 = time.monotonic()
    bell.wait(5.0)
    assert time.monotonic() - t1 < 0.05
