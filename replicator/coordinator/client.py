"""Reaching the coordinator: ordered candidates with failover (used by hosts, the controller and `mtc status`).

The coordinator is served by the lowest-ranked live candidate (``docs/coordinator.md``). Callers try the
candidates in order on every call: a dead one fails fast (refused connection) or after a short probe
deadline, a standby one answers UNAVAILABLE. Whole rounds that fail are retried with jittered
exponential backoff until the caller's deadline, so a failover costs callers a few heartbeats, not an
error, and a crowd of callers does not retry in lockstep.

A client remembers the highest coordinator epoch it has been answered with and refuses an answer of a lower
one as if that candidate were a standby (:class:`StaleEpochError`, a failover code): a deposed coordinator
that has not heard of its successor yet (cut off, just healed) cannot take a client's view backwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from mtc_rpc import coordinator_pb2 as pb
from mtc_rpc import coordinator_pb2_grpc as pb_grpc
from replicator.coordinator.admission import RETRY_AFTER_KEY
from replicator.net.retry import JITTER, backoff_seconds

log = logging.getLogger(__name__)

# UNAVAILABLE: dead, standby or deposed candidate; DEADLINE_EXCEEDED: unreachable (black-holed) one.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def parse_addresses(value: str | Sequence[str]) -> list[str]:
    """``"h0:7070,h2:7070"`` (or a list) -> ordered candidate addresses; ``RANK=`` prefixes are dropped."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [i.strip().partition("=")[2] if "=" in i else i.strip() for i in items]
    out = [a for a in out if a]
    if not out:
        raise ValueError(f"no coordinator address in {value!r}")
    return out


def retry_after_seconds(e: grpc.RpcError) -> float | None:
    """The coordinator's ``retry-after-seconds`` advice on a refused call, if any."""
    try:
        for key, value in e.trailing_metadata() or ():
            if key == RETRY_AFTER_KEY:
                return float(value)
    except (AttributeError, ValueError):
        pass
    return None


class StaleEpochError(grpc.RpcError):
    """An answer from a coordinator of a lower epoch than one this client was answered with before."""

    def __init__(self, address: str, epoch: int, highest: int) -> None:
        super().__init__(f"{address} answered with epoch {epoch}, older than epoch {highest} seen before")
        self._details = str(self.args[0])

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


def answer_epoch(resp: Any) -> int:
    """The epoch an answer carries (its ``epoch`` field); 0 for a message without one."""
    desc = getattr(resp, "DESCRIPTOR", None)
    return int(resp.epoch) if desc is not None and "epoch" in desc.fields_by_name else 0


class FailoverStub:
    """A stub-like object: ``stub.Method(request, timeout=...)`` goes to the first candidate that answers."""

    def __init__(self, candidates: Candidates):
        self._candidates = candidates

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)

        def call(request: Any, timeout: float) -> Any:
            return self._candidates.call(method, request, timeout)

        return call


class Candidates:
    """Stubs to the ordered coordinator candidates; :meth:`call` goes to the first one that answers."""

    def __init__(self, addresses: Sequence[str], make_channel: Callable[[str], grpc.Channel],
                 stub_class: Callable[[grpc.Channel], Any] = pb_grpc.CoordinatorStub, fence_epochs: bool = False):
        """``fence_epochs``: refuse answers of a lower epoch than seen before (clients; the hosts' heartbeat
        has its own fence, which also tells the coordinator)."""
        self.addresses = list(addresses)
        self.fence_epochs = fence_epochs
        self.highest_epoch = 0
        self._make_channel = make_channel
        self._stub_class = stub_class
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, Any] = {}
        self._failed: set[int] = set()
        self.serving: int | None = None  # index of the candidate that answered last

    def stub(self, index: int) -> Any:
        if index not in self._stubs:
            self._channels[index] = self._make_channel(self.addresses[index])
            self._stubs[index] = self._stub_class(self._channels[index])
        return self._stubs[index]

    def call_one(self, index: int, method: str, request: Any, timeout: float, probe_timeout: float) -> Any:
        """One call to candidate ``index``; a candidate that failed last time gets only ``probe_timeout``."""
        t = min(timeout, probe_timeout) if index in self._failed else timeout
        try:
            resp = getattr(self.stub(index), method)(request, timeout=t)
        except grpc.RpcError as e:
            if e.code() in FAILOVER_CODES:
                self._failed.add(index)
            raise
        if self.fence_epochs:
            epoch = answer_epoch(resp)
            if 0 < epoch < self.highest_epoch:
                log.warning("refusing %s's answer to %s: epoch %d is older than epoch %d seen before",
                            self.addresses[index], method, epoch, self.highest_epoch)
                self._failed.add(index)
                raise StaleEpochError(self.addresses[index], epoch, self.highest_epoch)
            self.highest_epoch = max(self.highest_epoch, epoch)
        self._failed.discard(index)
        self.serving = index
        return resp

    def call(self, method: str, request: Any, timeout: float, probe_timeout: float = 1.0) -> Any:
        """Try every candidate in order once; raise the last failover error when none answers."""
        last: grpc.RpcError | None = None
        for i in range(len(self.addresses)):
            try:
                return self.call_one(i, method, request, timeout, probe_timeout)
            except grpc.RpcError as e:
                if e.code() not in FAILOVER_CODES:
                    raise
                last = e
        assert last is not None
        raise last

    def call_until(self, method: str, request: Any, timeout: float, deadline: float,
                   base_backoff: float = 0.2) -> Any:
        """:meth:`call` in rounds with jittered backoff until ``deadline`` (monotonic)."""
        failures = 0
        while True:
            try:
                return self.call(method, request, timeout)
            except grpc.RpcError as e:
                failures += 1
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_seconds(e) is not None:
                    pause = retry_after_seconds(e) * JITTER.uniform(1.0, 1.5)  # the coordinator's advice, jittered
                elif e.code() in FAILOVER_CODES:
                    pause = backoff_seconds(failures, base_backoff, cap_factor=10.0)
                else:
                    raise
                if time.monotonic() + pause >= deadline:
                    raise
                log.info("no coordinator candidate answered %s (%s); retrying in %.2fs", method,
                         e.code().name, pause)
                time.sleep(pause)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        self._stubs.clear()


class CoordinatorClient:
    """Calls to the coordinator, each with a deadline, failing over across ``address`` candidates.

    ``address``: one ``HOST:PORT`` or the ordered candidates, comma-separated or as a list.
    ``failover_seconds``: how long a call keeps trying candidates before raising (default: 3 RPC timeouts).
    ``gone_ranks``: ranks the caller knows are gone (on Pathways: hosts of slices counted down), sent with every
    steps and restore question (replicator/coordinator/gone.py).
    """

    def __init__(self, address: str | Sequence[str], token_file: str | None = None,
                 rpc_timeout_seconds: float = 30.0, tls: Any = None, failover_seconds: float | None = None,
                 gone_ranks: Sequence[int] = ()):
        from replicator.net import rpc
        from replicator.net.security import read_token_file

        token = read_token_file(Path(token_file)) if token_file else None
        self.addresses = parse_addresses(address)
        self.address = self.addresses[0]
        self.timeout = rpc_timeout_seconds
        self.failover_seconds = 3 * rpc_timeout_seconds if failover_seconds is None else failover_seconds
        self.gone_ranks = list(gone_ranks)
        self._candidates = Candidates(self.addresses, lambda a: rpc.make_channel(a, token=token, tls=tls),
                                      fence_epochs=True)

    def _call(self, method: str, request: Any, timeout: float, extra_seconds: float = 0.0) -> Any:
        deadline = time.monotonic() + self.failover_seconds + extra_seconds
        return self._candidates.call_until(method, request, timeout, deadline)

    @property
    def highest_epoch(self) -> int:
        """The highest coordinator epoch this client has been answered with (0: none yet)."""
        return self._candidates.highest_epoch

    @property
    def serving_address(self) -> str | None:
        i = self._candidates.serving
        return None if i is None else self.addresses[i]

    def steps(self, wait_seconds: float | None = None, min_step: int | None = None) -> pb.GetStepsResponse:
        """The complete steps; ``min_step``: long-poll up to ``wait_seconds`` until it (or newer) is complete."""
        wait = self.timeout / 2 if wait_seconds is None else wait_seconds
        req = pb.GetStepsRequest(wait_seconds=wait, min_step=min_step, gone_ranks=self.gone_ranks)
        return self._call("GetSteps", req, wait + self.timeout)

    def complete_steps(self) -> list[int]:
        return list(self.steps().complete_steps)

    def prepare_restore(self, step: int | None, wait_seconds: float) -> int:
        """Have every live host hold its data of ``step`` (default: newest recoverable); returns the step.

        A coordinator lost mid-call is retried on the next candidate (which re-plans from reports).
        """
        resp = self._call("PrepareRestore",
                          pb.PrepareRestoreRequest(step=-1 if step is None else step, wait_seconds=wait_seconds,
                                                   gone_ranks=self.gone_ranks),
                          wait_seconds + self.timeout, extra_seconds=wait_seconds)
        if resp.step < 0:
            raise FileNotFoundError(f"nothing to restore: {resp.reason}")
        if not resp.ready:
            raise TimeoutError(f"restore of step {resp.step} not ready: {resp.reason}")
        log.info("coordinator prepared restore: %s", resp.reason)
        return resp.step

    def pin_restore(self, step: int) -> pb.PrepareRestoreResponse:
        """Pin ``step`` for a restore and make it every host's restore target, without waiting for the
        hosts (an elastic restore fetches what it lacks itself); the answer says which ranks are ready."""
        return self._call("PrepareRestore", pb.PrepareRestoreRequest(step=step, wait_seconds=0,
                                                                   gone_ranks=self.gone_ranks), self.timeout)

    def status(self, hosts: bool = False, detail_steps: Sequence[int] = (), rank_first: int = 0,
               rank_count: int = 0) -> pb.GetStatusResponse:
        """The typed status: summary by default; per-host / per-step detail on request for ranks
        ``rank_first .. rank_first + rank_count - 1`` (``rank_count`` 0: through the last rank)."""
        req = pb.GetStatusRequest(hosts=hosts, detail_steps=list(detail_steps), rank_first=rank_first,
                                  rank_count=rank_count)
        return self._call("GetStatus", req, self.timeout)

    def close(self) -> None:
        self._candidates.close()
