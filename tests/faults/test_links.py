"""Lossy links, one-way and coordinator-only partitions, a host cut off mid-save and mid-restore, and a host
restarted while cut off (issue #33), on the fault rig (tests/kits/fault_rig.py): each case is fault -> keep
saving -> heal -> progress -> restore, checked by the history checker. ``make test-faults``; needs root.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.kits import faultnet
from tests.kits.fault_cluster import CANDIDATES, NODES
from tests.kits.fault_history import judge_cut_restore
from tests.kits.fault_rig import (
    CUT_SECONDS,
    HEARTBEAT_SECONDS,
    ISOLATED_AFTER_SECONDS,
    LOST_SECONDS,
    Rig,
    assert_passed,
    wait_for,
)

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(faultnet.available()), reason=faultnet.available() or "available")]

# While packets are lost (no partition), the job must keep going: every save and its daemon's acknowledgement
# within LOSSY_SAVE_SECONDS, no host declared lost, and the newest complete step at most LOSSY_LAG_STEPS
# behind the step saved 2 s earlier (TCP retransmits a lost heartbeat within its RTO, 0.2 s and up).
LOSSY_SAVE_SECONDS = 2.0
LOSSY_LAG_STEPS = 2
BIG_STEP_BYTES = 16 << 20
SLOW_MBIT = 20


@pytest.mark.parametrize("share", [0.15])
def test_a_lossy_link_on_one_host_keeps_saves_and_steps_going(rig: Rig, share: float) -> None:
    # Ranks 0 and 2 copy to each other over links without loss; host 1 restores across its lossy link.
    case = rig.run_case(f"lossy-one-host-{int(share * 100)}pct", lambda: rig.net.lossy(1, share), slow_only=True,
                        save_seconds_bound=LOSSY_SAVE_SECONDS, max_lag_steps=LOSSY_LAG_STEPS,
                        keep_up_ranks=(0, 2), fetch_rank=1)
    assert_passed(rig, case)


@pytest.mark.parametrize("share", [0.08])
def test_lossy_links_on_every_host_keep_saves_and_steps_going(rig: Rig, share: float) -> None:
    case = rig.run_case(f"lossy-all-hosts-{int(share * 100)}pct", lambda: rig.net.lossy_everywhere(share),
                        slow_only=True, save_seconds_bound=LOSSY_SAVE_SECONDS, max_lag_steps=LOSSY_LAG_STEPS,
                        keep_up_ranks=tuple(range(NODES)))
    assert_passed(rig, case)


def test_a_host_cut_from_the_coordinator_only_and_healed(rig: Rig) -> None:
    # Host 3 still reaches its data-parallel peer (host 1), the other candidate (host 2) and the controller.
    case = rig.run_case("host-cut-from-coordinator-only", lambda: rig.net.cut_between([3], [CANDIDATES[0]]))
    assert_passed(rig, case)


@pytest.mark.parametrize(("src", "dst"), [(0, 3), (3, 0)], ids=["host-deaf-to-coordinator",
                                                                "coordinator-deaf-to-host"])
def test_a_one_way_drop_between_the_coordinator_and_a_host(rig: Rig, src: int, dst: int) -> None:
    case = rig.run_case(f"one-way-{src}-to-{dst}", lambda: rig.net.one_way(src, dst))
    assert_passed(rig, case)


def test_a_host_cut_off_mid_save_and_healed(rig: Rig) -> None:
    """A 16 MiB step: ranks 0 and 1 write and notify it, then host 3 is cut before rank 2 writes it (rank 3
    writes it and notifies its daemon while cut off); the others save on."""
    big: list[int] = []

    def before_rank(rank: int, step: int) -> None:
        if big and step == big[0] and rank == 2:
            rig.net.cut(3)

    def fault() -> None:
        rig.trainer.before_rank = before_rank
        big.append(rig.trainer.step + 1)
        rig.trainer.save_next(nbytes=BIG_STEP_BYTES)
        rig.trainer.before_rank = None

    case = rig.run_case("host-cut-mid-save", fault)
    case.extra += rig.check_every_copy()
    assert_passed(rig, case)


def test_a_host_cut_off_mid_restore_and_healed(rig: Rig) -> None:
    """Host 3's link at 20 Mbit/s, then host 3 replaced (stopped, its RAM dir wiped, started again) after a
    16 MiB step is redundant; a restore of that step started, and host 3 cut once >= 1 MiB of its data landed from its
    peer. No saves during the cut (a restoring job does not train)."""
    big: list[int] = []
    proc: list[subprocess.Popen] = []

    def fetching() -> bool:
        tmp = list(rig.cluster.ram(3).glob(f"steps/.tmp-{big[0]}-*/**/*"))
        return sum(f.stat().st_size for f in tmp if f.is_file()) >= 1 << 20

    def fault() -> None:
        big.append(rig.trainer.save_next(nbytes=BIG_STEP_BYTES))
        wait_for(lambda: rig.redundant(big[0]), 60, f"step {big[0]} redundant")
        # Slowed first: the replaced daemon's first heartbeat may already carry its restore task (the newest
        # complete step to every host), and 16 MiB at full speed lands in ~0.05 s, before a later throttle.
        rig.net.throttle(3, SLOW_MBIT)
        rig.cluster.replace(3)
        proc.append(rig.cluster.restore_started(wait_seconds=60))
        wait_for(fetching, 60, f"host 3 fetching step {big[0]}", interval=0.05)
        rig.net.cut(3)

    def after_heal() -> None:
        # The restore started before the cut ends either way (its outcome is not the case's: the restore
        # after progress is); it must end, bounded.
        out, _ = proc[0].communicate(timeout=90)
        during["restore"] = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}

    during: dict = {}
    case = rig.run_case("host-cut-mid-restore", fault, after_heal=after_heal, train_during_fault=False)
    case.extra += rig.check_every_copy()
    case.extra += judge_cut_restore(during["restore"])
    print("restore started before the cut:", during)
    assert_passed(rig, case)


@pytest.mark.parametrize("rank", [3, 0], ids=["host", "coordinator-host"])
def test_a_host_restarted_while_cut_off_and_healed(rig: Rig, rank: int) -> None:
    """Host ``rank`` cut off with the others saving on; once it is declared lost its daemon is stopped (by
    pid) and started again with its RAM dir kept, still cut off; the heal 6 s after it listens again, and for
    the serving coordinator's host no sooner than :data:`CUT_SECONDS` after the cut, as in coordinator-host-cut:
    its successor answers clients only once it has declared the cut-off host lost (6 s after that host fell
    silent to it: about 7-8 s after the cut here; 10-13 s while the clock started at the takeover), and a restart
    that took 1 s healed the cut before any client could hear the successor. A probe started in its namespace right after
    the restart (a fresh channel: no reconnect backoff) asks it too."""
    fresh: list = []

    def fault() -> None:
        t_cut = time.monotonic()
        rig.net.cut(rank)
        rig.trainer.resume()
        time.sleep(LOST_SECONDS + 2 * HEARTBEAT_SECONDS)
        rig.cluster.daemons[rank].stop()
        rig.cluster.daemons[rank].start()
        fresh.append(rig.cluster.probe(rig.net.host_ns[rank], f"host{rank}-restarted",
                                       direct=rig.cluster.addresses[rank]))
        if rank == CANDIDATES[0]:  # run_case heals LOST_SECONDS after this returns
            time.sleep(max(0.0, t_cut + CUT_SECONDS - LOST_SECONDS - time.monotonic()))

    kw: dict = {}
    if rank == CANDIDATES[0]:
        kw = {"old_coordinator": rig.cluster.addresses[rank], "successor": rig.cluster.addresses[CANDIDATES[1]],
              "isolated_after": ISOLATED_AFTER_SECONDS}
    case = rig.run_case(f"restart-while-cut-{rank}", fault, cut_seconds=LOST_SECONDS, **kw)
    recs = fresh[0].records()
    case.client_streams.append([r for r in recs if r["who"] == "client"])
    case.direct += [r for r in recs if r["who"] != "client"]
    case.extra += rig.check_every_copy()
    assert_passed(rig, case)
