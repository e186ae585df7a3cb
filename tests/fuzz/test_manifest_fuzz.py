"""Property tests of the manifest parser: any bytes or JSON give a StepManifest or a ManifestError.

A manifest comes from a peer, a bucket or a RAM disk that may hold anything (bit flips, truncation, a
hostile peer): parsing must never fail with anything but the typed ManifestError (a ValueError), and what it
accepts must survive a round trip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import layout

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(), st.text(max_size=12),
    st.sampled_from(["../x", "/etc/passwd", "a/../b", "", ".", "a\x00b", "a\\b", layout.MANIFEST_NAME]),
)
json_value = st.recursive(json_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                          max_leaves=20)


def _valid() -> dict:
    files = [layout.FileEntry("0.0.bin", 16, 123), layout.FileEntry("1.0.bin", 8, 7)]
    arrays = [layout.ArrayEntry("w", (4, 4), "uint8", (layout.ShardEntry(((0, 4), (0, 4)), "0.0.bin", 0, 16, 123),)),
              layout.ArrayEntry("b", (8,), "uint8", (layout.ShardEntry(((0, 8),), "1.0.bin", 0, 8, 7),))]
    m = layout.StepManifest("job", 3, 1, 2, tuple(files), tuple(arrays), (layout.ValueEntry("step", 3),))
    return m.to_dict()


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON document, the root included."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(doc, path, value):
    if not path:
        return value
    cur = doc
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return doc


# Untyped errors the parser is known to raise: none (int(Infinity) and deep nesting are ManifestErrors now).
KNOWN_UNTYPED: tuple[type[BaseException], ...] = ()


def _parse(data: bytes, tolerate_known: bool = True) -> layout.StepManifest | None:
    try:
        m = layout.StepManifest.from_json(data)
    except layout.ManifestError:
        return None
    except KNOWN_UNTYPED:
        if tolerate_known:
            return None
        raise
    # What is accepted is self-consistent: it round-trips and its names are safe relative paths.
    assert layout.StepManifest.from_json(m.to_json()) == m
    for f in m.files:
        layout.safe_relpath(f.name)
    return m


def test_the_valid_manifest_parses() -> None:
    assert _parse(json.dumps(_valid()).encode()) is not None


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _parse(data)


@SETTINGS
@given(json_value)
def test_random_json(doc) -> None:
    _parse(json.dumps(doc).encode())


@SETTINGS
@given(st.data())
def test_mutated_valid_manifest(data) -> None:
    doc = _valid()
    for _ in range(data.draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path, _ = data.draw(st.sampled_from(paths))
        action = data.draw(st.sampled_from(["replace", "delete"]))
        if action == "delete" and path:
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            del parent[path[-1]]
        else:
            doc = _set(doc, path, data.draw(json_value))
    _parse(json.dumps(doc).encode())


@SETTINGS
@given(st.binary(min_size=1, max_size=400), st.integers(0, 10_000))
def test_flipped_and_truncated_bytes(noise: bytes, where: int) -> None:
    raw = bytearray(json.dumps(_valid()).encode())
    i = where % len(raw)
    raw[i] ^= noise[0] or 1
    _parse(bytes(raw))
    _parse(bytes(raw[: where % len(raw)]))


@SETTINGS
@given(st.binary(max_size=200))
def test_read_manifest_from_disk(tmp_path_factory, data: bytes) -> None:
    d = tmp_path_factory.mktemp("m")
    (d / layout.MANIFEST_NAME).write_bytes(data)
    try:
        layout.read_manifest(d)
    except layout.ManifestError:
        pass


# Defects the fuzzers found, kept as exact regressions: each is a ManifestError now.
KNOWN = [
    pytest.param(b'{"format_version": Infinity}', id="infinity-int-overflow"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting-recursion"),
]


@pytest.mark.parametrize("data", KNOWN)
def test_known_parser_defects(data: bytes) -> None:
    assert _parse(data, tolerate_known=False) is None


def test_read_manifest_missing_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        layout.read_manifest(tmp_path)
