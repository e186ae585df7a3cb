"""A host function's failure as data: what crosses a colocated call back to the controller, and its revival.

On Pathways an exception raised inside a colocated-Python function reaches the controller as a
``jax.errors.JaxRuntimeError`` whose status is the runtime's, not ours (docs/pathways.md): pathwaysutils'
``elastic_retry`` would then decide on its text (``INTERNAL`` counts as a slice-down and is retried, without
limit unless the loop passes a ``retry_policy``), and callers that catch ``FileNotFoundError`` (the manager's
fall-back to an older step) would never see that type. So the host functions never let one of their own
exceptions cross the call: :func:`capture` turns it into a small typed record that travels in the call's
output rows, and the controller raises :func:`revive`'s exception — the same Python type (for the types
listed here; any other becomes :class:`HostError`), message, ``errno`` — naming the rank that raised it. A
``JaxRuntimeError`` on the controller then only ever means what the runtime meant (a host or slice lost).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import traceback
from typing import Any

# Bound on the traceback text a record carries (it shares a fixed-size row with the message).
TRACEBACK_CHARS = 1500
# The one key of a row that carries a failure instead of an answer (no tree path looks like it).
FAILURE_KEY = "mtc.host_failure"


class HostError(RuntimeError):
    """A host function failed with an exception of a type not revived as itself (its name is in the text)."""


class RankMismatchError(ValueError):
    """The rank the controller assigned a host differs from the rank its replicator serves."""


class StepAlreadyExistsError(FileExistsError, ValueError):
    """A save of a step that is already saved (Orbax's ``StepAlreadyExistsError`` is a ``ValueError``; this
    one is also the ``FileExistsError`` earlier versions raised)."""


# Types revived as themselves, by the name a record carries. Ours are imported lazily (no import cycles).
_BUILTINS = ("FileNotFoundError", "FileExistsError", "IsADirectoryError", "NotADirectoryError", "PermissionError",
             "TimeoutError", "ConnectionError", "OSError", "ValueError", "TypeError", "KeyError", "LookupError",
             "RuntimeError", "NotImplementedError", "MemoryError")
_OURS = {
    "sidecar.checksums.ChecksumError": ("sidecar.checksums", "ChecksumError"),
    "sidecar.reader.BadCopyError": ("sidecar.reader", "BadCopyError"),
    "sidecar.reader.CorruptStepError": ("sidecar.reader", "CorruptStepError"),
    "sidecar.layout.ManifestError": ("sidecar.layout", "ManifestError"),
    "sidecar.layout.ManifestChecksumError": ("sidecar.layout", "ManifestChecksumError"),
    "sidecar.writer.SaveError": ("sidecar.writer", "SaveError"),
    "sidecar.remote.ReplicatorUnavailableError": ("sidecar.remote", "ReplicatorUnavailableError"),
    "sidecar.failures.HostError": (__name__, "HostError"),
    "sidecar.failures.RankMismatchError": (__name__, "RankMismatchError"),
    "sidecar.failures.StepAlreadyExistsError": (__name__, "StepAlreadyExistsError"),
}


@dataclasses.dataclass(frozen=True)
class Failure:
    """One host function's exception, as data."""

    type: str  # "ValueError", or "sidecar.reader.CorruptStepError" for ours
    message: str
    ranks: tuple[int, ...]  # the ranks the failing call acted for
    host: str = ""  # where it ran (the worker's host name)
    errno: int | None = None
    strerror: str | None = None
    filename: str | None = None
    traceback: str = ""

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> Failure:
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            raise ValueError(f"not a host failure record: {data!r:.200}")
        return cls(type=data["type"], message=str(data.get("message", "")),
                   ranks=tuple(int(r) for r in data.get("ranks", ())), host=str(data.get("host", "")),
                   errno=data.get("errno"), strerror=data.get("strerror"), filename=data.get("filename"),
                   traceback=str(data.get("traceback", "")))


def _type_name(e: BaseException) -> str:
    cls = type(e)
    if cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def capture(e: Exception, ranks: tuple[int, ...] | list[int]) -> Failure:
    """The record of ``e``, raised by a host function acting for ``ranks``."""
    import socket

    err = e if isinstance(e, OSError) else None
    message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    tb = "".join(traceback.format_exception(e))[-TRACEBACK_CHARS:]
    filename = getattr(err, "filename", None)
    return Failure(type=_type_name(e), message=message, ranks=tuple(sorted(ranks)), host=socket.gethostname(),
                   errno=getattr(err, "errno", None), strerror=getattr(err, "strerror", None),
                   filename=None if filename is None else str(filename), traceback=tb)


def _class_of(name: str) -> type[BaseException] | None:
    if name in _BUILTINS:
        return getattr(builtins, name)
    where = _OURS.get(name)
    if where is None:
        return None
    import importlib

    return getattr(importlib.import_module(where[0]), where[1])


def revive(f: Failure) -> BaseException:
    """The controller-side exception for ``f``: its own type where known (else :class:`HostError`), its
    message, its ``errno``; a note names the ranks and host, another carries the worker's traceback."""
    cls = _class_of(f.type)
    if cls is None:
        err: BaseException = HostError(f"{f.type}: {f.message}")
    else:
        if issubclass(cls, OSError) and f.errno is not None:
            # OSError takes errno, strerror and filename in __new__ (ours may define another __init__).
            args = (f.errno, f.strerror or f.message, *(() if f.filename is None else (f.filename,)))
            err = cls.__new__(cls, *args)
            OSError.__init__(err, *args)
        else:
            err = cls.__new__(cls)
            BaseException.__init__(err, f.message)
    where = f" ({f.host})" if f.host else ""
    err.add_note(f"raised by the host function of rank(s) {list(f.ranks)}{where}")
    if f.traceback:
        err.add_note(f"host traceback:\n{f.traceback}")
    return err


def encode_row(payload: Any, size: int) -> bytes:
    """``payload`` as length-prefixed JSON of at most ``size`` bytes (a failure's traceback is cut to fit)."""
    data = json.dumps(payload).encode()
    if len(data) + 4 > size and isinstance(payload, dict) and FAILURE_KEY in payload:
        f = dict(payload[FAILURE_KEY])
        f["traceback"] = ""
        f["message"] = f["message"][: max(0, size // 2)]
        data = json.dumps({FAILURE_KEY: f}).encode()
    if len(data) + 4 > size:
        raise ValueError(f"host answer of {len(data)} bytes exceeds {size - 4}")
    return len(data).to_bytes(4, "little") + data


def decode_row(row: bytes) -> Any:
    """What :func:`encode_row` encoded; ``None`` for an all-zero row."""
    n = int.from_bytes(row[:4], "little")
    return json.loads(row[4 : 4 + n]) if n else None


def failure_payload(f: Failure) -> dict[str, Any]:
    """The row payload that carries ``f``."""
    return {FAILURE_KEY: f.to_wire()}


def failure_of(payload: Any) -> Failure | None:
    """The failure a decoded row carries, if it is one (``{FAILURE_KEY: {...}}``)."""
    if isinstance(payload, dict) and set(payload) == {FAILURE_KEY}:
        return Failure.from_wire(payload[FAILURE_KEY])
    return None
