"""Test kit: see every verified read of a saved file (``sidecar.checksums.map_verified`` / ``read_verified``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar import checksums


def spy_reads(monkeypatch: Any, seen: Callable[[Path], None]) -> None:
    """Call ``seen(path)`` before every verified read, mapped or copied, for the rest of the test."""
    real_map, real_read = checksums.map_verified, checksums.read_verified

    def map_verified(path, *a, **kw):
        seen(path)
        return real_map(path, *a, **kw)

    def read_verified(path, *a, **kw):
        seen(path)
        return real_read(path, *a, **kw)

    monkeypatch.setattr(checksums, "map_verified", map_verified)
    monkeypatch.setattr(checksums, "read_verified", read_verified)
