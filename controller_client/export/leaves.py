"""The saved leaf paths of a native step as the tree Orbax stores: each leaf's keys, their kinds and its name.

A native manifest names each leaf by its ``jax.tree_util.keystr`` path (``"['opt'][0].mu"``); Orbax names it
by its keys joined with ``.`` (``opt.0.mu``) and records each key as a dict key or a sequence index. Lists are
rebuilt where every key of a level is 0..n-1; other integer keys become string dict keys.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator, Mapping
from typing import Any

_PART_RE = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_][A-Za-z0-9_]*)")
SEQUENCE_KEY, DICT_KEY = 1, 2  # Orbax's KeyType values in _METADATA
_SCALAR_DTYPES = ((bool, "bool"), (int, "int64"), (float, "float64"))  # as Orbax stores Python scalars


def parse_path(path: str) -> list[str | int]:
    """``"['opt'][0].mu"`` -> ``['opt', 0, 'mu']`` (the ``jax.tree_util.keystr`` form the manifest stores)."""
    out: list[str | int] = []
    pos = 0
    while pos < len(path):
        m = _PART_RE.match(path, pos)
        if m is None:
            raise ValueError(f"cannot export leaf path {path!r}: unsupported key at {path[pos:]!r}")
        if m.group(2) is not None:
            out.append(m.group(2))
        else:
            out.append(ast.literal_eval(m.group(1)))
        pos = m.end()
    if not out:
        raise ValueError(f"cannot export leaf path {path!r}")
    return out


def build_tree(leaves: Mapping[str, Any]) -> Any:
    """Nested dicts (and lists where every key of a level is 0..n-1) from ``{path: leaf}``."""
    root: dict[Any, Any] = {}
    for path, leaf in leaves.items():
        keys = parse_path(path)
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"leaf path {path!r} conflicts with another leaf")
        if keys[-1] in node:
            raise ValueError(f"leaf path {path!r} appears twice")
        node[keys[-1]] = leaf

    def fix(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        fixed = {k: fix(v) for k, v in node.items()}
        if fixed and all(isinstance(k, int) for k in fixed) and sorted(fixed) == list(range(len(fixed))):
            return [fixed[i] for i in range(len(fixed))]
        return {str(k): v for k, v in fixed.items()}

    return fix(root)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf as Orbax stores it. ``kind``: "array" (a saved array), "scalar" (a Python int, float or bool,
    stored as a 0-d array) or "none" (no data)."""

    path: str  # the manifest's path
    keys: tuple[str, ...]
    key_types: tuple[int, ...]
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    value: Any = None

    @property
    def name(self) -> str:
        """Orbax's parameter name: the zarr array's key in the OCDBT database."""
        return ".".join(self.keys)


def _scalar_dtype(path: str, value: Any) -> str:
    for kind, dtype in _SCALAR_DTYPES:
        if isinstance(value, kind):
            return dtype
    raise ValueError(f"cannot export leaf {path!r}: a {type(value).__name__} value (a standard Orbax checkpoint "
                     "holds arrays, numbers and None)")


def _walk(node: Any, keys: tuple[str, ...], types: tuple[int, ...]) -> Iterator[tuple[tuple[str, ...],
                                                                                    tuple[int, ...], Any]]:
    if isinstance(node, dict):
        for k in sorted(node):
            yield from _walk(node[k], (*keys, k), (*types, DICT_KEY))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*keys, str(i)), (*types, SEQUENCE_KEY))
    else:
        yield keys, types, node


def tree_leaves(arrays: Mapping[str, tuple[tuple[int, ...], str]], values: Mapping[str, Any]) -> list[Leaf]:
    """Every leaf of the step in Orbax's terms: ``arrays`` maps a path to (global shape, dtype name),
    ``values`` a path to its Python value. ValueError for a value Orbax's standard checkpoint cannot hold
    (a string) or paths that do not make a tree."""
    marks: dict[str, Leaf] = {}
    for path, (shape, dtype) in arrays.items():
        marks[path] = Leaf(path, (), (), "array", tuple(shape), dtype)
    for path, value in values.items():
        if path in marks:
            raise ValueError(f"leaf path {path!r} appears twice")
        kind = "none" if value is None else "scalar"
        marks[path] = Leaf(path, (), (), kind, (), "" if value is None else _scalar_dtype(path, value), value)
    tree = build_tree(marks)
    if not isinstance(tree, (dict, list)) or not marks:
        raise ValueError("nothing to export")
    return [dataclasses.replace(leaf, keys=keys, key_types=types) for keys, types, leaf in _walk(tree, (), ())]
