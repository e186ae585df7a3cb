"""Pytree leaves as the checkpoint sees them: stable path strings, arrays, PRNG keys and plain values."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PLAIN_TYPES = (bool, int, float, str, type(None))


def _is_leaf(x: Any) -> bool:
    return x is None


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """[(path, leaf)] in treedef order, and the treedef. ``None`` is kept as a leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in leaves], treedef


def unflatten(treedef: Any, leaves: list[Any]) -> Any:
    return jax.tree_util.tree_unflatten(treedef, leaves)


def is_key_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def is_array_like(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def dtype_from_name(name: str) -> np.dtype:
    try:
        return jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"unknown dtype {name!r} in manifest") from e


def key_impl_name(x: Any) -> str:
    return str(jax.random.key_impl(x))


def key_data_shape(shape: tuple[int, ...], impl: str) -> tuple[int, ...]:
    """Shape of the uint32 key data behind a key array of ``shape`` (the impl adds trailing dims)."""
    probe = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return tuple(shape) + tuple(probe.shape)
