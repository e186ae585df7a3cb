"""Erasure-coded redundancy end to end (issue #35): real replicator processes on 127.0.0.1, `--redundancy ec:K+M`.

Every host's data differs (the state is sharded over every device: no data-parallel replica to lean on), so
with ec:K+M the peer tier holds parity, not whole copies. Up to M hosts are replaced at once with empty RAM
disks; each rebuilds its rank's data from its code group's surviving data and parity, and the restore is
bit-exact.
"""

from __future__ import annotations

import re
import signal

import pytest

from sidecar import commit
from tests.kits.admin import mtc
from tests.kits.cluster import assert_equal, manager, redundant, save_steps, target, wait_for

pytestmark = pytest.mark.slow


def _parity_steps(cl, rank: int) -> list[int]:
    root = cl.ram(rank) / "parity"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


@pytest.mark.parametrize("nodes,k,m,lost,mode", [(4, 3, 1, (1,), "spread"), (4, 2, 2, (0, 3), "spread"),
                                                 (4, 3, 1, (2,), "pipelined")],
                         ids=["3+1-one-lost", "2+2-two-lost", "3+1-one-lost-pipelined"])
def test_hosts_replaced_together_rebuild_their_data_from_parity(cluster_factory, nodes, k, m, lost, mode):
    cl = cluster_factory(nodes=nodes, data_parallelism=1,
                         extra=["--redundancy", f"ec:{k}+{m}", "--ec-rebuild", mode])
    cl.start_all()
    mgr = manager(cl, 1, nodes)
    trees = save_steps(mgr, [3], replicated_over_slices=False)
    wait_for(lambda: redundant(cl, 3), what="step 3 complete with all its parity held", timeout=90)
    for r in range(nodes):  # parity, not whole copies
        assert 3 in _parity_steps(cl, r), f"host {r} holds no parity of step 3"
        assert not list((cl.ram(r) / "peer").glob("*/3")), f"host {r} holds a whole copy"

    shown = mtc("status", "-o", "json", "--coordinator", cl.coordinator)
    assert shown.code == 0 and shown.json()["redundancy"] == f"ec:{k}+{m}", shown

    for r in lost:
        cl.procs[r].signal(signal.SIGKILL)
    for r in lost:
        cl.procs[r].wait()
        cl.wipe(r)
    for r in lost:
        cl.start(r)
    assert_equal(trees[3], mgr.restore(None, target(trees[3])))
    for r in lost:
        wait_for(lambda r=r: 3 in commit.committed_steps(cl.ram(r) / "steps"), timeout=60,
                 what=f"host {r} rebuilt its rank's step 3 from parity")
    logs = "".join(p.read_text(errors="replace") for p in (cl.base / "logs").iterdir())
    for r in lost:  # from the code group, not from the bucket or a copy: the coordinator's restore task or the
        # sidecar's fetch for the restore, whichever asked first
        assert re.search(rf"rank {r} now holds rank {r}'s data of step 3 \((task|sidecar)\) from code group "
                         rf"ec:{k}\+{m}", logs), r
        # decoded by the other members (spread: each a share; pipelined: along chains), in the mode asked for:
        # the rebuilding host received each byte ~once
        assert re.search(rf"rebuilt rank {r} step 3 from its code group \(ec:{k}\+{m}, lost \[[0-9, ]+\], rebuild "
                         rf"mode {mode} over ranks", logs), r
    mgr.close()

