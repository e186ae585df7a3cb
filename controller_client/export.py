"""`mtc export`: a downloaded native step as a standard Orbax checkpoint that plain ``orbax.checkpoint`` loads.

Every array is assembled whole from the ranks' verified shards (``sidecar.reader``), the tree is rebuilt
from the saved leaf paths (dict keys; list indices become lists), and the result is written with
``orbax.checkpoint.StandardCheckpointer``. Typed PRNG keys are written as their ``uint32`` key data
(``jax.random.wrap_key_data(data, impl=...)`` brings them back; the impl is in the manifest and in
``mtc inspect``). Imports jax and Orbax: only this command needs the ``[jax]`` extra.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

_PART_RE = re.compile(r"\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\]|\.([A-Za-z_][A-Za-z0-9_]*)")


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


def build_tree(leaves: dict[str, Any]) -> Any:
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


def export_step(step: int, roots: list[Path], dest: Path) -> dict[str, Any]:
    """Write ``step`` (every rank's data under ``roots``, as ``<root>/steps/<step>``) to ``dest`` with Orbax."""
    # Imported here: `mtc export` is the only admin command that needs JAX and Orbax ([jax] extra).
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from sidecar import layout, reader

    dest = Path(dest).absolute()
    if dest.exists():
        raise FileExistsError(f"{dest} exists already")
    src = reader.StepSource(step, roots)
    kinds = {m.kind for _, m in src.manifests}
    if kinds != {layout.KIND_NATIVE}:
        raise ValueError(f"step {step} was saved by {sorted(kinds)}: only native steps are exported (an Orbax "
                         "step is an Orbax checkpoint already: use `mtc backups download`)")
    leaves: dict[str, Any] = {}
    total = 0
    for path, arr in sorted(src.arrays.items()):
        full = tuple((0, n) for n in arr.global_shape)
        data = src.assemble(path, full)
        total += data.nbytes
        leaves[path] = jnp.asarray(data)
    for path, value in sorted(src.values.items()):
        leaves[path] = value
    tree = build_tree(leaves)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(dest, tree)
    ckptr.wait_until_finished()
    ckptr.close()
    keys = {p: a.key_impl for p, a in src.arrays.items() if a.key_impl}
    return {"step": step, "dest": str(dest), "leaves": len(leaves), "bytes": total, "prng_key_leaves": keys}
