"""Erasure-coded redundancy end to end (issue #35): real replicator processes on 127.0.0.1, `--redundancy ec:K+M`.

Every host's data differs (the state is sharded over every device: no data-parallel replica to lean on), so
with ec:K+M the peer tier holds parity, not whole copies. Up to M hosts are replaced at once with empty RAM
disks; each rebuilds its rank's data from its code group's surviving data and parity, and the restore is
bit-exact.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from replicator.erasure.holder import RECORD_NAME, ParityRecord, shard_name
from sidecar import checksums, commit
from tests.kits.admin import mtc
from tests.kits.cluster import assert_equal, manager, redundant, save_steps, target, wait_for

pytestmark = pytest.mark.slow


def _parity_steps(cl, rank: int) -> list[int]:
    root = cl.ram(rank) / "parity"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


@pytest.mark.parametrize("nodes,k,m,lost", [(4, 3, 1, (1,)), (4, 2, 2, (0, 3))], ids=["3+1-one-lost", "2+2-two-lost"])
def test_hosts_replaced_together_rebuild_their_data_from_parity(cluster_factory, nodes, k, m, lost):
    cl = cluster_factory(nodes=nodes, data_parallelism=1, extra=["--redundancy", f"ec:{k}+{m}"])
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
    mgr.close()


def _record(cl, rank: int, step: int) -> tuple[Path, ParityRecord] | None:
    root = cl.ram(rank) / "parity" / str(step)
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if (d / RECORD_NAME).is_file():
            return d, ParityRecord.from_json((d / RECORD_NAME).read_bytes())
    return None


def test_a_corrupt_parity_block_is_passed_over_dropped_by_its_holder_and_computed_again(cluster_factory):
    """Bit rot in a parity shard that a rebuild needs: the restore is still bit-exact (the rebuild passes over
    it), the holder drops that parity when it finds it while serving, and the coordinator's next ParityTask
    computes it again: the step is redundant again with parity that verifies."""
    nodes, k, m, lost = 4, 2, 2, 1
    cl = cluster_factory(nodes=nodes, data_parallelism=1, extra=["--redundancy", f"ec:{k}+{m}"])
    cl.start_all()
    mgr = manager(cl, 1, nodes)
    trees = save_steps(mgr, [3], replicated_over_slices=False)
    wait_for(lambda: redundant(cl, 3), what="step 3 complete with all its parity held", timeout=90)
    _, rec = _record(cl, 0, 3)
    lay = rec.group.layout
    rotation = lay.data_rotation(lost, 0)
    holder = lay.holders(rotation)[lay.k]  # the first parity fragment: what the rebuild reads for stripe 0
    bad_dir, _ = _record(cl, holder, 3)
    shard = bad_dir / shard_name(rotation, 0)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x20
    shard.write_bytes(bytes(data))

    cl.procs[lost].signal(signal.SIGKILL)
    cl.procs[lost].wait()
    cl.wipe(lost)
    cl.start(lost)
    assert_equal(trees[3], mgr.restore(None, target(trees[3])))
    wait_for(lambda: 3 in commit.committed_steps(cl.ram(lost) / "steps"), timeout=60,
             what=f"host {lost} rebuilt its rank's step 3 from parity")

    def healed() -> bool:
        got = _record(cl, holder, 3)
        return got is not None and all(checksums.crc32c((got[0] / f.name).read_bytes()) == f.crc32c
                                       for f in got[1].files)

    wait_for(healed, timeout=90, what=f"host {holder} computed its parity of step 3 again")
    wait_for(lambda: redundant(cl, 3), timeout=90, what="step 3 redundant again")
    logs = (cl.base / "logs" / f"replicator-{holder}.log").read_text(errors="replace")
    assert f"bad parity of step 3 ({rec.digest}): shard {shard.name} stripe 0" in logs, logs[-3000:]
    mgr.close()
