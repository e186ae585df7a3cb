"""The crash matrix's erasure-coding cases (group ``ec``): four replicators at ``--redundancy ec:3+1``, every host's
data different (data parallelism 1, so the peer tier holds parity, not copies); the armed one is killed while it
computes its parity of step 1 (``ec.parity.before_commit``) or, replaced with an empty RAM disk, while it rebuilds
its step 1 from its code group (``ec.rebuild.mid``). Then it restarts with its RAM disk and must finish the work:
nothing half-written is listed before or after, step 1 is redundant again and restores bit-exact."""

from __future__ import annotations

import signal
from pathlib import Path

from controller_client.demo.cluster import LocalCluster
from replicator.coordinator.client import CoordinatorClient
from replicator.local.store import RamDiskStore
from sidecar import commit, layout
from tests.crash import daemons, inflight, kit
from tests.kits.cluster import redundant

NODES, K, M = 4, 3, 1
SETTLE_SECONDS = 40.0


def _check_nothing_broken(cl: LocalCluster) -> None:
    for r in range(cl.nodes):
        kit.check_nothing_broken(cl.ram(r), r)
    inflight.check_listed_parity(cl)


def run_ec(point: str, case, work: Path) -> None:  # case: test_matrix.Case
    cl = LocalCluster(work / "c", NODES, 1, heartbeat_seconds=0.1, extra=["--redundancy", f"ec:{K}+{M}"])
    fired_file, victim, armed = work / "fired", case.victim, f"{point}@{case.at}"
    rebuild = point.startswith("ec.rebuild")
    try:
        for r in range(NODES):
            daemons.start(cl, r, armed if r == victim and not rebuild else None, fired_file)
        daemons.save_all(cl, 1)
        if rebuild:  # step 1 redundant, then the victim comes back empty: it rebuilds step 1 from parity
            kit.wait_for(lambda: redundant(cl, 1), timeout=SETTLE_SECONDS, what="step 1 redundant")
            cl.procs[victim].kill()
            cl.wipe(victim)
            daemons.start(cl, victim, armed, fired_file)
        rc = daemons.died(cl, victim)
        assert rc == -signal.SIGKILL and kit.fired(fired_file) == [point], (
            f"point {point} not reached: rc={rc} fired={kit.fired(fired_file)}\n{cl.logs()}")
        _check_nothing_broken(cl)
        if rebuild:
            assert 1 not in commit.committed_steps(layout.steps_dir(cl.ram(victim))), "a half-rebuilt step is listed"
        else:
            assert not inflight.listed_parity(cl.ram(victim)), "parity committed although killed before its commit"
        assert inflight.staging_left(cl), "the killed work left no staging directory: was it in flight?"
        daemons.start(cl, victim, None, fired_file)  # restart, unarmed, its RAM disk kept
        kit.wait_for(lambda: redundant(cl, 1), timeout=SETTLE_SECONDS, what="step 1 redundant again")
        kit.wait_for(lambda: not inflight.staging_left(cl), timeout=SETTLE_SECONDS, what="no staging directory left")
        client = CoordinatorClient(cl.coordinator, rpc_timeout_seconds=10)
        try:
            assert client.prepare_restore(None, 30) == 1
        finally:
            client.close()
        for r in range(NODES):
            kit.check_step_dir(layout.steps_dir(cl.ram(r)) / "1", r, 1)
        _check_nothing_broken(cl)
        assert inflight.listed_parity(cl.ram(victim)), "the restarted victim holds no parity of step 1"
        cl.stop_all()
        RamDiskStore(cl.ram(victim), victim)
        daemons.save_all(cl, 2)  # after a restart the next step saves as ever
        for r in range(NODES):
            kit.check_step_dir(layout.steps_dir(cl.ram(r)) / "2", r, 2)
    except BaseException:
        print(cl.logs())
        raise
    finally:
        cl.stop_all(signal.SIGKILL)
