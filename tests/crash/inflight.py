"""In-flight fault matrix kit (tests/crash/test_inflight*.py): the environment that holds an operation at a pause
point, a watcher of every answer the coordinator gives, and the "nothing half-written" checks of RAM disks
(steps, peer copies and parity)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc

from controller_client.demo.cluster import LocalCluster
from replicator.coordinator.client import CoordinatorClient
from replicator.erasure.holder import PARITY_DIR, RECORD_NAME, ParityRecord
from sidecar import checksums, faults, layout
from tests.crash import kit


def pause_env(point: str, pause_seconds: float, fired: Path, arm_file: Path | None = None) -> dict[str, str]:
    """A replicator's environment that holds ``point`` for ``pause_seconds`` the first time it is reached
    (while ``arm_file`` exists, when given) and records it in ``fired``."""
    env = {faults.ENV_POINT: point, faults.ENV_PAUSE_SECONDS: str(pause_seconds), faults.ENV_FIRED_FILE: str(fired)}
    if arm_file is not None:
        env[faults.ENV_ARM_FILE] = str(arm_file)
    return env


def complete_steps(cl: LocalCluster) -> list[int] | None:
    """The coordinator's complete steps; None while it is unreachable."""
    c = CoordinatorClient(cl.coordinator, rpc_timeout_seconds=5)
    try:
        return list(c.complete_steps())
    except grpc.RpcError:
        return None
    finally:
        c.close()


class Watcher:
    """Records the newest complete step of every answer the coordinator gives (-1: none), on a thread of its
    own, from :meth:`start` until :meth:`stop`."""

    def __init__(self, cl: LocalCluster, interval_seconds: float = 0.25):
        self.cl, self.interval = cl, interval_seconds
        self.readings: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            steps = complete_steps(self.cl)
            if steps is not None:
                self.readings.append((time.monotonic(), max(steps) if steps else -1))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def below(self, step: int) -> list[tuple[float, int]]:
        """The answers whose newest complete step was below ``step``."""
        return [(round(t, 2), s) for t, s in self.readings if s < step]


def staging_left(cl: LocalCluster) -> list[str]:
    """Temporary directories on any RAM disk: steps, peer copies, parity (none once the cluster is quiet)."""
    left = []
    for r in range(cl.nodes):
        root = cl.ram(r)
        parity = root / PARITY_DIR
        for d in [layout.steps_dir(root), *(root / layout.PEER_DIR).glob("*"), parity, *parity.glob("*")]:
            if d.is_dir():
                left += [str(p) for p in d.iterdir() if p.name.startswith(layout.TMP_PREFIX)]
    return left


def check_listed_steps(cl: LocalCluster) -> None:
    """Every step any RAM disk lists (own or peer copy) verifies; one deleted while it is read was GC."""
    for r in range(cl.nodes):
        for d in kit.listed(cl.ram(r)).values():
            try:
                checksums.verify_step_dir(d)
            except FileNotFoundError:
                if (d / layout.MANIFEST_NAME).exists():
                    raise  # not a concurrent GC: a listed step lacks a file


def listed_parity(root: Path) -> dict[tuple[int, str], Path]:
    """Every committed parity a host directory lists: (step, digest) -> directory (its GROUP.json exists)."""
    out = {}
    base = Path(root) / PARITY_DIR
    for sd in base.glob("*"):
        if layout.parse_step_name(sd.name) is None:
            continue
        for d in sd.glob("*"):
            if not d.name.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX)) and (d / RECORD_NAME).is_file():
                out[(int(sd.name), d.name)] = d
    return out


def check_listed_parity(cl: LocalCluster) -> int:
    """Every parity any RAM disk lists is whole and verifies: its record parses, names its step, its digest and
    its holder, and every shard has the record's size and crc32c. Returns how many were checked (one deleted
    while it is read was GC: its record went first)."""
    n = 0
    for r in range(cl.nodes):
        for (step, digest), d in listed_parity(cl.ram(r)).items():
            try:
                rec = ParityRecord.from_json((d / RECORD_NAME).read_bytes())
                assert (rec.step, rec.digest, rec.holder) == (step, digest, r), (d, rec.step, rec.digest, rec.holder)
                for f in rec.files:
                    data = (d / f.name).read_bytes()
                    assert (len(data), checksums.crc32c(data)) == (f.size, f.crc32c), f"{d / f.name} does not verify"
                n += 1
            except FileNotFoundError:
                if (d / RECORD_NAME).exists():
                    raise
    return n
