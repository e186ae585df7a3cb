"""A committed copy lacking a file (or with a short one) is a bad copy: not counted, dropped (issue #19)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from replicator.local.store import RamDiskStore
from replicator.tiers import Tier
from sidecar import layout
from tests.kits.storage import make_step


def _files(seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    return {"meta.json": rnd.randbytes(64), "state/0.bin": rnd.randbytes(4096), "state/1.bin": rnd.randbytes(512)}


@pytest.mark.parametrize("damage", ["missing", "short"])
@pytest.mark.parametrize("where", ["own", "peer"])
def test_a_copy_lacking_a_file_is_not_counted_and_is_dropped(tmp_path: Path, caplog, damage: str, where: str) -> None:
    store = RamDiskStore(tmp_path, 0)
    owner = 0 if where == "own" else 3
    parent = layout.steps_dir(tmp_path) if where == "own" else store.peer_parent(3)
    make_step(parent, 5, owner, 4, _files(5))
    make_step(parent, 6, owner, 4, _files(6))
    tier = Tier.LOCAL if where == "own" else Tier.PEER
    assert {(h.owner_rank, h.step, h.tier) for h in store.inventory()} == {(owner, 5, tier), (owner, 6, tier)}
    victim = store.step_dir(owner, 6) / "state" / "0.bin"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="replicator.local.store"):
        inv = store.inventory()
    assert {(h.owner_rank, h.step) for h in inv} == {(owner, 5)}  # step 6 is no longer counted
    assert not store.step_dir(owner, 6).exists()  # dropped: another tier refills it
    assert any(f"bad copy of rank {owner} step 6" in r.getMessage() and "state/0.bin" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
