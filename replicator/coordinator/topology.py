"""Job topology: which hosts are data-parallel replicas of each other and where a rank's step is copied.

Ranks are slice-major: with ``D`` data-parallel slices of ``H = nodes // D`` hosts each,
``rank = slice * H + index_in_slice``. Hosts with the same in-slice index in different slices are
data-parallel replicas and usually hold byte-identical data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from sidecar.parse import parse_int


@dataclasses.dataclass(frozen=True)
class JobTopology:
    """The shape of a job: ``nodes`` hosts in ``data_parallelism`` slices, ``replicas`` peer copies per step.

    ``replicas`` is how many other hosts should hold a verified copy of each rank's step (a
    content-identical data-parallel replica counts as one). It may exceed ``nodes - 1``; copies are
    then capped at ``nodes - 1``.
    """

    nodes: int
    data_parallelism: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        parse_int(self.nodes, "nodes", 1, strict=True)
        parse_int(self.data_parallelism, "data_parallelism", 1, strict=True)
        parse_int(self.replicas, "replicas", 0, strict=True)
        if self.nodes % self.data_parallelism:
            raise ValueError(
                f"nodes={self.nodes} is not a multiple of data_parallelism={self.data_parallelism}"
            )

    @property
    def hosts_per_slice(self) -> int:
        return self.nodes // self.data_parallelism

    def check_rank(self, rank: object) -> int:
        """Return ``rank`` if it is a valid rank of this job, else raise ValueError."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"rank must be an int, got {rank!r}")
        if not 0 <= rank < self.nodes:
            raise ValueError(f"rank {rank} outside 0..{self.nodes - 1}")
        return rank

    def slice_of(self, rank: int) -> int:
        return self.check_rank(rank) // self.hosts_per_slice

    def index_in_slice(self, rank: int) -> int:
        return self.check_rank(rank) % self.hosts_per_slice

    def rank_of(self, slice_index: int, index_in_slice: int) -> int:
        if not 0 <= slice_index < self.data_parallelism:
            raise ValueError(f"slice {slice_index} outside 0..{self.data_parallelism - 1}")
        if not 0 <= index_in_slice < self.hosts_per_slice:
            raise ValueError(f"index_in_slice {index_in_slice} outside 0..{self.hosts_per_slice - 1}")
        return slice_index * self.hosts_per_slice + index_in_slice

    def replicas_of(self, rank: int) -> list[int]:
        """Data-parallel replicas of ``rank``: same in-slice index in every other slice, slice order."""
        index = self.index_in_slice(rank)
        own = self.slice_of(rank)
        return [self.rank_of(s, index) for s in range(self.data_parallelism) if s != own]

    def peer_ranks(self, rank: int) -> list[int]:
        """``peer-ranks`` as Orbax writes it in ``replicator.yaml`` ([] for one slice)."""
        return self.replicas_of(rank)

    def copy_preference(self, rank: int) -> list[int]:
        """Every other rank, in the order ``rank``'s step should be copied to them (see :meth:`iter_copy_preference`)."""
        return list(self.iter_copy_preference(rank))

    def iter_copy_preference(self, rank: int) -> Iterator[int]:
        """Every other rank, in the order ``rank``'s step should be copied to them; lazy.

        Other slices first (different failure domain), then the own slice. Within that, candidate
        ``k`` is a fixed cyclic shift of (slice, in-slice index), so for every position ``k`` the
        map ``rank -> preference[k]`` is a permutation: each host receives exactly as many copies
        as it sends. With one slice this is the plain ring ``rank+1, rank+2, ...``.
        """
        d, h = self.data_parallelism, self.hosts_per_slice
        s, i = self.slice_of(rank), self.index_in_slice(rank)
        # Index shift outer, slice shift inner: consecutive candidates land in different slices.
        for di in range(h):
            for ds in range(1, d):
                yield ((s + ds) % d) * h + (i + di) % h
        for di in range(1, h):
            yield s * h + (i + di) % h

    def copy_targets(self, rank: int) -> list[int]:
        """The ``replicas`` preferred hosts for copies of ``rank``'s step (never itself, at most nodes-1)."""
        return self.copy_preference(rank)[: self.replicas]

    def ring_distance(self, src: int, dst: int) -> int:
        """Forward distance from ``src`` to ``dst`` on the rank ring; a deterministic tie-breaker."""
        return (self.check_rank(dst) - self.check_rank(src)) % self.nodes

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
