"""Replica identity survives the loss of either party: real replicator processes on 127.0.0.1 (issue #19).

4 hosts in 2 slices; the state is replicated over the slices, so rank 0's data is byte-identical to rank 2's
and rank 1's to rank 3's (recorded by content hash, no bytes copied). Host 0 (the coordinator's host) is
replaced with an empty RAM disk and restores rank 0's data from rank 2's: it keeps it as a copy of rank 2's
directory. Then slice 1 (hosts 2 and 3) is replaced: the only host that attested rank 0 == rank 2 is gone,
yet hosts 0 and 1 hold every byte of the step, so the coordinator must still count it complete (before the
fix: no complete step at all, ``latest_step()`` None, although an explicit restore was bit-exact).

The sibling (issue #33, "lost replica identity"): a copy of one replica's data on a third host witnesses the
other replica, so the identity survives when both replicas' hosts are replaced.
"""

from __future__ import annotations

import json
import signal

import grpc
import pytest

from replicator.local.store import REPLICA_FILE
from sidecar import checksums, commit
from tests.kits.cluster import assert_equal, manager, redundant, save_steps, status, target, wait_for

pytestmark = pytest.mark.slow


def _attested(cl, rank: int) -> list[list[int]]:
    """(owner, step) pairs host ``rank`` recorded as byte-identical to data it holds (its replica-of.json)."""
    try:
        return [[o, s] for o, s, _ in json.loads((cl.ram(rank) / REPLICA_FILE).read_text())]
    except (OSError, ValueError):
        return []


def test_restored_host_keeps_the_replica_proof_when_the_replica_slice_is_replaced(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=2)
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [3, 4])
    wait_for(lambda: redundant(cl, 4), what="step 4 redundant", timeout=60)
    for r in range(4):  # identical replicas: verified by hash, no byte copy anywhere
        assert not list((cl.ram(r) / "peer").glob("*/4")), f"host {r} holds a byte copy"
    # "Redundant" counts rank 0's data twice as soon as host 2's own step has its hash; what outlives host 0 and
    # the coordinator's restart is host 2's record of that (its hash-only task), which may land later under
    # load (make test twice restored step 3: host 0 was replaced before host 2 recorded step 4's identity).
    wait_for(lambda: [0, 4] in _attested(cl, 2), timeout=30, what="host 2 records rank 0's step 4 as its own")

    # Host 0 (the coordinator's) replaced with an empty RAM disk; it restores from its replica (rank 2).
    cl.procs[0].kill()
    cl.wipe(0)
    cl.start(0)
    assert_equal(trees[4], mgr.restore(None, target(trees[4])))
    # The restore may have read rank 2's data through the replicator while host 0's own restore task was
    # still landing it (the read does not wait for the landing): wait for the kept copy, bounded.
    wait_for(lambda: 4 in commit.committed_steps(cl.ram(0) / "peer" / "2"), timeout=30,
             what="rank 0 restored from rank 2's data and kept as its copy")
    assert commit.committed_steps(cl.ram(0) / "steps") == []
    mgr.close()

    # Slice 1 replaced: the host that attested rank 0 == rank 2 is gone, and so is rank 2's own copy.
    before = {h.rank: h.incarnation for h in status(cl, hosts=True).hosts}
    for r in (2, 3):
        cl.procs[r].signal(signal.SIGKILL)
    for r in (2, 3):
        cl.procs[r].wait()
        cl.wipe(r)
    for r in (2, 3):
        cl.start(r)

    def newest_complete():
        st = status(cl, hosts=True)
        new = {h.rank for h in st.hosts if h.inventory_reported and h.incarnation != before.get(h.rank)}
        old = {h.rank for h in st.hosts if h.inventory_reported and h.rank in (0, 1)}
        return st.newest_complete_step if new >= {2, 3} and old == {0, 1} else None

    # Every host reported (the new slice with empty RAM disks): step 4 is still complete.
    assert wait_for(newest_complete, what="every host reported, step 4 complete", timeout=30) == 4
    mgr = manager(cl, 2, 2)  # a fresh manager, as after a job restart
    assert mgr.latest_step() == 4
    assert_equal(trees[4], mgr.restore(None, target(trees[4])))
    checksums.verify_step_dir(cl.ram(2) / "steps" / "4")  # rank 2 refilled from host 0's copy of its data
    # And the job goes on: the next save becomes complete and redundant again.
    trees.update(save_steps(mgr, [5]))
    wait_for(lambda: mgr.latest_step() == 5, what="step 5 complete", timeout=60)
    wait_for(lambda: redundant(cl, 4) and redundant(cl, 5), what="steps 4 and 5 redundant", timeout=60)
    mgr.close()


def test_a_copy_of_a_replicas_data_keeps_the_identity_when_both_replicas_hosts_are_replaced(cluster_factory):
    cl = cluster_factory(nodes=4, data_parallelism=2, extra=["--host-lost-seconds", "2"])
    cl.start_all()
    mgr = manager(cl, 2, 2)
    trees = save_steps(mgr, [4])
    wait_for(lambda: redundant(cl, 4), what="step 4 redundant", timeout=60)
    mgr.close()

    # Host 3 (rank 3's data == rank 1's, recorded by hash on hosts 1 and 3) is lost: rank 1's data is copied
    # to host 2, which also records itself as a witness of rank 3 (the same bytes).
    cl.procs[3].signal(signal.SIGKILL)
    cl.procs[3].wait()
    cl.wipe(3)
    wait_for(lambda: 4 in commit.committed_steps(cl.ram(2) / "peer" / "1"), timeout=60,
             what="host 2 holds a copy of rank 1's step 4")

    def witnessed():
        try:
            return [[o, s] for o, s, _ in json.loads((cl.ram(2) / REPLICA_FILE).read_text())]
        except (OSError, ValueError):
            return []
    wait_for(lambda: [3, 4] in witnessed(), timeout=30, what="host 2 witnesses rank 3's step 4")

    def is_redundant():
        try:
            return redundant(cl, 4)
        except grpc.RpcError:
            return False
    wait_for(is_redundant, what="step 4 redundant again without host 3", timeout=60)

    # Host 1 replaced too: host 2's witness is the only record that its copy is rank 3's data as well.
    before = {h.rank: h.incarnation for h in status(cl, hosts=True).hosts}
    cl.procs[1].signal(signal.SIGKILL)
    cl.procs[1].wait()
    cl.wipe(1)
    cl.start_many([1, 3])

    def newest_complete():
        try:
            st = status(cl, hosts=True)
        except grpc.RpcError:
            return None
        new = {h.rank for h in st.hosts if h.inventory_reported and h.incarnation != before.get(h.rank)}
        return st.newest_complete_step if new >= {1, 3} else None

    assert wait_for(newest_complete, what="every host reported, step 4 complete", timeout=30) == 4
    mgr = manager(cl, 2, 2)  # a fresh manager, as after a job restart
    assert mgr.latest_step() == 4
    assert_equal(trees[4], mgr.restore(None, target(trees[4])))
    mgr.close()
