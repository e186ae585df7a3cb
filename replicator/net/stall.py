"""A bound on silence for server-streaming gRPC calls: a stream that delivers nothing for too long is cancelled.

Why: gRPC's keepalive does not bound a stalled stream. Under 15 % packet loss on one host and a loaded CPU
(tests/faults ``lossy-one-host-15pct``), a ``ReadFiles`` stream whose server had sent its whole 64 KiB reply
delivered nothing for 61 s before the channel failed "ping timeout" (keepalive is set to 2 s + 3 s): both transfer
threads of the receiving host sat on such streams and its copies of the step to restore waited, 48 s past the heal.
A data-port transfer already fails after ``DATA_IDLE_TIMEOUT_SECONDS`` of silence; :func:`watched` gives a stream
the same bound. Its failure is a :class:`StreamStalled`, an ``RpcError`` of code DEADLINE_EXCEEDED, so a kept
channel is retired by it (``replicator.peer.channels``) and the retry dials a new connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import grpc

T = TypeVar("T")

# The watchdog's resolution: how late past its bound a stalled stream may be cancelled.
POLL_SECONDS = 0.5


class StreamStalled(grpc.RpcError, TimeoutError):
    """A server stream delivered no message within its bound and was cancelled (code DEADLINE_EXCEEDED)."""

    def __init__(self, what: str, seconds: float):
        super().__init__(f"{what}: no message for {seconds:.1f}s (stream cancelled)")
        self.seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)


class _Watchdog:
    """Cancels ``call`` once ``first_seconds`` pass without a first message, or ``idle_seconds`` after the last."""

    def __init__(self, call: Any, first_seconds: float, idle_seconds: float):
        self._call = call
        self._idle = idle_seconds
        self._bound = first_seconds
        self._last = time.monotonic()
        self._done = threading.Event()
        self.fired_after = 0.0
        threading.Thread(target=self._watch, name="mtc-stream-watchdog", daemon=True).start()

    def tick(self) -> None:
        self._last = time.monotonic()
        self._bound = self._idle

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            silent = time.monotonic() - self._last
            if silent > self._bound:
                self.fired_after = silent
                self._call.cancel()
                return


def watched(call: Any, what: str, idle_seconds: float, first_seconds: float | None = None) -> Iterator[T]:
    """The messages of server-streaming ``call``; the call is cancelled and :class:`StreamStalled` raised when no
    message arrives within ``first_seconds`` (default ``idle_seconds``) of the start or ``idle_seconds`` of the
    previous one. The caller still cancels ``call`` when it stops early (as without the watchdog)."""
    dog = _Watchdog(call, idle_seconds if first_seconds is None else first_seconds, idle_seconds)
    try:
        for msg in call:
            dog.tick()
            yield msg
            dog.tick()  # the silence is the peer's only while we wait for it, not while the caller works
    except grpc.RpcError as e:
        if dog.fired_after and getattr(e, "code", None) is not None and e.code() == grpc.StatusCode.CANCELLED:
            raise StreamStalled(what, dog.fired_after) from e
        raise
    finally:
        dog.stop()
