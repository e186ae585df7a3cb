"""The bucket's faults (issue #33): 429/503 storms and stalled responses from a GCS emulator during a backup
and during a restore from the bucket alone, with the real daemons of tests/kits/fault_rig.py backing up to
``gs://`` through a fault-injecting proxy (tests/kits/storage.py, :class:`NetnsFaultProxy`: it listens on the
controller's address in the test network's bridge namespace; the emulator runs on this process's loopback).

Each fault is time-based: every matching request is answered 429/503 (or stalled) for a window of
:data:`WINDOW_SECONDS`, then the proxy is healthy again. Besides the rig's history check (saves succeeded,
``latest_step()`` never went backwards, progress and a restore within the rig's bound after the heal), a
watcher lists the bucket directly (not through the proxy) throughout: the newest committed backup never goes
backwards, and every step ever listed as committed holds every rank's data bit for bit. After the heal a step
saved after it is committed in the bucket within :data:`BACKUP_BOUND_SECONDS`. ``make test-faults``; root.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.backup.bucket import BackupStore
from tests.kits import faultnet
from tests.kits.fault_cluster import NODES, check_copy
from tests.kits.fault_history import Case
from tests.kits.fault_rig import PROGRESS_BOUND_SECONDS, SETTLE_TIMEOUT_SECONDS, Rig, assert_passed, wait_for
from tests.kits.storage import BUCKET, Emulator, NetnsFaultProxy, Window

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(faultnet.available()), reason=faultnet.available() or "available")]

PREFIX = "mtc"
JOB = "t"
WINDOW_SECONDS = 20.0
# The daemons' per-request bucket timeout (--bucket-timeout-seconds): a stalled request ends after it.
REQUEST_TIMEOUT_SECONDS = 2.0
RETRY_AFTER_SECONDS = 4.0
# Honouring Retry-After, one caller makes at most WINDOW / RETRY_AFTER + 1 requests in a storm; a host has at
# most this many callers at once (two upload threads, the coordinator's begin/commit thread).
CALLERS_PER_HOST = 3
# During a bucket fault the coordinator keeps answering (the probe asks every 0.3 s, 2 s RPC timeout).
ANSWER_GAP_SECONDS = 5.0
# After the heal, a step saved after it is committed in the bucket within this: the scheduler's back-off
# after failed runs (at most 16 s), one backup interval (5 steps, one a second) and the upload itself.
BACKUP_BOUND_SECONDS = 45.0


class BucketWatcher:
    """Lists the bucket's committed backups every ``interval`` seconds, straight from the emulator, and
    checks each newly listed step's every rank bit for bit; records (time, newest committed) and problems."""

    def __init__(self, emu: Emulator, interval: float = 0.3) -> None:
        self.backups = BackupStore(emu.store(PREFIX), JOB)
        self.interval = interval
        self.newest: list[tuple[float, int]] = []
        self.checked: set[int] = set()
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._tmp = Path(tempfile.mkdtemp(prefix="mtc-bucket-watch-"))
        self._thread = threading.Thread(target=self._run, daemon=True, name="bucket-watcher")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                steps = self.backups.committed_steps()
            except Exception as e:  # noqa: BLE001 - the emulator itself never fails; recorded if it does
                self.problems.append(f"listing the bucket: {type(e).__name__}: {e}")
                steps = []
            if steps:
                self.newest.append((time.monotonic(), max(steps)))
            for step in steps:
                if step not in self.checked:
                    self._check(step)
            self._stop.wait(self.interval)

    def _check(self, step: int) -> None:
        try:
            for rank in range(NODES):
                dest = self._tmp / f"{step}-{rank}"
                d = self.backups.download_rank(step, rank, dest)
                check_copy(d, rank, step)
                shutil.rmtree(dest, ignore_errors=True)
        except FileNotFoundError:
            if step in self.backups.committed_steps():
                self.problems.append(f"step {step} listed as committed but a rank's backup is missing")
                self.checked.add(step)
            return  # deleted meanwhile by retention
        except (AssertionError, OSError, ValueError) as e:
            self.problems.append(f"committed step {step}: {type(e).__name__}: {e}")
        self.checked.add(step)

    def newest_at(self, t: float) -> int:
        return max((n for tt, n in self.newest if tt <= t), default=-1)

    def violations(self, t_heal: float) -> list[str]:
        """The newest committed backup went backwards, or a listed step did not hold its data."""
        out = list(self.problems)
        high = -1
        for t, n in self.newest:
            if n < high:
                out.append(f"the bucket's newest committed backup went from {high} to {n} ({t - t_heal:+.1f}s "
                           "from the heal)")
            high = max(high, n)
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        shutil.rmtree(self._tmp, ignore_errors=True)


class BucketRig(Rig):
    """The fault rig with a gs:// bucket behind the proxy, and the bucket watcher."""

    emu: Emulator
    proxy: NetnsFaultProxy
    watcher: BucketWatcher

    def backed_up_after(self, t: float, bound: float) -> list[str]:
        """A step saved after ``t`` committed in the bucket within ``bound`` seconds (else the violation).

        Training runs while it waits: backups go every 5 steps, so the first step saved after the heal may
        only be covered by a newer one (the case's restore paused the trainer; CI once waited 45 s on a
        paused trainer whose step 24 fell between the backups of steps 21 and 26)."""
        self.trainer.resume()
        try:
            step = wait_for(lambda: next((s["step"] for s in self.trainer.saves if s["t"] > t), None), 10,
                            "a save after the heal")
            wait_for(lambda: self.watcher.newest_at(time.monotonic()) >= step, bound,
                     f"a backup of step {step} or newer")
        except TimeoutError as e:
            return [f"no step saved after the heal was backed up within {bound}s: {e}"]
        finally:
            self.trainer.pause()
        return []


@pytest.fixture
def bucket_rig(tmp_path: Path) -> Iterator[BucketRig]:
    faultnet.reap_stale()
    emu = Emulator("fake-gcs", tmp_path)
    try:
        with faultnet.FaultNetwork(NODES) as net:
            proxy = NetnsFaultProxy(emu.port, net.bridge_ns, net.controller_ip)
            r = BucketRig(net, tmp_path)
            r.emu, r.proxy = emu, proxy
            for d in r.cluster.daemons.values():
                d.args += ["--backup-url", f"gs://{BUCKET}/{PREFIX}",
                           "--bucket-timeout-seconds", str(REQUEST_TIMEOUT_SECONDS)]
                d.env["STORAGE_EMULATOR_HOST"] = proxy.url
            r.watcher = BucketWatcher(emu)
            try:
                r.start()
                wait_for(lambda: r.watcher.newest, SETTLE_TIMEOUT_SECONDS, "a first backup committed")
                yield r
            finally:
                r.watcher.stop()
                r.trainer.stop()
                r.cluster.stop()
                proxy.close()
    finally:
        emu.stop()


def coordinator_kept_answering(rig: Rig, t0: float, t1: float) -> list[str]:
    """The controller's probe had answers from one coordinator (one epoch) throughout ``[t0, t1]``, none
    more than :data:`ANSWER_GAP_SECONDS` apart: the bucket's fault held up no heartbeat and no client."""
    ok = [r for r in rig.controller.records() if r["who"] == "client" and r.get("code") == "OK"
          and t0 <= r["t"] <= t1]
    times = [t0] + [r["t"] for r in ok] + [t1]
    gap, at = max((b - a, a) for a, b in zip(times, times[1:], strict=False))
    out = []
    if gap > ANSWER_GAP_SECONDS:
        out.append(f"the coordinator did not answer for {gap:.1f}s from {at - t0:.1f}s into the bucket's fault")
    epochs = sorted({r["epoch"] for r in ok})
    if len(epochs) > 1:
        out.append(f"the coordinator changed during the bucket's fault (epochs {epochs})")
    return out


def _backup_case(rig: BucketRig, name: str, start: callable) -> tuple[Case, list[Window]]:  # type: ignore[valid-type]
    """A fault window during backups, training on (saves and heartbeats must not notice: ``slow_only``)."""
    windows: list[Window] = []

    def fault() -> None:
        windows.append(start())

    case = rig.run_case(name, fault, cut_seconds=WINDOW_SECONDS, after_heal=rig.proxy.end_windows,
                        slow_only=True)
    case.extra += rig.backed_up_after(case.t_heal, BACKUP_BOUND_SECONDS)
    case.extra += rig.watcher.violations(case.t_heal)
    case.extra += coordinator_kept_answering(rig, case.t_cut, case.t_heal)
    hit = rig.proxy.requests_in(windows[0])
    if not any(r[3] for r in hit):
        case.extra.append(f"no request met the fault during its window ({len(hit)} requests)")
    return case, windows


def test_a_503_storm_during_backups_is_retried_and_commits_after(bucket_rig: BucketRig) -> None:
    case, _ = _backup_case(bucket_rig, "bucket-503-storm",
                           lambda: bucket_rig.proxy.storm(503, WINDOW_SECONDS))
    assert_passed(bucket_rig, case)


def test_a_429_storm_with_retry_after_during_backups_is_honoured(bucket_rig: BucketRig) -> None:
    case, (window,) = _backup_case(bucket_rig, "bucket-429-storm-retry-after",
                                   lambda: bucket_rig.proxy.storm(429, WINDOW_SECONDS,
                                                                  retry_after=RETRY_AFTER_SECONDS))
    bound = CALLERS_PER_HOST * (WINDOW_SECONDS / RETRY_AFTER_SECONDS + 1)
    per_host: dict[str, int] = {}
    for _, client, _, kind in bucket_rig.proxy.requests_in(window):
        per_host[client] = per_host.get(client, 0) + bool(kind)
    print(f"requests answered 429 per host during the storm: {per_host} (bound {bound:g})")
    case.extra += [f"{client} sent {n} requests into the storm (bound {bound:g}: Retry-After not honoured)"
                   for client, n in per_host.items() if n > bound]
    assert_passed(bucket_rig, case)


def test_stalled_responses_during_backups_end_at_the_request_timeout(bucket_rig: BucketRig) -> None:
    case, _ = _backup_case(bucket_rig, "bucket-stall",
                           lambda: bucket_rig.proxy.stall(WINDOW_SECONDS))
    assert_passed(bucket_rig, case)


# The restore cases fault the downloads of backed-up data only (object names hold ".../data/<hash>/..."): the
# daemons restart into the fault (their start and the coordinator's reading of the commit records need the
# bucket's metadata, which stays healthy), and restore every host's data from the bucket during it.
DATA_OBJECTS = "%2Fdata%2F"
RESTORE_WINDOW_SECONDS = 30.0


def _restore_case(rig: BucketRig, name: str, start: callable) -> Case:  # type: ignore[valid-type]
    """Every host wiped (the bucket the only source) and restarted during a fault of the data downloads,
    restored: it completes after the window, of the newest backed-up step, bit for bit; then training
    goes on."""
    rig.quiesce()
    seen: list[int] = []

    def settled() -> bool:  # the newest backup stays the same for 3 s (no run in flight) and was checked
        seen.append(rig.watcher.newest_at(time.monotonic()))
        return len(seen) > 10 and len(set(seen[-10:])) == 1 and seen[-1] in rig.watcher.checked

    wait_for(settled, SETTLE_TIMEOUT_SECONDS, "the bucket's newest backup settled", interval=0.3)
    backed_up = seen[-1]
    for d in rig.cluster.daemons.values():
        d.stop()
    for r in range(NODES):
        shutil.rmtree(rig.cluster.ram(r), ignore_errors=True)
    t_cut = t_restart = time.monotonic()
    window = start()
    rig.cluster.start()
    first = wait_for(lambda: (r := rig.latest(t_restart)) and r["newest"] == backed_up and r,
                     SETTLE_TIMEOUT_SECONDS,
                     f"the coordinator naming backed-up step {backed_up} newest after every host was wiped")
    restored = rig.cluster.restore(wait_seconds=RESTORE_WINDOW_SECONDS + PROGRESS_BOUND_SECONDS)
    t_restored = time.monotonic()
    extra: list[str] = []
    if restored.get("step") != backed_up:
        extra.append(f"restored {restored} instead of backed-up step {backed_up}")
    elif t_restored < window.end:
        extra.append(f"the restore ended {window.end - t_restored:.1f}s before the fault did: it did not need "
                     "the bucket")
    else:
        extra += rig.check_restored(backed_up)
    extra += rig.check_every_copy()
    t_heal = window.end
    rig.proxy.end_windows()
    extra += coordinator_kept_answering(rig, first["t"], t_heal)
    extra += ([] if any(r[3] for r in rig.proxy.requests_in(window)) else
              ["no download met the fault during its window"])
    rig.trainer.resume()
    t_progress = None
    try:
        first = wait_for(lambda: next((s["step"] for s in rig.trainer.saves if s["t"] > t_restored), None), 10,
                         "a save after the restore")
        rec = wait_for(lambda: (r := rig.latest(t_restored)) and r["newest"] >= first and r,
                       PROGRESS_BOUND_SECONDS, f"step {first} complete after the restore")
        t_progress = rec["t"]
    except TimeoutError as e:
        extra.append(str(e))
    rig.trainer.pause()
    if t_progress is not None:
        restored["t_end"] = max(t_restored, t_progress)
    extra += rig.watcher.violations(t_heal)
    after = [[r for r in stream if r["t"] > t_restart] for stream in rig.client_streams()]
    return Case(name, t_cut, t_heal, after, [r for r in rig.direct() if r["t"] > t_restart],
                list(rig.trainer.saves), PROGRESS_BOUND_SECONDS, t_progress, restored, extra=extra)


def test_a_bucket_restore_during_a_503_storm_completes_after_it_bit_exact(bucket_rig: BucketRig) -> None:
    case = _restore_case(bucket_rig, "bucket-restore-503-storm",
                         lambda: bucket_rig.proxy.storm(503, RESTORE_WINDOW_SECONDS, DATA_OBJECTS))
    assert_passed(bucket_rig, case)


def test_a_bucket_restore_through_responses_stalled_mid_body_is_bit_exact(bucket_rig: BucketRig) -> None:
    case = _restore_case(bucket_rig, "bucket-restore-stall-mid-body",
                         lambda: bucket_rig.proxy.stall(RESTORE_WINDOW_SECONDS, DATA_OBJECTS, mid_body=True))
    assert_passed(bucket_rig, case)
