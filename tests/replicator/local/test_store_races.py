"""The RAM-disk store and the sidecar writer share a directory across processes: they must never race.

A replicator (re)starting runs start-up cleanup (``RamDiskStore`` → ``commit.remove_tmp_dirs``) while
the training process may be writing a step; that cleanup used to delete the writer's temporary
directory, failing saves and committing steps with missing files.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from replicator.local.store import RamDiskStore
from sidecar import checksums, commit, layout, writer

# A "replicator" restarting in a tight loop: each iteration is what a daemon start does to the disk.
_RESTARTER = r"""
import sys, time
from pathlib import Path
from replicator.local.store import RamDiskStore
from sidecar import checksums, commit, layout
root, stop = Path(sys.argv[1]), Path(sys.argv[2])
n = 0
print("ready", flush=True)
while not stop.exists():
    RamDiskStore(root, 0)
    commit.remove_tmp_dirs(layout.steps_dir(root))  # and what a daemon stop does
    n += 1
print(n, flush=True)
"""


def _host_step(root: Path, step: int, files: int) -> writer.HostStep:
    rng = np.random.default_rng(step)
    arrays = [
        writer.ArrayCopy(f"['w{i}']", (64,), "float32", None,
                         [writer.ShardCopy(((0, 64),), rng.standard_normal(64, dtype=np.float32))])
        for i in range(files)
    ]
    return writer.HostStep(root, "t", step, 0, 1, arrays, [layout.ValueEntry("['step']", step)])


def test_restarting_replicator_never_breaks_a_save(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    RamDiskStore(root, 0)
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", _RESTARTER, str(root), str(stop)],
                            stdout=subprocess.PIPE, text=True)
    w = writer.HostWriter(root, threads=2)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for step in range(1, 31):
            w.submit(_host_step(root, step, files=200), keep=3)
        w.wait(timeout_seconds=300)  # raises SaveError if any save failed
    finally:
        stop.touch()
        out, _ = proc.communicate(timeout=60)
        w.close()
    restarts = int(out.strip())
    assert restarts > 10, f"the cleanup loop ran only {restarts} times: the test proved nothing"
    steps = commit.committed_steps(layout.steps_dir(root))
    assert steps == [28, 29, 30]
    for s in steps:
        m = checksums.verify_step_dir(layout.steps_dir(root) / str(s))  # every listed file present and intact
        assert len(m.files) == 200
    assert [p.name for p in layout.steps_dir(root).iterdir() if not p.name.isdigit()] == []


def test_store_delete_is_crash_safe_and_inventory_ignores_trash(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    store = RamDiskStore(root, 0)
    for step in (1, 2):
        writer.write_step(_host_step(root, step, files=3))
    # A GC killed after the rename: trash under the steps directory.
    trash = layout.steps_dir(root) / f"{layout.TRASH_PREFIX}1-abc"
    (layout.steps_dir(root) / "1").rename(trash)
    assert [h.step for h in store.inventory()] == [2]
    writer.write_step(_host_step(root, 1, files=3))  # the step number is free again
    t0 = time.monotonic()
    RamDiskStore(root, 0)  # start-up cleanup removes the trash
    assert time.monotonic() - t0 < 30
    assert not trash.exists()
    assert sorted(h.step for h in store.inventory()) == [1, 2]
    store.delete(0, 2)
    assert [p.name for p in layout.steps_dir(root).iterdir()] == ["1"]
