"""A deletion the coordinator sends names the copy it means: a save of the same step committed since (a job
that rolled back saves the step again) is kept, never deleted in its place."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from replicator.local.store import RamDiskStore
from sidecar import commit, layout, writer


def _save(root: Path, step: int, seed: int) -> str:
    """Commit ``step`` with content of ``seed`` (replacing a committed one, as a re-save does)."""
    rng = np.random.default_rng(seed)
    arrays = [writer.ArrayCopy("['w']", (64,), "float32", None,
                               [writer.ShardCopy(((0, 64),), rng.standard_normal(64, dtype=np.float32))])]
    writer.write_step(writer.HostStep(root, "t", step, 0, 1, arrays, [layout.ValueEntry("['step']", step)]))
    return layout.read_manifest(layout.steps_dir(root) / str(step)).content_hash


def test_a_newer_save_of_the_step_is_kept_and_the_named_one_deleted(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    store = RamDiskStore(root, 0)
    old = _save(root, 6, seed=1)
    new = _save(root, 6, seed=2)  # the job rolled back and saved step 6 again
    assert old != new
    assert store.delete(0, 6, content_hash=old) is False
    assert store.has(0, 6, new)
    assert [h.content_hash for h in store.inventory() if h.step == 6] == [new]
    assert store.delete(0, 6, content_hash=new) is True
    assert not (layout.steps_dir(root) / "6").exists()
    assert store.delete(0, 6, content_hash=new) is False  # nothing left to delete
    _save(root, 7, seed=3)
    assert store.delete(0, 7) is True  # no content named: whatever is there (the admin's deletions)


def test_a_save_committed_after_the_check_is_put_back(tmp_path: Path) -> None:
    """The check runs again once the directory is under its trash name; a save that landed between the
    store's first look and the rename is renamed back, whole."""
    root = tmp_path / "ram"
    _save(root, 6, seed=1)
    d = layout.steps_dir(root) / "6"
    new = _save(root, 6, seed=2)
    seen = []

    def only_if(trash: Path) -> bool:
        assert not d.exists() and trash.parent == d.parent
        seen.append(layout.read_manifest(trash).content_hash)
        return False

    assert commit.delete_step(d, only_if=only_if) is False
    assert seen == [new]
    assert layout.read_manifest(d).content_hash == new
    assert [p.name for p in d.parent.iterdir()] == ["6"]


def test_the_superseded_copy_goes_when_yet_another_save_took_the_name(tmp_path: Path) -> None:
    root = tmp_path / "ram"
    _save(root, 6, seed=1)
    d = layout.steps_dir(root) / "6"
    newest: list[str] = []

    def only_if(trash: Path) -> bool:
        newest.append(_save(root, 6, seed=3))  # committed under the name while the other is away
        return False

    assert commit.delete_step(d, only_if=only_if) is True
    assert layout.read_manifest(d).content_hash == newest[0]
    assert [p.name for p in d.parent.iterdir()] == ["6"]
