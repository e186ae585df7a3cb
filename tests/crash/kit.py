"""Crash-matrix kit: deterministic per-(rank, step) data, the invariant checks, and fault-armed children.

Every rank's data of a step is a pure function of (rank, step), so any copy on any tier -- own directory,
peer copy, bucket, restored -- can be compared bit for bit with what was saved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from sidecar import checksums, commit, copies, faults, layout, reader, writer

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("child.py")
FILES_PER_STEP = 3
CHILD_TIMEOUT_SECONDS = 60.0


def arrays_for(rank: int, step: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(rank * 100_003 + step)
    return [
        ("w", rng.standard_normal((64, 256)).astype(np.float32)),  # 64 KiB
        ("b", rng.integers(-(2**40), 2**40, size=(512,), dtype=np.int64)),
        ("m", rng.integers(0, 255, size=(3, 1000), dtype=np.uint8)),
    ]


def host_step(root: Path, rank: int, nodes: int, step: int, job: str = "t") -> writer.HostStep:
    arrays = [
        writer.ArrayCopy(path, tuple(a.shape), a.dtype.name, None,
                         [writer.ShardCopy(tuple((0, n) for n in a.shape), np.ascontiguousarray(a))])
        for path, a in arrays_for(rank, step)
    ]
    return writer.HostStep(Path(root), job, step, rank, nodes, arrays, [layout.ValueEntry("step", step)])


def save_step(root: Path, rank: int, nodes: int, step: int, job: str = "t") -> layout.StepManifest:
    return writer.write_step(host_step(root, rank, nodes, step, job))


def check_step_dir(d: Path, rank: int, step: int) -> None:
    """``d`` is a committed, verified copy of rank's data of ``step``, bit-exact."""
    m = checksums.verify_step_dir(d)
    assert (m.rank, m.step) == (rank, step), f"{d} holds rank {m.rank} step {m.step}"
    expected = dict(arrays_for(rank, step))
    assert {a.path for a in m.arrays} == set(expected), d
    for a in m.arrays:
        want = expected[a.path]
        (shard,) = a.shards
        got = checksums.read_verified(layout.resolve_under(d, shard.file), shard.length, shard.crc32c, shard.offset)
        assert bytes(got) == want.tobytes(), f"{d}: {a.path} differs"
    if d.parent.name == layout.STEPS_DIR:  # the restore path reads own steps through StepSource
        src = reader.StepSource(step, [d.parent.parent])
        # Only this directory's copy: the host's peer copies hold other ranks' (here different) data of the
        # same leaves, which the reader would rightly use if a running daemon's GC removed d meanwhile.
        for arr in src.arrays.values():
            for index, locs in arr.shards.items():
                arr.shards[index] = [loc for loc in locs if loc.where == copies.StepDir(d)]
        try:
            for path, want in expected.items():
                got = src.assemble(path, tuple((0, n) for n in want.shape))
                np.testing.assert_array_equal(np.asarray(got).view(want.dtype).reshape(want.shape), want)
        except FileNotFoundError:
            if (d / layout.MANIFEST_NAME).exists():
                raise
            # collected by the live daemon between the checks above and this read: not a broken step
        src.drop_cache()
    assert [v.value for v in m.values] == [step]


def listed(root: Path) -> dict[tuple[int, int], Path]:
    """Every committed step a host directory lists: (owner, step) -> directory (own steps: owner -1)."""
    root = Path(root)
    out = {(-1, s): layout.steps_dir(root) / str(s) for s in commit.committed_steps(layout.steps_dir(root))}
    peers = root / layout.PEER_DIR
    if peers.is_dir():
        for od in peers.iterdir():
            if layout.parse_step_name(od.name) is not None:
                for s in commit.committed_steps(od):
                    out[(int(od.name), s)] = od / str(s)
    return out


def check_nothing_broken(root: Path, rank: int) -> list[int]:
    """No partial or broken step is listed on this host; returns its own committed steps."""
    for (owner, step), d in listed(root).items():
        try:
            check_step_dir(d, rank if owner < 0 else owner, step)
        except (OSError, EOFError):
            if (d / layout.MANIFEST_NAME).exists():
                raise
            # GC deleted it while we read it (the manifest goes first): it is no longer listed.
    return commit.committed_steps(layout.steps_dir(root))


def fault_env(point: str | None, fired_file: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV_POINT, faults.ENV_FIRED_FILE)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    if point:
        env[faults.ENV_POINT] = point
        if fired_file is not None:
            env[faults.ENV_FIRED_FILE] = str(fired_file)
    return env


def fired(fired_file: Path) -> list[str]:
    try:
        return [line.split()[0] for line in fired_file.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def run_child(op: str, args: dict, point: str | None, fired_file: Path | None,
              timeout: float = CHILD_TIMEOUT_SECONDS) -> subprocess.CompletedProcess:
    """Run ``child.py op`` with the point armed; returns the finished process (SIGKILLed when it fired)."""
    return subprocess.run([sys.executable, str(CHILD), op, json.dumps(args)], env=fault_env(point, fired_file),
                          cwd=str(REPO), capture_output=True, timeout=timeout)


def assert_killed_at(proc: subprocess.CompletedProcess, point: str, fired_file: Path) -> None:
    assert proc.returncode == -signal.SIGKILL and fired(fired_file) == [point], (
        f"point {point} not reached: rc={proc.returncode} fired={fired(fired_file)} "
        f"stderr={proc.stderr.decode(errors='replace')[-2000:]}")


def wait_for(pred, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    import time

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
