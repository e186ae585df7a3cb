"""Logging set-up shared by `mtc` and `mtc-replicator`: one level option, read after the subcommand too."""

from __future__ import annotations

import argparse
import logging
import os

LEVELS = ("debug", "info", "warning", "error")
ENV_LOG_LEVEL = "MTC_LOG_LEVEL"
DEFAULT_LEVEL = "warning"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(p: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """``--log-level`` (and ``-v`` = info) on ``p``; unset means ``$MTC_LOG_LEVEL``, else ``warning``.

    ``default=argparse.SUPPRESS`` lets the same flags appear before and after a subcommand without the
    subparser's default overwriting what was given before it.
    """
    p.add_argument("--log-level", choices=LEVELS, type=str.lower, default=default,
                   help=f"log level (default: ${ENV_LOG_LEVEL} or {DEFAULT_LEVEL})")
    p.add_argument("-v", "--verbose", action="store_true", default=default if default else False,
                   help="log at INFO level (same as --log-level info)")


def level_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    env = (os.environ if environ is None else environ).get(ENV_LOG_LEVEL, "").strip().lower()
    if getattr(args, "log_level", None):
        return args.log_level
    if getattr(args, "verbose", False):
        return "info"
    if env in LEVELS:
        return env
    return DEFAULT_LEVEL


def configure(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format=FORMAT, force=True)
