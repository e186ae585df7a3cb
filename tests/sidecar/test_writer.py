"""The background writer: re-saving a step number, recycled pages, a full disk."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from sidecar import checksums, layout, spares, writer


def _hs(root: Path, step: int, fill: float, n: int = 1 << 19) -> writer.HostStep:
    data = np.full(n, fill, dtype=np.float32)
    return writer.HostStep(root, "t", step, 0, 1,
                           [writer.ArrayCopy("['w']", (n,), "float32", None, [writer.ShardCopy(((0, n),), data)])],
                           [layout.ValueEntry("['step']", step)])


def test_saving_a_committed_step_again_replaces_it(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    writer.write_step(_hs(root, 10, 1.0))
    # E.g. the job restored step 8 and reaches step 10 again: the abandoned step 10 is replaced.
    m = writer.write_step(_hs(root, 10, 2.0))
    d = layout.steps_dir(root) / "10"
    assert layout.read_manifest(d) == m
    got = np.fromfile(d / layout.shard_file_name(0, 0), dtype=np.float32)
    assert (got == 2.0).all()
    assert sorted(os.listdir(layout.steps_dir(root))) == ["10"]


def test_gc_recycles_pages_into_the_next_save(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    for step in (1, 2):
        writer.write_step(_hs(root, step, float(step)))
    ino = os.stat(layout.steps_dir(root) / "1" / layout.shard_file_name(0, 0)).st_ino
    assert writer.gc_local_steps(root, keep=1) == [1]
    assert spares.spare_bytes(spares.spare_dir(root)) == 2 << 20
    writer.write_step(_hs(root, 3, 3.0))
    path = layout.steps_dir(root) / "3" / layout.shard_file_name(0, 0)
    assert os.stat(path).st_ino == ino  # the deleted step's file (its pages) was reused
    checksums.verify_step_dir(layout.steps_dir(root) / "3")
    assert (np.fromfile(path, dtype=np.float32) == 3.0).all()
    assert spares.spare_bytes(spares.spare_dir(root)) == 0
