"""The replicator's task executor: copies, restores and uploads run here, single-flight, with backoff.

A task is keyed ``(kind, owner rank, step)``; a key already running is not started twice, and a key that
failed waits (exponential backoff with jitter) before its next attempt. :meth:`TaskRunner.once` is the
single-flight of the *data*: whichever task (or sidecar fetch) brings a step directory here first, the
others wait for it instead of moving the bytes twice.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from replicator.metrics import HostCounters
from replicator.net import priority, retry
from sidecar import layout

log = logging.getLogger(__name__)

TaskKey = tuple[str, int, int]  # (kind, owner rank, step); owner -1 for a backup (all ranks of the step)
RECENT_ERRORS_KEPT = 20
# How many times a caller of TaskRunner.once whose concurrent fetch failed tries again (as the fetcher).
ONCE_ATTEMPTS = 2


class TaskRunner:
    """Runs the daemon's tasks on a bulk-priority pool (or, when urgent, a thread of their own)."""

    def __init__(self, *, threads: int, bulk_priority: int, backoff_base_seconds: float,
                 wait_seconds: float, counters: HostCounters, on_success: Callable[[], None]):
        self._counters = counters
        self._on_success = on_success  # report the result at once (a failure changed nothing to report)
        self._wait_seconds = wait_seconds
        # Copies, restores and uploads run here (and in the threads they start, which inherit it) at the
        # bulk priority, so that they yield the CPU to training.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads),
                                                           thread_name_prefix="mtc-xfer",
                                                           initializer=priority.lower_current_thread,
                                                           initargs=(bulk_priority,))
        self._in_flight: set[TaskKey] = set()
        # Failed copies/restores wait (exponential backoff with jitter) before the next attempt: a copy into a
        # full RAM disk used to be retried hundreds of times a second, one heartbeat after the other.
        self._retry = retry.KeyedBackoff(base_seconds=backoff_base_seconds, max_seconds=60.0)
        self._fetching: dict[tuple[int, int], threading.Event] = {}
        # Kind -> the (owner, step) of the tasks of that kind the coordinator's latest answer asks for (see asked).
        self._asked: dict[str, frozenset[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.errors: list[str] = []  # the most recent failures, for the local status

    def submit(self, kind: str, owner: int, step: int, fn: Callable[..., Any], *args: Any,
               urgent: bool = False) -> None:
        """Run ``fn(*args)`` as task ``(kind, owner, step)`` unless it runs already or is backing off."""
        key = (kind, owner, step)
        if not self._retry.ready(key):
            return
        with self._lock:
            if key in self._in_flight or self._stopping:
                return
            self._in_flight.add(key)

        def run() -> None:
            ok = False
            try:
                if not urgent and self._superseded(kind, owner, step):
                    return
                fn(*args)
                ok = True
                self._retry.succeeded(key)
            except Exception as e:
                delay = self._retry.failed(key)
                msg = f"{kind} of rank {owner} step {step} failed: {e}"
                log.warning("%s (attempt %d; next in %.1fs)", msg, self._retry.failures(key), delay)
                self.errors = (self.errors + [msg])[-RECENT_ERRORS_KEPT:]
                if kind == "copy":
                    self._counters.add("copy_failures")
            finally:
                with self._lock:
                    self._in_flight.discard(key)
                if ok:
                    self._on_success()

        if urgent:
            threading.Thread(target=run, name=f"mtc-urgent-{kind}", daemon=True).start()
            return
        try:
            self._pool.submit(run)
        except RuntimeError:  # pool shut down
            with self._lock:
                self._in_flight.discard(key)

    def asked(self, kind: str, keys: Iterable[tuple[int, int]]) -> None:
        """The (owner, step) of every task of ``kind`` the coordinator's latest answer asks for. A queued task of
        that kind it no longer names (its step superseded, or the copy planned elsewhere) is skipped when a thread
        takes it: under packet loss, copies of superseded steps filled both transfer threads (then failed
        NOT_FOUND) while the copy the coordinator asked for next waited. Call before submitting the answer's
        tasks. Kinds never told are never skipped."""
        with self._lock:
            self._asked[kind] = frozenset(keys)

    def _superseded(self, kind: str, owner: int, step: int) -> bool:
        with self._lock:
            wanted = self._asked.get(kind)
        if wanted is None or (owner, step) in wanted:
            return False
        log.info("%s of rank %d step %d skipped: the coordinator no longer asks for it", kind, owner, step)
        return True

    def busy(self, owner: int, step: int) -> bool:
        """A task touches ``owner``'s ``step`` (or a backup the whole step): not to be deleted now."""
        with self._lock:
            return any(k[1] == owner and k[2] == step for k in self._in_flight) or any(
                k[0] == "backup" and k[2] == step for k in self._in_flight)

    def in_flight(self) -> list[TaskKey]:
        with self._lock:
            return sorted(self._in_flight)

    def once(self, owner: int, step: int, content_hash: str | None, fetch: Callable[[], layout.StepManifest],
             present: Callable[[], layout.StepManifest | None]) -> layout.StepManifest:
        """Bring ``owner``'s ``step`` here once, from whichever tier: a copy task, a restore and a sidecar's
        fetch may want the same directory at the same time; later callers wait for the first (then read
        what it left with ``present()``) instead of moving the bytes twice (and colliding on its commit).
        A waiter whose first fetch failed (its peer was unreachable, say) tries once more itself."""
        key = (owner, step)
        for _ in range(ONCE_ATTEMPTS):
            with self._lock:
                running = self._fetching.get(key)
                if running is None:
                    self._fetching[key] = threading.Event()
                    break
            running.wait(self._wait_seconds)
            m = present()
            if m is not None and (not content_hash or m.content_hash == content_hash):
                return m
            # The first caller failed (its peer was unreachable, say): try again ourselves.
        else:
            raise RuntimeError(f"concurrent fetches of rank {owner} step {step} did not produce it")
        try:
            return fetch()
        finally:
            with self._lock:
                self._fetching.pop(key).set()

    def shutdown(self, wait: bool = False) -> None:
        """Start nothing more; queued tasks are cancelled, running ones finish (or are abandoned)."""
        with self._lock:
            self._stopping = True
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
