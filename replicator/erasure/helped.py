"""What the helped rebuilds (:mod:`replicator.erasure.spread`, :mod:`replicator.erasure.pipeline`) share: a
fragment's name, the callback a serving thread hands fragments to, and how a rebuild's helper streams end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Item = tuple[int, int, int]  # (rotation, stripe, fragment index)
# A serving thread's hand-off: ("frag", bytes) / ("end", None) / ("error", exc); False when the reader left.
Put = Callable[[tuple[str, Any]], bool]


def close_call(call: Iterator[bytes]) -> None:
    """End a helper's stream (a gRPC call or a test's iterator)."""
    close = getattr(call, "close", None)
    if close is not None:
        close()


@contextlib.contextmanager
def failing_as(error: type[OSError], calls: dict[Any, Iterator[bytes]]) -> Iterator[None]:
    """A helped rebuild's body: any OSError or ValueError comes out as ``error`` (the caller then tries the
    next way), and every helper's stream still in ``calls`` is closed, however it ends."""
    try:
        yield
    except error:
        raise
    except (OSError, ValueError) as e:
        raise error(f"{type(e).__name__}: {e}") from e
    finally:
        for call in calls.values():
            close_call(call)
