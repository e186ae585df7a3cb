"""The in-flight fault matrix in erasure-coding mode (issue #35 item 5): hosts replaced (or a replicator restarted)
**while** parity is computed, a save commits or a host rebuilds its data from its code group.

Four real replicators on loopback at ``--redundancy ec:K+M``, one slice (data parallelism 1: every host's data
differs, so the peer tier holds parity, not copies) and no bucket: a wiped host's data can come back from its
code group only. The controller's ``CheckpointManager`` runs in this process. The operation is held by a pause
point (sidecar/faults.py) while the test replaces the victims (SIGKILL, RAM disk emptied or kept, restarted
unarmed):

* ``parity`` x ``host`` (ec:3+1): every host's parity of step 2 is held just before its commit
  (``ec.parity.before_commit``: all stripes written and checked) while host 2 is replaced;
* ``save`` x ``two-hosts`` (ec:2+2): one host's commit of step 2 is held (``save.before_commit``, in this
  process) while hosts 0 (the coordinator's) and 3 are replaced together;
* ``rebuild`` x ``restart`` (ec:3+1): host 2, replaced, rebuilds step 1 from parity; its replicator is killed
  mid-rebuild (``ec.rebuild.mid``: a first part of the stream written, the step not committed) and restarted
  with its RAM disk;
* ``rebuild`` x ``corrupt-parity`` (ec:2+2): bit rot in the parity block host 1's rebuild reads first, then
  host 1 replaced: the rebuild passes over it, its holder drops that parity when it finds it while serving,
  and the coordinator's next ParityTask computes it again (no point held: the rebuild meets the rot).

Every cell checks: every answer the coordinator gives from the event on is at least the newest step redundant
before it (complete with all its parity); that step, or the newer one in flight, is redundant again within
60 s, rebuilt on each replaced host from its code group (its log says so); a fresh manager's restore is
bit-exact; nothing half-written is visible (every step and every parity any RAM disk lists verifies, and no
staging directory remains once the cluster is quiet). The cells are rows of the in-flight table printed at the
end of the run (tests/crash/report.py).
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.demo.cluster import LocalCluster
from controller_client.manager import CheckpointManager
from replicator.erasure.holder import RECORD_NAME, ParityRecord, shard_name
from sidecar import checksums, commit, faults, layout
from tests.crash import inflight, kit
from tests.kits.cluster import assert_equal, manager, state, status, step_summary, target, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NODES = 4
PAUSE_SECONDS = 5.0
HOST_LOST_SECONDS = 3.0
SETTLE_SECONDS = 60.0  # the bound on "redundant again" and "quiet"



def ec_state(step: int) -> dict:
    """The kit's state sharded over every device, and 4 MiB more per host: a step's stream spans several
    stripes of each of its K shards (1 MiB per fragment), so a rebuild held mid-stream has written some."""
    tree = state(step, replicated_over_slices=False)
    mesh = tree["w"].sharding.mesh
    big = np.random.default_rng(10_000 + step).standard_normal((8, 1 << 19)).astype(np.float32)
    tree["big"] = jax.device_put(big, NamedSharding(mesh, P(("data", "model"))))
    return tree


CELLS = {  # (operation, event) -> (K, M, the point that holds the operation)
    ("parity", "host"): (3, 1, "ec.parity.before_commit"),
    ("save", "two-hosts"): (2, 2, "save.before_commit"),
    ("rebuild", "restart"): (3, 1, "ec.rebuild.mid"),
    ("rebuild", "corrupt-parity"): (2, 2, ""),
}


@dataclass
class EcCell:
    cl: LocalCluster
    k: int
    m: int
    point: str
    fired: Path
    trees: dict[int, dict] = field(default_factory=dict)

    # ------------------------------------------------------------------ cluster
    @property
    def arm_file(self) -> Path:
        return self.fired.with_name("armed")

    def start(self, rank: int, armed: bool) -> None:
        self.cl.env = inflight.pause_env(self.point, PAUSE_SECONDS, self.fired, self.arm_file) if armed else {}
        try:
            self.cl.start(rank)
        finally:
            self.cl.env = {}

    def replace(self, ranks: tuple[int, ...], wipe: bool) -> None:
        """The victims' replicators die (SIGKILL), their RAM disks are emptied (or kept), and replacements start
        at once, unarmed (the coordinator's host first)."""
        for r in ranks:
            self.cl.procs[r].kill()
        if wipe:
            for r in ranks:
                shutil.rmtree(self.cl.ram(r), ignore_errors=True)
        for r in sorted(ranks):
            self.start(r, False)

    def wait_fired(self, count: int = 1) -> None:
        wait_for(lambda: len(kit.fired(self.fired)) >= count, timeout=45,
                 what=f"{self.point} reached {count} time(s) (in flight)")

    # ------------------------------------------------------------------ observations
    def redundant(self, step: int) -> bool:
        """``step`` is complete and every code group holds all its parity."""
        try:
            s = step_summary(status(self.cl), step)
        except grpc.RpcError:
            return False
        return bool(s and s.complete and s.redundant)

    def newest_redundant(self) -> int:
        try:
            steps = status(self.cl).steps
        except grpc.RpcError:
            return -1
        return max([s.step for s in steps if s.complete and s.redundant] or [-1])

    def own_steps(self, rank: int) -> list[int]:
        return commit.committed_steps(layout.steps_dir(self.cl.ram(rank)))

    def rebuilt(self, rank: int, step: int) -> bool:
        """``rank``'s log says it rebuilt its data of ``step`` from its code group (not a copy, not a bucket)."""
        log = (self.cl.base / "logs" / f"replicator-{rank}.log").read_text(errors="replace")
        return bool(re.search(rf"rank {rank} now holds rank {rank}'s data of step {step} \((task|sidecar)\) "
                              rf"from code group ec:{self.k}\+{self.m}", log))

    def save(self, mgr: CheckpointManager, step: int) -> None:
        self.trees[step] = ec_state(step)
        assert mgr.save(step, self.trees[step], force=True)
        mgr.wait_until_finished()

    def restore(self, step: int | None = None) -> int:
        """A fresh manager's restore of ``step`` (default: its newest), checked bit for bit; returns the step."""
        fresh = manager(self.cl, 1, NODES)
        try:
            got = step if step is not None else fresh.latest_step()
            assert got is not None and got in self.trees, (got, sorted(self.trees))
            assert_equal(self.trees[got], fresh.restore(got, target(self.trees[got])))
            return got
        finally:
            fresh.close()

    def check_quiet(self) -> None:
        """Nothing half-written: no staging directory once quiet; every listed step and parity verifies."""
        wait_for(lambda: not inflight.staging_left(self.cl), timeout=SETTLE_SECONDS, what="no staging directory left")
        inflight.check_listed_steps(self.cl)
        assert inflight.check_listed_parity(self.cl), "no parity listed anywhere"


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="mtc-ifec-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(("op", "event"), list(CELLS), ids=[f"{op}-{ev}" for op, ev in CELLS])
def test_inflight_ec(op: str, event: str, workdir: Path, inflight_matrix: dict) -> None:
    inflight_matrix[(op, event)] = {}
    k, m, point = CELLS[(op, event)]
    cl = LocalCluster(workdir / "c", NODES, 1, heartbeat_seconds=0.2,
                      extra=["--redundancy", f"ec:{k}+{m}", "--host-lost-seconds", str(HOST_LOST_SECONDS)])
    c = EcCell(cl, k, m, point, workdir / "fired")
    watcher = inflight.Watcher(cl)
    mgr: CheckpointManager | None = None
    try:
        for r in range(NODES):  # the parity cell's replicators armed (held once the arm file exists)
            c.start(r, op == "parity")
        mgr = manager(cl, 1, NODES)
        c.save(mgr, 1)
        wait_for(lambda: c.redundant(1), timeout=SETTLE_SECONDS, what="step 1 redundant")
        newest_before = c.newest_redundant()
        assert newest_before == 1
        note = CELL_RUNS[(op, event)](c, mgr, watcher)
        inflight_matrix[(op, event)]["note"] = f"redundant before: {newest_before}; {note}"
        watcher.stop()
        low = watcher.below(newest_before)
        assert not low, f"the newest complete step regressed below {newest_before}: {low}"
        c.check_quiet()
    except BaseException:
        print(cl.logs())
        raise
    finally:
        faults.arm(None)
        watcher.stop()
        if mgr is not None:
            mgr.close()
        cl.stop_all(signal.SIGKILL)


def _parity_host(c: EcCell, mgr: CheckpointManager, watcher: inflight.Watcher) -> str:
    """Every host's parity of step 2 held before its commit; host 2 replaced meanwhile. The others' parity
    commits after the pause (they had read host 2's data), so host 2 rebuilds step 2 from it, computes its
    parity anew, and step 2 becomes redundant."""
    c.arm_file.touch()
    c.save(mgr, 2)
    c.wait_fired(NODES)
    held = {r: inflight.listed_parity(c.cl.ram(r)) for r in range(NODES)}
    assert not [key for keys in held.values() for key in keys if key[0] == 2], f"parity of step 2 committed: {held}"
    watcher.start()
    c.replace((2,), wipe=True)
    inflight.check_listed_parity(c.cl)  # while the held parity commits
    wait_for(lambda: c.redundant(2), timeout=SETTLE_SECONDS, what="step 2 redundant again (all its parity)")
    assert c.rebuilt(2, 2), "host 2's step 2 was not rebuilt from its code group"
    assert c.restore() == 2
    return "step 2 redundant, host 2 rebuilt it from parity"


def _save_two_hosts(c: EcCell, mgr: CheckpointManager, watcher: inflight.Watcher) -> str:
    """One host's commit of step 2 held; hosts 0 and 3 replaced together meanwhile. Step 1 (redundant before)
    restores bit-exact from parity, both replaced hosts rebuilt it, and the next step is redundant."""
    faults.arm(c.point, 1, PAUSE_SECONDS, str(c.fired))
    c.trees[2] = ec_state(2)
    assert mgr.save(2, c.trees[2], force=True)
    c.wait_fired()
    watcher.start()
    c.replace((0, 3), wipe=True)
    note = ""
    try:
        mgr.wait_until_finished()  # the save in flight may fail on a replaced host: allowed
    except Exception as e:
        note = f"the save in flight: {type(e).__name__}; "
    faults.arm(None)
    assert c.restore(1) == 1
    for r in (0, 3):
        assert c.rebuilt(r, 1), f"host {r}'s step 1 was not rebuilt from its code group"
    latest = c.restore()
    mgr.close()
    fresh = manager(c.cl, 1, NODES)
    try:
        c.save(fresh, 3)
    finally:
        fresh.close()
    wait_for(lambda: c.redundant(3), timeout=SETTLE_SECONDS, what="step 3 redundant")
    assert c.restore() == 3
    return note + f"newest after: {latest}; step 1 rebuilt on hosts 0 and 3 from parity"


def _rebuild_restart(c: EcCell, mgr: CheckpointManager, watcher: inflight.Watcher) -> str:
    """Host 2 replaced empty rebuilds step 1 from its code group; its replicator is killed mid-rebuild and
    restarted with its RAM disk: the rebuild completes, nothing half-rebuilt is ever listed."""
    watcher.start()  # from the host's loss on: step 1 stays complete (rebuildable) throughout
    c.cl.procs[2].kill()
    c.cl.wipe(2)
    c.arm_file.touch()
    c.start(2, True)
    c.wait_fired()
    staged = [p for p in layout.steps_dir(c.cl.ram(2)).iterdir() if p.name.startswith(layout.TMP_PREFIX)]
    assert 1 not in c.own_steps(2) and staged, (c.own_steps(2), staged)
    written = sum(f.stat().st_size for d in staged for f in d.rglob("*") if f.is_file())
    assert written > 0, "held before a first stripe was written"
    c.replace((2,), wipe=False)
    wait_for(lambda: c.redundant(1), timeout=SETTLE_SECONDS, what="step 1 redundant again (host 2 rebuilt it)")
    assert c.rebuilt(2, 1), "host 2's step 1 was not rebuilt from its code group"
    assert not any(p.exists() for p in staged), f"the killed rebuild's staging left: {staged}"
    assert c.restore(1) == 1
    c.save(mgr, 2)
    wait_for(lambda: c.redundant(2), timeout=SETTLE_SECONDS, what="step 2 redundant")
    assert c.restore() == 2
    return "host 2 rebuilt step 1 after its restart"


def _rebuild_corrupt_parity(c: EcCell, mgr: CheckpointManager, watcher: inflight.Watcher) -> str:
    """A byte of the parity block host 1's rebuild of step 1 reads first flipped, then host 1 replaced: its
    rebuild passes over the block (bit-exact), the holder drops that parity when it finds the rot while serving
    it, and computes it again on the coordinator's next ParityTask: step 1 is redundant again, and every parity
    listed verifies (``check_quiet``)."""
    lost = 1
    rec = _parity_of(c.cl.ram(0), 1)
    assert rec is not None, "host 0 holds no parity of step 1"
    lay = rec.group.layout
    rotation = lay.data_rotation(lost, 0)
    holder = lay.holders(rotation)[lay.k]  # the first parity fragment: read for the stripe's missing data
    shard = inflight.listed_parity(c.cl.ram(holder))[(1, rec.digest)] / shard_name(rotation, 0)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x20
    shard.write_bytes(bytes(data))
    watcher.start()
    c.replace((lost,), wipe=True)
    assert c.restore(1) == 1
    assert c.rebuilt(lost, 1), f"host {lost}'s step 1 was not rebuilt from its code group"
    wait_for(lambda: _parity_verifies(c.cl.ram(holder), 1), timeout=SETTLE_SECONDS,
             what=f"host {holder} dropped its bad parity of step 1 and computed it again")
    wait_for(lambda: c.redundant(1), timeout=SETTLE_SECONDS, what="step 1 redundant again")
    log = (c.cl.base / "logs" / f"replicator-{holder}.log").read_text(errors="replace")
    assert f"bad parity of step 1 ({rec.digest}): shard {shard.name} stripe 0" in log, log[-3000:]
    c.save(mgr, 2)
    wait_for(lambda: c.redundant(2), timeout=SETTLE_SECONDS, what="step 2 redundant")
    assert c.restore() == 2
    return f"host {holder} dropped its rotten parity and computed it again; host {lost} rebuilt step 1"


def _parity_of(root: Path, step: int) -> ParityRecord | None:
    found = [d for (s, _), d in inflight.listed_parity(root).items() if s == step]
    return ParityRecord.from_json((found[0] / RECORD_NAME).read_bytes()) if found else None


def _parity_verifies(root: Path, step: int) -> bool:
    """The host holds parity of ``step`` whose every shard matches its record's crc32c."""
    try:
        rec = _parity_of(root, step)
        d = inflight.listed_parity(root).get((step, rec.digest)) if rec else None
        return d is not None and all(checksums.crc32c((d / f.name).read_bytes()) == f.crc32c for f in rec.files)
    except FileNotFoundError:  # replaced while read
        return False


CELL_RUNS = {("parity", "host"): _parity_host, ("save", "two-hosts"): _save_two_hosts,
             ("rebuild", "restart"): _rebuild_restart, ("rebuild", "corrupt-parity"): _rebuild_corrupt_parity}
