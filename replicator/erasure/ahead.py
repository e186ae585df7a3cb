"""Read a code group's fragments ahead of the coder: each holder's reads on that holder's own thread, in order.

The coder asks for the K fragments of a stripe one after another; over the peer tier each is a window
transfer now and then (one ``OpenTransfer`` and a data connection), so reading them in turn leaves the links
idle while one waits. :class:`HolderThreads` gives every holder one worker thread: the reads of different
holders run at once, and those of one holder stay in order (its window serves the next stripes; two threads
on one holder's window would fetch the same bytes twice). :func:`lookahead` starts the work of up to
``depth`` items ahead of the one the coder consumes, so the next window is fetched while it decodes. Memory
is bounded: ``depth`` stripes of K fragments in flight, plus each holder's window.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class HolderThreads:
    """One single-thread executor per holder rank, made when first used; :meth:`close` cancels what has not
    started and waits for what has (every read has its own timeout), so no thread outlives it."""

    def __init__(self, name: str = "ec-read"):
        self._name = name
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, holder: int, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("HolderThreads closed")
            pool = self._pools.get(holder)
            if pool is None:
                pool = self._pools[holder] = ThreadPoolExecutor(1, thread_name_prefix=f"{self._name}-{holder}")
        return pool.submit(fn, *args)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for pool in pools:
            pool.shutdown(wait=True)

    def __enter__(self) -> HolderThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lookahead(items: Iterable[T], start: Callable[[T], U], depth: int) -> Iterator[U]:
    """``start(item)`` for each item, up to ``depth`` items ahead of the one yielded (0: none ahead)."""
    pending: collections.deque[U] = collections.deque()
    for item in items:
        pending.append(start(item))
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()
