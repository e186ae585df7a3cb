"""A node's RAM disk outlives its Pods: when a JobSet restart places another rank on the node, the steps the
earlier rank saved are that rank's copies, and copies of the new rank's data are its own steps."""

from __future__ import annotations

import random
from pathlib import Path

from replicator.local.store import RamDiskStore
from replicator.tiers import Tier
from sidecar import layout
from tests.kits.storage import make_step


def _files(seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    return {"meta.json": rnd.randbytes(64), "state/0.bin": rnd.randbytes(2048)}


def test_another_ranks_steps_become_its_copies_and_copies_of_this_rank_its_own(tmp_path: Path) -> None:
    make_step(layout.steps_dir(tmp_path), 8, 1, 2, _files(1))  # rank 1 ran on this node before the restart
    make_step(layout.steps_dir(tmp_path), 4, 1, 2, _files(2))
    make_step(layout.peer_dir(tmp_path, 0), 8, 0, 2, _files(3))  # its copy of rank 0's step 8
    store = RamDiskStore(tmp_path, 0)  # rank 0 runs here now
    held = {(h.owner_rank, h.step, h.tier) for h in store.inventory()}
    assert held == {(1, 8, Tier.PEER), (1, 4, Tier.PEER), (0, 8, Tier.LOCAL)}
    assert layout.read_manifest(store.step_dir(0, 8)).rank == 0
    assert layout.read_manifest(store.step_dir(1, 8)).rank == 1
    assert store.own_steps() == [8]


def test_a_step_already_where_it_belongs_stays_and_the_duplicate_goes(tmp_path: Path) -> None:
    make_step(layout.steps_dir(tmp_path), 8, 1, 2, _files(1))
    make_step(layout.peer_dir(tmp_path, 1), 8, 1, 2, _files(9))  # a different save of rank 1's step 8 is there
    store = RamDiskStore(tmp_path, 0)
    assert {(h.owner_rank, h.step, h.tier) for h in store.inventory()} == {(1, 8, Tier.PEER)}
    assert (store.step_dir(1, 8) / "state" / "0.bin").read_bytes() == _files(9)["state/0.bin"]
    assert store.own_steps() == []


def test_the_same_rank_again_moves_nothing(tmp_path: Path) -> None:
    make_step(layout.steps_dir(tmp_path), 8, 0, 2, _files(1))
    make_step(layout.peer_dir(tmp_path, 1), 8, 1, 2, _files(2))
    store = RamDiskStore(tmp_path, 0)
    assert {(h.owner_rank, h.step, h.tier) for h in store.inventory()} == {(0, 8, Tier.LOCAL), (1, 8, Tier.PEER)}
