"""The coordinator state's erasure-coding side (``--redundancy ec:K+M``): the redundancy setting checked against
the topology, and the queries the service answers hosts with (parity tasks, parity GC, rebuildable ranks).
Part of :class:`~replicator.coordinator.planner.CoordinatorState` (its :attr:`ec`); the rules are in
:mod:`~replicator.coordinator.parity` and :mod:`~replicator.coordinator.gc_plan`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from replicator.coordinator import gc_plan
from replicator.coordinator.coverage import Coverage
from replicator.coordinator.facts import Facts
from replicator.coordinator.parity import ParityView
from replicator.coordinator.topology import JobTopology
from replicator.erasure.redundancy import Redundancy
from replicator.erasure.wire import CodeGroupSpec
from replicator.tiers import Holding, check_int


def checked_redundancy(topology: JobTopology, redundancy: Redundancy | None, elastic: bool = False) -> Redundancy:
    """The job's redundancy (None: ``copies:<topology.replicas>``), checked against the topology: ValueError
    for copies:N other than the topology's replicas, and for ec:K+M on fewer than K + M hosts or an elastic job."""
    if redundancy is None:
        return Redundancy.copies_of(topology.replicas)
    if not isinstance(redundancy, Redundancy):
        raise ValueError(f"redundancy must be a Redundancy, got {type(redundancy).__name__}")
    if not redundancy.is_ec:
        if redundancy.copies != topology.replicas:
            raise ValueError(f"redundancy {redundancy} contradicts the topology's {topology.replicas} replicas")
        return redundancy
    if elastic:
        raise ValueError(f"--redundancy {redundancy}: erasure coding codes groups of the whole job and does not "
                         f"support elastic training (savers subsets, changing node counts); use copies:N")
    if topology.nodes < redundancy.min_hosts:
        raise ValueError(f"--redundancy {redundancy} needs at least {redundancy.min_hosts} hosts (K + M); the job "
                         f"has {topology.nodes} ({topology.data_parallelism} slice(s) x {topology.hosts_per_slice})")
    return redundancy


class ErasureCoding:
    """The erasure-coding events and queries of one :class:`CoordinatorState` (queries inert in copies mode),
    memoised per version of its facts like its other whole answers. ``check_reporter(rank, incarnation)``: the
    state's check that a report comes from the registered process of ``rank``."""

    def __init__(self, facts: Facts, coverage: Coverage, view: ParityView, memos: Callable[[], dict[Any, Any]],
                 check_reporter: Callable[[int, int | None], None]):
        self._facts = facts
        self._coverage = coverage
        self._view = view
        self._memos = memos
        self._check_reporter = check_reporter

    # ------------------------------------------------------------------------------------------ events
    # (a parity holding itself is reported like any other: CoordinatorState.report_inventory / report_committed)

    def report_removed(self, rank: int, steps: Iterable[int], incarnation: int | None = None) -> None:
        """Host ``rank`` deleted its parity of these steps; unknown ones are ignored."""
        self._check_reporter(rank, incarnation)
        for step in [check_int("step", s) for s in steps]:
            self._facts.remove_parity(rank, step)

    def deleting(self, holder: int, steps: Iterable[int]) -> None:
        """This coordinator ordered host ``holder`` to delete its parity of these steps: it counts for nothing
        until the holder's next accepted report (``CoordinatorState.deletions_acted``), as data does."""
        self._facts.mark_deleting_parity(holder, steps)

    def deletions_in_flight(self) -> dict[int, list[int]]:
        """holder -> steps whose parity deletion is in flight."""
        return {r: sorted(steps) for r, steps in sorted(self._facts.parity_deleting.items())}

    # ----------------------------------------------------------------------------------------- queries

    @property
    def enabled(self) -> bool:
        return self._view.enabled

    def coding_step(self) -> int | None:
        """The step whose parity the code groups compute now (:meth:`ParityView.coding_step`); None when there is
        none, and in copies mode."""
        return self._coverage.coding_step()

    def tasks_for(self, holder: int) -> list[tuple[int, CodeGroupSpec]]:
        """(step, code group without addresses) of the parity host ``holder`` must compute: of the coding step
        (:meth:`coding_step`, every member of every code group holds it LOCAL), when ``holder``'s parity of it is
        not of their data; at most one. [] in copies mode."""
        if not self._view.enabled:
            return []
        memo = self._memos()
        key = ("parity", holder)
        if key not in memo:
            memo[key] = self._view.tasks_for(holder, self.coding_step())
        return list(memo[key])

    def asked(self, step: int) -> None:
        """A ParityTask of ``step`` was sent (:meth:`ParityView.asked`): the step stays the coding step until its
        parity is complete."""
        self._view.asked(step)

    def asked_steps(self) -> list[int]:
        """The steps a ParityTask of which was sent (this coordinator's own record, not derived from reports)."""
        return self._view.asked_steps()

    def gc_for(self, holder: int, keep_local: int) -> list[Holding]:
        """The parity host ``holder`` may delete (:func:`gc_plan.parity_gc_for`)."""
        check_int("keep_local", keep_local, 1)
        self._coverage.refresh()
        memo = self._memos()
        key = ("parity-gc", holder, keep_local)
        if key not in memo:
            memo[key] = gc_plan.parity_gc_for(self._facts, self._coverage, self._view.counts, holder, keep_local)
        return list(memo[key])

    def counts(self, holder: int, step: int) -> bool:
        """``holder``'s parity of ``step`` counts (of the step's current data, not corrupt, not being deleted)."""
        return self._view.counts(holder, step)

    def rebuild_ranks(self, step: int) -> list[int]:
        """Ranks of ``step`` whose data no host holds and that can be rebuilt from parity ([] in copies mode)."""
        check_int("step", step)
        return self._view.rebuild_ranks(step) if self._view.enabled else []

    def parity_complete(self, step: int) -> bool:
        """Every code group of ``step`` holds all its parity (False in copies mode)."""
        return self._view.redundant(check_int("step", step))

    def parity_of(self, rank: int) -> list[Holding]:
        """The parity host ``rank`` reported holding, by step."""
        self._facts.topology.check_rank(rank)
        return [h for _, h in sorted(self._facts.parity.get(rank, {}).items())]
