"""Unchanged Orbax 0.12.8 multi-tier checkpointing against real `mtc replicator` daemons in Orbax mode.

Every host runs its own daemon (a real process, ``--local-dir`` without ``--rank/--nodes``) and one JAX CPU
process per job incarnation (``initialize_multi_tier_checkpointing`` + ``ReplicatorCheckpointManager``,
unchanged). Daemons stay up across job restarts (each new ``replicator.yaml`` is a new handshake) unless a
scenario replaces a host (stop, wipe its directory, start).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from replicator.orbax import contract as oc
from sidecar import checksums, layout
from tests.kits.orbax_replicator import REPO, OrbaxCluster, restored_from, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def base() -> Iterator[Path]:
    # The RAM disk when there is one (same filesystem for Orbax's directory and the store: renames).
    d = Path(tempfile.mkdtemp(prefix="mtc-orbax-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    clusters: list[OrbaxCluster] = []
    yield d, clusters
    for c in clusters:
        c.stop_all(signal.SIGKILL)
    shutil.rmtree(d, ignore_errors=True)


def _cluster(base, nodes: int, extra: list[str] = ()) -> OrbaxCluster:
    root, clusters = base
    c = OrbaxCluster(root / f"c{len(clusters)}", nodes, list(extra))
    clusters.append(c)
    c.start_all()
    return c


def _ok(cl: OrbaxCluster, res) -> None:
    assert all(rc == 0 for rc in res.returncodes), cl.describe(res)


def _restored(cl: OrbaxCluster, res, step: int) -> None:
    _ok(cl, res)
    for r in res.results:
        assert r["latest_at_start"] == step and r["restore_bit_exact"] is True, cl.describe(res)


def _bucket_steps(url: str, job: str) -> list[int]:
    return BackupStore(open_store(url), job).committed_steps()


def _replica_attested(cl: OrbaxCluster, holder: int, owner: int, step: int) -> bool:
    try:
        entries = json.loads((cl.local(holder) / "replica-of.json").read_text())
    except (OSError, ValueError):
        return False
    return any(o == owner and s == step for o, s, _ in entries)


def _check_ingested(cl: OrbaxCluster, rank: int, step: int) -> layout.StepManifest:
    """Orbax's <local>/<step> was moved into the store as a committed, verified step of kind orbax."""
    local = cl.local(rank)
    assert not (local / str(step)).is_dir() or oc.is_restored_copy(local / str(step))
    d = local / "steps" / str(step)
    m = checksums.verify_step_dir(d)
    assert (m.kind, m.step, m.rank) == (layout.KIND_ORBAX, step, rank)
    # The identity is Orbax's content hash of the directory as Orbax wrote it (without our manifest).
    bare = cl.base / "scratch" / f"{rank}-{step}"
    shutil.rmtree(bare, ignore_errors=True)
    shutil.copytree(d, bare, ignore=shutil.ignore_patterns(layout.MANIFEST_NAME))
    assert m.content_id == oc.orbax_content_hash(bare) and m.content_hash == m.content_id
    assert {f.name for f in m.files} >= {"_CHECKPOINT_METADATA", "commit_success.txt", "state/_METADATA"}
    return m


def test_orbax_preservation_policy_and_delete_keep_our_copies(base) -> None:
    """Orbax code with a preservation policy (LatestN) that also deletes the restored step trains, restarts
    and restores through our replicator: Orbax's deleter removes only the restore marker's hard links."""
    cl = _cluster(base, 2)
    _ok(cl, cl.run_job("pp", slices=2, save_steps="1,2,3", keep_latest=1))
    wait_for(lambda: all((cl.local(r) / "steps" / "3" / layout.MANIFEST_NAME).is_file() for r in range(2)),
             what="step 3 ingested", timeout=90)
    second = cl.run_job("pp", slices=2, restore_step=3, save_steps="4,5", keep_latest=1, delete_restored=True)
    _restored(cl, second, 3)  # and close() did not raise (rc 0)
    for r in range(2):
        assert ["delete", 3] in second.results[r]["events"], cl.describe(second)
        assert not os.path.lexists(cl.local(r) / "3")
        holders = [cl.local(r) / "steps" / "3", *cl.local(r).glob("peer/*/3")]
        assert holders and all(checksums.verify_step_dir(h) for h in holders if h.is_dir())
    wait_for(lambda: all((cl.local(r) / "steps" / "5" / layout.MANIFEST_NAME).is_file() for r in range(2)),
             what="step 5 ingested", timeout=90)
    _restored(cl, cl.run_job("pp", slices=2, restore_step=5, keep_latest=1), 5)


def test_two_slices_restart_wipe_one_wipe_all_backup_every_n_steps(base) -> None:
    """2 JAX processes = 2 slices (data-parallel replicas), bucket backup every 2 steps."""
    bucket = f"file://{base[0]}/bucket"
    cl = _cluster(base, 2, ["--backup-url", bucket])
    t0 = time.monotonic()
    first = cl.run_job("dp", slices=2, save_steps="1,2,3,4", save_sleep=0.6, backup_interval_steps=2)
    _ok(cl, first)
    wait_for(lambda: all((cl.local(r) / "steps" / "4" / layout.MANIFEST_NAME).is_file() for r in range(2)),
             what="step 4 ingested on both hosts")
    ms = [_check_ingested(cl, r, 4) for r in range(2)]
    # Replicas differ in file names (ocdbt.process_<id>) but not in content: one identity, no byte copy.
    assert ms[0].content_id == ms[1].content_id and ms[0].files != ms[1].files
    wait_for(lambda: _replica_attested(cl, 0, 1, 4) and _replica_attested(cl, 1, 0, 4), what="replicas attested")
    assert not list(cl.local(0).glob("peer/*/4")) and not list(cl.local(1).glob("peer/*/4"))
    # Every 2 steps: the first complete step, then one at least 2 steps later.
    backed = wait_for(lambda: (s := _bucket_steps(bucket, "dp")) and len(s) >= 2 and s, timeout=30,
                      what="two backups")
    assert backed[0] in (1, 2) and all(b - a >= 2 for a, b in zip(backed, backed[1:], strict=False)), backed
    for r in range(2):
        assert cl.daemons[r].lines[:1] == [f"LISTENING {cl.address(r)}"]

    # Restart every process (the daemons stay up and answer the new handshake): step 4 comes back.
    second = cl.run_job("dp", slices=2, restore_step=4, save_steps="5")
    _restored(cl, second, 4)
    for r in range(2):
        link = cl.local(r) / "4"
        assert restored_from(link, cl.local(r) / "steps" / "4")
    wait_for(lambda: _replica_attested(cl, 0, 1, 5), what="rank 1's step 5 attested on host 0")

    # Host 1 is replaced: its directory is wiped; it gets step 5 from its data-parallel replica (host 0).
    cl.stop(1)
    cl.wipe(1)
    cl.start(1)
    third = cl.run_job("dp", slices=2, restore_step=5)
    _restored(cl, third, 5)
    link = cl.local(1) / "5"
    assert restored_from(link, cl.local(1) / "peer" / "0" / "5")
    checksums.verify_step_dir(cl.local(1) / "peer" / "0" / "5")

    # Every host is lost: the newest backup comes back from the bucket.
    backed = _bucket_steps(bucket, "dp")
    assert cl.stop_all() == [0, 0]  # SIGTERM: clean exit
    for r in range(2):
        cl.wipe(r)
    cl.start_all()
    fourth = cl.run_job("dp", slices=2, restore_step=backed[-1])
    _restored(cl, fourth, backed[-1])
    # At least one host downloaded its data from the bucket; the other may then take its replica's copy
    # from that host (a peer is faster than the bucket) or download its own.
    n = str(backed[-1])
    for r in range(2):
        assert any(restored_from(cl.local(r) / n, c)
                   for c in (cl.local(r) / "steps" / n, cl.local(r) / "peer" / str(1 - r) / n))
    assert any(restored_from(cl.local(r) / n, cl.local(r) / "steps" / n) for r in range(2))
    print(f"2 processes: 4 incarnations in {time.monotonic() - t0:.1f}s; backups {backed}; init "
          f"{[round(x.results[0]['init_seconds'], 1) for x in (first, second, third, fourth)]}s")


def test_four_processes_two_slices_minutes_backup_request_wipe_one_and_all(base) -> None:
    """4 JAX processes = 2 slices x 2 hosts; bucket backup every minute; a _BACKUP_REQUESTED step."""
    bucket = f"file://{base[0]}/bucket"
    # No preemption flush when a host is stopped to be replaced: the bucket must not gain step 3 that way.
    cl = _cluster(base, 4, ["--backup-url", bucket, "--preemption-grace-seconds", "0"])
    t0 = time.monotonic()
    first = cl.run_job("quad", slices=2, save_steps="1,2,3", save_sleep=0.6, backup_interval_minutes=1)
    _ok(cl, first)
    # Minutes: the first complete step is backed up at once, the next not before a minute has passed.
    (only,) = wait_for(lambda: _bucket_steps(bucket, "quad"), timeout=30, what="first backup")
    assert only < 3
    # Hosts 1 and 3 hold the same shards (same in-slice index): attested replicas, no byte copies.
    wait_for(lambda: _replica_attested(cl, 1, 3, 3) and _replica_attested(cl, 3, 1, 3), what="replicas")
    assert _check_ingested(cl, 1, 3).content_id == _check_ingested(cl, 3, 3).content_id
    assert _check_ingested(cl, 0, 3).content_id != _check_ingested(cl, 1, 3).content_id

    # Host 3 is replaced (wiped): all 4 processes restart and get step 3, host 3 from host 1's copy (the
    # bucket does not hold step 3).
    cl.stop(3)
    cl.wipe(3)
    cl.start(3)
    second = cl.run_job("quad", slices=2, restore_step=3, save_steps="4")
    _restored(cl, second, 3)
    assert restored_from(cl.local(3) / "3", cl.local(3) / "peer" / "1" / "3")
    wait_for(lambda: all((cl.local(r) / "steps" / "4" / layout.MANIFEST_NAME).is_file() for r in range(4)),
             what="step 4 ingested")
    # The minute runs on across the restarted coordinator (from the backup's commit time): no new backup.
    time.sleep(1.0)
    assert _bucket_steps(bucket, "quad") == [only]
    # Newer Orbax drops _BACKUP_REQUESTED into a step it wants backed up now (0.12.8 never does): the
    # daemons pass it to the coordinator, whose scheduler backs the step up ahead of the interval.
    for r in range(4):
        (cl.local(r) / "steps" / "4" / oc.BACKUP_REQUESTED_FILE).touch()
    wait_for(lambda: 4 in _bucket_steps(bucket, "quad"), timeout=30, what="requested backup of step 4")

    # All hosts lost: step 4 from the bucket. Replicas' files differ (per-writer metadata, OCDBT names),
    # so each rank's files are kept apart in the bucket and every rank's download verifies.
    cl.stop_all()
    for r in range(4):
        cl.wipe(r)
    cl.start_all()
    third = cl.run_job("quad", slices=2, restore_step=4)
    _restored(cl, third, 4)
    for r in range(4):
        assert any(restored_from(cl.local(r) / "4", c)
                   for c in (cl.local(r) / "steps" / "4", cl.local(r) / "peer" / str((r + 2) % 4) / "4"))
    assert any(restored_from(cl.local(r) / "4", cl.local(r) / "steps" / "4") for r in range(4))
    print(f"4 processes: 3 incarnations in {time.monotonic() - t0:.1f}s; init "
          f"{[round(x.results[0]['init_seconds'], 1) for x in (first, second, third)]}s")


def test_single_slice_ring_copy_restores_a_wiped_host(base) -> None:
    """One slice (peer-ranks []): the ring copy is the only in-cluster copy of each host's step."""
    cl = _cluster(base, 2)
    first = cl.run_job("ring", slices=1, save_steps="1,2", save_sleep=0.3)
    _ok(cl, first)
    wait_for(lambda: (cl.local(0) / "peer" / "1" / "2" / layout.MANIFEST_NAME).is_file(), what="ring copy")
    m0, m1 = _check_ingested(cl, 0, 2), _check_ingested(cl, 1, 2)
    assert m0.content_id != m1.content_id  # each host holds different shards
    # `mtc status --local-dir` reaches an Orbax-mode daemon like a native one.
    out = subprocess.run(
        [sys.executable, "-m", "controller_client.cli", "status", "-o", "json", "--local-dir", str(cl.local(0))],
        capture_output=True, text=True, timeout=60, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    st = json.loads(out.stdout)
    assert (st["job"], st["rank"], st["nodes"], st["own_steps"][-1]) == ("ring", 0, 2, 2), out
    checksums.verify_step_dir(cl.local(0) / "peer" / "1" / "2")
    # Host 1's RAM disk is wiped under its running daemon (which rewrites jax-init-info.txt and answers the
    # next handshake with a fresh store).
    cl.wipe(1)
    second = cl.run_job("ring", slices=1, restore_step=2)
    _restored(cl, second, 2)
    # Fetched back from host 0 into host 1's own store.
    assert restored_from(cl.local(1) / "2", cl.local(1) / "steps" / "2")
    # Where the handshake's time went, phase by phase (replicator/orbax/handshake_clock.py).
    phases = ", ".join(rf"{p} \d+\.\d+s" for p in ("stop", "layout", "start", "hosts", "plan", "marker"))
    assert re.search(rf"handshake 2 done in \d+\.\d+s \({phases}\): restore step 2 from ",
                     (cl.base / "logs" / "replicator-1.log").read_text()), cl.describe(second)
    # ... and typed in `mtc status`: the host's own (--local-dir), per host and the slowest (the coordinator).
    _handshake_in_status(cl)
    assert _check_ingested(cl, 1, 2).content_id == m1.content_id


def _mtc_status(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "controller_client.cli", "status", "-o", "json", *args],
        capture_output=True, text=True, timeout=60, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    return json.loads(out.stdout)


def _handshake_in_status(cl: OrbaxCluster) -> None:
    """Every host's second handshake, phase by phase, in `mtc status` (never parsed from a log line)."""
    names = ["stop", "layout", "start", "hosts", "plan", "marker"]
    local = _mtc_status("--local-dir", str(cl.local(1)))["last_handshake"]
    assert local["number"] == 2 and local["outcome"].startswith("restore step 2 from "), local
    assert [p["phase"] for p in local["phases"]] == names
    assert local["seconds"] == pytest.approx(sum(p["seconds"] for p in local["phases"]), abs=1e-6)
    # The coordinator has each host's once its next heartbeat carried it.
    wait_for(lambda: all(h["last_handshake"] and h["last_handshake"]["number"] == 2 for h in
                         _mtc_status("--coordinator", cl.address(0), "--hosts")["hosts"]), what="handshakes reported")
    st = _mtc_status("--coordinator", cl.address(0), "--hosts")
    slowest = max(st["hosts"], key=lambda h: h["last_handshake"]["seconds"])
    assert st["slowest_handshake"]["rank"] == slowest["rank"]
    assert st["slowest_handshake"]["seconds"] == slowest["last_handshake"]["seconds"]
    assert [p["phase"] for p in st["slowest_handshake"]["phases"]] == names


def test_a_handshake_waits_for_no_heartbeat_interval(base) -> None:
    """With the default 2 s heartbeats, a handshake of daemons that stay up (the coordinator restarts inside it)
    takes well under one interval: each host reports as soon as the new coordinator answers (not after its
    failed heartbeat's back-off) and right after asking for the plan (not at its next heartbeat)."""
    cl = _cluster(base, 2, ["--heartbeat-seconds", "2"])
    _ok(cl, cl.run_job("hb", slices=2, save_steps="1"))
    wait_for(lambda: all((cl.local(r) / "steps" / "1" / layout.MANIFEST_NAME).is_file() for r in range(2)),
             what="step 1 ingested", timeout=60)
    _restored(cl, cl.run_job("hb", slices=2, restore_step=1), 1)
    for r in range(2):
        hs = _mtc_status("--local-dir", str(cl.local(r)))["last_handshake"]
        phases = {p["phase"]: p["seconds"] for p in hs["phases"]}
        assert hs["number"] == 2 and phases["hosts"] + phases["plan"] < 1.0, hs


def test_colocated_python_saves_and_restores(base) -> None:
    """use_colocated_python=True (Orbax's Pathways check patched in the worker only): one CPU process."""
    cl = _cluster(base, 1)
    first = cl.run_job("colo", slices=1, save_steps="1,2", colocated=True)
    _ok(cl, first)
    wait_for(lambda: (cl.local(0) / "steps" / "2" / layout.MANIFEST_NAME).is_file(), what="step 2 ingested")
    _check_ingested(cl, 0, 2)
    second = cl.run_job("colo", slices=1, restore_step=2, save_steps="3", colocated=True)
    _restored(cl, second, 2)
    wait_for(lambda: (cl.local(0) / "steps" / "3" / layout.MANIFEST_NAME).is_file(), what="step 3 ingested")


def test_fatal_errors_reach_orbax_and_bad_config_exits_2(base) -> None:
    root = base[0]
    (root / "not-a-dir").write_text("")
    cl = _cluster(base, 2, ["--backup-url", f"file://{root}/not-a-dir/bucket"])
    # A malformed handshake file: replicator.failed, and the yaml removed so that Orbax would see it.
    (cl.local(0)).mkdir(parents=True, exist_ok=True)
    (cl.local(0) / oc.REPLICATOR_FILE).write_text("job-name: x\nframework: orbax\n")
    failed = cl.local(0) / oc.FAILED_FILE
    wait_for(lambda: failed.exists() and not (cl.local(0) / oc.REPLICATOR_FILE).exists(), what="fatal report")
    assert "unusable replicator.yaml" in failed.read_text() and "lacks required key" in failed.read_text()
    failed.unlink()
    # The replicator cannot start (its bucket is unusable): Orbax's init raises its RuntimeError.
    res = cl.run_job("fatal", slices=2, save_steps="1")
    assert res.returncodes == [3, 3], cl.describe(res)
    for rank, r in enumerate(res.results):
        assert r["init_error"].startswith(
            f"RuntimeError: Replicator fatal errors: mtc replicator: rank {rank}: cannot start: NotADirectoryError"
        ), r
    # Both daemons keep serving (the next handshake is answered again) and exit 0 on SIGTERM.
    assert cl.stop_all() == [0, 0]
    # Configuration errors are one line and exit 2.
    out = subprocess.run(
        [sys.executable, "-m", "controller_client.cli", "replicator", "--local-dir", str(root / "x")],
        capture_output=True, text=True, timeout=60, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out
    assert "Orbax mode needs the coordinator's address" in out.stderr


# --------------------------------------------------------------------------- in-process (no Orbax run)


def _fake_orbax_step(d: Path, payload: bytes = b"x" * 100) -> None:
    """A committed Orbax-like step without OCDBT (hashed byte by byte by orbax_content_hash)."""
    (d / "state").mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text(json.dumps({"init_timestamp_nsecs": time.time_ns()}))
    (d / "state" / "_METADATA").write_bytes(payload)
    (d / "commit_success.txt").write_text("done")


def test_orbax_store_ingests_only_committed_real_step_dirs(tmp_path: Path) -> None:
    from replicator.orbax.store import OrbaxStore

    errors: list[str] = []
    store = OrbaxStore(tmp_path, 1, job="j", nodes=2, on_error=errors.append)
    _fake_orbax_step(tmp_path / "5")
    (tmp_path / "6").mkdir()  # no commit_success.txt: not committed, left alone
    (tmp_path / "7.orbax-checkpoint-tmp").mkdir()  # a save in progress
    _fake_orbax_step(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "4")  # an earlier restore's link: never ingested
    os.symlink(tmp_path / "gone", tmp_path / "3")  # its target was collected: removed
    _fake_orbax_step(tmp_path / "kept")
    oc.write_restore_marker(tmp_path, "j", 2, 1, tmp_path / "kept")
    os.rename(tmp_path / oc.marker_name("j", 2, 1), tmp_path / "2")  # Orbax's rename: hard links, not ingested
    _fake_orbax_step(tmp_path / "8")
    (tmp_path / "8" / "state" / "ocdbt.process_1").mkdir()  # per-process OCDBT without a root: unreadable

    assert store.ingest() == [5]
    # Orbax's <local>/5 stays where it was: links to our copy now (Orbax may be deleting it right now).
    assert oc.is_restored_copy(tmp_path / "5") and (tmp_path / "6").is_dir() and (tmp_path / "4").is_symlink()
    assert os.path.samefile(tmp_path / "5" / "state" / "_METADATA", tmp_path / "steps" / "5" / "state" / "_METADATA")
    assert not os.path.lexists(tmp_path / "3") and oc.is_restored_copy(tmp_path / "2")
    m = checksums.verify_step_dir(tmp_path / "steps" / "5")
    assert (m.kind, m.rank, m.nodes, m.job) == (layout.KIND_ORBAX, 1, 2, "j")
    # Identity = Orbax's content hash: equal to a replica's (other timestamps), not to the file bytes.
    assert m.content_id == oc.orbax_content_hash(tmp_path / "elsewhere") == m.content_hash
    # The unreadable step is reported once and given back under Orbax's name; nothing half-visible.
    assert (tmp_path / "8" / "commit_success.txt").is_file() and len(errors) == 1 and "step 8" in errors[0]
    assert store.ingest() == [] and len(errors) == 1
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["5"]
    # A later save of the same step number (after a restore of an older step, which removed <local>/5)
    # replaces the stored one; inventory ingests first.
    shutil.rmtree(tmp_path / "5")
    _fake_orbax_step(tmp_path / "5", payload=b"y" * 100)
    (held,) = [h for h in store.inventory() if h.step == 5]
    assert held.content_hash != m.content_id and held.owner_rank == 1
    # _BACKUP_REQUESTED (newer Orbax) is a request, not content: excluded from files and identity.
    (tmp_path / "steps" / "5" / oc.BACKUP_REQUESTED_FILE).touch()
    assert store.backup_requests() == [5]
    assert store.data_dir_for(5) == tmp_path / "steps" / "5" and store.data_dir_for(6) is None


def test_replicator_options_from_replicator_yaml(tmp_path: Path) -> None:
    from replicator.options import ConfigError, ReplicatorOptions
    from replicator.orbax.mode import replicator_options

    opts = ReplicatorOptions(local_dir=tmp_path, peers={0: "h0:1", 1: "h1:1", 2: "h2:1", 3: "h3:1"}).validate()
    cfg = oc.ReplicatorConfig("job", "orbax", 2, 3, 4, (1,), backup_interval_steps=7)
    r = replicator_options(opts, cfg, "127.0.0.1:5000")
    assert (r.job, r.rank, r.nodes, r.data_parallelism, r.backup_interval_steps, r.backup_interval_minutes) == (
        "job", 3, 4, 2, 7, 0.0)
    assert (r.listen, r.advertise, r.coordinator_address()) == ("127.0.0.1:5000", "h3:1", "h0:1")
    # Peers that are not slice-major: every host its own failure domain (ring copies), never a wrong pairing.
    odd = oc.ReplicatorConfig("job", "orbax", 2, 3, 4, (0,), backup_interval_minutes=5)
    r = replicator_options(opts, odd, "127.0.0.1:5000")
    assert (r.data_parallelism, r.backup_interval_minutes) == (1, 5.0)
    with pytest.raises(ConfigError, match="coordinator"):
        ReplicatorOptions(local_dir=tmp_path).validate()
    with pytest.raises(ConfigError, match="go together"):
        ReplicatorOptions(local_dir=tmp_path, coordinator="c:1", jax_coordinator="h:1").validate()


def test_step_zero_is_reserved_for_no_checkpoint(base) -> None:
    """The guide: "Step 0 is reserved by the replicator service to indicate 'no checkpoint'". Orbax 0.12.8
    (multi-controller) saves step 0 like any other (test_orbax_multiprocess); our replicator keeps it, but a
    restart whose newest complete step is 0 answers "nothing to restore" (the empty s0 marker)."""
    cl = _cluster(base, 2)
    first = cl.run_job("zero", slices=2, save_steps="0")
    _ok(cl, first)
    wait_for(lambda: all((cl.local(r) / "steps" / "0" / layout.MANIFEST_NAME).is_file() for r in range(2)),
             what="step 0 ingested on both hosts")
    second = cl.run_job("zero", slices=2, save_steps="1")
    _ok(cl, second)
    assert [r["latest_at_start"] for r in second.results] == [None, None], cl.describe(second)
    # A later step restores as usual.
    wait_for(lambda: all((cl.local(r) / "steps" / "1" / layout.MANIFEST_NAME).is_file() for r in range(2)),
             what="step 1 ingested on both hosts")
    _restored(cl, cl.run_job("zero", slices=2, restore_step=1), 1)


def test_a_host_reports_right_after_asking_for_its_plan_and_while_it_waits() -> None:
    """The coordinator trusts a plan only on reports made after every host's request: the first reports come a
    hosts-poll apart (the hosts ask within a poll or so of each other), then paced under ~1000 calls a second
    on the coordinator while the call is open (a host waiting for its replica group's bucket fetch)."""
    from replicator.orbax.mode import paced_report_offsets, plan_report_offsets

    assert plan_report_offsets(0.02) == (0.02, 0.04, 0.06, 0.1, 0.3)
    assert plan_report_offsets(0.1) == (0.1, 0.2, 0.3)
    paced = paced_report_offsets(4, 5.0)
    assert paced[0] == pytest.approx(0.32) and paced[-1] <= 5.0 and len(paced) > 200
    assert all(b - a == pytest.approx(0.02) for a, b in zip(paced, paced[1:], strict=False))
    assert paced_report_offsets(1000, 5.0)[:2] == (1.3, 2.3)  # 1000 hosts: each reports once a second
    assert paced_report_offsets(4, 0.2) == ()
