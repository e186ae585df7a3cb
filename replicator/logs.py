"""Logging set-up shared by `mtc` and `mtc-replicator`: level and format options, read after the subcommand too.

Every line carries the process's job, rank and incarnation once the daemon knows them
(:func:`set_context`). ``--log-format json`` writes one JSON object per line with the fields Cloud
Logging reads from a container's output (``severity``, ``message``, ``time``), plus ``logger``, ``job``,
``rank`` and ``incarnation``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import threading
import time
from typing import IO, Any

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
ENV_LOG_LEVEL = "MTC_LOG_LEVEL"
ENV_LOG_FORMAT = "MTC_LOG_FORMAT"
DEFAULT_LEVEL = "warning"
DEFAULT_FORMAT = "text"
FORMAT = "%(asctime)s %(levelname)s %(mtc_context)s%(name)s: %(message)s"

_context: dict[str, Any] = {}
_context_lock = threading.Lock()


def add_arguments(p: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """``--log-level`` (and ``-v`` = info) and ``--log-format`` on ``p``.

    Unset means ``$MTC_LOG_LEVEL`` / ``$MTC_LOG_FORMAT``, else ``warning`` / ``text``.
    ``default=argparse.SUPPRESS`` lets the same flags appear before and after a subcommand without the
    subparser's default overwriting what was given before it.
    """
    p.add_argument("--log-level", choices=LEVELS, type=str.lower, default=default,
                   help=f"log level (default: ${ENV_LOG_LEVEL} or {DEFAULT_LEVEL})")
    p.add_argument("-v", "--verbose", action="store_true", default=default if default else False,
                   help="log at INFO level (same as --log-level info)")
    p.add_argument("--log-format", choices=FORMATS, type=str.lower, default=default,
                   help=f"text, or json for Cloud Logging (default: ${ENV_LOG_FORMAT} or {DEFAULT_FORMAT})")


def level_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    env = (os.environ if environ is None else environ).get(ENV_LOG_LEVEL, "").strip().lower()
    if getattr(args, "log_level", None):
        return args.log_level
    if getattr(args, "verbose", False):
        return "info"
    if env in LEVELS:
        return env
    return DEFAULT_LEVEL


def format_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    env = (os.environ if environ is None else environ).get(ENV_LOG_FORMAT, "").strip().lower()
    if getattr(args, "log_format", None):
        return args.log_format
    if env in FORMATS:
        return env
    return DEFAULT_FORMAT


def set_context(**fields: Any) -> None:
    """Stamp every later log line of this process with these fields (e.g. job, rank, incarnation)."""
    with _context_lock:
        _context.update({k: v for k, v in fields.items() if v is not None})


def context() -> dict[str, Any]:
    with _context_lock:
        return dict(_context)


class _ContextFilter(logging.Filter):
    """Adds the process's context to each record: ``mtc_context`` (text) and ``mtc_fields`` (JSON)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = context()
        record.mtc_fields = ctx
        record.mtc_context = "".join(f"{k}={v} " for k, v in ctx.items())
        return True


class RateLimitFilter(logging.Filter):
    """At most ``burst`` warnings/errors per ``window_seconds`` for each (logger, message template): hostile or broken
    input (garbage protobufs, a client hammering a refused call) cannot flood the log. The first line let
    through after a suppression says how many similar lines were dropped."""

    def __init__(self, burst: int = 10, window_seconds: float = 60.0, clock: Any = time.monotonic):
        super().__init__()
        self.burst, self.window, self.clock = burst, window_seconds, clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, Any], list[float | int]] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:  # INFO/DEBUG lines are our own progress: each one is kept
            return True
        key = (record.name, record.msg)
        now = self.clock()
        with self._lock:
            st = self._seen.get(key)
            if st is None or now - st[0] >= self.window:
                dropped = int(st[2]) if st is not None else 0
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > 4096:  # bounded: forget the oldest windows
                    for k in sorted(self._seen, key=lambda k: self._seen[k][0])[:1024]:
                        del self._seen[k]
                if dropped:
                    record.msg = f"{record.msg} ({dropped} similar lines suppressed in the last {self.window:.0f}s)"
                return True
            if st[1] < self.burst:
                st[1] += 1
                return True
            st[2] += 1
            return False


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with Cloud Logging's ``severity``, ``message`` and ``time``."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        out: dict[str, Any] = {
            "severity": "CRITICAL" if record.levelno >= logging.CRITICAL else record.levelname,
            "message": message,
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "logger": record.name,
        }
        out.update(getattr(record, "mtc_fields", None) or {})
        return json.dumps(out, default=str)


def configure(level: str, fmt: str = DEFAULT_FORMAT, stream: IO[str] | None = None) -> None:
    """Log at ``level`` in ``fmt`` (text or json) to ``stream`` (default stderr), replacing earlier set-up."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RateLimitFilter())
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
