"""Fixtures for the replicator tests (the kit lives in cluster_kit.py, importable from the tests)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from controller_client.local_cluster import LocalCluster as Cluster  # noqa: E402


@pytest.fixture
def cluster_factory() -> Iterator:
    made: list[Cluster] = []
    base = Path(tempfile.mkdtemp(prefix="mtc-cluster-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))

    def make(nodes: int = 4, data_parallelism: int = 2, **kw) -> Cluster:
        c = Cluster(base / f"c{len(made)}", nodes, data_parallelism, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop_all(signal.SIGKILL)
    shutil.rmtree(base, ignore_errors=True)


