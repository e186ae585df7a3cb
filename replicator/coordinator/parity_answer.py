"""What a heartbeat answer carries for erasure coding (``ec:K+M``): ParityTasks, parity deletions, and a rebuild
restore source, on the wire. Used by the coordinator service under its lock.

:class:`ParityOrders` remembers the ParityTasks sent and not yet answered: a host computing its parity (reading
K shards of M rotations from the other members) is not told again at every heartbeat; the same task goes out
again only after :attr:`ParityOrders.retry_seconds` (the host's attempt may have failed) or when the host
registered anew. A task for other data (a re-save: another digest) goes out at once, and so does one whose
members' addresses changed (a member's replicator restarted: the task sent names its old address, and an attempt
that failed reading from it would otherwise wait out the retry time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import tier_pb2
from replicator.coordinator.model import Source
from replicator.coordinator.planner import CoordinatorState
from replicator.erasure.wire import CodeGroupSpec
from replicator.tier_wire import holder_to_wire
from replicator.tiers import Holding

# A ParityTask unanswered for this many heartbeat intervals (at least PARITY_RETRY_MIN_SECONDS) is sent again.
PARITY_RETRY_INTERVALS = 10
PARITY_RETRY_MIN_SECONDS = 20.0


def with_addresses(spec: CodeGroupSpec, members: Collection[int], addresses: Mapping[int, str]) -> CodeGroupSpec:
    """``spec`` naming the Peer address of each member in ``members``; "" for the rest."""
    return dataclasses.replace(spec, addresses=tuple(
        addresses.get(r, "") if r in members else "" for r in spec.members))


class ParityOrders:
    """(holder, step) -> (digest, members' addresses, when sent) of the ParityTasks sent and not yet answered."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, int], tuple[str, tuple[str, ...], float]] = {}

    def forget(self, rank: int) -> None:
        """``rank`` registered anew (another process): what it was told is forgotten with it."""
        for key in [k for k in self._sent if k[0] == rank]:
            del self._sent[key]

    def tasks(self, st: CoordinatorState, rank: int, now: float, retry_seconds: float,
              addresses: Mapping[int, str]) -> list[pb.ParityTask]:
        """The ParityTasks for host ``rank`` now (of the coding step, ``st.ec.coding_step()``): each one at most
        once per ``retry_seconds`` while unanswered (at once when it names other data or other addresses); none
        while some member's address is unknown."""
        due = st.ec.tasks_for(rank)
        pending = {step for step, _ in due}
        for key in [k for k in self._sent if k[0] == rank and k[1] not in pending]:
            del self._sent[key]  # done, obsolete, or no longer wanted
        out = []
        for step, spec in due:
            if any(not addresses.get(r) for r in spec.members):
                continue  # every member reports its address with each heartbeat: soon known
            digest = spec.digest()
            spec = with_addresses(spec, spec.members, addresses)
            sent = self._sent.get((rank, step))
            if sent is not None and sent[:2] == (digest, spec.addresses) and now - sent[2] < retry_seconds:
                continue
            self._sent[(rank, step)] = (digest, spec.addresses, now)
            st.ec.asked(step)
            task = pb.ParityTask(step=step)
            spec.to_proto(task.group)
            out.append(task)
        return out


def parity_deletion(h: Holding) -> pb.Deletion:
    """The Deletion of a host's parity holding ``h`` (owner_rank = the holder, content_hash = the group digest)."""
    return pb.Deletion(owner_rank=h.owner_rank, step=h.step, content_hash=h.content_hash,
                       tier=tier_pb2.TIER_PARITY)


def parity_source(s: Source, addresses: Mapping[int, str]) -> pb.RestoreSource:
    """A rebuild source (``s.kind`` PARITY) with the addresses of the members whose fragments it reads."""
    if s.group is None:
        raise ValueError(f"a parity source of rank {s.owner_rank} without its code group")
    src = pb.RestoreSource(kind=tier_pb2.TIER_PARITY, holder_rank=holder_to_wire(s.holder_rank), holder_address="",
                           owner_rank=s.owner_rank, content_hash=s.content_hash or "")
    with_addresses(s.group, set(s.helpers), addresses).to_proto(src.group)
    return src
