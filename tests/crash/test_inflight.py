"""The in-flight fault matrix: a host, a slice or the coordinator's host is replaced with an empty RAM disk
(or one replicator restarts with its RAM disk) **while** a backup uploads, a peer copy runs, a restore
runs, garbage collection deletes or a save commits.

Four real replicators on loopback (2 slices x 2 hosts, a local-folder bucket, every step backed up), the
controller's ``CheckpointManager`` in this process. The operation is held in flight by a pause fault point
(``MTC_FAULT_PAUSE_SECONDS``, sidecar/faults.py): the process that reaches the point first records it and
holds there for a few seconds, and the test replaces the victims meanwhile. Then every cell checks:

* the newest complete step never regresses: every answer the coordinator gives from the event on, and a
  fresh manager's ``latest_step()`` afterwards, is at least the newest complete step before the event;
* the newest complete step reaches the bucket within a bounded time (without a newer save), and so does
  the next step saved after the event;
* a fresh manager's restore of the newest step is bit-exact (and, in the restore cells, the restore that
  was in flight completes bit-exact);
* nothing half-written is left: every step any RAM disk lists verifies, no staging directory remains once
  the cluster is quiet, and every step the bucket lists restores and verifies.

The outcome of every cell is printed at the end of the run as an operations x events table
(tests/crash/report.py).
"""

from __future__ import annotations

import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.demo.cluster import LocalCluster
from controller_client.manager import CheckpointManager
from replicator.backup.bucket import BackupOptions, BackupStore
from replicator.backup.storage import open_store
from sidecar import checksums, faults
from tests.crash import inflight, kit
from tests.kits.cluster import assert_equal, manager, status, target, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PAUSE_SECONDS = 4.0
HOST_LOST_SECONDS = 3.0
# GC's point is on the heartbeat thread (Heartbeat._act deletes, then the host reports again), and every armed
# host reaches it with the same answer: held longer than the lost-host time, every host still running was
# declared lost at once and its pieces stopped counting -- a second fault the cell does not mean. Whenever
# step 3 was already redundant when the point fired, the newest complete step fell to the bucket's 2 until
# they reported again (gc-host and gc-restart, about 1 run in 7, on main as with the changes it was blamed
# on). A held heartbeat is a slow host, not a lost one: these cells declare a host lost only after the pause.
HOST_LOST_SECONDS_HEARTBEAT_HELD = PAUSE_SECONDS + 3.0
SETTLE_SECONDS = 60.0  # the bound on "backed up", "complete again" and "quiet"

OPS = {  # operation -> the point that holds it in flight
    "backup": "backup.upload.mid_upload",
    "copy": "peer.fetch.mid_transfer",
    "restore": "peer.fetch.mid_transfer",
    "gc": "gc.before_delete",
    "save": "save.before_commit",
}
EVENTS = {  # event -> (ranks replaced, RAM disk wiped)
    "host": ((3,), True),
    "slice": ((2, 3), True),
    "coordinator": ((0,), True),
    "restart": ((1,), False),
}
CELLS = [(op, ev) for op in OPS for ev in EVENTS]


def state(step: int) -> dict:
    """``w`` is identical on both slices (data-parallel replicas); ``b`` is split between them (FSDP), so
    every rank's data differs and steps are copied to peers."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(step)
    return {
        "w": jax.device_put(rng.standard_normal((8, 64)).astype(np.float32), NamedSharding(mesh, P(None, "model"))),
        "b": jax.device_put(jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16),
                            NamedSharding(mesh, P("data", "model"))),
        "step": step,
    }


@dataclass
class Cell:
    op: str
    event: str
    cl: LocalCluster
    bucket: Path
    fired: Path
    trees: dict[int, dict] = field(default_factory=dict)

    # ------------------------------------------------------------------ cluster
    @property
    def arm_file(self) -> Path:
        return self.fired.with_name("armed")

    def _env(self, armed: bool) -> dict[str, str]:
        return inflight.pause_env(OPS[self.op], PAUSE_SECONDS, self.fired, self.arm_file) if armed else {}

    def start(self, rank: int, armed: bool) -> None:
        self.cl.env = self._env(armed)
        try:
            self.cl.start(rank)
        finally:
            self.cl.env = {}

    def start_all(self, *, armed: bool) -> None:
        self.cl.env = self._env(armed)
        try:
            self.cl.start_all()
        finally:
            self.cl.env = {}
        assert all(self.cl.procs[r].alive for r in range(self.cl.nodes)), self.cl.logs()

    def wait_fired(self) -> None:
        wait_for(lambda: kit.fired(self.fired), timeout=45, what=f"{OPS[self.op]} reached ({self.op} in flight)")

    def replace(self) -> None:
        """The event: the victims' replicators die (SIGKILL), their RAM disks are emptied (or kept), and
        replacements start at once, unarmed."""
        ranks, wipe = EVENTS[self.event]
        for r in ranks:
            self.cl.procs[r].kill()
        if wipe:
            for r in ranks:
                shutil.rmtree(self.cl.ram(r), ignore_errors=True)
        self.start(ranks[0], False)  # the coordinator first when it is among them
        for r in ranks[1:]:
            self.start(r, False)

    # ------------------------------------------------------------------ observations
    def complete(self) -> list[int] | None:
        return inflight.complete_steps(self.cl)

    def summaries(self) -> list:
        try:
            return list(status(self.cl).steps)
        except grpc.RpcError:
            return []

    def safe(self, step: int) -> bool:
        """``step`` is complete, on two hosts for every rank and in the bucket."""
        s = next((s for s in self.summaries() if s.step == step), None)
        return bool(s and s.complete and s.redundant and s.backed_up)

    def newest_safe(self) -> int:
        """The newest complete step that survives the loss of any host: on two hosts, or in the bucket."""
        return max([s.step for s in self.summaries() if s.complete and (s.redundant or s.backed_up)] or [-1])

    def backed_up(self) -> list[int]:
        bs = BackupStore(open_store(f"file://{self.bucket}"), "t", BackupOptions())
        return bs.committed_steps()

    def save(self, mgr: CheckpointManager, step: int) -> None:
        self.trees[step] = state(step)
        assert mgr.save(step, self.trees[step], force=True)
        mgr.wait_until_finished()


def _cell(op: str, event: str, base: Path) -> Cell:
    bucket = base / "bucket"
    lost = HOST_LOST_SECONDS_HEARTBEAT_HELD if op == "gc" else HOST_LOST_SECONDS
    cl = LocalCluster(base / "c", 4, 2, heartbeat_seconds=0.2,
                      extra=["--backup-url", f"file://{bucket}", "--backup-interval-steps", "1",
                             "--host-lost-seconds", str(lost)])
    return Cell(op, event, cl, bucket, base / "fired")


@pytest.fixture
def workdir():
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="mtc-if-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(("op", "event"), CELLS, ids=[f"{op}-{ev}" for op, ev in CELLS])
def test_inflight(op: str, event: str, workdir: Path, inflight_matrix: dict) -> None:
    inflight_matrix[(op, event)] = {}
    c = _cell(op, event, workdir)
    mgr: CheckpointManager | None = None
    watcher = inflight.Watcher(c.cl)
    restore_out: dict = {}
    try:
        # ---------------------------------------------------------- a safe step, then the operation in flight
        c.start_all(armed=op != "save")
        mgr = manager(c.cl, 2, 2)
        c.save(mgr, 1)
        wait_for(lambda: c.safe(1), timeout=SETTLE_SECONDS, what="step 1 redundant and in the bucket")
        c.arm_file.touch()  # from here on the armed point holds whoever reaches it first
        if op in ("backup", "copy"):
            c.save(mgr, 2)  # its backup (copy) is held
        elif op == "gc":
            c.save(mgr, 2)
            c.save(mgr, 3)  # step 1 goes (--keep-local 2): its deletion is held
        elif op == "save":
            faults.arm(OPS[op], 1, PAUSE_SECONDS, str(c.fired))
            c.trees[2] = state(2)
            assert mgr.save(2, c.trees[2], force=True)  # one host's commit of step 2 is held
        elif op == "restore":
            # Host 1 comes back empty: the fetch that its restore needs is held.
            c.cl.procs[1].kill()
            shutil.rmtree(c.cl.ram(1), ignore_errors=True)
            c.start(1, True)
            mgr.close()
            mgr = manager(c.cl, 2, 2)

            def run_restore(m: CheckpointManager = mgr) -> None:
                try:
                    restore_out["tree"] = m.restore(1, target(c.trees[1]))
                except BaseException as e:  # reported by the assertions below
                    restore_out["error"] = e

            restorer = threading.Thread(target=run_restore, daemon=True)
            restorer.start()
        c.wait_fired()
        newest_before = c.newest_safe()
        assert newest_before >= 1, c.cl.logs()
        inflight_matrix[(op, event)]["note"] = f"safe before: {newest_before}"
        # ---------------------------------------------------------- the event, while the operation runs
        watcher.start()
        c.replace()
        if op == "save":
            try:
                mgr.wait_until_finished()  # the save in flight may fail on the replaced host: allowed
            except Exception as e:
                inflight_matrix[(op, event)]["note"] += f"; the save in flight: {type(e).__name__}"
            faults.arm(None)
        if op == "restore":
            restorer.join(timeout=SETTLE_SECONDS + 30)
            assert not restorer.is_alive(), "the restore in flight never returned"
            assert "error" not in restore_out, f"the restore in flight failed: {restore_out['error']!r}"
            assert_equal(c.trees[1], restore_out["tree"])
        # ---------------------------------------------------------- the checks
        fresh = manager(c.cl, 2, 2)
        try:
            latest = fresh.latest_step()
            assert latest is not None and latest >= newest_before, (latest, newest_before)
            # A step newer than the safe one may have been complete only with the replaced host's copy: lost
            # with it, it rightly stops being complete and never reaches the bucket (the in-flight backup
            # of step 2 abandoned, in a failed make test). What must reach it is the newest complete step
            # as it is now, never below the step safe before the event.

            def newest_backed_up() -> int | None:
                n = fresh.latest_step()
                return n if n is not None and n >= newest_before and n in c.backed_up() else None

            latest = wait_for(newest_backed_up, timeout=SETTLE_SECONDS,
                              what=f"the newest complete step (>= {newest_before}) in the bucket "
                                   f"(has {c.backed_up()})")
            assert_equal(c.trees[latest], fresh.restore(latest, target(c.trees[latest])))
            nxt = max(c.trees) + 1
            c.save(fresh, nxt)
            wait_for(lambda: nxt in (c.complete() or []), timeout=SETTLE_SECONDS, what=f"step {nxt} complete")
            wait_for(lambda: nxt in c.backed_up(), timeout=SETTLE_SECONDS, what=f"step {nxt} in the bucket")
            assert fresh.latest_step() == nxt
            assert_equal(c.trees[nxt], fresh.restore(None, target(c.trees[nxt])))
        finally:
            fresh.close()
        watcher.stop()
        low = watcher.below(newest_before)
        assert not low, f"the newest complete step regressed below {newest_before}: {low}"
        _check_nothing_half_written(c, workdir / "scratch")
    except BaseException:
        print(c.cl.logs())
        raise
    finally:
        faults.arm(None)
        watcher.stop()
        if mgr is not None:
            mgr.close()
        c.cl.stop_all(signal.SIGKILL)


def _check_nothing_half_written(c: Cell, scratch: Path) -> None:
    wait_for(lambda: not inflight.staging_left(c.cl), timeout=SETTLE_SECONDS, what="no staging directory left")
    inflight.check_listed_steps(c.cl)
    bs = BackupStore(open_store(f"file://{c.bucket}"), "t", BackupOptions())
    for s in bs.committed_steps():
        for rank in range(c.cl.nodes):
            dest = scratch / f"{s}-{rank}"
            dest.mkdir(parents=True)
            checksums.verify_step_dir(bs.download_rank(s, rank, dest))
