"""Orbax mode after an elastic event: replicator.yaml with fewer or more nodes (issue #10 item 6).

The real-Orbax tests run the unchanged pinned Orbax in 2 or 4 JAX CPU processes against real daemon
processes on loopback (``tests/kits/orbax_replicator.py``). Every host keeps its directory (its RAM disk)
for the life of the test unless it is lost for good; ranks follow Orbax's numbering of the current job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from replicator.orbax import contract as oc
from replicator.orbax import elastic
from replicator.orbax.store import OrbaxStore
from sidecar import checksums, commit, layout
from tests.kits.orbax_replicator import OrbaxCluster, restored_from, wait_for

# --------------------------------------------------------------------------- in-process: the re-labelling


def _fake_orbax_step(d: Path, payload: bytes) -> None:
    """A committed Orbax-like step without OCDBT (hashed byte by byte by orbax_content_hash)."""
    (d / "state").mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"init_timestamp_nsecs": time.time_ns()}))
    (d / "state" / "_METADATA").write_bytes(payload)
    (d / "commit_success.txt").write_text("done")


def _saved(local: Path, rank: int, nodes: int, step: int, position: int) -> str:
    """Host ``local`` saved ``step`` as ``rank`` of ``nodes``; data depends only on the in-slice position."""
    _fake_orbax_step(local / str(step), payload=f"position {position} step {step}".encode())
    OrbaxStore(local, rank, job="j", nodes=nodes).ingest()
    return layout.read_manifest(local / "steps" / str(step)).content_hash


def _peer_copy(local: Path, holder: int, owner: int, nodes: int, step: int, position: int) -> None:
    """A ring copy of ``owner``'s step on host ``holder`` (as the peer client commits it)."""
    src = local / "scratch"
    _fake_orbax_step(src / str(step), payload=f"position {position} step {step}".encode())
    OrbaxStore(src, owner, job="j", nodes=nodes).ingest()
    dest = layout.peer_dir(local, owner)
    dest.mkdir(parents=True, exist_ok=True)
    os.rename(src / "steps" / str(step), dest / str(step))
    shutil.rmtree(src)


class _Doorbell:
    """A stand-in daemon's heartbeat doorbell (OrbaxMode rings it: now, and at times after asking for a plan)."""

    def wake(self) -> None:
        pass

    def wake_after(self, delays):
        return lambda: None


def test_remap_shrink_relabels_own_data_by_position_and_drops_what_has_no_slot(tmp_path: Path) -> None:
    # Old job: 4 nodes = 2 slices x 2 hosts. This host was rank 3 (position 1) and now is rank 1 of 2.
    h3 = _saved(tmp_path, 3, 4, 7, position=1)
    _peer_copy(tmp_path, 3, 2, 4, 7, position=0)  # a copy of old rank 2 (position 0)
    _peer_copy(tmp_path, 3, 1, 4, 7, position=1)  # old rank 1: position 1 again, a duplicate of ours
    (tmp_path / "replica-of.json").write_text(json.dumps([[1, 7, h3]]))
    prev = elastic.Layout("j", 3, 4, 2)
    new = elastic.Layout("j", 1, 2, 1)
    rep = elastic.remap(tmp_path, new, prev)

    own = checksums.verify_step_dir(tmp_path / "steps" / "7")
    assert (own.rank, own.nodes, own.content_hash) == (1, 2, h3)  # our own data, now rank 1's
    copy = checksums.verify_step_dir(tmp_path / "peer" / "0" / "7")
    assert (copy.rank, copy.nodes) == (0, 2)  # old rank 2's data is new rank 0's (position 0)
    assert not (tmp_path / "peer" / "2").exists() or not any((tmp_path / "peer" / "2").iterdir())
    assert rep.dropped == [(7, 1)] and not (tmp_path / elastic.STAGING_DIR).exists()
    assert sorted(rep.relabelled) == [(7, 2, 0), (7, 3, 1)] and rep.attest == []
    # Old attestations (of old ranks) are dropped by the handshake; the store reports the new ranks only.
    store = OrbaxStore(tmp_path, 1, job="j", nodes=2)
    store.forget_replicas(rep.steps)
    assert store._load_replicas() == {}
    held = {(h.owner_rank, h.step, str(h.tier)) for h in store.inventory()}
    assert held == {(1, 7, "local"), (0, 7, "peer")}
    assert store.data_dir_for(7) == tmp_path / "steps" / "7"
    # Idempotent: a second handshake with the same layout changes nothing.
    assert not elastic.remap(tmp_path, new, new).changed


def test_remap_grow_attests_new_ranks_and_ignores_current_pieces(tmp_path: Path) -> None:
    # Old job: 2 nodes in 1 slice; this host was rank 1 and stays rank 1 of 4 (2 slices).
    h = _saved(tmp_path, 1, 2, 5, position=1)
    rep = elastic.remap(tmp_path, elastic.Layout("j", 1, 4, 2), elastic.Layout("j", 1, 2, 1))
    m = checksums.verify_step_dir(tmp_path / "steps" / "5")
    assert (m.rank, m.nodes) == (1, 4)
    # New rank 3 (position 1 of the new slice) did not exist at the save: this host's data is its data.
    assert rep.attest == [(3, 5, h)]
    store = OrbaxStore(tmp_path, 1, job="j", nodes=4)
    assert store.attest_replica(3, 5, h)
    assert {(x.owner_rank, str(x.tier)) for x in store.inventory()} == {(1, "local"), (3, "replica")}
    # The new slice may come first: this host (rank 0 of 2) becomes rank 2 of 4; rank 0 is the new host.
    other = tmp_path / "other"
    h0 = _saved(other, 0, 2, 5, position=0)
    rep = elastic.remap(other, elastic.Layout("j", 2, 4, 2), elastic.Layout("j", 0, 2, 1))
    assert rep.relabelled == [(5, 0, 2)] and rep.attest == [(0, 5, h0)]


def test_remap_other_hosts_per_slice_moves_old_data_aside(tmp_path: Path) -> None:
    _saved(tmp_path, 0, 4, 3, position=0)
    rep = elastic.remap(tmp_path, elastic.Layout("j", 0, 3, 1), elastic.Layout("j", 0, 4, 2))
    assert "2 hosts per slice" in rep.unmapped and "3 hosts per slice" in rep.unmapped
    assert commit.committed_steps(tmp_path / "steps") == []
    assert len(list((tmp_path / elastic.UNMAPPED_DIR).iterdir())) == 1


def test_remap_finishes_an_interrupted_remap(tmp_path: Path) -> None:
    """A crash between the two phases leaves pieces (with their old manifests) in the staging dir."""
    _saved(tmp_path, 2, 4, 9, position=0)
    staging = tmp_path / elastic.STAGING_DIR
    staging.mkdir()
    os.rename(tmp_path / "steps" / "9", staging / "9-2-own-0-1")
    rep = elastic.remap(tmp_path, elastic.Layout("j", 0, 2, 1), None)
    assert rep.relabelled == [(9, 2, 0)] and not staging.exists()
    assert checksums.verify_step_dir(tmp_path / "steps" / "9").rank == 0


def test_bucket_source_rank_by_position() -> None:
    hashes = ("a" * 64, "b" * 64, "", "d" * 64)  # 4 nodes, 2 per slice; rank 2 did not save
    new = elastic.Layout("j", 1, 2, 1)
    assert elastic.bucket_source_rank(4, hashes, new) == 1  # same number, same position
    assert elastic.bucket_source_rank(4, hashes, elastic.Layout("j", 0, 2, 1)) == 0
    assert elastic.bucket_source_rank(2, hashes[:2], elastic.Layout("j", 2, 4, 2)) == 0  # grown: position 0
    with pytest.raises(ValueError, match="no rank of in-slice position 0"):
        elastic.bucket_source_rank(4, ("", "b" * 64, "", "d" * 64), elastic.Layout("j", 0, 2, 1))
    with pytest.raises(ValueError, match="hosts per slice"):
        elastic.bucket_source_rank(3, hashes[:3], new)
    assert elastic.holds_nothing(Path("/nonexistent-dir-for-test"))


def test_nothing_restorable_although_steps_are_held_is_reported_to_orbax(tmp_path: Path) -> None:
    """E.g. both survivors of a shrink held position 0: rank 1's data is nowhere. Orbax starts from
    scratch, and replicator.errors names what is missing instead of a silent "nothing to restore"."""
    from mtc_rpc import coordinator_pb2 as cpb
    from replicator.options import ReplicatorOptions
    from replicator.orbax.mode import OrbaxMode

    reason = "no step is recoverable for every rank; newest known step 7 lacks ranks 1"

    class FakeDaemon(_Doorbell):
        def call_coordinator(self, method, request, timeout):
            if method == "GetStatus":
                return cpb.GetStatusResponse(hosts_reported=2)
            return cpb.PrepareRestoreResponse(step=-1, reason=reason)

    opts = ReplicatorOptions(local_dir=tmp_path, peers={0: "127.0.0.1:1", 1: "127.0.0.1:2"}).validate()
    mode = OrbaxMode(opts, build=lambda *a, **k: None)
    cfg = oc.ReplicatorConfig("j", "orbax", 1, 0, 2, (), backup_interval_minutes=30)
    store = OrbaxStore(tmp_path, 0, job="j", nodes=2)
    assert mode._plan(FakeDaemon(), store, cfg, opts) == (None, None)
    assert not (tmp_path / oc.ERRORS_FILE).exists()  # a host holding nothing: nothing to say
    _saved(tmp_path, 0, 2, 7, position=0)
    assert mode._plan(FakeDaemon(), store, cfg, opts) == (None, None)
    text = (tmp_path / oc.ERRORS_FILE).read_text()
    assert "holds steps [7]" in text and "lacks ranks 1" in text


def _yaml(rank: int, nodes: int, slices: int) -> oc.ReplicatorConfig:
    h = nodes // slices
    peers = tuple(r for r in range(rank % h, nodes, h) if r != rank)
    return oc.ReplicatorConfig("j", "orbax", slices, rank, nodes, peers, backup_interval_minutes=30)


def test_a_renumbered_host_keeps_its_address_and_its_coordinator_candidacy(tmp_path: Path) -> None:
    """--peers is the full allocation (by allocation index): a host Orbax renumbers needs no new map."""
    from replicator.daemon import Replicator
    from replicator.options import ReplicatorOptions
    from replicator.orbax.mode import replicator_options

    addr = {r: f"127.0.0.1:{7000 + r}" for r in range(4)}
    opts = ReplicatorOptions(local_dir=tmp_path, peers=addr).validate()
    first = replicator_options(opts, _yaml(3, 4, 2), addr[3])
    assert (first.rank, first.allocation_index, first.advertise) == (3, 3, addr[3])
    assert first.coordinator_candidate_list() == [(0, addr[0]), (2, addr[2])]  # each slice's first host
    # Slice 0 lost: Orbax makes hosts 2, 3 ranks 0, 1 of 2 (one slice). Each keeps its own address, and the
    # candidates stay the allocation's: host 2 (now rank 0) is the second one, the first live one.
    roles = {}
    for host, rank in ((2, 0), (3, 1)):
        o = replicator_options(opts, _yaml(rank, 2, 1), addr[host])
        assert (o.rank, o.nodes, o.allocation_index, o.advertise) == (rank, 2, host, addr[host])
        assert o.coordinator_candidate_list() == [(0, addr[0]), (2, addr[2])]
        d = Replicator(o, rank=o.rank, nodes=o.nodes, job=o.job, store=None)
        roles[host] = (d.my_candidate, d.coordinator is not None)
        d.tasks.shutdown()
    assert roles == {2: (1, True), 3: (None, False)}
    # Mixed loss (hosts 0 and 3): host 1 is rank 0 and not a candidate, host 2 (rank 1) is.
    o = replicator_options(opts, _yaml(0, 2, 1), addr[1])
    assert (o.allocation_index, o.advertise) == (1, addr[1])
    # Flags that do not say which host this is: Orbax's rank is assumed to be the allocation index.
    legacy = replicator_options(opts, _yaml(1, 2, 1), "127.0.0.1:9")
    assert (legacy.allocation_index, legacy.advertise) == (1, addr[1])


def test_allocation_index_from_a_template_by_advertise_or_host_name(tmp_path: Path, monkeypatch) -> None:
    from replicator.options import ReplicatorOptions
    from replicator.orbax import allocation
    from replicator.orbax.mode import replicator_options

    tpl = "{job}-w-{slice}-{host}.{job}:7070"
    opts = ReplicatorOptions(local_dir=tmp_path, peer_address_template=tpl, listen="0.0.0.0:7070",
                             advertise="j-w-1-0.j:7070").validate()
    o = replicator_options(opts, _yaml(0, 2, 1), "0.0.0.0:7070")  # allocation host 2 (slice 1) is rank 0
    assert (o.allocation_index, o.advertise) == (2, "j-w-1-0.j:7070")
    # The template has no size: the candidates run up to this host's own slice (a prefix every host shares).
    assert o.coordinator_candidate_list() == [(0, "j-w-0-0.j:7070"), (2, "j-w-1-0.j:7070")]
    # No --advertise: the entry naming this host (a Pod's host name is the first label of its DNS name).
    monkeypatch.setattr(allocation.socket, "gethostname", lambda: "j-w-1-1")
    bare = ReplicatorOptions(local_dir=tmp_path, peer_address_template=tpl, listen="0.0.0.0:7070").validate()
    o = replicator_options(bare, _yaml(1, 2, 1), "0.0.0.0:7070")
    assert (o.allocation_index, o.advertise) == (3, "j-w-1-1.j:7070")
    # --allocation-index wins over everything.
    given = ReplicatorOptions(local_dir=tmp_path, peer_address_template=tpl, allocation_index=1).validate()
    assert replicator_options(given, _yaml(1, 4, 2), "0.0.0.0:7070").advertise == "j-w-0-1.j:7070"


def test_a_coordinator_of_another_node_count_is_not_trusted_for_the_plan(tmp_path: Path) -> None:
    """The previous incarnation's coordinator (its host has not seen the new yaml yet) would plan over the
    old ranks: the handshake waits for one of the yaml's node count, and says so if none comes."""
    from mtc_rpc import coordinator_pb2 as cpb
    from replicator.options import ReplicatorOptions
    from replicator.orbax.mode import HandshakeError, OrbaxMode

    asked = []

    class OldCoordinator(_Doorbell):
        def call_coordinator(self, method, request, timeout):
            asked.append(method)
            if method == "GetStatus":
                return cpb.GetStatusResponse(hosts_reported=4, topology=cpb.Topology(nodes=4),
                                             coordinator_address="127.0.0.1:7000")
            return cpb.PrepareRestoreResponse(step=-1, reason="nothing")

    opts = ReplicatorOptions(local_dir=tmp_path, peers={0: "127.0.0.1:1", 1: "127.0.0.1:2"},
                             handshake_timeout_seconds=0.5).validate()
    mode = OrbaxMode(opts, build=lambda *a, **k: None)
    store = OrbaxStore(tmp_path, 0, job="j", nodes=2)
    with pytest.raises(HandshakeError, match=r"127.0.0.1:7000 serves 4 hosts, replicator.yaml says 2"):
        mode._plan(OldCoordinator(), store, _yaml(0, 2, 1), opts)
    assert "PrepareRestore" not in asked and "GetStatus" in asked


# --------------------------------------------------------------------------- real Orbax, real daemons

@pytest.fixture
def cluster_base() -> Iterator[tuple[Path, list[OrbaxCluster]]]:
    d = Path(tempfile.mkdtemp(prefix="mtc-orbax-el-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    clusters: list[OrbaxCluster] = []
    yield d, clusters
    for c in clusters:
        c.stop_all(signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def _cluster(base, hosts: int, members: list[int], extra: list[str] = ()) -> OrbaxCluster:
    root, clusters = base
    c = OrbaxCluster(root / f"c{len(clusters)}", hosts, list(extra), members=members)
    clusters.append(c)
    c.start_all()
    return c


def _restored(cl: OrbaxCluster, res, step: int) -> None:
    assert all(rc == 0 for rc in res.returncodes), cl.describe(res)
    for r in res.results:
        assert r["latest_at_start"] == step and r["restore_bit_exact"] is True, cl.describe(res)


def _ingested(cl: OrbaxCluster, hosts: list[int], step: int) -> None:
    wait_for(lambda: all((cl.local(h) / "steps" / str(step) / layout.MANIFEST_NAME).is_file() for h in hosts),
             what=f"step {step} ingested on hosts {hosts}")


def _replica_attested(cl: OrbaxCluster, holder: int, owner: int, step: int) -> bool:
    try:
        entries = json.loads((cl.local(holder) / "replica-of.json").read_text())
    except (OSError, ValueError):
        return False
    return any(o == owner and s == step for o, s, _ in entries)


def _lose(cl: OrbaxCluster, hosts: list[int]) -> None:
    """Hosts gone for good (a slice lost): daemon killed, RAM disk gone."""
    for h in hosts:
        cl.daemons.pop(h).stop(signal.SIGKILL)
        cl.wipe(h)


def _restart(cl: OrbaxCluster, hosts: list[int]) -> None:
    for h in hosts:
        if h in cl.daemons:
            cl.daemons[h].stop()
        cl.start(h)


@pytest.mark.parametrize(("gone", "restart"), [([2, 3], False), ([0, 1], False), ([0, 1], True), ([0, 3], False)],
                         ids=["slice1", "slice0", "slice0-restarted", "mixed"])
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_orbax_shrinks_to_the_surviving_hosts_and_grows_back(cluster_base, gone: list[int], restart: bool) -> None:
    """2 slices x 2 hosts save; 2 hosts are lost for good; Orbax re-initialises on the 2 survivors (their
    RAM disks hold old-rank data), restores, saves; then 2 empty hosts join again (4 nodes) and get the
    data from the survivors. The daemons stay up throughout (``--peers`` is the whole allocation), except
    in ``slice0-restarted``, where the survivors' daemons are restarted before the shrink (RAM disks kept).

    slice1: the survivors keep ranks 0 and 1 (the issue's case). slice0: hosts 2 and 3 become ranks 0
    and 1 (same in-slice positions; the coordinator moves to host 2, the first live candidate). mixed:
    hosts 1 and 2 become ranks 0 and 1, so each holds the other's position: they swap data through the
    peer service; and the lost hosts' daemons stay up through the shrink (only their workers failed), so
    host 0 still serves the 4-node job's coordinator: the 2-node job's hosts skip it (another node count).
    """
    t0 = time.monotonic()
    cl = _cluster(cluster_base, 4, [0, 1, 2, 3])
    first = cl.run_job("el", slices=2, save_steps="1,2")
    assert all(rc == 0 for rc in first.returncodes), cl.describe(first)
    _ingested(cl, [0, 1, 2, 3], 2)

    survivors = [h for h in range(4) if h not in gone]
    # The survivors attested that their data equals the lost slice's (replica holdings of ranks that the
    # 2-node job does not have: what made the new coordinator reject every heartbeat).
    wait_for(lambda: all(_replica_attested(cl, h, (h + 2) % 4, 2) for h in survivors), what="replicas attested")
    stale = gone == [0, 3]
    if not stale:
        _lose(cl, gone)
    cl.set_members(survivors)
    pids = {h: cl.daemons[h].proc.pid for h in survivors}
    renumbered = survivors != [0, 1]
    if renumbered:
        # The cluster (GKE's ranks service) hands JAX the new process ids; the daemons are not told.
        for rank, h in enumerate(survivors):
            oc.write_jax_init_info(cl.local(h), rank, f"127.0.0.1:{cl.jax_port}")
    if restart:
        _restart(cl, survivors)
    second = cl.run_job("el", slices=1, restore_step=2, save_steps="3", elastic=True)
    _restored(cl, second, 2)
    for rank, h in enumerate(survivors):
        # The host's own old data re-labelled as its new rank's (mixed: the other survivor's, fetched).
        assert restored_from(cl.local(h) / "2", cl.local(h) / "steps" / "2"), cl.describe(second)
        m = checksums.verify_step_dir(cl.local(h) / "steps" / "2")
        assert (m.rank, m.nodes) == (rank, 2), cl.describe(second)
        assert "elastic scale up/down" in second.results[rank].get("orbax_restore_error", ""), second.results
        assert not (cl.local(h) / oc.FAILED_FILE).exists()
    _ingested(cl, survivors, 3)

    # Scale back up: the lost hosts return with empty RAM disks as ranks 2 and 3 (a new slice).
    if stale:
        _lose(cl, gone)
    cl.set_members(survivors + gone)
    _restart(cl, gone)
    third = cl.run_job("el", slices=2, restore_step=3, elastic=True)
    _restored(cl, third, 3)
    if not restart:  # the survivors answered all three handshakes with the daemons they started with
        assert {h: cl.daemons[h].proc.pid for h in survivors} == pids
        assert all(cl.daemons[h].proc.poll() is None for h in survivors)
    for rank, h in enumerate(gone, start=2):
        # Fetched from the survivor of the same in-slice position (rank - 2), verified, then restored.
        src = rank - 2
        copy = cl.local(h) / "peer" / str(src) / "3"
        assert restored_from(cl.local(h) / "3", copy), cl.describe(third)
        checksums.verify_step_dir(copy)
    print(f"lost hosts {gone}: 3 incarnations in {time.monotonic() - t0:.1f}s; init "
          f"{[round(x.results[0]['init_seconds'], 1) for x in (first, second, third)]}s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_orbax_changed_node_count_restores_from_a_backup_of_the_other_layout(cluster_base) -> None:
    """Every RAM disk lost across a shrink (4 -> 2) and again across a grow (2 -> 4): each host downloads
    its in-slice position's data of the newest backup, saved by the other node count."""
    bucket = f"file://{cluster_base[0]}/bucket"
    cl = _cluster(cluster_base, 4, [0, 1, 2, 3], ["--backup-url", bucket])

    def backed(step: int) -> bool:
        return step in BackupStore(open_store(bucket), "elb").committed_steps()

    first = cl.run_job("elb", slices=2, save_steps="1,2", backup_interval_steps=1)
    assert all(rc == 0 for rc in first.returncodes), cl.describe(first)
    wait_for(lambda: backed(2), timeout=60, what="step 2 in the bucket")

    _lose(cl, [0, 1])
    for h in (2, 3):  # the survivors' RAM disks are lost too: only the bucket holds step 2
        cl.daemons.pop(h).stop()
        cl.wipe(h)
    cl.set_members([2, 3])
    _restart(cl, [2, 3])
    second = cl.run_job("elb", slices=1, restore_step=2, save_steps="3", backup_interval_steps=1, elastic=True)
    _restored(cl, second, 2)
    for rank, h in enumerate([2, 3]):
        assert restored_from(cl.local(h) / "2", cl.local(h) / "steps" / "2"), cl.describe(second)
        m = checksums.verify_step_dir(cl.local(h) / "steps" / "2")
        assert (m.rank, m.nodes) == (rank, 2), cl.describe(second)
    wait_for(lambda: backed(3), timeout=60, what="step 3 in the bucket")

    for h in (2, 3):
        cl.daemons.pop(h).stop()
        cl.wipe(h)
    cl.set_members([0, 1, 2, 3])
    _restart(cl, [0, 1, 2, 3])
    third = cl.run_job("elb", slices=2, restore_step=3, elastic=True)
    _restored(cl, third, 3)
