"""The crash-point matrix: SIGKILL a process at every named fault point, restart, check the invariants.

For each point in :data:`sidecar.faults.POINTS` a real process (the sidecar's writer, a backup uploader, a
replicator daemon, an Orbax-mode daemon) is started with ``MTC_FAULT_POINT`` naming it and killed there.
Then, before and after a restart:

* no partial or broken step is listed (every listed step on every tier verifies and is bit-exact);
* the newest globally complete step restores bit-exact;
* the same step number can be saved (backed up, fetched) again.

The outcome of every point is printed at the end of the run (tests/crash/report.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from controller_client.demo.cluster import LocalCluster
from controller_client.demo.ports import free_port as _free_port
from replicator.backup.bucket import BackupOptions, BackupStore
from replicator.backup.storage import open_store
from replicator.coordinator.client import CoordinatorClient
from replicator.local.store import RamDiskStore
from replicator.orbax import contract as oc
from sidecar import checksums, commit, faults, layout
from tests.crash import daemons, kit
from tests.crash.ec_points import run_ec
from tests.kits.cluster import redundant

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Case:
    group: str  # sidecar | jax | bucket | cluster | ec | orbax
    at: int = 1  # fire at the at-th time the point is reached
    victim: int = 1  # cluster: the rank whose replicator is armed
    xfail: str = ""  # a known defect: reason and the owning area
    raises: type[BaseException] | None = None  # the error the known defect raises


CASES: dict[str, Case] = {
    # sidecar writer: steps 1, 2, 3 with keep=2; the point fires while step 3 is written
    "save.after_tmp_dir": Case("sidecar", at=3),
    "save.mid_file": Case("sidecar", at=2 * kit.FILES_PER_STEP + 1),
    "save.after_files": Case("sidecar", at=3),
    "save.before_manifest": Case("sidecar", at=3),
    "save.after_manifest": Case("sidecar", at=3),
    "save.before_commit": Case("sidecar", at=3),
    "save.after_commit": Case("sidecar", at=3),
    "save.before_local_gc": Case("sidecar", at=3),
    "save.before_notify": Case("sidecar", at=3),
    "save.after_notify": Case("sidecar", at=3),
    "gc.mid_delete": Case("sidecar", at=1),  # step 3's GC deletes step 1
    # CheckpointManager (JAX, in-process dispatcher): the third save dies after its host copy
    "save.after_host_copy": Case("jax", at=3),
    # bucket: backups of step 1 (done) and 2 (killed), retention, restore of one rank
    "backup.upload.mid_upload": Case("bucket", at=kit.FILES_PER_STEP + 1),
    "backup.upload.before_manifest": Case("bucket", at=2),
    "backup.upload.after_manifest": Case("bucket", at=2),
    "backup.commit.before_record": Case("bucket"),
    "backup.commit.after_record": Case("bucket"),
    "backup.commit.after_rename": Case("bucket"),
    "backup.retention.mid_delete": Case("bucket"),
    "restore.bucket.mid_download": Case("bucket", at=2),
    "restore.bucket.before_commit": Case("bucket"),
    # replicator daemons (2 hosts, ring copies): the armed one dies while steps 1..4 are saved
    "notify.received": Case("cluster", at=2),
    "heartbeat.after_response": Case("cluster", at=10, victim=0),  # the coordinator's host
    "copy.before_fetch": Case("cluster", at=2),
    "peer.fetch.after_tmp_dir": Case("cluster", at=2),
    "peer.fetch.mid_transfer": Case("cluster", at=kit.FILES_PER_STEP + 1),
    "peer.fetch.before_manifest": Case("cluster", at=2),
    "peer.fetch.before_commit": Case("cluster", at=2),
    "peer.fetch.after_commit": Case("cluster", at=2),
    "peer.serve.mid_send": Case("cluster", at=kit.FILES_PER_STEP + 1),
    "gc.before_delete": Case("cluster"),
    "gc.after_delete": Case("cluster", victim=0),
    "restore.peer.before_fetch": Case("cluster"),
    # erasure coding (4 daemons at ec:3+1): the armed one computes its parity of step 1, or rebuilds it replaced
    "ec.parity.before_commit": Case("ec"),
    "ec.rebuild.mid": Case("ec"),
    # Orbax-mode daemon: one handshake for a committed step 5
    "orbax.ingest.after_link": Case("orbax"),
    "orbax.ingest.before_commit": Case("orbax"),
    "orbax.after_ingest": Case("orbax"),
    "orbax.before_marker": Case("orbax"),
    "orbax.after_marker": Case("orbax"),
    "orbax.after_ack": Case("orbax"),
}


def test_every_point_is_placed_once_and_in_the_matrix() -> None:
    assert len(faults.POINTS) >= 30 and set(CASES) == set(faults.POINTS)
    sources = "".join(p.read_text() for d in ("sidecar", "replicator") for p in (kit.REPO / d).rglob("*.py")
                      if p.name != "faults.py")
    for name in faults.POINTS:
        assert sources.count(f'faults.point("{name}")') == 1, name


def _params():
    for name in faults.POINTS:
        case = CASES[name]
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail, raises=case.raises)] if case.xfail else []
        yield pytest.param(name, case, id=name, marks=marks)


@pytest.mark.parametrize(("point", "case"), list(_params()))
def test_crash_point(point: str, case: Case, tmp_path: Path, crash_matrix: dict) -> None:
    crash_matrix[point] = {"group": case.group, "xfail": case.xfail}
    base = Path(os.environ.get("MTC_CRASH_DIR", "/dev/shm" if os.path.isdir("/dev/shm") else tmp_path))
    work = Path(tempfile_dir(base))
    try:
        RUNNERS[case.group](point, case, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def tempfile_dir(base: Path) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="mtc-crash-", dir=base)


# --------------------------------------------------------------------------- sidecar writer


def run_sidecar(point: str, case: Case, work: Path) -> None:
    root, fired_file = work / "ram" / "0", work / "fired"
    proc = kit.run_child("save", {"root": str(root), "rank": 0, "nodes": 1, "steps": [1, 2, 3], "keep": 2},
                         f"{point}@{case.at}", fired_file)
    kit.assert_killed_at(proc, point, fired_file)
    own = kit.check_nothing_broken(root, 0)
    assert own and own[-1] >= 2, own
    # Restart: the replicator's store and the sidecar's writer open the directory (start-up cleanup).
    RamDiskStore(root, 0)
    own = kit.check_nothing_broken(root, 0)
    assert not [p for p in layout.steps_dir(root).iterdir() if p.name.startswith(layout.TMP_PREFIX)]
    for step in (1, 2, 3):
        if step not in own:  # the same step number can be saved again
            kit.save_step(root, 0, 1, step)
            kit.check_step_dir(layout.steps_dir(root) / str(step), 0, step)


# --------------------------------------------------------------------------- CheckpointManager (JAX)


def run_jax(point: str, case: Case, work: Path) -> None:
    import numpy as np

    from tests.crash import jax_state

    template, fired_file = str(work / "ram" / "{host}"), work / "fired"
    proc = kit.run_child("jax_save", {"template": template, "steps": [1, 2, 3]}, f"{point}@{case.at}",
                         fired_file, timeout=120)
    kit.assert_killed_at(proc, point, fired_file)
    for r in range(4):
        for s in commit.committed_steps(layout.steps_dir(work / "ram" / str(r))):
            checksums.verify_step_dir(layout.steps_dir(work / "ram" / str(r)) / str(s))
    mgr = jax_state.manager(template)
    try:
        assert mgr.latest_step() == 2
        got = mgr.restore(2, jax_state.target())
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(jax_state.state(2)["w"]))
        assert got["step"] == 2
        mgr.save(3, jax_state.state(3))  # the step whose save died is saved again
        mgr.wait_until_finished()
        got = mgr.restore(3, jax_state.target())
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(jax_state.state(3)["w"]))
    finally:
        mgr.close()


# --------------------------------------------------------------------------- bucket


def _store(url: str, strategy: str) -> BackupStore:
    bs = BackupStore(open_store(url), "t", BackupOptions(commit_strategy=strategy))
    bs.check_capabilities()
    return bs


def _backup(url: str, strategy: str, roots: list[Path], step: int) -> None:
    bs = _store(url, strategy)
    staging = bs.begin(step, len(roots))
    for rank, root in enumerate(roots):
        bs.upload_rank(staging, rank, layout.steps_dir(root) / str(step))
    bs.commit(staging)


def _check_bucket(url: str, strategy: str, roots: list[Path], scratch: Path) -> list[int]:
    """Every committed backup restores every rank bit-exact; returns the committed steps."""
    bs = _store(url, strategy)
    steps = bs.committed_steps()
    for step in steps:
        for rank in range(len(roots)):
            dest = scratch / f"{step}-{rank}" / layout.STEPS_DIR
            shutil.rmtree(dest.parent, ignore_errors=True)
            bs.download_rank(step, rank, dest)
            kit.check_step_dir(dest / str(step), rank, step)
    return steps


def run_bucket(point: str, case: Case, work: Path) -> None:
    """Both commit strategies: atomic folder rename, and a create-only commit record written last."""
    roots = [work / "ram" / "0", work / "ram" / "1"]
    for rank, root in enumerate(roots):
        for step in (1, 2):
            kit.save_step(root, rank, 2, step)
    ran = 0
    for strategy in ("rename", "marker"):
        if strategy == "marker" and point in ("backup.commit.after_record", "backup.commit.after_rename"):
            continue  # rename-only steps: the marker strategy's commit is the record itself
        _run_bucket(point, case, work / strategy, roots, strategy)
        ran += 1
    assert ran


def _run_bucket(point: str, case: Case, work: Path, roots: list[Path], strategy: str) -> None:
    url, fired_file, scratch = f"file://{work}/bucket", work / "fired", work / "scratch"
    work.mkdir(parents=True)
    armed = f"{point}@{case.at}"
    common = {"url": url, "job": "t", "strategy": strategy}
    _backup(url, strategy, roots, 1)
    if point.startswith("backup.upload") or point.startswith("backup.commit"):
        proc = kit.run_child("backup", {**common, "step": 2, "roots": [str(r) for r in roots]}, armed, fired_file)
        kit.assert_killed_at(proc, point, fired_file)
        steps = _check_bucket(url, strategy, roots, scratch)
        assert 1 in steps
        if 2 in steps:
            assert point == "backup.commit.after_rename", f"step 2 committed although killed at {point}"
            with pytest.raises(FileExistsError):
                _backup(url, strategy, roots, 2)
        else:
            _backup(url, strategy, roots, 2)  # the same step is backed up again after the crash
        assert _check_bucket(url, strategy, roots, scratch) == [1, 2]
    elif point == "backup.retention.mid_delete":
        _backup(url, strategy, roots, 2)
        proc = kit.run_child("retention", {**common, "keep": 1}, armed, fired_file)
        kit.assert_killed_at(proc, point, fired_file)
        assert _check_bucket(url, strategy, roots, scratch) == [2]
        _backup(url, strategy, roots, 1)  # the deleted step can be backed up again
        assert _check_bucket(url, strategy, roots, scratch) == [1, 2]
    else:  # restore.bucket.*: a replaced host (empty RAM disk) restores rank 1's step 2 from the bucket
        _backup(url, strategy, roots, 2)
        host = work / "new-host"
        proc = kit.run_child("download", {**common, "step": 2, "rank": 1, "dest": str(layout.steps_dir(host))},
                             armed, fired_file)
        kit.assert_killed_at(proc, point, fired_file)
        assert kit.check_nothing_broken(host, 1) == []
        RamDiskStore(host, 1)  # restart: leftovers of the killed download go
        assert sorted(p.name for p in layout.steps_dir(host).iterdir()) == []
        _store(url, strategy).download_rank(2, 1, layout.steps_dir(host))
        kit.check_step_dir(layout.steps_dir(host) / "2", 1, 2)


# --------------------------------------------------------------------------- replicator daemons


def run_cluster(point: str, case: Case, work: Path) -> None:
    cl = LocalCluster(work / "c", 2, 1, replicas=1, heartbeat_seconds=0.1)
    fired_file, victim = work / "fired", case.victim
    armed = f"{point}@{case.at}"
    try:
        daemons.start(cl, 0, armed if victim == 0 else None, fired_file)
        daemons.start(cl, 1, armed if victim == 1 else None, fired_file)
        if point.startswith("restore."):
            for step in (1, 2, 3):
                daemons.save_all(cl, step)
            kit.wait_for(lambda: redundant(cl, 3), timeout=30, what="step 3 redundant")
            # Host 1 loses its step 3 (restart with the point armed); a restore makes it fetch it back.
            cl.procs[1].stop()
            shutil.rmtree(layout.steps_dir(cl.ram(1)) / "3")
            try:
                daemons.start(cl, 1, armed, fired_file)
            except RuntimeError:
                # The daemon heartbeats before it prints LISTENING: under load its first answer's restore
                # task reaches the point first (make test, -n 2, once). The crash under test, earlier: the
                # checks below judge it.
                if kit.fired(fired_file) != [point]:
                    raise
            threading.Thread(target=_try_prepare, args=(cl,), daemon=True).start()
            newest = 3
        else:
            newest = 0
            for step in (1, 2, 3, 4):
                daemons.save_all(cl, step)
                newest = step
                if cl.procs[victim].proc.poll() is not None:
                    break
                time.sleep(0.4)
        rc = daemons.died(cl, victim)
        assert rc == -signal.SIGKILL and kit.fired(fired_file) == [point], (
            f"point {point} not reached: rc={rc} fired={kit.fired(fired_file)}\n{cl.logs()}")
        for r in range(cl.nodes):
            kit.check_nothing_broken(cl.ram(r), r)
        daemons.start(cl, victim, None, fired_file)  # restart, unarmed
        kit.wait_for(lambda: redundant(cl, newest), timeout=40, what=f"step {newest} redundant")
        client = CoordinatorClient(cl.coordinator, rpc_timeout_seconds=10)
        try:
            assert client.prepare_restore(None, 30) == newest
        finally:
            client.close()
        for r in range(cl.nodes):
            kit.check_step_dir(layout.steps_dir(cl.ram(r)) / str(newest), r, newest)
            kit.check_nothing_broken(cl.ram(r), r)
        cl.stop_all()
        for r in range(cl.nodes):  # after a restart every step number not held can be saved again
            RamDiskStore(cl.ram(r), r)
            own = commit.committed_steps(layout.steps_dir(cl.ram(r)))
            for step in range(1, newest + 1):
                if step not in own:
                    kit.save_step(cl.ram(r), r, cl.nodes, step)
                    kit.check_step_dir(layout.steps_dir(cl.ram(r)) / str(step), r, step)
    except BaseException:
        print(cl.logs())
        raise
    finally:
        cl.stop_all(signal.SIGKILL)


def _try_prepare(cl: LocalCluster) -> None:
    try:
        c = CoordinatorClient(cl.coordinator, rpc_timeout_seconds=5)
        try:
            c.prepare_restore(None, 10)
        finally:
            c.close()
    except Exception:  # the host that should fetch dies on purpose
        pass


# --------------------------------------------------------------------------- Orbax mode


def _fake_orbax_step(d: Path, payload: bytes) -> None:
    (d / "state").mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": 1}')
    (d / "state" / "_METADATA").write_bytes(payload)
    (d / "commit_success.txt").write_text("done")


def _write_yaml(local: Path) -> None:
    cfg = oc.ReplicatorConfig("j", "orbax", 1, 0, 1, (), backup_interval_minutes=30)
    tmp = local / "replicator.yaml.tmp"
    tmp.write_text(yaml.safe_dump(cfg.to_dict()))
    os.replace(tmp, local / oc.REPLICATOR_FILE)


def _orbax_daemon(local: Path, port: int, point: str | None, fired_file: Path, log: Path) -> subprocess.Popen:
    args = ["--local-dir", str(local), "--listen", f"127.0.0.1:{port}", "--peers", f"0=127.0.0.1:{port}",
            "--heartbeat-seconds", "0.1", "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "30",
            "--handshake-timeout-seconds", "20"]
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "controller_client.cli", "-v", "replicator", *args],
                                stdout=subprocess.DEVNULL, stderr=f, env=kit.fault_env(point, fired_file),
                                cwd=str(kit.REPO))


def run_orbax(point: str, case: Case, work: Path) -> None:
    local, fired_file, log = work / "local", work / "fired", work / "daemon.log"
    local.mkdir()
    payload = os.urandom(3000)
    _fake_orbax_step(local / "5", payload)
    _write_yaml(local)
    port = _free_port()
    procs = [_orbax_daemon(local, port, f"{point}@{case.at}", fired_file, log)]
    try:
        try:
            rc = procs[0].wait(timeout=40)
        except subprocess.TimeoutExpired:
            rc = 0
        assert rc == -signal.SIGKILL and kit.fired(fired_file) == [point], (
            f"point {point} not reached: rc={rc}\n{log.read_text()[-3000:]}")
        for s in commit.committed_steps(layout.steps_dir(local)):
            checksums.verify_step_dir(layout.steps_dir(local) / str(s))
        if not (local / oc.REPLICATOR_FILE).exists():
            _write_yaml(local)  # acknowledged before the crash: Orbax proceeded; the next job start asks again
        procs.append(_orbax_daemon(local, port, None, fired_file, log))
        kit.wait_for(lambda: not (local / oc.REPLICATOR_FILE).exists(), timeout=40, what="handshake ack")
        assert not (local / "replicator.failed").exists(), (local / "replicator.failed").read_text()
        markers = sorted(p for p in local.iterdir() if p.name.endswith(".restore"))
        assert [m.name for m in markers] == [oc.marker_name("j", 5, 0)] and markers[0].is_dir(), markers
        target = layout.steps_dir(local) / "5"
        assert os.path.samefile(markers[0] / oc.COMMIT_SUCCESS_FILE, target / oc.COMMIT_SUCCESS_FILE)
        checksums.verify_step_dir(target)
        assert (target / "state" / "_METADATA").read_bytes() == payload
        # Orbax takes the marker as <local>/5 and saves on; its next step is ingested like any other.
        os.rename(markers[0], local / "5")
        _fake_orbax_step(local / "6", payload[::-1])
        kit.wait_for(lambda: (layout.steps_dir(local) / "6" / layout.MANIFEST_NAME).is_file(), timeout=20,
                     what="step 6 ingested")
        d6 = layout.steps_dir(local) / "6"
        checksums.verify_step_dir(d6)
        assert (d6 / "state" / "_METADATA").read_bytes() == payload[::-1]
    except BaseException:
        print(log.read_text()[-5000:])
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=10)


RUNNERS = {"sidecar": run_sidecar, "jax": run_jax, "bucket": run_bucket, "cluster": run_cluster, "ec": run_ec,
           "orbax": run_orbax}


# --------------------------------------------------------------------------- beyond one point


def test_trainer_killed_between_host_commits_saves_the_step_again(tmp_path: Path) -> None:
    from tests.crash import jax_state

    template, fired_file = str(tmp_path / "ram" / "{host}"), tmp_path / "fired"
    # 4 hosts commit each step (the trainer waits between saves): the 9th commit is step 3's first.
    proc = kit.run_child("jax_save", {"template": template, "steps": [1, 2, 3]}, "save.after_commit@9",
                         fired_file, timeout=120)
    kit.assert_killed_at(proc, "save.after_commit", fired_file)
    holders = [r for r in range(4) if 3 in commit.committed_steps(layout.steps_dir(tmp_path / "ram" / str(r)))]
    assert holders, "step 3 committed nowhere"
    if len(holders) == 4:  # the writers run in parallel: all got there before the kill landed
        for r in holders[1:]:
            commit.delete_step(layout.steps_dir(tmp_path / "ram" / str(r)) / "3")
    mgr = jax_state.manager(template)
    try:
        assert mgr.latest_step() == 2
        mgr.restore(2, jax_state.target())
        mgr.save(3, jax_state.state(3))
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3
    finally:
        mgr.wait_until_finished()
