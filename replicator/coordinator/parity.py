"""Erasure coding in the coordinator's view (``--redundancy ec:K+M``, docs/peer.md "Erasure coding"). Part of
:class:`~replicator.coordinator.planner.CoordinatorState`; pure, derived from
:class:`~replicator.coordinator.facts.Facts` only.

Per step and code group (:func:`replicator.erasure.placement.code_groups`, the same for every step),
:class:`GroupView` says which parity still counts, which member lacks its parity, and whether a member whose data
is on no host can be rebuilt:

- a parity holding *counts* when its group is the job's code group (same K, M and members in the same order),
  its content hash is the group's digest (else it is corrupt), and no member holds current LOCAL data of the step
  with another hash than the group's (else a re-save made it obsolete). Parity that does not count is deleted.
- the *planned* group exists once every member holds the step LOCAL: its spec names their hashes, and each member
  whose parity is not of that spec gets a ParityTask.
- a rank x is *rebuildable* from a spec when each of the K rotations x gives data to has at least K intact
  fragments: a data fragment of member y (y not x) is intact when y holds LOCAL data of the step with the spec's
  hash for y; a parity fragment held by y is intact when y's parity of the step that counts has the spec's digest.

One step is coded at a time (:meth:`ParityView.coding_step`): among the steps newer than the newest one with all
its parity of which every code group has its planned group, the oldest one whose coding started (some member
holds parity of it that counts, or this coordinator sent a ParityTask for it: :meth:`ParityView.asked`), else
the newest. ParityTasks name only that step, and GC keeps it (``gc_plan``) until its parity is
complete. Found by tests/faults/test_erasure.py (docs/testing.md, "Erasure coding"): when tasks went out for every
new step and GC removed a step's data ``--keep-local`` steps later, parity that took longer than that (a link near
its capacity) never completed, and each newer task only slowed the others. The newest when none is started, not
the oldest: after a stall (a task's answer lost, asked again 20 s later) the oldest-first rule coded every step
held meanwhile in turn before the newest (simulation seed 183: the newest step lacked parity after the quiet phase).
A task sent starts the step, not only a parity reported: else a step saved before any member finished turned the
coding step to it, members asked at later heartbeats coded that one beside the first, and across a link near its
capacity (ec-3+1-slow-link) every holder coded two steps at once, half of them deleted unfinished or obsolete.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping

from replicator.coordinator.facts import Facts
from replicator.erasure.group import GroupLayout
from replicator.erasure.wire import CodeGroupSpec
from replicator.tiers import Tier


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """How one rank's data of a step can be rebuilt: from ``spec`` (addresses empty), reading the intact
    fragments that ``helpers`` (members, ascending) hold."""

    spec: CodeGroupSpec
    helpers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One code group of one step as the reports show it (see the module docstring)."""

    layout: GroupLayout
    local: Mapping[int, str]  # member -> content hash of its current LOCAL data of the step
    parity: Mapping[int, str]  # member -> digest of its parity of the step that counts
    specs: Mapping[str, CodeGroupSpec]  # digest -> group of parity that counts
    planned: CodeGroupSpec | None  # every member holds the step LOCAL: the group its parity must be of

    @functools.cached_property
    def missing(self) -> tuple[int, ...]:
        """Members lacking parity of the planned group (none while some member lacks the step)."""
        if self.planned is None:
            return ()
        want = self.planned.digest()
        return tuple(y for y in self.layout.members if self.parity.get(y) != want)

    @property
    def redundant(self) -> bool:
        """Every member holds the step and its parity of the planned group."""
        return self.planned is not None and not self.missing

    def rebuild(self, rank: int, want: str | None, without: int | None = None) -> Rebuild | None:
        """How ``rank``'s data can be rebuilt (from the spec most parity holders agree on that works), or None.
        ``want``: the rank's definitive content hash when one is known (a spec naming another is passed over).
        ``without``: as if that member held nothing (whether the step survives its loss)."""
        layout, k = self.layout, self.layout.k
        votes = collections.Counter(self.parity.values())
        for digest, spec in sorted(self.specs.items(), key=lambda kv: (-votes[kv[0]], kv[0])):
            if want is not None and spec.hash_of(rank) != want:
                continue
            helpers: set[int] = set()
            for j in range(k):
                holders = layout.holders(layout.data_rotation(rank, j))
                intact = [y for i, y in enumerate(holders) if y != rank and y != without and (
                    self.local.get(y) == spec.hash_of(y) if i < k else self.parity.get(y) == digest)]
                if len(intact) < k:
                    break
                helpers.update(intact)
            else:
                return Rebuild(spec, tuple(sorted(helpers)))
        return None


class ParityView:
    """Per (step, code group) its :class:`GroupView`, kept incrementally: a change to a member's data or parity
    marks its code group dirty for that step (``Facts.ec_dirty``) and the next query re-derives just those. So
    is, per step, the set of code groups lacking some parity (redundancy is asked on every GC answer)."""

    def __init__(self, facts: Facts):
        self._facts = facts
        self._views: dict[int, dict[int, GroupView]] = {}  # step -> code group -> view
        self._lacking: dict[int, set[int]] = {}  # step -> code groups not holding all their parity
        self._unplanned: dict[int, set[int]] = {}  # step -> code groups some member of which lacks the step
        self._started: dict[int, set[int]] = {}  # step -> code groups some member of which holds parity that counts
        self._asked: set[int] = set()  # steps a ParityTask of which this coordinator sent (asked)

    @property
    def enabled(self) -> bool:
        """Erasure coding is on (the job has code groups)."""
        return bool(self._facts.code_groups)

    def clear(self) -> None:
        """Forget what is derived from the facts (re-derived on the next query). What this coordinator asked for
        (:meth:`asked`) is no view but its own record, kept."""
        self._views.clear()
        self._lacking.clear()
        self._unplanned.clear()
        self._started.clear()

    def refresh(self) -> None:
        """Re-derive the code groups that changed since the last refresh."""
        facts = self._facts
        if not facts.ec_dirty:
            return
        dirty, facts.ec_dirty = facts.ec_dirty, {}
        every = range(len(facts.code_groups))
        for step, groups in dirty.items():
            if not facts.has_step(step):
                self._views.pop(step, None)
                self._lacking.pop(step, None)
                self._unplanned.pop(step, None)
                self._started.pop(step, None)
                self._asked.discard(step)
                continue
            views = self._views.setdefault(step, {})
            lacking = self._lacking.setdefault(step, set(every))  # a new step: no group has its parity
            unplanned = self._unplanned.setdefault(step, set(every))  # nor has every member of a group saved it
            started = self._started.setdefault(step, set())
            for gi in groups:
                view = views[gi] = self._derive(step, facts.code_groups[gi])
                if view.parity:
                    started.add(gi)
                else:
                    started.discard(gi)
                if view.redundant:
                    lacking.discard(gi)
                else:
                    lacking.add(gi)
                if view.planned is None:
                    unplanned.add(gi)
                else:
                    unplanned.discard(gi)

    def group(self, step: int, gi: int) -> GroupView:
        """Code group ``gi`` of ``step``."""
        self.refresh()
        views = self._views.setdefault(step, {})
        view = views.get(gi)
        if view is None:  # never changed since its step appeared (or no member holds anything of it)
            view = views[gi] = self._derive(step, self._facts.code_groups[gi])
        return view

    def group_of(self, step: int, rank: int) -> GroupView | None:
        gi = self._facts.code_group_of.get(rank)
        return None if gi is None else self.group(step, gi)

    def rebuild(self, step: int, rank: int, want: str | None, without: int | None = None) -> Rebuild | None:
        """How ``rank``'s data of ``step`` can be rebuilt from its code group, or None (see :meth:`GroupView.rebuild`)."""
        view = self.group_of(step, rank)
        return None if view is None else view.rebuild(rank, want, without)

    def redundant(self, step: int) -> bool:
        """Every code group of ``step`` has all its parity (ec mode; False in copies mode). O(1)."""
        self.refresh()
        lacking = self._lacking.get(step)
        return self.enabled and lacking is not None and not lacking

    def rebuild_ranks(self, step: int) -> list[int]:
        """Ranks whose data of ``step`` no host holds and that can be rebuilt (a cheap view for status)."""
        facts = self._facts
        out = []
        for gi, layout in enumerate(facts.code_groups):
            view = self.group(step, gi)
            out.extend(x for x in layout.members if x not in view.local and view.rebuild(x, None) is not None)
        return sorted(out)

    def coding_step(self, newest_redundant: int | None) -> int | None:
        """The step whose parity the code groups compute now, among the steps newer than ``newest_redundant`` (the
        newest step every code group of which has all its parity; None: no step has) of which every member of every
        code group holds its current data, not abandoned: the oldest one whose coding started (some member holds
        parity of it that counts, or a ParityTask of it was sent: :meth:`asked`), else the newest. None: there is
        no such step. O(steps).

        The same for every group, and once started it stays the step to code (GC keeps it) until every group has
        its parity, however long that takes (a slow link, a holder retried): each step started is finished, and
        the job's newest redundant step advances by whole steps (groups coding different steps would never give
        one). Steps saved meanwhile and not kept are passed over, and so are those kept: the next step coded is
        the newest (module docstring, seed 183)."""
        self.refresh()
        newest = None
        for step in sorted(self._unplanned):
            if newest_redundant is not None and step <= newest_redundant:
                continue
            if self._unplanned[step] or self._facts.is_abandoned(step):
                continue
            if self._started.get(step) or step in self._asked:
                return step
            newest = step
        return newest

    def tasks_for(self, holder: int, step: int | None) -> list[tuple[int, CodeGroupSpec]]:
        """[(``step``, its planned group)] when ``holder`` must compute its parity of ``step`` (the coding step),
        else []."""
        gi = self._facts.code_group_of.get(holder)
        if gi is None or step is None or self._facts.is_abandoned(step):
            return []
        view = self.group(step, gi)
        return [(step, view.planned)] if view.planned is not None and holder in view.missing else []

    def asked(self, step: int) -> None:
        """A ParityTask of ``step`` was sent: its coding started (it stays the coding step until it is redundant,
        abandoned or gone, as when a member's parity of it counts)."""
        if self._facts.has_step(step):
            self._asked.add(step)

    def asked_steps(self) -> list[int]:
        """The steps (still known) a ParityTask of which was sent, ascending."""
        return sorted(self._asked)

    def counts(self, holder: int, step: int) -> bool:
        """``holder``'s parity of ``step`` (not being deleted) counts; False when it holds none or it is obsolete."""
        view = self.group_of(step, holder)
        return view is not None and holder in view.parity

    def _derive(self, step: int, layout: GroupLayout) -> GroupView:
        facts = self._facts
        by_owner = facts.index.get(step, {})
        local: dict[int, str] = {}
        for y in layout.members:
            h = by_owner.get(y, {}).get(y)
            if h is not None and h.tier is Tier.LOCAL and facts.current(h):
                local[y] = h.content_hash
        parity: dict[int, str] = {}
        specs: dict[str, CodeGroupSpec] = {}
        held = facts.parity_index.get(step, {})
        for y in layout.members:
            h = held.get(y)
            if h is None or h.group is None:
                continue
            g = h.group
            if (g.k, g.m, g.members) != (layout.k, layout.m, layout.members) or h.content_hash != g.digest():
                continue  # another code group, or corrupt (its digest is not its group's)
            if any(g.hash_of(z) != hz for z, hz in local.items()):
                continue  # obsolete: a member's data of the step is another save now
            parity[y] = h.content_hash
            specs.setdefault(h.content_hash, g)
        planned = None
        if len(local) == layout.n:
            planned = CodeGroupSpec(layout.k, layout.m, layout.members, tuple(local[y] for y in layout.members),
                                    ("",) * layout.n)
        return GroupView(layout, local, parity, specs, planned)
