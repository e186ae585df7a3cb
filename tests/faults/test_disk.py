"""Faults of the RAM disk (issue #33): real I/O errors at byte N of a write and of a read, served by a FUSE
filesystem (tests/kits/faultfs.py) under host 3's RAM dir, and a small tmpfs there filled by bytes or by
files -- while the rig's daemons copy, serve and back up and its trainer saves every second
(tests/kits/fault_rig.py). Each case runs as the rig's cases do (fault, keep saving, clear, progress,
restore, history checked); the saves of host 3 that the fault must fail are checked for their error and
taken out of the history, any other failure stays a violation. ``make test-faults``; needs root.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar import layout, reader
from sidecar.remote import ReplicatorFetcher
from tests.kits import faultfs, faultnet
from tests.kits.fault_cluster import NODES, check_copy, step_bytes
from tests.kits.fault_history import SUMMARY, Case
from tests.kits.fault_rig import Rig, assert_passed

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(faultnet.available() or faultfs.available()),
                                 reason=faultnet.available() or faultfs.available() or "available")]

DISK = 3  # the host whose RAM disk fails
PEER = 1  # its peer in the other slice: copies to it and from it
FAULT_SECONDS = 6.0  # a disk fault needs no host-lost timing: a few saves fail, then it is cleared
AT_BYTE = 20_000  # inside the first 64 KiB write of a shard (the trainer's steps are 64 KiB a rank)
TMPFS_BYTES = 16 << 20
TMPFS_INODES = 4000


@pytest.fixture
def disk_rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Rig, object]]:
    """The rig with host 3's RAM dir on a faultfs mount (``fuse``) or a small tmpfs (``tmpfs``), made before
    the daemons start and unmounted after they stopped, even on failure."""
    faultnet.reap_stale()
    ram = tmp_path / "ram" / str(DISK)
    with contextlib.ExitStack() as stack:
        disk: object
        if request.param == "fuse":
            disk = stack.enter_context(faultfs.FaultMount(tmp_path / "backing", ram, tmp_path / "faultfs.json"))
        else:
            disk = stack.enter_context(faultfs.Tmpfs(ram, TMPFS_BYTES, TMPFS_INODES))
        net = stack.enter_context(faultnet.FaultNetwork(NODES))
        r = Rig(net, tmp_path)
        try:
            r.start()
            yield r, disk
        finally:
            r.trainer.stop()
            r.cluster.stop()


def _run(rig: Rig, name: str, fault: Callable[[], None], clear: Callable[[], None]) -> tuple[Case, float]:
    """The rig's case with the disk fault cleared right after the (no-op) network heal; returns the case and
    when the fault was cleared (a save started before then may still meet it)."""
    cleared: list[float] = []

    def after_heal() -> None:
        clear()
        cleared.append(time.monotonic())

    case = rig.run_case(name, fault, cut_seconds=FAULT_SECONDS, after_heal=after_heal)
    return case, cleared[0]


def _expected_failures(case: Case, t_clear: float, pattern: str) -> list[int]:
    """Take host 3's saves that failed as ``pattern`` says while the fault was on out of the history (the
    fault's expected outcome); the steps they were. Any other failure stays for the checker."""
    failed, kept = [], []
    for s in case.saves:
        if not s["ok"] and case.t_cut <= s["t"] <= t_clear and re.fullmatch(pattern, s["error"]):
            failed.append(s["step"])
        else:
            kept.append(s)
    case.saves = kept
    if not failed:
        case.extra.append(f"no save failed with {pattern!r} while the fault was on")
    return failed


def _nothing_half_visible(rig: Rig, failed: list[int]) -> list[str]:
    """No committed step directory of a failed save on host 3, no temporary directory left on its disk."""
    ram = rig.cluster.ram(DISK)
    out = [f"step {s} failed on host {DISK} but is committed there" for s in failed if s in rig.cluster.committed(DISK)]
    tmp = [str(p.relative_to(ram)) for p in [*ram.glob(f"{layout.STEPS_DIR}/{layout.TMP_PREFIX}*"),
                                             *ram.glob(f"{layout.PEER_DIR}/*/{layout.TMP_PREFIX}*")]]
    if tmp:
        out.append(f"temporary directories left on host {DISK}'s RAM disk: {tmp}")
    return out


def _fired(mount: faultfs.FaultMount, op: str, at: int) -> list[str]:
    hits = [h for h in mount.hit_records() if h["op"] == op]
    if not hits:
        return [f"the {op} fault never fired"]
    first = min(h["offset"] for h in hits)
    if op == "write" and first != at:  # writes are cut at byte N exactly: a short write, then the error
        return [f"the write fault fired first at byte {first}, not {at}"]
    if op == "read" and not any(h["offset"] <= at < h["offset"] + h["size"] for h in hits):
        return [f"no failed read covered byte {at} (first failed at {first})"]
    return []


@pytest.mark.parametrize("disk_rig", ["fuse"], indirect=True)
@pytest.mark.parametrize("err", ["EIO", "ENOSPC"])
def test_a_write_error_at_byte_n_fails_the_save_cleanly(disk_rig: tuple[Rig, faultfs.FaultMount], err: str) -> None:
    """Host 3's shard writes fail at byte N: each save there fails with an OSError of that errno naming the
    step and the RAM disk; no step of a failed save is committed, no temporary directory stays; once the
    disk writes again the job saves, completes and restores a newer step."""
    rig, mount = disk_rig
    ram = rig.cluster.ram(DISK)
    rule = {"op": "write", "glob": f"{layout.STEPS_DIR}/{layout.TMP_PREFIX}*/*.bin", "at": AT_BYTE, "errno": err}
    case, t_clear = _run(rig, f"disk-write-{err.lower()}-at-byte-n", lambda: mount.set([rule]),
                         lambda: mount.set([]))
    what = r"\[Errno 5\] Input/output error" if err == "EIO" else r"\[Errno 28\] RAM disk full"
    failed = _expected_failures(case, t_clear, rf"rank {DISK}: OSError: {what} while writing step \d+ to "
                                               rf"{re.escape(str(ram))}.*")
    case.extra += _nothing_half_visible(rig, failed) + _fired(mount, "write", AT_BYTE)
    assert_passed(rig, case)


@pytest.mark.parametrize("disk_rig", ["fuse"], indirect=True)
def test_a_read_error_at_byte_n_of_a_committed_copy_heals_from_the_peer(
        disk_rig: tuple[Rig, faultfs.FaultMount]) -> None:
    """Host 3's committed shard file of a redundant step S reads EIO from byte N on. The sidecar's reader
    restoring S on host 3 returns nothing unverified: it drops the copy and reads rank 3's data of S from the
    other tier (the peer copy, fetched by host 3's replicator) -- bit-exact, the local copy replaced by a good
    one. Meanwhile the job saves on; afterwards it completes and restores a newer step."""
    rig, mount = disk_rig
    ram, backing = rig.cluster.ram(DISK), Path(mount.backing)
    got: dict[str, object] = {}

    def fault() -> None:
        step = rig.trainer.step  # redundant: quiesced
        shard = layout.shard_file_name(0, 0)
        st = os.stat(backing / layout.STEPS_DIR / str(step) / shard)
        bad = [st.st_ino, st.st_mtime_ns]
        mount.set([{"op": "read", "glob": f"{layout.STEPS_DIR}/{step}/{shard}", "at": AT_BYTE, "errno": "EIO",
                    "files": [bad]}])
        got["step"] = step
        src = reader.StepSource(step, [ram], fetcher=ReplicatorFetcher(ram, 60.0), drop_bad=True, own_rank=DISK)
        try:
            nbytes = rig.trainer.nbytes
            data = src.assemble("w", ((0, nbytes),))
            # The trainer writes every rank's data as the same region of one array "w": to the reader, the
            # peer's copy held on this host (rank 1's) is another verified copy of that region (as a
            # replicated array's would be). Either is right; zeros, a part, or anything else is not.
            got["exact"] = bytes(data) in {step_bytes(r, step, nbytes).tobytes() for r in (DISK, PEER)}
        except Exception as e:  # recorded as a violation below
            got["error"] = f"{type(e).__name__}: {e}"
        finally:
            src.close()
        # Healed: host 3's own copy of the step is a good one again, another file than the bad one.
        try:
            now = os.stat(backing / layout.STEPS_DIR / str(step) / shard)
            healed = [now.st_ino, now.st_mtime_ns] != bad
            check_copy(ram / layout.STEPS_DIR / str(step), DISK, step)
            got["healed"] = healed
        except (AssertionError, OSError, ValueError) as e:
            got["healed"] = f"{type(e).__name__}: {e}"

    case, _ = _run(rig, "disk-read-eio-at-byte-n", fault, lambda: mount.set([]))
    step = got["step"]
    if "error" in got:
        case.extra.append(f"restoring step {step} on host {DISK} failed: {got['error']}")
    elif not got.get("exact"):
        case.extra.append(f"restoring step {step} on host {DISK} returned other bytes than saved")
    case.extra += _fired(mount, "read", AT_BYTE)
    if got.get("healed") is not True:
        case.extra.append(f"host {DISK}'s copy of step {step} not replaced by a good one: {got.get('healed')}")
    assert_passed(rig, case)


def _progress_during(case: Case) -> list[str]:
    """The other hosts' work went on while host 3's disk failed: a step saved during the fault completed."""
    during = [r["newest"] for s in case.client_streams for r in s
              if r.get("code") == "OK" and case.t_cut + 2.0 < r["t"] <= case.t_heal]
    first = min((s["step"] for s in case.saves if s["t"] >= case.t_cut and s["ok"]), default=None)
    if first is None or not during or max(during) < first:
        return [f"no step saved during the fault completed (newest answered {max(during, default=-1)})"]
    return []


@pytest.mark.parametrize("disk_rig", ["fuse"], indirect=True)
@pytest.mark.parametrize("kind", ["bytes", "inodes"])
def test_the_peer_landing_dir_out_of_space_fails_the_copy_cleanly(disk_rig: tuple[Rig, faultfs.FaultMount],
                                                                   kind: str) -> None:
    """Peer copies landing on host 3 (rank 1's steps) fail with ENOSPC at byte N of a file (``bytes``) or at
    the creation of its files (``inodes``), while host 3's own saves still succeed: every save succeeds,
    steps keep completing, no half copy is committed (every committed copy verifies bit for bit), no
    temporary directory stays; once space is back the copies land again and the job restores."""
    rig, mount = disk_rig
    landing = f"{layout.PEER_DIR}/*/{layout.TMP_PREFIX}*/*"
    rule = ({"op": "write", "glob": landing, "at": AT_BYTE, "errno": "ENOSPC"} if kind == "bytes"
            else {"op": "create", "glob": landing, "errno": "ENOSPC"})
    case, _ = _run(rig, f"disk-peer-landing-full-{kind}", lambda: mount.set([rule]), lambda: mount.set([]))
    case.extra += _fired(mount, rule["op"], AT_BYTE) + _nothing_half_visible(rig, []) + _progress_during(case)
    case.extra += rig.check_every_copy()
    if not [s for s in rig.cluster.ram(DISK).glob(f"{layout.PEER_DIR}/{PEER}/[0-9]*")
            if int(s.name) > rig.trainer.step - 5]:
        case.extra.append(f"no copy of rank {PEER}'s recent steps landed on host {DISK} after the fault")
    assert_passed(rig, case)


@pytest.mark.parametrize("disk_rig", ["tmpfs"], indirect=True)
@pytest.mark.parametrize("kind", ["bytes", "inodes"])
def test_a_full_ram_disk_fails_the_save_naming_the_disk(disk_rig: tuple[Rig, faultfs.Tmpfs], kind: str) -> None:
    """Host 3's RAM disk (a tmpfs) filled up by bytes or by files: each save there fails with ENOSPC naming
    the RAM disk, nothing of it visible; the daemon and the other hosts go on; once room is made the job
    saves, completes and restores a newer step."""
    rig, disk = disk_rig
    ram = rig.cluster.ram(DISK)
    fill = disk.fill_bytes if kind == "bytes" else disk.fill_inodes
    case, t_clear = _run(rig, f"disk-full-{kind}", lambda: fill() and None, disk.free)
    failed = _expected_failures(case, t_clear, rf"rank {DISK}: OSError: \[Errno 28\] .*{re.escape(str(ram))}.*")
    case.extra += _nothing_half_visible(rig, failed) + rig.check_every_copy()
    assert_passed(rig, case)


@pytest.mark.parametrize("disk_rig", ["fuse"], indirect=True)
def test_a_read_error_at_byte_n_while_serving_a_peer_copy_commits_no_bad_copy(
        disk_rig: tuple[Rig, faultfs.FaultMount]) -> None:
    """Every shard file host 3 commits during the fault reads EIO from byte N on, so the copies of rank 3's
    steps that host 3 serves to its peer (and its bucket backups) fail mid-file: no copy of them is committed
    unverified anywhere (every committed copy on every host verifies bit for bit), every save succeeds, the
    daemon keeps serving, and once the disk reads well rank 3's steps are copied to the peer again."""
    rig, mount = disk_rig
    before: list[int] = []

    def fault() -> None:
        before.append(rig.trainer.step)
        mount.set([{"op": "read", "glob": f"{layout.STEPS_DIR}/*/*.bin", "at": AT_BYTE, "errno": "EIO"}])

    case, _ = _run(rig, "disk-read-eio-while-serving", fault, lambda: mount.set([]))
    case.extra += _fired(mount, "read", AT_BYTE) + _nothing_half_visible(rig, []) + _progress_during(case)
    case.extra += rig.check_every_copy()
    peer = rig.cluster.ram(PEER) / layout.PEER_DIR / str(DISK)
    if not [d for d in peer.glob("[0-9]*") if int(d.name) > before[0]]:
        case.extra.append(f"no copy of rank {DISK}'s steps after {before[0]} landed on host {PEER}")
    assert_passed(rig, case)


def test_a_jax_save_through_the_manager_meets_a_write_error_then_a_read_error(tmp_path: Path) -> None:
    """A real JAX save through ``CheckpointManager`` (4 simulated hosts, local dirs on a faultfs mount):
    host 3's shard writes fail with EIO at byte N, so ``wait_until_finished`` raises ``SaveError`` naming
    the step and host 3's RAM disk, no step of it is listed, host 3 has no temporary directory; once cleared the
    next save succeeds. Then host 3's committed files of it read EIO from byte N on: the restore returns the
    saved values bit-exact (from the other slice's copy) or fails with a clear error, never other bytes."""
    jax = pytest.importorskip("jax")
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.topology import HostTopology
    from sidecar.writer import SaveError

    violations: list[str] = []
    with faultfs.FaultMount(tmp_path / "backing", tmp_path / "mnt", tmp_path / "faultfs.json") as mount:
        devs = jax.devices()
        if len(devs) < 8:
            pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
        mesh = Mesh(np.array(devs).reshape(2, 4), ("a", "b"))
        rng = np.random.default_rng(0)
        # 512 KiB a shard: files below the reader's 1 MiB mapping threshold (an mmap'd bad page is a SIGBUS).
        tree = {"w": jax.device_put(rng.standard_normal((256, 2048)).astype(np.float32),
                                    NamedSharding(mesh, P(None, "b")))}
        opts = CheckpointManagerOptions(local_directory=str(tmp_path / "mnt" / "{host}"), job_name="t")
        topo = HostTopology.simulated(devs, slices=2, hosts_per_slice=2)
        ram3 = tmp_path / "mnt" / str(DISK)
        with CheckpointManager(opts, devices=devs, topology=topo) as mgr:
            mgr.save(1, tree)
            mgr.wait_until_finished()
            mount.set([{"op": "write", "glob": f"{DISK}/{layout.STEPS_DIR}/{layout.TMP_PREFIX}*/*.bin",
                        "at": AT_BYTE, "errno": "EIO"}])
            try:
                mgr.save(2, tree)
                mgr.wait_until_finished()
                violations.append("the save of step 2 on a failing disk succeeded")
            except SaveError as e:
                if not re.search(rf"Input/output error while writing step 2 to {re.escape(str(ram3))}", str(e)):
                    violations.append(f"the save's error names neither the step nor the disk: {e}")
            mount.set([])
            t_clear = time.monotonic()
            if 2 in mgr.all_steps():
                violations.append(f"step 2 listed after its save failed: {mgr.all_steps()}")
            left = sorted(os.listdir(ram3 / layout.STEPS_DIR))
            if left != ["1"]:
                violations.append(f"host {DISK}'s steps after the failed save: {left}")
            violations += _fired(mount, "write", AT_BYTE)
            mgr.save(3, tree)
            mgr.wait_until_finished()
            progress = time.monotonic() - t_clear
            if 3 not in mgr.all_steps():
                violations.append(f"the save after the fault did not commit: {mgr.all_steps()}")
            back = tmp_path / "backing" / str(DISK) / layout.STEPS_DIR / "3"
            files = [[(st := os.stat(f)).st_ino, st.st_mtime_ns] for f in back.glob("*.bin")]
            mount.set([{"op": "read", "glob": f"{DISK}/{layout.STEPS_DIR}/3/*.bin", "at": AT_BYTE, "errno": "EIO",
                        "files": files}])
            target = {"w": jax.ShapeDtypeStruct(tree["w"].shape, tree["w"].dtype, sharding=tree["w"].sharding)}
            try:
                got = mgr.restore(3, target)
                if not np.array_equal(np.asarray(got["w"]), np.asarray(tree["w"])):
                    violations.append("the restore returned other values than saved")
                print(f"restore of step 3 with host {DISK}'s files failing: bit-exact")
            except Exception as e:  # a clear error is allowed (printed for the run's log)
                print(f"restore of step 3 with host {DISK}'s files failing: {type(e).__name__}: {e}")
                if "Input/output error" not in str(e) and "bad copy" not in str(e).lower():
                    violations.append(f"the restore failed without naming the I/O error: {type(e).__name__}: {e}")
            mount.set([])
            violations += _fired(mount, "read", AT_BYTE)
    SUMMARY.add("disk-jax-save-and-restore", violations, progress)
    assert not violations, violations
