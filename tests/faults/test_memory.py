"""Memory faults (issue #33): one replicator (rank 3) in a memory cgroup of the test's own
(tests/kits/cgroup.py), the rest of the rig as in tests/kits/fault_rig.py. ``make test-faults``; needs root.

How the kernel charges memory decides what a limit means (measured on these machines: ``dd`` of 256 MiB under
a 32 MiB limit succeeds into a disk file, and is OOM-killed into a tmpfs): a page is charged to the cgroup of
the process that first brings it into memory; a disk file's page cache is reclaimed under the limit, a
tmpfs's pages are not (no swap). So:

- on a disk-backed RAM dir (the rig's), a limit of the daemon's baseline plus **half a step** bounds what the
  daemon itself holds: a daemon that buffered one whole file of the step (peer client or server, backup
  upload, restore fetch) would be OOM-killed. It receives a peer copy of a 64 MiB step, backs it up, and serves
  it to a wiped host's restore, never killed;
- on a tmpfs RAM dir (as deployed) the peer copies a daemon writes are charged to it: its limit must hold them.
  Lowered below that in the middle of a peer copy, the daemon is OOM-killed; no half copy is visible, and
  restarted (as Kubernetes restarts a container) with its RAM dir kept and its limit back, the copy completes.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from replicator.backup.bucket import BackupStore
from replicator.backup.storage.filesystem import FileStore
from sidecar import commit, layout
from tests.kits import cgroup, faultnet
from tests.kits.fault_cluster import NODES, check_copy
from tests.kits.fault_rig import PROGRESS_BOUND_SECONDS, SETTLE_TIMEOUT_SECONDS, Rig, assert_passed, wait_for

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(faultnet.available() or cgroup.available()),
                                 reason=faultnet.available() or cgroup.available() or "available")]

LIMITED = 3  # a non-candidate: the limit is on the data path, not on a coordinator
STEP_BYTES = 64 << 20
# The OOM case's tmpfs: room for a step, a peer copy of it and small ones, but not for the writer's spare-page
# pool (sidecar/spares.py fills one only when twice a step is free). A copy that takes a spare file
# overwrites pages charged to the writer, not to the daemon: with no pool, every page it lands is its own.
TMPFS_BYTES = STEP_BYTES * 5 // 2
COPY_MBIT = 100  # the limited host's link in the OOM case: a 64 MiB copy takes ~5 s, long enough to catch
OOM_MARGIN_BYTES = 8 << 20  # the OOM case's lowered limit: usage mid-copy plus this


@dataclass
class MemoryRig:
    rig: Rig
    cg: cgroup.MemoryCgroup
    baseline: int  # the limited daemon's own memory at rest: anonymous plus kernel (page cache excluded)
    peak_own: int = 0  # the highest anonymous + kernel memory sampled while a case runs

    def own(self) -> int:
        s = self.cg.stat()
        kmem = self.cg.path / "memory.kmem.usage_in_bytes"
        k = int(kmem.read_text()) if kmem.exists() else s.get("kernel", 0)
        return self.cg.anon() + k

    def partner(self) -> int:
        """The rank whose peer copies the limited daemon holds."""
        owners = [int(p.name) for p in (self.rig.cluster.ram(LIMITED) / layout.PEER_DIR).glob("[0-9]*")]
        assert len(owners) == 1, f"rank {LIMITED} holds peer copies of {owners}"
        return owners[0]

    def sampled(self) -> contextlib.AbstractContextManager[None]:
        """Sample the daemon's own memory every 50 ms into :attr:`peak_own`."""
        def sample() -> None:
            self.peak_own = max(self.peak_own, self.own())
        return cgroup.sampling(sample, "memory-sampler")


@contextlib.contextmanager
def _memory_rig(base: Path, ram_on_tmpfs: bool) -> Iterator[MemoryRig]:
    """The rig with rank 3's daemon started in a cgroup of its own (no limit yet: its baseline is measured at
    rest once the first steps are redundant), its RAM dir on a tmpfs of the test's own if asked. Torn down
    in order: daemons stopped by pid, the cgroup removed, the tmpfs unmounted, the namespaces deleted."""
    faultnet.reap_stale()
    cgroup.reap_stale()
    mounted: Path | None = None
    with faultnet.FaultNetwork(NODES) as net, cgroup.MemoryCgroup() as cg:
        try:
            if ram_on_tmpfs:
                mounted = base / "ram" / str(LIMITED)
                mounted.mkdir(parents=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0755", "mtc-test-ram",
                                str(mounted)], check=True, timeout=10)
            r = Rig(net, base)
            r.cluster.in_cgroup(LIMITED, cg)
            try:
                r.start()
                time.sleep(2.0)  # at rest: the first copies done
                yield MemoryRig(r, cg, baseline=MemoryRig(r, cg, 0).own())
            finally:
                r.trainer.stop()
                r.cluster.stop()
        finally:
            if mounted is not None:
                subprocess.run(["umount", str(mounted)], check=False, timeout=30)


@pytest.fixture
def rig_on_disk(tmp_path: Path) -> Iterator[MemoryRig]:
    with _memory_rig(tmp_path, ram_on_tmpfs=False) as m:
        yield m


@pytest.fixture
def rig_on_tmpfs(tmp_path: Path) -> Iterator[MemoryRig]:
    with _memory_rig(tmp_path, ram_on_tmpfs=True) as m:
        yield m


def _backed_up(rig: Rig) -> list[int]:
    return BackupStore(FileStore(rig.cluster.base / "bucket"), "t").committed_steps()


def _peer_copy(rig: Rig, holder: int, owner: int, step: int) -> Path:
    return rig.cluster.ram(holder) / layout.PEER_DIR / str(owner) / str(step)


def test_a_replicator_limited_below_half_a_step_copies_backs_up_and_serves_a_restore(
        rig_on_disk: MemoryRig) -> None:
    """Limit: the daemon's baseline plus half a step (the RAM dir on disk, so the limit bounds what the
    daemon itself holds). A 64 MiB step is copied to it, backed up from it to the bucket, and fetched back
    from it by its partner, wiped and restarted; it is never OOM-killed."""
    m, rig = rig_on_disk, rig_on_disk.rig
    limit = m.baseline + STEP_BYTES // 2
    m.cg.set_limit(limit)
    partner = m.partner()
    daemon = rig.cluster.daemons[LIMITED]
    found: list[str] = []
    big: list[int] = []

    def fault() -> None:
        try:
            copy_back_up_and_serve()
        except (TimeoutError, AssertionError, OSError, ValueError) as e:  # e.g. the daemon OOM-killed
            found.append(f"{type(e).__name__}: {e}")

    def copy_back_up_and_serve() -> None:
        # The backup runs every 5 complete steps: the big step is the one due next.
        last = max(wait_for(lambda: _backed_up(rig), SETTLE_TIMEOUT_SECONDS, "a first backup"))
        while rig.trainer.step < last + 4:
            rig.trainer.save_next()
        step = rig.trainer.save_next(nbytes=STEP_BYTES)
        big.append(step)
        wait_for(lambda: rig.redundant(step), SETTLE_TIMEOUT_SECONDS, f"step {step} redundant")
        check_copy(_peer_copy(rig, LIMITED, partner, step), partner, step)
        wait_for(lambda: step in _backed_up(rig), SETTLE_TIMEOUT_SECONDS, f"step {step} backed up")
        # A replacement host for the partner: its RAM dir empty, its data of the step on rank 3 alone.
        old = rig.cluster.daemons[partner]
        old.stop()
        subprocess.run(["rm", "-rf", str(rig.cluster.ram(partner))], check=True, timeout=30)
        old.start()
        restored = rig.cluster.restore(wait_seconds=PROGRESS_BOUND_SECONDS)
        if restored.get("step") != step:
            found.append(f"the restore with the partner wiped prepared {restored}, not step {step}")
            return
        found.extend(rig.check_restored(step))

    with m.sampled():
        case = rig.run_case("memory-limit-half-a-step", fault, cut_seconds=0.0, train_during_fault=False)
    alive = daemon.proc is not None and daemon.proc.poll() is None
    print(f"memory case 1: baseline {m.baseline >> 20} MiB, limit {limit >> 20} MiB, peak own "
          f"{m.peak_own >> 20} MiB, failcnt {m.cg.failcnt()}, oom kills {m.cg.oom_kills()}, step {big}")
    case.extra += found
    case.extra += rig.check_every_copy()
    if not alive or m.cg.oom_kills():
        case.extra.append(f"rank {LIMITED}'s daemon was killed under {limit >> 20} MiB "
                          f"(oom kills {m.cg.oom_kills()}, exit {daemon.proc and daemon.proc.returncode})")
    assert_passed(rig, case)


def test_a_replicator_oom_killed_mid_copy_restarts_and_nothing_is_half_visible(rig_on_tmpfs: MemoryRig) -> None:
    """The RAM dir on a tmpfs: the limit holds one peer copy of a step; lowered to the usage of the moment
    while a 64 MiB copy lands, the daemon is OOM-killed mid-copy. No half copy is committed; restarted with
    its RAM dir kept and its limit back, the copy completes and the job goes on."""
    m, rig = rig_on_tmpfs, rig_on_tmpfs.rig
    limit = m.baseline + STEP_BYTES * 3 // 2
    m.cg.set_limit(limit)
    partner = m.partner()
    daemon = rig.cluster.daemons[LIMITED]
    found: list[str] = []
    big: list[int] = []

    def landed(step: int) -> int:
        tmp = rig.cluster.ram(LIMITED) / layout.PEER_DIR / str(partner)
        # Pages written, not the size: a copy's file is given its full size at once (sparse).
        return sum(f.stat().st_blocks * 512 for f in tmp.glob(f".tmp-{step}-*/**/*") if f.is_file())

    def fault() -> None:
        rig.net.throttle(LIMITED, COPY_MBIT)
        step = rig.trainer.save_next(nbytes=STEP_BYTES)
        big.append(step)
        wait_for(lambda: landed(step) >= 4 << 20, 30, f"the peer copy of step {step} under way", interval=0.05)
        # What the daemon cannot give back (its own memory and the tmpfs pages it wrote) plus a margin: the
        # kernel reclaims the rest (page cache, e.g. of the backup's bucket files) to get there.
        m.cg.set_limit(m.own() + m.cg.stat().get("shmem", 0) + OOM_MARGIN_BYTES)
        assert daemon.proc is not None
        try:
            daemon.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            found.append(f"rank {LIMITED} not OOM-killed within 60 s of its limit lowered mid-copy")
            return
        at_kill = landed(step)
        if daemon.proc.returncode != -9 or not m.cg.oom_kills():
            found.append(f"rank {LIMITED} exited {daemon.proc.returncode}, oom kills {m.cg.oom_kills()}")
        if not 0 < at_kill < STEP_BYTES:
            found.append(f"killed with {at_kill} bytes of the copy landed: not mid-copy")
        if _peer_copy(rig, LIMITED, partner, step).exists():
            found.append(f"a copy of step {step} committed on rank {LIMITED} after its OOM kill mid-copy")
        found.extend(rig.check_every_copy())
        print(f"memory case 2: baseline {m.baseline >> 20} MiB, killed with {at_kill >> 20} MiB of step "
              f"{step} landed, oom kills {m.cg.oom_kills()}")
        m.cg.set_limit(limit)
        daemon.start()  # as Kubernetes restarts the container: the same RAM dir, the same limit

    def copy_completes() -> None:
        step = big[0]
        try:
            wait_for(lambda: step in commit.committed_steps(_peer_copy(rig, LIMITED, partner, step).parent),
                     PROGRESS_BOUND_SECONDS, f"the peer copy of step {step} on rank {LIMITED} after the restart")
            check_copy(_peer_copy(rig, LIMITED, partner, step), partner, step)
        except (TimeoutError, AssertionError, OSError, ValueError) as e:
            found.append(f"{type(e).__name__}: {e}")
        left = list((rig.cluster.ram(LIMITED) / layout.PEER_DIR / str(partner)).glob(f".tmp-{step}-*"))
        if left:
            found.append(f"the killed copy's temporary dirs left after the restart: {left}")

    case = rig.run_case("memory-oom-mid-copy", fault, cut_seconds=0.0, after_heal=copy_completes,
                        train_during_fault=False)
    case.extra += found
    case.extra += rig.check_every_copy()
    if daemon.proc is None or daemon.proc.poll() is not None:
        case.extra.append(f"rank {LIMITED}'s restarted daemon died under {limit >> 20} MiB")
    assert_passed(rig, case)


# Six of the gs:// backend's default 64 MiB resumable chunks. An upload sends each chunk as a view of the file's
# mapped page-cache pages (measured +6 MiB over its baseline for this step; a buffered upload held about two
# chunks, +139 MB), whatever the file's size; the download back holds a few 8 MiB buffers.
GCS_STEP_BYTES = 384 << 20


def _gcs_worker(endpoint: str, step_dir: str, dest: str) -> None:
    """In the limited process: wait for the go (the test measures this process at rest first), back up the step
    to the emulator with the product's default GCS options, and download it back (a bucket restore)."""
    import sys

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from replicator.backup.storage.gcs import GcsOptions, GcsStore
    from tests.kits.storage import BUCKET

    client = storage.Client(project="test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": endpoint})
    backup = BackupStore(GcsStore(BUCKET, "mem", options=GcsOptions(), client=client), "t")
    print("ready", flush=True)
    sys.stdin.readline()
    step = int(Path(step_dir).name)
    staging = backup.begin(step, 1)
    backup.upload_rank(staging, 0, Path(step_dir))
    backup.commit(staging)
    backup.download_rank(step, 0, Path(dest))
    print("done", flush=True)


def test_a_replicator_process_limited_below_half_a_step_backs_up_to_gcs_and_restores_from_it(
        tmp_path: Path) -> None:
    """The bucket tier alone against the GCS emulator (tests/kits/storage.py; the rig's hosts are in network
    namespaces the emulator on loopback does not reach), in a process limited to its baseline plus half a
    384 MiB step, with the product's default GCS options: the upload (resumable, 64 MiB chunks) and the
    download stream; a backend that held a whole file would be OOM-killed."""
    from tests.kits.fault_cluster import save_rank
    from tests.kits.fault_history import SUMMARY
    from tests.kits.storage import Emulator

    cgroup.reap_stale()
    violations: list[str] = []
    root, dest = tmp_path / "ram", tmp_path / "restored"
    save_rank(root, 0, 7, GCS_STEP_BYTES)  # notify fails quietly: no daemon (the files are committed)
    dest.mkdir()
    emu = Emulator("fake-gcs", tmp_path)
    argv = [sys.executable, "-c", "import sys; from tests.faults.test_memory import _gcs_worker; "
            "_gcs_worker(*sys.argv[1:])", emu.url, str(root / layout.STEPS_DIR / "7"), str(dest)]
    try:
        with cgroup.MemoryCgroup() as cg:
            m = MemoryRig(None, cg, 0)  # type: ignore[arg-type]
            proc = subprocess.Popen(cg.wrap(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    cwd=str(Path(__file__).resolve().parents[2]))
            try:
                assert proc.stdout is not None and proc.stdin is not None
                assert proc.stdout.readline().strip() == "ready", "the worker did not start"
                baseline = m.own()
                limit = baseline + GCS_STEP_BYTES // 2
                cg.set_limit(limit)
                with m.sampled():
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    rc = proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            print(f"memory gcs case: baseline {baseline >> 20} MiB, limit {limit >> 20} MiB, peak own "
                  f"{m.peak_own >> 20} MiB, exit {rc}, oom kills {cg.oom_kills()}")
            if rc != 0 or cg.oom_kills():
                violations.append(f"the backup/restore process exited {rc} under {limit >> 20} MiB "
                                  f"(baseline {baseline >> 20} MiB), oom kills {cg.oom_kills()}")
    finally:
        emu.stop()
    if not violations:
        try:
            check_copy(dest / "7", 0, 7)
        except (AssertionError, OSError, ValueError) as e:
            violations.append(f"the step restored from the bucket: {type(e).__name__}: {e}")
    SUMMARY.add("memory-limit-gcs-backup-restore", violations, None)
    assert not violations, "\n".join(violations)
