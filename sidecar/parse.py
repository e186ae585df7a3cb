"""THE integer rule for every input we read (flags, YAML, env, manifests, requests)."""

from __future__ import annotations

import re
from typing import Any

_INT_RE = re.compile(r"^[+-]?[0-9]{1,19}$")


def parse_int(value: Any, what: str, minimum: int | None = None, *, strict: bool = False) -> int:
    """THE integer rule for every input we read (flags, YAML, env, manifests, requests).

    Accepts an ``int`` (never a ``bool``) or, unless ``strict``, a decimal string; anything else, or a value
    below ``minimum``, is a ``ValueError`` whose message starts with ``what`` (e.g. ``--rank``).
    """
    if isinstance(value, str) and not strict and _INT_RE.match(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what}: must be >= {minimum}, got {value}")
    return value
