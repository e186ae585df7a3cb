"""Fixtures for the replicator tests (the kit lives in tests/kits/cluster.py)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller_client.demo.cluster import LocalCluster as Cluster  # noqa: E402


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


