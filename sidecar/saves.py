"""Which saves of which steps count: rank ranges (and their text), one step's save as seen, and the one
completeness/rollback rule.

Pure (no I/O, no clocks), the bottom of the dependency graph: the controller (``controller_client.manager``),
the coordinator's planner and the reader (``sidecar.reader``) all decide with these functions.

The rule, stated once:

- A step number may be saved more than once (a rollback, then saving forward again): the save with the
  highest ``generation`` is the step; copies of older saves are abandoned (:func:`newest_generation`).
- A step is *rolled back* (abandoned as a whole) when an older step number carries a newer save: the job
  restored an older step and saved forward past it (:func:`rolled_back`).
- A step is *complete* when every rank that saved it (its newest save's savers) has its data somewhere,
  and it is not rolled back (:func:`complete_steps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any


def rank_ranges(ranks: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``[0, 1, 2, 5]`` -> ``((0, 2), (5, 5))``: a set of ranks as inclusive ranges (compact at any scale)."""
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return tuple(out)


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (``""`` when empty): how people read a set of ranks in logs, errors,
    status and the CLI, short even for thousands of ranks."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in rank_ranges(ranks))


def parse_rank_span(text: str) -> tuple[int, int]:
    """One range as people type it, ``"A-B"``, ``"A-"`` (to the last rank) or ``"A"`` -> ``(first, last)``, with
    ``last`` -1 for an open end; ValueError for anything else."""
    a, sep, b = text.partition("-")
    if not a.isdigit() or (b and not b.isdigit()):
        raise ValueError(f"a rank range must be A-B, A- or A, got {text!r}")
    return int(a), (int(b) if b else -1) if sep else int(a)


@dataclasses.dataclass(frozen=True)
class RankRanges:
    """A set of ranks as sorted, disjoint, non-adjacent inclusive ranges ``((first, last), ...)``.

    Its size follows the number of gaps, not of ranks: every rank of a 10,000-host job is one range.
    """

    ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        prev = None
        for a, b in self.ranges:
            if not (isinstance(a, int) and isinstance(b, int)) or a < 0 or b < a or (prev is not None and a <= prev + 1):
                raise ValueError(f"bad rank ranges {self.ranges!r}")
            prev = b

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankRanges:
        return cls(rank_ranges(int(r) for r in ranks))

    @classmethod
    def every(cls, nodes: int) -> RankRanges:
        """All ranks of a job of ``nodes`` hosts (one range)."""
        return cls(((0, nodes - 1),)) if nodes > 0 else cls()

    def __iter__(self) -> Iterator[int]:
        for a, b in self.ranges:
            yield from range(a, b + 1)

    def __len__(self) -> int:
        return sum(b - a + 1 for a, b in self.ranges)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and any(a <= rank <= b for a, b in self.ranges)

    def issubset(self, other: RankRanges) -> bool:
        return all(any(c <= a and b <= d for c, d in other.ranges) for a, b in self.ranges)

    def union(self, other: RankRanges) -> RankRanges:
        merged: list[list[int]] = []
        for a, b in sorted(self.ranges + other.ranges):
            if merged and a <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return RankRanges(tuple((a, b) for a, b in merged))

    def to_wire(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    @classmethod
    def from_wire(cls, data: Any) -> RankRanges:
        return cls(tuple((int(a), int(b)) for a, b in data))


@dataclasses.dataclass(frozen=True)
class StepSave:
    """One save of a step as some hosts see it: its generation, the ranks that saved it, the ranks whose
    data of it they hold. ``savers`` of an all-rank save is ``RankRanges.every(nodes)``: one range."""

    step: int
    generation: int
    savers: RankRanges
    held: RankRanges

    def to_wire(self) -> list[Any]:
        return [self.step, self.generation, self.savers.to_wire(), self.held.to_wire()]

    @classmethod
    def from_wire(cls, data: Any) -> StepSave:
        step, gen, savers, held = data
        return cls(int(step), int(gen), RankRanges.from_wire(savers), RankRanges.from_wire(held))

    @property
    def complete(self) -> bool:
        """Every saver's data is held (rollback aside: see :func:`complete_steps`)."""
        return self.savers.issubset(self.held)


def newest_generation(generations: Iterable[int], default: int = -1) -> int:
    """The generation that is the step among saves of one step number (older ones are abandoned)."""
    return max(generations, default=default)


def rolled_back(step: int, generation: int, newest_by_step: Iterable[tuple[int, int]]) -> bool:
    """An older step number carries a newer save than ``step``'s (``generation``): the job rolled back past
    ``step``. ``newest_by_step``: (step, newest generation) of every known step, e.g. a mapping's
    ``items()`` or a lazy generator (the coordinator asks this per holding: it must not build a dict)."""
    return any(s < step and g > generation for s, g in newest_by_step)


def merge(saves: Iterable[StepSave]) -> dict[int, StepSave]:
    """Per step, its newest save with the ranks held united over every answer that saw that save."""
    best: dict[int, StepSave] = {}
    for s in saves:
        cur = best.get(s.step)
        if cur is None or s.generation > cur.generation:
            best[s.step] = s
        elif s.generation == cur.generation:
            best[s.step] = dataclasses.replace(cur, held=cur.held.union(s.held))
    return best


def complete_steps(saves: Iterable[StepSave]) -> list[int]:
    """Steps, ascending, whose newest save has every saver's data held and that no rollback abandoned
    (checked against every step seen, complete or not)."""
    best = merge(saves)
    newest = {step: s.generation for step, s in best.items()}
    return [step for step, s in sorted(best.items())
            if s.complete and not rolled_back(step, s.generation, newest.items())]
