"""The simulation's network between hosts and coordinator candidates (issue #33 item 2).

What a schedule with the network on models, beyond the reliable-network faults of :mod:`tests.simulation.model`:

- two coordinator candidates, as ``--coordinator-candidates`` configures them: candidate 0 on rank 0, which
  activates when its replicator starts (``daemon.py``), and candidate 1 on the first host of slice 1, a
  standby that takes over once every lower candidate has been silent for ``max(2 intervals, lost_after/2)``
  (``Heartbeat._send``); each host heartbeats the lowest-ranked candidate that answers, failing over on
  ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` within the same beat, and a candidate whose lower one answers
  steps down;
- per-message loss rates (a request lost, an answer lost after the coordinator handled it: the call times
  out, the host tries the next candidate);
- duplicated delivery: the coordinator handles the same heartbeat twice (now, or after the host's newer
  ones: an older report handled after a newer one, as a request queued in another server thread can be;
  hosts number their reports, and the coordinator refuses such a one with ABORTED);
  a duplicated answer is drawn but reaches no daemon (a unary gRPC call yields one answer, and the daemon
  acts once per call), so it is only noted in the trace;
- reordering of answers: a late answer of a timed-out call is dropped (gRPC delivers none once the call
  ended, so the daemon never sees it) and an answer of a lower epoch than the host accepted is ignored
  (``Heartbeat.beat``);
- partitions: a set of hosts that cannot reach the serving candidate for a while but can reach the other
  (two candidates serving different hosts at once when the other candidate's host is among them), or the
  candidates cut from each other only; all heal when the fault window ends.

Draws come from a second generator seeded from the schedule's seed, so a schedule with the network off is
the same schedule as before the network was modelled (the guard seeds replay unchanged).
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass
class NetConfig:
    """The network's rates for one schedule (drawn from the seed)."""

    on: bool
    p_request_lost: float
    p_answer_lost: float
    p_request_dup: float  # the coordinator handles the heartbeat again, 0-2 s later
    p_answer_dup: float  # the answer's packets duplicated (dropped by gRPC: noted only)
    p_partition: float  # of a fault, that it is a partition

    @classmethod
    def draw(cls, rng: random.Random, on: bool | None = None) -> NetConfig:
        if on is None:
            on = rng.random() < 0.75
        return cls(on=on, p_request_lost=rng.choice([0.0, 0.02, 0.05, 0.15]),
                   p_answer_lost=rng.choice([0.0, 0.02, 0.05, 0.15]),
                   p_request_dup=rng.choice([0.0, 0.05, 0.15]), p_answer_dup=rng.choice([0.0, 0.05, 0.15]),
                   p_partition=rng.choice([0.15, 0.3]))


@dataclasses.dataclass
class Partition:
    """``ranks`` cannot reach candidate ``candidate`` (nor it them) until ``until``."""

    ranks: frozenset[int]
    candidate: int
    until: float


class Network:
    """Who reaches which candidate, and the message faults' draws."""

    def __init__(self, seed: int, on: bool | None):
        self.rng = random.Random(seed * 2654435761 + 97)
        self.cfg = NetConfig.draw(self.rng, on)
        self.partitions: list[Partition] = []

    def reaches(self, rank: int, candidate: int, candidate_rank: int, now: float) -> bool:
        if rank == candidate_rank:
            return True  # its own candidate: loopback
        return not any(p.candidate == candidate and rank in p.ranks and now < p.until for p in self.partitions)

    def heal(self, now: float) -> None:
        self.partitions = [p for p in self.partitions if now < p.until]

    def chance(self, p: float) -> bool:
        return p > 0.0 and self.rng.random() < p
