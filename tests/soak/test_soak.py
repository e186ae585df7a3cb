"""Soak: 12 replicators on loopback, a trainer saving every second, random SIGKILLs of both.

For ``MTC_SOAK_SECONDS`` (default 20) a chaos loop SIGKILLs a random replicator (the coordinator's
included) and restarts it after a moment, or SIGKILLs the trainer, whose restart restores the newest
globally complete step (checked bit-exact) and saves on. Afterwards: no broken step is listed on any host,
the newest complete step restores bit-exact on all 12 hosts, and every replicator's RSS (VmRSS, sampled
throughout) stayed under a generous bound. The numbers are printed (``-s``) and kept in the test's report.
``MTC_SOAK_SEED`` fixes the chaos.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from controller_client.demo.cluster import LocalCluster
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from replicator.coordinator.client import CoordinatorClient
from sidecar import checksums
from tests.crash import kit

SOAK_SECONDS = float(os.environ.get("MTC_SOAK_SECONDS", "20"))
NODES, SLICES = 12, 2
TRAINER = Path(__file__).with_name("trainer.py")
RSS_BOUND_MB = 400.0  # generous: a replicator idles at ~60-80 MB

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.timeout(int(SOAK_SECONDS) + 300)]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Trainer:
    def __init__(self, base: Path, coordinator: str):
        self.base, self.coordinator = base, coordinator
        self.events = base / "trainer-events.jsonl"
        self.log = base / "logs" / "trainer.log"
        self.proc: subprocess.Popen | None = None

    def start(self, verify: bool = False) -> subprocess.Popen:
        env = kit.fault_env(None, None)
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(TRAINER), "--template", str(self.base / "ram" / "{host}"),
                 "--coordinator", self.coordinator, "--events", str(self.events), *(["--verify"] if verify else [])],
                stdout=f, stderr=f, env=env, cwd=str(kit.REPO))
        return self.proc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def read(self) -> list[dict]:
        if not self.events.exists():
            return []
        out = []
        for line in self.events.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by SIGKILL
        return out


def _status(cl: LocalCluster):
    """The coordinator's typed status (GetStatusResponse), or None when it does not answer."""
    c = CoordinatorClient(cl.coordinator, rpc_timeout_seconds=5)
    try:
        return c.status()
    except grpc.RpcError:
        return None
    finally:
        c.close()


def _settled(cl: LocalCluster) -> int | None:
    """The newest complete step once it is redundant (every host up and caught up), else None."""
    st = _status(cl)
    if not st:
        return None
    complete = [s for s in st.steps if s.complete]
    if not complete:
        return None
    newest = max(complete, key=lambda s: s.step)
    return newest.step if newest.redundant else None


def test_soak_12_hosts_random_sigkills() -> None:
    base = Path(tempfile.mkdtemp(prefix="mtc-soak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    seed = int(os.environ.get("MTC_SOAK_SEED", str(int(time.time()) % 100_000)))
    rng = random.Random(seed)
    bucket = f"file://{base}/bucket"
    cl = LocalCluster(base, NODES, SLICES, replicas=1, heartbeat_seconds=0.5,
                      extra=["--backup-url", bucket, "--backup-interval-steps", "5", "--backup-keep", "2"])
    cl.env = kit.fault_env(None, None)
    trainer = Trainer(base, "")
    rss: dict[int, list[float]] = {r: [] for r in range(NODES)}
    lives: dict[int, list[tuple[float, float]]] = {}  # pid -> (monotonic, VmRSS MB) samples of one incarnation
    kills = {"replicator": 0, "trainer": 0}
    try:
        cl.start_all()
        trainer.coordinator = cl.coordinator
        trainer.start()
        dead: dict[int, float] = {}
        trainer_restart_at: float | None = None
        t_end = time.monotonic() + SOAK_SECONDS
        next_chaos = time.monotonic() + 3.0
        while time.monotonic() < t_end:
            now = time.monotonic()
            for r, p in cl.procs.items():
                if p.alive and (v := rss_mb(p.proc.pid)) is not None:
                    rss[r].append(v)
                    lives.setdefault(p.proc.pid, []).append((now, v))
            for r, at in list(dead.items()):
                if now >= at:
                    cl.start(r)
                    del dead[r]
            if trainer_restart_at is not None and now >= trainer_restart_at:
                trainer.start()
                trainer_restart_at = None
            elif trainer_restart_at is None and trainer.proc.poll() is not None:
                pytest.fail(f"trainer exited by itself with {trainer.proc.returncode}: "
                            f"{trainer.log.read_text()[-3000:]}")
            if now >= next_chaos:
                if rng.random() < 0.25 and trainer_restart_at is None:
                    trainer.kill()
                    kills["trainer"] += 1
                    trainer_restart_at = now + rng.uniform(0.2, 1.5)
                else:
                    alive = [r for r in range(NODES) if r not in dead]
                    r = rng.choice(alive)
                    cl.procs[r].kill()
                    kills["replicator"] += 1
                    dead[r] = now + rng.uniform(0.3, 3.0)
                next_chaos = now + rng.uniform(1.5, 3.5)
            time.sleep(0.25)
        # Calm: everyone back up; the trainer saves a few more steps, then it is killed one last time.
        for r in list(dead):
            cl.start(r)
        if trainer_restart_at is not None:
            trainer.start()
        saved_before = len([e for e in trainer.read() if e["event"] == "saved"])
        kit.wait_for(lambda: len([e for e in trainer.read() if e["event"] == "saved"]) >= saved_before + 3,
                     timeout=90, what="three saves after the chaos")
        trainer.kill()
        for r, p in cl.procs.items():
            if (v := rss_mb(p.proc.pid)) is not None:
                rss[r].append(v)
        newest = kit.wait_for(lambda: _settled(cl), timeout=60, what="the newest complete step redundant")
        for r in range(NODES):  # nothing broken is listed on any host
            for d in kit.listed(cl.ram(r)).values():
                checksums.verify_step_dir(d)
        backups = BackupStore(open_store(bucket), "t").committed_steps()
        with tempfile.TemporaryDirectory(dir=base) as scratch:  # the newest backup restores, verified
            for r in range(NODES) if backups else ():
                BackupStore(open_store(bucket), "t").download_rank(backups[-1], r, Path(scratch) / str(r))
        trainer.start(verify=True)
        assert trainer.proc.wait(timeout=180) == 0, trainer.log.read_text()[-3000:]
        events = trainer.read()
        restores = [e for e in events if e["event"] == "restored"]
        assert restores and all(e["ok"] for e in restores), restores
        assert restores[-1]["step"] == newest, (restores[-1], newest)
        saved = sorted({e["step"] for e in events if e["event"] == "saved"})
        errors = [e for e in events if e["event"] in ("save_error", "restore_error")]
        peak = {r: round(max(v), 1) for r, v in rss.items() if v}
        first = {r: round(v[0], 1) for r, v in rss.items() if v}
        longest = max(lives.values(), key=lambda s: s[-1][0] - s[0][0])
        report = {"seconds": SOAK_SECONDS, "seed": seed, "nodes": NODES, "kills": kills, "steps_saved": len(saved),
                  "newest_complete_step": newest, "restores_bit_exact": len(restores), "backups": backups,
                  "save_or_restore_errors": len(errors),
                  "error_kinds": sorted({e["error"].split(":")[0] for e in errors}),
                  "replicator_rss_mb_first": first, "replicator_rss_mb_peak": peak,
                  "rss_peak_max_mb": max(peak.values()),
                  "longest_incarnation": {"seconds": round(longest[-1][0] - longest[0][0], 1),
                                          "rss_mb_first": round(longest[0][1], 1),
                                          "rss_mb_peak": round(max(v for _, v in longest), 1),
                                          "rss_mb_last": round(longest[-1][1], 1)},
                  "errors_sample": [e["error"][:160] for e in errors[:3]]}
        print("SOAK " + json.dumps(report))
        (Path(os.environ.get("MTC_SOAK_REPORT", base / "soak.json"))).write_text(json.dumps(report))
        assert kills["replicator"] >= 1 and len(saved) >= 3 and backups
        assert max(peak.values()) < RSS_BOUND_MB, report
    except BaseException:
        print(cl.logs()[-20000:])
        raise
    finally:
        trainer.kill()
        cl.stop_all(signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
