"""Which host (slice, index in slice, rank) each device belongs to; injectable because CPU devices have none."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


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

    def devices_of(self, rank: int, devices: Sequence[Any]) -> list[Any]:
        return [d for d in devices if self.device_rank.get(d.id) == rank]

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
    def from_devices(cls, devices: Sequence[Any]) -> HostTopology:
        """From device attributes: ``slice_index`` when present (TPU), else one slice of processes."""
        devs = sorted(devices, key=lambda d: d.id)
        hosts: dict[tuple[int, int], list[Any]] = {}
        for d in devs:
            sl = getattr(d, "slice_index", 0) or 0
            hosts.setdefault((int(sl), int(d.process_index)), []).append(d)
        by_slice: dict[int, list[int]] = {}
        for sl, proc in sorted(hosts):
            by_slice.setdefault(sl, []).append(proc)
        counts = {len(v) for v in by_slice.values()}
        if len(counts) != 1:
            raise ValueError(f"slices have different host counts: { {k: len(v) for k, v in by_slice.items()} }")
        per = counts.pop()
        slices = sorted(by_slice)
        device_rank = {}
        for si, sl in enumerate(slices):
            for hi, proc in enumerate(by_slice[sl]):
                for d in hosts[(sl, proc)]:
                    device_rank[d.id] = si * per + hi
        return cls(device_rank, len(slices), per)
