"""`mtc plan --snapshotter`: the host RAM budget counts Orbax's in-memory Snapshotter's pinned-host copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller_client.cli import main  # noqa: E402

ARGS = ["plan", "--state-bytes", "8e9", "--hosts", "4", "--slices", "2", "--replicas", "1", "--keep", "2", "-o", "json"]


def _plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert main(ARGS + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_the_snapshotters_copy_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    plain = _plan(capsys)
    snap = _plan(capsys, "--snapshotter")
    own = 4_000_000_000  # 8e9 over 2 hosts per slice
    assert plain["own_bytes_per_step"] == snap["own_bytes_per_step"] == own
    assert snap["ram_disk_bytes_per_host"] == plain["ram_disk_bytes_per_host"]  # the RAM disk itself is the same
    assert plain["snapshot_bytes_per_host"] == 0
    assert plain["host_ram_bytes_per_host"] == plain["ram_disk_bytes_per_host"]
    assert snap["snapshot_bytes_per_host"] == own
    assert snap["host_ram_bytes_per_host"] == snap["ram_disk_bytes_per_host"] + own
    assert "Snapshotter" in snap["rule"]


def test_the_table_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGS[:-2] + ["--snapshotter"]) == 0
    out = capsys.readouterr().out
    assert "Snapshotter's pinned-host copy" in out and "host RAM per host" in out
