"""`mtc export` of a 4 GiB step under a 1 GiB memory limit (issue #48, item 5): the export streams, so a state
four times the process's limit exports, and plain Orbax restores it bit for bit. ``make test-faults``; root.

The step (16 arrays of 256 MiB, each cut in 4 shards, saved by 8 ranks) is built shard by shard into a file
bucket on /dev/shm (tests/kits/export_state.py). ``mtc export`` runs as a subprocess inside a memory cgroup of
the test's own (tests/kits/cgroup.py, v1 or v2) limited to 1 GiB, its download (--scratch) and checkpoint
(--dest) on disk: a disk file's page cache is reclaimed under the limit, a tmpfs's would not be (see
tests/faults/test_memory.py). What it holds itself (anonymous memory) is sampled every 50 ms.

"Bit-exact" here: plain Orbax (a fresh interpreter that cannot import this repository) restores each array
whole, one at a time (PyTreeCheckpointer, partial_restore: 256 MiB at once rather than 4 GiB), and the sha256
of each restored array's bytes, its dtype and shape equal those of the array as saved, regenerated here from
its seed; the scalar is restored by value. Every byte of the state is compared, through its digest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import cgroup
from tests.kits.export_state import Spec, digest, expected, orbax_restore, write_bucket

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(cgroup.available()), reason=cgroup.available() or "available")]

REPO = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 1 << 30
ARRAYS = {f"['layer{i:02d}']": Spec((65536, 1024), "float32", (4, 1)) for i in range(16)}  # 16 x 256 MiB
STATE_BYTES = sum(s.nbytes for s in ARRAYS.values())
STEP = 100
EXPORT_TIMEOUT_SECONDS = 150.0


@contextlib.contextmanager
def _shm_dir() -> Iterator[Path]:
    d = Path("/dev/shm") / f"mtc-export-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _sampled(cg: cgroup.MemoryCgroup, peaks: dict[str, int]) -> contextlib.AbstractContextManager[None]:
    """Sample the group's anonymous memory (what the export holds) and usage every 50 ms into ``peaks``."""
    def sample() -> None:
        peaks["anon"] = max(peaks.get("anon", 0), cg.anon())
        peaks["usage"] = max(peaks.get("usage", 0), cg.usage())
    return cgroup.sampling(sample, "export-memory-sampler")


def test_a_4_gib_step_exports_under_a_1_gib_limit_and_orbax_restores_it_bit_exact(tmp_path: Path) -> None:
    assert STATE_BYTES == 4 << 30
    cgroup.reap_stale()
    with _shm_dir() as shm:
        t0 = time.monotonic()
        write_bucket(shm / "bucket", shm / "build", STEP, ARRAYS, {"['step']": STEP}, ranks=8)
        built = time.monotonic() - t0
        dest, scratch = tmp_path / "exported", tmp_path / "scratch"
        scratch.mkdir()
        argv = [sys.executable, "-m", "controller_client.cli", "export", str(STEP), "--backup-url",
                f"file://{shm / 'bucket'}", "--dest", str(dest), "--scratch", str(scratch), "-o", "json"]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        peaks: dict[str, int] = {}
        try:
            with cgroup.MemoryCgroup(LIMIT_BYTES) as cg, _sampled(cg, peaks):
                t1 = time.monotonic()
                proc = subprocess.run(cg.wrap(argv), capture_output=True, text=True, env=env, cwd=str(REPO),
                                      timeout=EXPORT_TIMEOUT_SECONDS)
                took = time.monotonic() - t1
                kills, group_peak = cg.oom_kills(), cg.peak()
            assert proc.returncode == 0 and kills == 0, (proc.returncode, kills, proc.stderr[-3000:])
            info = json.loads(proc.stdout)
            print(f"export of {STATE_BYTES >> 20} MiB under {LIMIT_BYTES >> 20} MiB: {took:.1f}s (download "
                  f"{info['download_seconds']:.1f}s, write {info['seconds']:.1f}s); the process's peak RSS "
                  f"{info['peak_rss_bytes'] >> 20} MiB ({info['download_peak_rss_bytes'] >> 20} MiB by the end of the "
                  f"download); the group's peak anonymous memory "
                  f"{peaks.get('anon', 0) >> 20} MiB, peak usage with page cache {(group_peak or 0) >> 20} MiB "
                  f"(sampled {peaks.get('usage', 0) >> 20} MiB); build {built:.1f}s")
            assert info["bytes"] == STATE_BYTES and info["leaves"] == len(ARRAYS) + 1
            assert peaks.get("anon", 0) < LIMIT_BYTES // 2, peaks  # far below: what the export holds itself
            assert info["peak_rss_bytes"] < LIMIT_BYTES // 2, info

            t2 = time.monotonic()
            got = orbax_restore(dest, mode="each", timeout=240)
            for path, spec in ARRAYS.items():
                want = expected(0, path, spec, tuple((0, n) for n in spec.shape))
                rec = got[path]
                assert (rec["dtype"], tuple(rec["shape"])) == ("float32", spec.shape), path
                assert rec["sha256"] == digest(want), f"{path} differs"
                del want
            print(f"restored by plain Orbax array by array and compared in {time.monotonic() - t2:.1f}s")
        finally:
            shutil.rmtree(dest, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
