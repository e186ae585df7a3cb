"""Ingesting Orbax's ``<local>/<N>`` by hard links, with Orbax's real step deleter running at the same time.

CI caught it: Orbax with a preservation policy (``LatestN``) deletes step N right after saving N+1, in a
thread: its deleter finds ``<local>/<N>``, then ``rmtree``-s it. A daemon that *moved* the directory into
its store in between made that ``rmtree`` raise ``FileNotFoundError`` out of Orbax's ``close()``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from replicator.orbax import contract as oc
from replicator.orbax import store as orbax_store
from replicator.orbax.store import OrbaxStore
from sidecar import checksums, layout


def _fake_orbax_step(d: Path, payload: bytes = b"x" * 5000) -> None:
    (d / "state" / "d").mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"init_timestamp_nsecs": time.time_ns()}))
    (d / "state" / "_METADATA").write_bytes(payload[:100])
    (d / "state" / "d" / "blob").write_bytes(payload)
    (d / "commit_success.txt").write_text("done")


def _orbax_deleter(local: Path):
    from orbax.checkpoint._src.path import deleter as orbax_deleter
    from orbax.checkpoint._src.path import step as step_lib

    return orbax_deleter.create_checkpoint_deleter(local, name_format=step_lib.standard_name_format(),
                                                   primary_host=None)


def test_orbax_deleting_a_step_the_daemon_ingests_between_its_find_and_its_rmtree(tmp_path: Path,
                                                                                monkeypatch) -> None:
    from orbax.checkpoint._src.path import deleter as orbax_deleter

    errors: list[str] = []
    store = OrbaxStore(tmp_path, 0, job="j", nodes=1, on_error=errors.append)
    _fake_orbax_step(tmp_path / "4")
    found = orbax_deleter.step_lib.find_step_path

    def find_then_ingest(*args, **kwargs):  # the daemon's heartbeat runs exactly in Orbax's window
        path = found(*args, **kwargs)
        assert store.ingest() == [4]
        return path

    monkeypatch.setattr(orbax_deleter.step_lib, "find_step_path", find_then_ingest)
    d = _orbax_deleter(tmp_path)
    d.delete(4)
    d.close()  # raised FileNotFoundError when the ingest moved <local>/4 away
    assert not os.path.lexists(tmp_path / "4") and errors == []
    # Orbax removed its links only: our copy is whole, still held, and not ingested again.
    m = checksums.verify_step_dir(tmp_path / "steps" / "4")
    assert (m.kind, m.step) == (layout.KIND_ORBAX, 4)
    assert (tmp_path / "steps" / "4" / "state" / "d" / "blob").stat().st_nlink == 1
    assert [h.step for h in store.inventory()] == [4] and store.ingest() == []


def test_gc_of_an_ingested_step_removes_orbax_links_with_it(tmp_path: Path) -> None:
    store = OrbaxStore(tmp_path, 0, job="j", nodes=1)
    for step in (1, 2, 3):
        _fake_orbax_step(tmp_path / str(step), payload=bytes([step]) * 5000)
    assert store.ingest() == [1, 2, 3]
    assert all(oc.is_restored_copy(tmp_path / str(s)) for s in (1, 2, 3))
    # Collected: the links go too (else they would keep its bytes on the RAM disk and be ingested again).
    assert store.delete(0, 1)
    assert not os.path.lexists(tmp_path / "1") and not store.has(0, 1)
    assert store.ingest() == []
    # A delete naming another content keeps both the copy and Orbax's links.
    assert not store.delete(0, 2, content_hash="f" * 64)
    assert store.has(0, 2) and oc.is_restored_copy(tmp_path / "2")
    # Orbax's <local>/3 that is not links to our copy (saved again since) is never removed by our GC.
    (tmp_path / "3").rename(tmp_path / "old3")
    _fake_orbax_step(tmp_path / "3", payload=b"new" * 2000)
    assert store.delete(0, 3)
    assert (tmp_path / "3" / "commit_success.txt").is_file() and store.ingest() == [3]


def test_orbax_deleting_the_step_while_it_is_linked_is_not_an_error(tmp_path: Path, monkeypatch) -> None:
    errors: list[str] = []
    store = OrbaxStore(tmp_path, 0, job="j", nodes=1, on_error=errors.append)
    _fake_orbax_step(tmp_path / "4")
    real_link = os.link
    calls = []

    def link_then_orbax_deletes(src, dst, **kwargs):
        calls.append(src)
        if len(calls) == 2:
            import shutil

            shutil.rmtree(tmp_path / "4")  # Orbax's deleter, mid-way through our links
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(orbax_store.os, "link", link_then_orbax_deletes)
    assert store.ingest() == []
    monkeypatch.undo()
    assert errors == [] and not os.path.lexists(tmp_path / "4")
    assert list((tmp_path / "steps").iterdir()) == [] and store.inventory() == []


def test_a_failed_ingest_leaves_orbax_dir_as_it_was(tmp_path: Path) -> None:
    errors: list[str] = []
    store = OrbaxStore(tmp_path, 0, job="j", nodes=1, on_error=errors.append)
    _fake_orbax_step(tmp_path / "4")
    (tmp_path / "4" / "state" / "ocdbt.process_1").mkdir()  # per-process OCDBT without a root: unreadable
    before = sorted(str(p.relative_to(tmp_path / "4")) for p in (tmp_path / "4").rglob("*"))
    assert store.ingest() == [] and len(errors) == 1 and "step 4" in errors[0]
    assert sorted(str(p.relative_to(tmp_path / "4")) for p in (tmp_path / "4").rglob("*")) == before
    assert (tmp_path / "4" / "state" / "d" / "blob").stat().st_nlink == 1  # no link of it left anywhere
    assert list((tmp_path / "steps").iterdir()) == [] and store.ingest() == [] and len(errors) == 1
