"""Suspend-resume from the controller: which slices got a preemption notice of their own, and the wait until the
step saved after a notice is durable, so that the program may exit 75 (controller_client/preemption_exit.py).

Why the wait: exit 75 restarts the JobSet, which deletes every Pod, the healthy ones (the coordinator's
included) too; their preStop hook tells such a deletion from a notice and skips the flush. A step whose
upload was still running on a healthy host is then not in the bucket, and the restart restores an older one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Literal

import grpc

from controller_client.topology import HostTopology
from mtc_rpc import coordinator_pb2 as pb
from sidecar.remote import PreemptionNotice

log = logging.getLogger(__name__)

# Between two status calls while waiting for a step to be durable (a backup's progress is reported per heartbeat).
POLL_SECONDS = 0.25


@dataclasses.dataclass(frozen=True)
class DurableStep:
    """A step that outlives the job's Pods: ``tier`` "bucket" (every saver's data of it is committed in the
    bucket) or, for a job without a bucket, "peers" (every rank's data on two hosts); ``seconds`` waited."""

    step: int
    tier: Literal["bucket", "peers"]
    seconds: float


def noticed_slices(answers: Mapping[int, PreemptionNotice], topology: HostTopology) -> frozenset[int]:
    """The slices (places in the full allocation) with a host whose own replicator got a notice."""
    return frozenset(topology.slice_of(rank) for rank, a in answers.items() if a.this_host)


def job_noticed(answers: Mapping[int, PreemptionNotice]) -> bool:
    """Some host's replicator knows of a notice (its own, or another host's the coordinator told of)."""
    return any(a.job for a in answers.values())


def _durable(st: pb.GetStatusResponse, step: int) -> DurableStep | None:
    """``step`` (or a newer step) as durable as the job allows, by the coordinator's typed status."""
    if st.backup.url:  # a bucket: nothing less survives every Pod of the job
        newer = [s for s in st.backed_up_steps if s >= step]
        return DurableStep(max(newer), "bucket", 0.0) if newer else None
    done = [s.step for s in st.steps if s.step >= step and s.complete and s.redundant]
    return DurableStep(max(done), "peers", 0.0) if done else None


def _progress(st: pb.GetStatusResponse, step: int) -> str:
    """How far ``step`` got, for the timeout's message (people read it; nothing decides on it)."""
    s = next((s for s in st.steps if s.step == step), None)
    if s is None:
        return f"the coordinator does not know step {step} (newest complete: {st.newest_complete_step})"
    where = (f"{s.ranks_backed_up} of its ranks in the bucket{' (backing up)' if s.backing_up else ''}"
             if st.backup.url else "no bucket configured")
    return f"complete={s.complete}, redundant={s.redundant}, {where}"


def wait_durable(status: Callable[[], pb.GetStatusResponse], saved: int | None, deadline: float) -> DurableStep:
    """Wait until the step saved last (``saved``; None: the newest complete step), or a newer one, is durable
    (:class:`DurableStep`), by ``deadline`` (``time.monotonic``).

    ``status``: the coordinator's ``GetStatus`` summary, each call bounded by its own deadline (failing calls are
    retried until ``deadline``). Raises :class:`TimeoutError` naming the step and how far it got, or
    :class:`FileNotFoundError` when no step is complete at all.
    """
    t0 = time.monotonic()
    target: int | None = None
    why = "no answer from the coordinator"
    while True:
        try:
            st = status()
        except grpc.RpcError as e:
            why = f"coordinator unreachable ({e.code().name})"
        else:
            if target is None:
                target = max(-1 if saved is None else saved, st.newest_complete_step)
                if target < 0:
                    raise FileNotFoundError("no complete step to make durable")
            got = _durable(st, target)
            if got is not None:
                got = dataclasses.replace(got, seconds=time.monotonic() - t0)
                log.info("step %d is durable (%s) after %.2fs", got.step, got.tier, got.seconds)
                return got
            why = _progress(st, target)
        left = deadline - time.monotonic()
        if left <= 0:
            step = "the newest complete step" if target is None else f"step {target}"
            raise TimeoutError(f"{step} is not durable after {time.monotonic() - t0:.1f}s: {why}")
        time.sleep(min(POLL_SECONDS, left))
