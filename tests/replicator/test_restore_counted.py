"""A host's restore is counted (``mtc_restore_seconds``, ``mtc_restores``, restore bytes) whichever path
brought its data: the coordinator's restore task, or the sidecar's fetch that got there first.

``make test`` caught it: a wiped host whose sidecar streamed its data before the coordinator's restore task
ran never counted a restore (the task then found the data here and counted nothing).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import tier_pb2
from replicator.backup.agent import BackupAgent
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from replicator.fetch import Fetcher
from replicator.local.store import RamDiskStore
from replicator.metrics import ReplicatorMetrics
from replicator.restore_phases import RestoreClock
from replicator.tasks import TaskRunner
from sidecar import layout
from tests.kits.storage import make_step

JOB = "j"
STEP = 3


def _sample(metrics: ReplicatorMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


@pytest.fixture
def host(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Rank 1 of 2, its RAM disk wiped; its data of step 3 is in a committed backup."""
    url = str(tmp_path / "bucket")
    bucket = BackupStore(open_store(url), JOB)
    staging = bucket.begin(STEP, 2)
    for r in (0, 1):
        d = make_step(tmp_path / f"saved{r}", STEP, r, 2, {"state/0.bin": bytes([r]) * 30_000}, JOB)
        bucket.upload_rank(staging, r, d)
    bucket.commit(staging)
    root = tmp_path / "host1"
    opts = SimpleNamespace(rpc_timeout_seconds=10.0, heartbeat_seconds=1.0, transfer_timeout_seconds=60.0)
    metrics = ReplicatorMetrics(root)
    store = RamDiskStore(root, 1)
    tasks = TaskRunner(threads=1, bulk_priority="low", backoff_base_seconds=0.1, wait_seconds=60.0,
                       counters=metrics.counters, on_success=lambda: None)
    fetcher = Fetcher(opts, store, tasks, BackupAgent(BackupStore(open_store(url), JOB)), metrics,  # type: ignore[arg-type]
                      token=None, tls=None)
    yield SimpleNamespace(fetcher=fetcher, metrics=metrics, store=store)
    tasks.shutdown(wait=True)


def _bucket_source() -> cpb.RestoreSource:
    return cpb.RestoreSource(owner_rank=1, kind=tier_pb2.TIER_BUCKET)


def test_the_sidecars_fetch_of_its_own_data_counts_as_the_restore(host) -> None:  # type: ignore[no-untyped-def]
    rel, _ = host.fetcher.for_sidecar([_bucket_source()], [0, 1], 1, STEP, False,
                                      clock=RestoreClock(STEP, 1, "sidecar"))
    assert rel == f"steps/{STEP}" and host.store.has(1, STEP)
    m = host.store.manifest(1, STEP)
    assert _sample(host.metrics, "mtc_restore_seconds_count") == 1
    assert host.metrics.counters.get("restores") == 1
    assert host.metrics.counters.get("restore_bytes") == m.total_bytes > 0
    # The coordinator's restore task that follows finds the data here: the same restore, not counted again.
    task = cpb.RestoreTask(step=STEP, sources=[_bucket_source()])
    host.fetcher.restore(1, task)
    assert _sample(host.metrics, "mtc_restore_seconds_count") == 1
    assert host.metrics.counters.get("restores") == 1


def test_the_restore_task_counts_it_when_it_comes_first(host) -> None:  # type: ignore[no-untyped-def]
    host.fetcher.restore(1, cpb.RestoreTask(step=STEP, sources=[_bucket_source()]))
    assert _sample(host.metrics, "mtc_restore_seconds_count") == 1 and host.metrics.counters.get("restores") == 1
    rel, _ = host.fetcher.for_sidecar([_bucket_source()], [0, 1], 1, STEP, False,
                                      clock=RestoreClock(STEP, 1, "sidecar"))
    assert layout.resolve_under(host.store.root, rel).is_dir()
    assert _sample(host.metrics, "mtc_restore_seconds_count") == 1 and host.metrics.counters.get("restores") == 1


def test_a_sidecar_fetch_of_another_ranks_data_is_not_this_hosts_restore(host) -> None:  # type: ignore[no-untyped-def]
    src = cpb.RestoreSource(owner_rank=0, kind=tier_pb2.TIER_BUCKET)
    host.fetcher.for_sidecar([src], [0, 1], 0, STEP, False, clock=RestoreClock(STEP, 0, "sidecar"))
    assert host.store.has(0, STEP)
    assert _sample(host.metrics, "mtc_restore_seconds_count") == 0 and host.metrics.counters.get("restores") == 0


def test_own_data_brought_for_the_sidecar_is_not_a_save(host) -> None:  # type: ignore[no-untyped-def]
    """The heartbeat counts each own step that appears on the RAM disk as a save, except those a restore
    brought: the sidecar's fetch (a stream, a rebuild from parity) is such a restore too."""
    host.fetcher.for_sidecar([_bucket_source()], [0, 1], 1, STEP, False, clock=RestoreClock(STEP, 1, "sidecar"))
    assert host.fetcher.restored_among({STEP, STEP + 1}) == {STEP}
    assert host.fetcher.restored_among({STEP}) == set()  # forgotten once asked: a later save counts
    # Another rank's data fetched here is kept under that rank's name: never an own step.
    host.fetcher.for_sidecar([cpb.RestoreSource(owner_rank=0, kind=tier_pb2.TIER_BUCKET)], [0, 1], 0, STEP, False)
    assert host.fetcher.restored_among({STEP}) == set()
