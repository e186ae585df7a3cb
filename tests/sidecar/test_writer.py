"""The background writer: re-saving a step number, recycled pages, a full disk."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

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


def test_a_save_fills_an_empty_spare_pool_for_the_next_save(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    w = writer.HostWriter(root)
    try:
        w.submit(_hs(root, 1, 1.0), keep=None)
        w.wait()
        pool = spares.spare_dir(root)
        deadline = time.monotonic() + 30  # the pool fills in a thread of its own, after the save is done
        while spares.spare_bytes(pool) != 2 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spares.spare_bytes(pool) == 2 << 20
        [name] = os.listdir(pool)
        ino = os.stat(pool / name).st_ino
        w.submit(_hs(root, 2, 2.0), keep=None)
        w.wait()
        path = layout.steps_dir(root) / "2" / layout.shard_file_name(0, 0)
        assert os.stat(path).st_ino == ino  # the warmed file (its pages) was taken
        checksums.verify_step_dir(layout.steps_dir(root) / "2")
        assert (np.fromfile(path, dtype=np.float32) == 2.0).all()
    finally:
        w.close()


def test_wait_pool_filled_waits_for_the_fill_the_save_started(tmp_path: Path, monkeypatch) -> None:
    """The fill is under way as soon as the save counts as finished (no gap in which a waiter misses it);
    wait_pool_filled waits for it, and says False when it is still running at the timeout."""
    root = tmp_path / "ram"
    release = threading.Event()
    real = spares.prewarm

    def held_prewarm(spare, sizes, free_bytes, stop):
        release.wait(30)
        return real(spare, sizes, free_bytes, stop)

    monkeypatch.setattr(spares, "prewarm", held_prewarm)
    w = writer.HostWriter(root)
    try:
        w.submit(_hs(root, 1, 1.0), keep=None)
        w.wait(timeout_seconds=30)
        assert w._warm is not None and w._warm.is_alive()  # registered before the save counted as done
        assert w.wait_pool_filled(timeout_seconds=0.2) is False
        release.set()
        assert w.wait_pool_filled(timeout_seconds=30) is True
        assert spares.spare_bytes(spares.spare_dir(root)) == 2 << 20
    finally:
        release.set()
        w.close()


def test_the_fill_runs_in_its_own_thread_and_yields_to_the_next_save(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "ram"
    seen: dict[str, object] = {}
    started, release = threading.Event(), threading.Event()
    real = spares.prewarm

    def slow_prewarm(spare, sizes, free_bytes, stop):  # the first fill waits until a second save is queued
        seen.setdefault("policy", os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None)
        seen.setdefault("thread", threading.current_thread().name)
        started.set()
        release.wait(30)
        seen.setdefault("stop_asked", stop())
        return real(spare, sizes, free_bytes, stop)

    monkeypatch.setattr(spares, "prewarm", slow_prewarm)
    w = writer.HostWriter(root)
    try:
        w.submit(_hs(root, 1, 1.0), keep=None)
        assert started.wait(30)
        w.submit(_hs(root, 2, 2.0), keep=None)
        w.wait(timeout_seconds=30)  # written while the first fill still holds its thread: not joined
        assert layout.read_manifest(layout.steps_dir(root) / "2").step == 2
        release.set()
    finally:
        release.set()
        w.close()
    assert seen["thread"].startswith("mtc-prewarm-")
    assert seen["stop_asked"] is True  # the second save asked the fill to stop
    if hasattr(os, "SCHED_IDLE"):  # never idle-class: holding the GIL there would stall the whole process
        assert seen["policy"] != os.SCHED_IDLE


def test_prewarm_adds_nothing_to_a_pool_in_use_or_a_tight_disk_and_stops_when_asked(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    pool = tmp_path / "pool"
    sizes = [3 << 20, 2 << 20, 100]
    assert spares.prewarm(pool, sizes, free_bytes=10 << 20 - 1) == 0  # under twice the 5 MiB
    assert spares.spare_bytes(pool) == 0
    calls = []
    stop_after = 1  # the first chunk of the first file, then stop

    def stop() -> bool:
        calls.append(1)
        return len(calls) > stop_after + 1

    monkeypatch.setattr(spares, "WARM_CHUNK_BYTES", 1 << 20)
    added = spares.prewarm(pool, sizes, free_bytes=1 << 30, stop=stop)
    assert added == 1 << 20 and spares.spare_bytes(pool) == 1 << 20  # cut short, at the size written
    assert not [n for n in os.listdir(pool) if n.startswith(spares.WARM_PREFIX)]
    assert spares.prewarm(pool, sizes, free_bytes=1 << 30) == 0  # the pool holds something already
    assert spares.drop_spares(pool) == 1 << 20
    assert spares.prewarm(pool, sizes, free_bytes=1 << 30) == 5 << 20
    assert sorted(n for n, _ in spares._spare_entries(pool)) == [2 << 20, 3 << 20]


def test_a_writer_starting_removes_a_fill_left_half_done_by_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    pool = spares.spare_dir(root)
    pool.mkdir(parents=True)
    (pool / f"{spares.WARM_PREFIX}dead").write_bytes(bytes(3 << 20))
    (pool / f"{2 << 20}-kept").write_bytes(bytes(2 << 20))
    w = writer.HostWriter(root, prewarm=False)
    w.close()
    assert sorted(os.listdir(pool)) == [f"{2 << 20}-kept"]  # the finished spare stays in the pool


def test_no_pool_is_filled_while_a_restore_runs_in_the_process(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    w = writer.HostWriter(root)
    try:
        with spares.quiet():
            w.submit(_hs(root, 1, 1.0), keep=None)
            w.wait()
            time.sleep(0.2)  # the writer thread has reached its fill (and stopped at once)
            assert spares.spare_bytes(spares.spare_dir(root)) == 0
        assert not spares.quieted()
    finally:
        w.close()
    assert spares.prewarm(spares.spare_dir(root), [2 << 20], free_bytes=1 << 30) == 2 << 20


def test_an_io_error_mid_write_names_the_step_and_the_disk_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """A failing write (EIO from the device) keeps its errno and OSError type but says which step and which
    RAM disk it was writing: the bare ``[Errno 5] Input/output error`` of ``pwrite`` named neither. (Real
    I/O errors at byte N from a FUSE filesystem: tests/faults/test_disk.py.)"""
    root = tmp_path / "ram"
    writer.write_step(_hs(root, 1, 1.0))

    def eio(fd: int, data: object, offset: int) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer.os, "pwrite", eio)
    with pytest.raises(OSError) as raised:
        writer.write_step(_hs(root, 2, 2.0))
    err = raised.value
    assert type(err) is OSError and err.errno == 5
    assert str(root) in str(err) and "step 2" in str(err) and "Input/output error" in str(err)
    assert sorted(os.listdir(layout.steps_dir(root))) == ["1"]  # no step 2, no temporary directory


def test_a_failed_save_is_raised_to_the_manager_that_queued_it_only(tmp_path: Path, caplog) -> None:
    """Its owner gets it once; another owner's calls (a later manager on a host that kept its sidecar
    process) log it and go on, and do not take it from a later failure of their own."""
    root = tmp_path / "ram"
    w = writer.HostWriter(root, prewarm=False)
    try:
        layout.steps_dir(root).write_text("")  # every write fails
        w.submit(_hs(root, 1, 1.0), None, owner="a")
        with pytest.raises(writer.SaveError, match="background save"):
            w.wait(30, owner="a")
        w.wait(30, owner="a")  # once
        w.submit(_hs(root, 2, 2.0), None, owner="a")
        with caplog.at_level("WARNING", logger="sidecar.writer"):
            w.wait(30, owner="b")
        assert "queued by an earlier checkpoint manager failed" in caplog.text
        w.submit(_hs(root, 3, 3.0), None, owner="b")
        with pytest.raises(writer.SaveError):
            writer.raise_failures([w], 30, wait=True, owner="b")
    finally:
        w.close()
