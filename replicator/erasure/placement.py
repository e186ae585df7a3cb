"""Which hosts form each code group, in which positions: other failure domains (slices) first. Pure.

Ranks are slice-major (``rank = slice * hosts_per_slice + index``). We order them slice-inner
(``(index 0, slice 0), (index 0, slice 1), ..., (index 1, slice 0), ...``) and cut that order into
``nodes // (K + M)`` consecutive groups (the remainder spread one per group, so every group has K + M to
2(K + M) - 1 hosts). Consecutive positions of a group are therefore in different slices wherever the job has
slices enough: with ``slices >= group size`` every member of a group is in a distinct slice, so a whole slice
lost costs each rotation one fragment; with fewer slices, each slice holds as few members of a group as
possible (``ceil(n / slices)``) and a lost slice is survived when that is <= M.
"""

from __future__ import annotations

from replicator.erasure.group import GroupLayout


def _check(v: object, name: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


def slice_inner_order(slices: int, hosts_per_slice: int) -> list[int]:
    """Every rank, the slice changing fastest: ``[0, H, 2H, ..., 1, H+1, ...]``."""
    return [s * hosts_per_slice + i for i in range(hosts_per_slice) for s in range(slices)]


def code_groups(slices: int, hosts_per_slice: int, k: int, m: int) -> tuple[GroupLayout, ...]:
    """The code groups of a job of ``slices x hosts_per_slice`` hosts at ec:K+M (see the module docstring);
    deterministic. ValueError when the job has fewer than K + M hosts."""
    _check(slices, "slices", 1)
    _check(hosts_per_slice, "hosts_per_slice", 1)
    _check(k, "K", 1)
    _check(m, "M", 1)
    nodes, width = slices * hosts_per_slice, k + m
    if nodes < width:
        raise ValueError(f"ec:{k}+{m} needs at least {width} hosts; the job has {nodes} "
                         f"({slices} slice(s) x {hosts_per_slice})")
    order = slice_inner_order(slices, hosts_per_slice)
    count = nodes // width
    base, extra = divmod(nodes, count)
    groups, at = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(GroupLayout(k, m, tuple(order[at:at + size])))
        at += size
    return tuple(groups)


def group_of(groups: tuple[GroupLayout, ...], rank: int) -> GroupLayout:
    """The group ``rank`` is a member of; ValueError when none."""
    for g in groups:
        if rank in g.members:
            return g
    raise ValueError(f"rank {rank} is in no code group")


def max_fragments_in_a_slice(layout: GroupLayout, hosts_per_slice: int) -> int:
    """The most fragments of one rotation of ``layout`` that one slice holds: a lost slice is survived
    when this is <= M."""
    worst = 0
    for r in range(layout.n):
        per: dict[int, int] = {}
        for rank in layout.holders(r):
            s = rank // hosts_per_slice
            per[s] = per.get(s, 0) + 1
        worst = max(worst, *per.values())
    return worst
