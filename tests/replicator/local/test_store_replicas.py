"""Replica attestations on the RAM disk: a replica's, a restored rank's own (issue #19 "lost replica proof") and a
witness's (issue #33 "lost replica identity")."""

from __future__ import annotations

import random
from pathlib import Path

from replicator.local.store import REPLICA_FILE, RamDiskStore
from replicator.tiers import Tier
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


def test_a_copy_of_a_replicas_data_witnesses_the_identical_replica(tmp_path: Path) -> None:
    """Host 3 holds a copy of rank 0's data; rank 2's is byte-identical: host 3 records itself as its witness
    (issue #33 "lost replica identity"), reported while the copy is here, kept across a restart, and gone
    with the copy."""
    store = RamDiskStore(tmp_path, 3)
    make_step(store.peer_parent(0), 4, 0, 4, _files(4))
    h = store.manifest(0, 4).content_hash
    assert not store.attest_replica(2, 4, "another-hash")  # no bytes of that content here
    assert not store.attest_replica(2, 5, h)  # nor of that step
    assert store.attest_replica(2, 4, h)
    inv = {(x.owner_rank, x.tier): x for x in store.inventory()}
    assert set(inv) == {(0, Tier.PEER), (2, Tier.REPLICA)}
    assert inv[(2, Tier.REPLICA)].content_hash == h and inv[(2, Tier.REPLICA)].size == 0
    again = RamDiskStore(tmp_path, 3)
    assert {(x.owner_rank, x.tier) for x in again.inventory()} == {(0, Tier.PEER), (2, Tier.REPLICA)}
    again.delete(0, 4, h)
    assert again.inventory() == []
    assert (tmp_path / REPLICA_FILE).read_text() == "[]"


def test_a_witness_of_a_coming_copy_is_reported_once_the_copy_lands(tmp_path: Path) -> None:
    """The answer that tells host 3 to copy rank 0's data also names it rank 2's witness: recorded at once
    (the coordinator that knew the identity may be gone when the copy lands), reported once the bytes are here."""
    store = RamDiskStore(tmp_path / "host3", 3)
    files = _files(4)
    h = layout.read_manifest(make_step(tmp_path / "host0", 4, 0, 4, files)).content_hash  # rank 0's, on host 0
    assert not store.attest_replica(2, 4, h)  # no bytes, none coming
    assert store.attest_replica(2, 4, h, coming=True)
    assert store.inventory() == []  # not reported before the bytes are here
    make_step(store.peer_parent(0), 4, 0, 4, files)  # the copy lands
    assert {(x.owner_rank, x.tier, x.content_hash) for x in store.inventory()} == {
        (0, Tier.PEER, h), (2, Tier.REPLICA, h)}


def test_an_attestation_stays_while_bytes_of_its_content_are_here(tmp_path: Path) -> None:
    """Host 2's own step is identical to rank 0's, and it also holds a copy of rank 0's data: deleting its
    own step keeps the attestation of rank 0 (the copy still proves it); deleting the copy drops it."""
    store = RamDiskStore(tmp_path, 2)
    make_step(layout.steps_dir(tmp_path), 4, 2, 4, _files(4))
    h = store.manifest(2, 4).content_hash
    assert store.attest_replica(0, 4, h)
    assert {(x.owner_rank, x.tier) for x in store.inventory()} == {(2, Tier.LOCAL), (0, Tier.REPLICA)}
    make_step(store.peer_parent(1), 4, 1, 4, _files(4))  # (a copy of an identical replica's data)
    store.delete(2, 4, h)
    assert {(x.owner_rank, x.tier) for x in store.inventory()} == {(1, Tier.PEER), (0, Tier.REPLICA)}
    store.delete(1, 4, h)
    assert store.inventory() == []
