"""The coordinator codes one step at a time (``ParityView.coding_step``): of the steps newer than the newest one
with all its parity that every code group holds, the oldest whose coding started (some member holds its parity,
or a ParityTask of it was sent), else the newest; ParityTasks name only it, and GC keeps that step's data and
parity until every group has its parity. Found by tests/faults/test_erasure.py at 1 MiB/s over a 20 Mbit/s link (docs/testing.md, "Erasure
coding"): tasks went out for every new step, GC removed each step's data ``--keep-local`` steps later, and no
parity finished. The newest when none started: simulation seed 183 (oldest first coded every kept step in turn
after a stall, and the newest lacked parity after the quiet phase)."""

from __future__ import annotations

from replicator.coordinator.parity_answer import ParityOrders
from replicator.coordinator.planner import CoordinatorState
from replicator.coordinator.topology import JobTopology
from replicator.erasure.redundancy import Redundancy
from replicator.erasure.wire import CodeGroupSpec
from replicator.tiers import Holding, Tier

SIZE = 300
KEEP = 2  # --keep-local (the default)
ADDRESSES = {r: f"10.0.0.{r}:7070" for r in range(8)}


def ec_state(d: int = 2, h: int = 2, k: int = 3, m: int = 1) -> CoordinatorState:
    st = CoordinatorState(JobTopology(d * h, d, 0), Redundancy.ec(k, m))
    for r in range(d * h):
        st.register(r, 1)
        st.report_inventory(r, [], 1)
    return st


def save(st: CoordinatorState, step: int, ranks: range | list[int] | None = None) -> None:
    for r in ranks if ranks is not None else range(st.topology.nodes):
        st.report_committed(r, Holding(r, step, f"s{step}-r{r}", SIZE))


def tasks(st: CoordinatorState) -> dict[int, list[int]]:
    """rank -> the steps of its ParityTasks."""
    return {r: [s for s, _ in st.ec.tasks_for(r)] for r in range(st.topology.nodes)}


def finish(st: CoordinatorState, ranks: range | list[int] | None = None) -> None:
    """These holders compute and report the parity their tasks ask for."""
    for r in ranks if ranks is not None else range(st.topology.nodes):
        for step, spec in st.ec.tasks_for(r):
            st.report_committed(r, Holding(r, step, spec.digest(), 100, Tier.PARITY, group=spec))


def gc(st: CoordinatorState) -> list[tuple[int, int, str]]:
    """Every host deletes what GC releases (data and parity) and reports it: (holder, step, kind) deleted."""
    out = []
    for r in range(st.topology.nodes):
        data, parity = st.gc_for(r, KEEP), st.ec.gc_for(r, KEEP)
        st.report_removed(r, data)
        st.ec.report_removed(r, [h.step for h in parity])
        out += [(r, s, "data") for _, s in data] + [(r, h.step, "parity") for h in parity]
    return sorted(out)


def test_one_step_is_coded_at_a_time_the_newest_unless_one_is_started():
    st = ec_state()
    for step in (1, 2, 3):
        save(st, step)
    assert st.ec.coding_step() == 3
    assert tasks(st) == {r: [3] for r in range(4)}  # not steps 1 and 2 as well
    finish(st)
    assert st.newest_redundant_step() == 3 and st.ec.coding_step() is None  # 1 and 2 are passed over
    save(st, 4)
    finish(st, [0])  # step 4's coding started ...
    save(st, 5)
    assert st.ec.coding_step() == 4 and tasks(st) == {0: [], 1: [4], 2: [4], 3: [4]}  # ... so it is finished first
    finish(st)
    assert st.newest_redundant_step() == 4 and st.ec.coding_step() == 5


def test_after_a_stall_the_newest_step_is_coded_next_not_each_step_held_meanwhile():
    """Simulation seed 183: host 2's ParityTask of step 2 was lost and asked again 20 s later; steps 3 and 4
    were saved meanwhile. Once step 2 has its parity the next step coded is 4, the newest (oldest first coded 3
    and then 4, and the quiet phase ended before step 4 had its parity)."""
    st = ec_state()
    save(st, 2)
    finish(st, [0, 1, 3])  # host 2's task answer lost
    save(st, 3)
    save(st, 4)
    assert st.ec.coding_step() == 2 and tasks(st) == {0: [], 1: [], 2: [2], 3: []}
    finish(st, [2])  # asked again
    assert st.ec.coding_step() == 4 and tasks(st) == {r: [4] for r in range(4)}


def test_the_coding_step_is_kept_while_slow_parity_runs_and_newer_saves_are_passed_over():
    """The defect's schedule: steps saved every second, each host's parity slower than --keep-local saves."""
    st = ec_state()
    save(st, 1)
    finish(st)
    save(st, 2)
    assert tasks(st) == {r: [2] for r in range(4)}
    finish(st, [0, 2])  # two holders are done with step 2; 1 and 3 read across the slow link
    for step in (3, 4, 5, 6):
        save(st, step)
        deleted = gc(st)
        # Step 2 (coding) and step 1 (newest redundant) stay, data and parity; the old-enough others go.
        assert not [d for d in deleted if d[1] in (1, 2)], deleted
        assert st.ec.coding_step() == 2 and tasks(st) == {0: [], 1: [2], 2: [], 3: [2]}
    assert {h.step for r in range(4) for h in st.holdings_of(r)} == {1, 2, 5, 6}  # 3 and 4: passed over
    finish(st, [1, 3])
    assert st.newest_redundant_step() == 2
    # The next step coded is the newest (6), not the deleted 3 and 4 nor the kept 5.
    assert st.ec.coding_step() == 6 and tasks(st) == {r: [6] for r in range(4)}
    assert gc(st) == [(r, 1, kind) for r in range(4) for kind in ("data", "parity")]  # step 1 is not needed now
    finish(st)
    assert st.newest_redundant_step() == 6 and st.ec.coding_step() is None


def test_the_step_being_coded_is_kept_beyond_keep_local_and_the_steps_after_it_are_not():
    st = ec_state()
    save(st, 1)
    finish(st)
    save(st, 2)
    finish(st, [0])  # coding of step 2 started
    for step in (3, 4, 5):
        save(st, step)
    assert st.ec.coding_step() == 2
    # Each host keeps steps 4 and 5 (--keep-local 2), 1 (the newest redundant) and 2 (being coded); not 3.
    assert [st.gc_for(r, KEEP) for r in range(4)] == [[(r, 3)] for r in range(4)]


def test_no_coding_step_while_a_member_lacks_the_step_and_parity_resumes_once_it_holds_one():
    st = ec_state()
    save(st, 1)
    finish(st)
    st.forget_host(3)  # lost: its rank saves nothing more
    save(st, 2, [0, 1, 2])
    assert st.ec.coding_step() is None and tasks(st) == {r: [] for r in range(4)}
    st.register(3, 2)  # replaced, empty: it restores step 1 (rebuilt), then saves on
    st.report_inventory(3, [Holding(3, 1, "s1-r3", SIZE)], 2)
    save(st, 3)
    assert st.ec.coding_step() == 1  # rank 3's parity of step 1 went with its host: step 1 (started) first
    assert tasks(st) == {0: [], 1: [], 2: [], 3: [1]}
    finish(st)
    assert st.ec.coding_step() == 3  # step 2 is passed over: rank 3 never saved it


def test_an_abandoned_step_is_not_coded():
    st = ec_state()
    save(st, 1)
    finish(st)
    save(st, 2)
    save(st, 3)
    for r in range(4):  # the job rolled back to step 1 and saved step 2 again: step 3 is abandoned
        st.report_committed(r, Holding(r, 2, f"s2-r{r}-again", SIZE, generation=1))
    assert st.ec.coding_step() == 2
    finish(st)
    assert st.ec.coding_step() is None


def test_the_coding_step_is_the_same_on_a_restarted_coordinator():
    st = ec_state()
    for step in (1, 2, 3):
        save(st, step)
    finish(st, [0, 1])
    save(st, 4)
    again = st.rebuilt()
    assert again.ec.coding_step() == st.ec.coding_step() == 3
    assert tasks(again) == tasks(st) == {0: [], 1: [], 2: [3], 3: [3]}
    assert all(again.gc_for(r, KEEP) == st.gc_for(r, KEEP) for r in range(4))


def test_parity_orders_send_only_the_coding_step_and_not_again_while_it_runs():
    st = ec_state()
    orders = ParityOrders()
    for step in (1, 2):
        save(st, step)
    sent = orders.tasks(st, 1, now=0.0, retry_seconds=20.0, addresses=ADDRESSES)
    assert [t.step for t in sent] == [2]
    spec = CodeGroupSpec.from_proto(sent[0].group)
    assert spec.addresses == tuple(ADDRESSES[r] for r in spec.members)
    finish(st, [0])  # another member's parity of step 2 is in: its coding started
    save(st, 3)
    assert orders.tasks(st, 1, now=1.0, retry_seconds=20.0, addresses=ADDRESSES) == []  # still running
    assert [t.step for t in orders.tasks(st, 1, now=21.0, retry_seconds=20.0, addresses=ADDRESSES)] == [2]
    finish(st)
    assert [t.step for t in orders.tasks(st, 1, now=22.0, retry_seconds=20.0, addresses=ADDRESSES)] == [3]


def test_a_step_saved_before_any_parity_of_the_one_asked_for_is_in_does_not_start_a_second_coding():
    """ec-3+1-slow-link (20 Mbit/s, a step a second): the ParityTasks of step 2 went out at hosts' heartbeats,
    step 3 was saved by all before any holder had finished step 2. The hosts asked later must code step 2 too:
    before, "started" meant only a parity reported, step 3 became the coding step, and the holders asked at later
    heartbeats coded step 3 beside step 2 (two steps at once across the slow link, parity lagging 3 steps)."""
    st = ec_state()
    orders = ParityOrders()
    save(st, 1)
    finish(st)
    save(st, 2)
    first = orders.tasks(st, 0, now=0.0, retry_seconds=20.0, addresses=ADDRESSES)
    assert [t.step for t in first] == [2]
    save(st, 3)
    assert st.ec.coding_step() == 2
    for r in (1, 2, 3):
        assert [t.step for t in orders.tasks(st, r, now=0.5, retry_seconds=20.0, addresses=ADDRESSES)] == [2]
    finish(st)
    assert st.newest_redundant_step() == 2 and st.ec.coding_step() == 3
    assert {r: [t.step for t in orders.tasks(st, r, now=1.0, retry_seconds=20.0, addresses=ADDRESSES)]
            for r in range(4)} == {r: [3] for r in range(4)}


def test_copies_mode_has_no_coding_step():
    st = CoordinatorState(JobTopology(4, 2, 1))
    for r in range(4):
        st.register(r, 1)
        st.report_inventory(r, [], 1)
    save(st, 1)
    assert st.ec.coding_step() is None and tasks(st) == {r: [] for r in range(4)}
