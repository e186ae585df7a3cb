"""Network faults on a test network of its own (issue #33): partitions made with iptables DROP rules and slow
links with ``tc tbf``, each healed and then checked by the history checker. The rig and what every case
does are in tests/kits/fault_rig.py. ``make test-faults``; needs root.
"""

from __future__ import annotations

import pytest

from tests.kits import faultnet
from tests.kits.fault_cluster import CANDIDATES, NODES
from tests.kits.fault_history import Case
from tests.kits.fault_rig import ISOLATED_AFTER_SECONDS, Rig, assert_passed, wait_for

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(bool(faultnet.available()), reason=faultnet.available() or "available")]


def test_coordinator_host_cut_off_fails_over_and_the_old_coordinator_stays_silent(rig: Rig) -> None:
    old, successor = (rig.cluster.addresses[r] for r in CANDIDATES)
    case = rig.run_case("coordinator-host-cut", lambda: rig.net.cut(0), old_coordinator=old,
                        successor=successor, isolated_after=ISOLATED_AFTER_SECONDS)
    assert_passed(rig, case)


def test_the_two_slices_cut_from_each_other_and_healed(rig: Rig) -> None:
    # Each side keeps a coordinator (candidate 0 still hears host 1; candidate 2 takes over for slice 1);
    # after the heal the epoch fence leaves one. Neither side's answers may go backwards, nor lose a step.
    case = rig.run_case("slices-cut", lambda: rig.net.cut_between([0, 1], [2, 3]))
    assert_passed(rig, case)


BIG_STEP_BYTES = 16 << 20
SLOW_MBIT = 20


def _cut_mid_copy(rig: Rig, train_during_fault: bool) -> Case:
    """Host 3's link slowed to 20 Mbit/s, a 16 MiB step saved, host 3 cut once a peer copy of it is under
    way (the step is complete, host 3's data of it on host 3 alone)."""
    big: list[int] = []

    def in_flight() -> bool:
        tmp = [f for r in range(NODES) for f in rig.cluster.ram(r).glob(f"peer/*/.tmp-{big[0]}-*/**/*")]
        return sum(f.stat().st_size for f in tmp if f.is_file()) >= 1 << 20

    def fault() -> None:
        rig.net.throttle(3, SLOW_MBIT)
        big.append(rig.trainer.save_next(nbytes=BIG_STEP_BYTES))
        wait_for(in_flight, 30, f"a peer copy of step {big[0]} under way", interval=0.05)
        rig.net.cut(3)

    name = "host-cut-mid-copy" + ("-training-on" if train_during_fault else "")
    case = rig.run_case(name, fault, train_during_fault=train_during_fault)
    case.unreplicated = big[0]  # complete only while host 3, holding its data alone, was heard from
    case.extra += rig.check_every_copy()
    return case


def test_a_host_cut_off_in_the_middle_of_a_peer_copy_and_healed(rig: Rig) -> None:
    # A synchronous job stalls while one of its hosts is unreachable: no save during the cut.
    assert_passed(rig, _cut_mid_copy(rig, train_during_fault=False))


def test_a_host_cut_off_mid_copy_while_the_others_save_on_keeps_the_last_redundant_step(rig: Rig) -> None:
    assert_passed(rig, _cut_mid_copy(rig, train_during_fault=True))


def test_a_slow_link_stalls_no_save_and_no_other_host(rig: Rig) -> None:
    """Host 1's link at 20 Mbit/s while every host saves 4 MiB a second (more than the link carries)."""
    def fault() -> None:
        rig.net.throttle(1, SLOW_MBIT)
        rig.trainer.nbytes = 4 << 20

    def after_heal() -> None:
        rig.trainer.nbytes = 64 << 10

    # Ranks 0 and 2 copy to each other off the slow link (ranks 1 and 3 copy across it); host 1 restores
    # across it.
    case = rig.run_case("slow-link", fault, after_heal=after_heal, slow_only=True, keep_up_ranks=(0, 2),
                        fetch_rank=1)
    assert_passed(rig, case)
