"""Replica attestations on the RAM disk, including a restored rank's own (issue #19 "lost replica proof")."""

from __future__ import annotations

import random
from pathlib import Path

from replicator.coordinator.model import Tier
from replicator.local.store import REPLICA_FILE, RamDiskStore
from sidecar import layout
from tests.kits.storage import make_step


def _files(seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    return {"meta.json": rnd.randbytes(64), "state/0.bin": rnd.randbytes(4096)}


def test_a_rank_restored_from_a_replicas_data_reports_it_as_its_own(tmp_path: Path) -> None:
    store = RamDiskStore(tmp_path, 0)
    assert not store.attest_restored(4, "nothing-here")  # no copy of a replica's data of step 4
    make_step(store.peer_parent(2), 4, 2, 4, _files(4))  # restored: rank 2's byte-identical data
    h = store.manifest(2, 4).content_hash
    assert not store.attest_restored(4, "another-hash")
    assert store.attest_restored(4, h)
    inv = {(x.owner_rank, x.step, x.tier): x for x in store.inventory()}
    assert set(inv) == {(2, 4, Tier.PEER), (0, 4, Tier.REPLICA)}
    assert inv[(0, 4, Tier.REPLICA)].content_hash == h and inv[(0, 4, Tier.REPLICA)].size == 0
    # Kept where the data is: a restarted replicator reports it again.
    again = RamDiskStore(tmp_path, 0)
    assert {(x.owner_rank, x.tier) for x in again.inventory()} == {(2, Tier.PEER), (0, Tier.REPLICA)}
    # It goes with the copy it names.
    again.delete(2, 4)
    assert again.inventory() == []
    assert (tmp_path / REPLICA_FILE).read_text() == "[]"


def test_own_data_needs_no_self_attestation(tmp_path: Path) -> None:
    store = RamDiskStore(tmp_path, 0)
    make_step(layout.steps_dir(tmp_path), 4, 0, 4, _files(4))
    make_step(store.peer_parent(2), 4, 2, 4, _files(4))
    assert not store.attest_restored(4, store.manifest(2, 4).content_hash)
    assert {(x.owner_rank, x.tier) for x in store.inventory()} == {(0, Tier.LOCAL), (2, Tier.PEER)}
