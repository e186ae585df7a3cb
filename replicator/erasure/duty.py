"""The heartbeat's erasure-coding work on this host: report its parity (Holding tier PARITY, with its code group),
run the coordinator's ``ParityTask`` s off the heartbeat thread (bulk priority, single-flight, backoff: the
daemon's :class:`~replicator.tasks.TaskRunner`), and apply ``Deletion`` s of tier PARITY.

Parity holdings are keyed (step, digest), apart from the data holdings keyed (owner rank, step): a host's own
data of a step and its parity of that step are two pieces. The inventory digest covers both (the coordinator
treats it as opaque): with no parity it is the data inventory's digest unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from mtc_rpc import coordinator_pb2 as cpb
from mtc_rpc import tier_pb2
from replicator.erasure.holder import ParityHolding
from replicator.erasure.host import EcHost, compute_parity
from replicator.erasure.wire import CodeGroupSpec
from replicator.metrics import HostCounters
from replicator.tasks import TaskRunner
from replicator.tier_wire import holding_to_wire
from replicator.tiers import Holding, Tier

log = logging.getLogger(__name__)

ParityKey = tuple[int, str]  # (step, digest)
TASK_KIND = "parity"


def is_parity(deletion: cpb.Deletion) -> bool:
    return deletion.tier == tier_pb2.TIER_PARITY


class ParityDuty:
    """This host's parity, as the heartbeat reports it and the coordinator's answers change it."""

    def __init__(self, ec: EcHost, tasks: TaskRunner, on_change: Callable[[], None],
                 counters: HostCounters | None = None):
        self.ec, self.tasks, self.on_change = ec, tasks, on_change
        self.counters = counters or HostCounters()

    @property
    def rank(self) -> int:
        return self.ec.rank

    # ------------------------------------------------------------------ reporting
    def inventory(self) -> dict[ParityKey, ParityHolding]:
        return {(h.step, h.digest): h for h in self.ec.parity.holdings()}

    def holding(self, h: ParityHolding) -> Holding:
        """``h`` as the coordinator's model holds it (tier PARITY, with its group, without addresses)."""
        return Holding(self.rank, h.step, h.digest, h.size, Tier.PARITY, group=h.group)

    def holdings(self, held: Mapping[ParityKey, ParityHolding]) -> list[Holding]:
        """Every one of ``held`` so: the heartbeat's inventory digest covers them by the coordinator's one rule
        (:func:`~replicator.tiers.inventory_digest`)."""
        return [self.holding(h) for h in held.values()]

    def report(self, req: cpb.HeartbeatRequest, held: Mapping[ParityKey, ParityHolding],
               acked: Mapping[ParityKey, ParityHolding] | None) -> None:
        """Add to ``req`` the parity holdings new since ``acked`` (all when None) and the parity gone since."""
        for key, h in held.items():
            if acked is not None and acked.get(key) == h:
                continue
            holding_to_wire(self.holding(h), req.holdings.add())
        if acked is not None:
            req.removed.extend(cpb.Deletion(owner_rank=self.rank, step=s, content_hash=d, tier=tier_pb2.TIER_PARITY)
                               for s, d in acked if (s, d) not in held)

    # ------------------------------------------------------------------ acting on an answer
    def act(self, resp: cpb.HeartbeatResponse) -> None:
        """Delete the parity the answer releases; start a task for each parity asked for and not held."""
        for x in resp.deletions:
            if not is_parity(x) or self.tasks.busy(self.rank, x.step):
                continue
            if x.owner_rank != self.rank:
                log.warning("ignoring a parity deletion for rank %d (this host is rank %d)", x.owner_rank, self.rank)
                continue
            try:
                if self.ec.parity.delete(x.step, x.content_hash or None):
                    self.on_change()
            except ValueError as e:  # a malformed digest: nothing of ours is named so
                log.warning("ignoring parity deletion of step %d: %s", x.step, e)
        for task in resp.parity:
            try:
                group = CodeGroupSpec.from_proto(task.group)
                group.layout.position(self.rank)
            except ValueError as e:
                log.warning("ignoring a malformed parity task for step %d: %s", task.step, e)
                continue
            if self.ec.parity.record(task.step, group.digest()) is None:
                self.tasks.submit(TASK_KIND, self.rank, task.step, self._compute, task.step, group)

    def _compute(self, step: int, group: CodeGroupSpec) -> None:
        """A parity task on the task pool (the pool's success callback reports the new holding at once)."""
        record = compute_parity(self.ec, step, group)
        self.counters.add("parity_tasks")
        self.counters.add("parity_bytes", record.parity_bytes)
