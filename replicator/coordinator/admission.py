"""Admission of the coordinator's waiting calls (GetSteps, PrepareRestore with a wait): a bounded number.

Each waiting call holds a server thread; beyond ``max_waiters`` the next one is refused with
RESOURCE_EXHAUSTED and a retry delay in the trailing metadata, so heartbeats always find a thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc

# The daemon's server has 16 threads: 8 waiters leave the rest to heartbeats.
MAX_WAITERS = 8
RETRY_AFTER_KEY = "retry-after-seconds"


class WaiterGate:
    """Counts the calls waiting on the coordinator and refuses those over ``max_waiters`` (thread-safe)."""

    def __init__(self, max_waiters: int = MAX_WAITERS):
        self.max_waiters = max_waiters
        self._waiters = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def admitted(self, context: grpc.ServicerContext, retry_seconds: float) -> Iterator[None]:
        """Hold a waiter's place for the ``with`` block, or abort the call (retry in ``retry_seconds``)."""
        with self._lock:
            admit = self._waiters < self.max_waiters
            if admit:
                self._waiters += 1
        if not admit:
            try:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{retry_seconds:.2f}"),))
            except AttributeError:
                pass
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_waiters} calls already wait on this "
                          f"coordinator; retry in {retry_seconds:.1f}s")
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1
