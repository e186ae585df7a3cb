"""Which host (slice, index in slice, rank) each device belongs to; injectable because CPU devices have none."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

_LOGICAL_TASK = re.compile(r"logical_task=(\d+)")
_VTASK = re.compile(r"vtask=(\d+)")


def _task_index(device: Any) -> int | None:
    """The worker (task) a Pathways device belongs to, in the order Orbax 0.12.8 looks for it
    (``_src/multihost/pathways.py``): ``virtual_task_index``, ``logical_task=N`` in the repr, ``task_id``,
    ``vtask=N`` in the repr; None when the device says nothing (not Pathways)."""
    vti = getattr(device, "virtual_task_index", None)
    if vti is not None:
        return int(vti)
    m = _LOGICAL_TASK.search(repr(device))
    if m:
        return int(m.group(1))
    tid = getattr(device, "task_id", None)
    if tid is not None:
        return int(tid)
    m = _VTASK.search(repr(device))
    return int(m.group(1)) if m else None


def worker_key(device: Any) -> tuple[int, int]:
    """``(slice_index, worker)`` of ``device``: the host it is attached to.

    On Pathways ``process_index`` is 0 for every device (one controller), so the worker is identified as
    Orbax does it, by the task index within the slice (see :func:`_task_index`); elsewhere (multi-controller
    JAX, CPU) each process is a host.
    """
    sl = getattr(device, "slice_index", None)
    task = _task_index(device)
    if task is not None:
        return int(sl or 0), task
    return int(sl or 0), int(device.process_index)


@dataclasses.dataclass(frozen=True)
class HostTopology:
    """Device id -> rank, with ranks slice-major (rank = slice * hosts_per_slice + index in slice)."""

    device_rank: dict[int, int]
    slices: int
    hosts_per_slice: int

    @property
    def nodes(self) -> int:
        return self.slices * self.hosts_per_slice

    def rank_of(self, device: Any) -> int:
        try:
            return self.device_rank[device.id]
        except KeyError:
            raise ValueError(f"device {device} is not in the host topology") from None

    def slice_of(self, rank: int) -> int:
        return rank // self.hosts_per_slice

    def ranks_of(self, devices: Sequence[Any]) -> list[int]:
        """The ranks (hosts) that ``devices`` belong to, ascending: the active set when given the active devices."""
        return sorted({self.rank_of(d) for d in devices})

    def check_active(self, devices: Sequence[Any]) -> list[int]:
        """The active ranks of ``devices``; every device of an active host must be among them."""
        ranks = self.ranks_of(devices)
        ids = {d.id for d in devices}
        for r in ranks:
            missing = [i for i, rr in self.device_rank.items() if rr == r and i not in ids]
            if missing:
                raise ValueError(f"host {r} is partly active: devices {sorted(missing)} are not in the active set")
        return ranks

    @classmethod
    def simulated(cls, devices: Sequence[Any], slices: int, hosts_per_slice: int) -> HostTopology:
        """Split ``devices`` (sorted by id) evenly into ``slices * hosts_per_slice`` simulated hosts."""
        devs = sorted(devices, key=lambda d: d.id)
        nodes = slices * hosts_per_slice
        if nodes <= 0 or len(devs) % nodes:
            raise ValueError(f"{len(devs)} devices cannot be split into {slices} x {hosts_per_slice} hosts")
        per = len(devs) // nodes
        return cls({d.id: i // per for i, d in enumerate(devs)}, slices, hosts_per_slice)

    @classmethod
    def from_devices(cls, devices: Sequence[Any], slices: int | None = None) -> HostTopology:
        """From device attributes: the host of each device is :func:`worker_key` (Pathways' task index, else
        the process), in its ``slice_index`` when present (TPU), else one slice.

        Ranks follow the full allocation: rank = slice_index * hosts_per_slice + index in slice, so that
        the devices of a subset of slices (an elastic job's active slices) keep their ranks. ``slices``:
        the allocation's slice count when ``devices`` do not include the last slice.
        """
        devs = sorted(devices, key=lambda d: d.id)
        hosts: dict[tuple[int, int], list[Any]] = {}
        for d in devs:
            hosts.setdefault(worker_key(d), []).append(d)
        by_slice: dict[int, list[int]] = {}
        for sl, proc in sorted(hosts):
            by_slice.setdefault(sl, []).append(proc)
        counts = {len(v) for v in by_slice.values()}
        if len(counts) != 1:
            raise ValueError(f"slices have different host counts: { {k: len(v) for k, v in by_slice.items()} }")
        per = counts.pop()
        present = sorted(by_slice)
        total = max(present) + 1 if slices is None else slices
        if present[-1] >= total:
            raise ValueError(f"device slice_index {present[-1]} outside an allocation of {total} slices")
        device_rank = {}
        for sl in present:
            for hi, proc in enumerate(by_slice[sl]):
                for d in hosts[(sl, proc)]:
                    device_rank[d.id] = sl * per + hi
        return cls(device_rank, total, per)
