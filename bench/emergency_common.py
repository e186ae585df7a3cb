"""What bench/emergency.py and bench/emergency_orbax.py share: the scenario's constants and its train state.

Both benchmarks' workers build the same deterministic state (:func:`make_state`), check a restore against it
bit for bit (:func:`check_state`) and run the same job shape (``PROCESSES`` hosts in ``SLICES`` slices).
``bench.emergency`` runs ``bench.emergency_orbax`` (imported in its ``main``); ``bench.emergency_orbax`` imports
only this module of the two.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MEASURES = ("save_block", "safe_after", "restore_local", "restore_one_lost", "restore_all_lost")
PROCESSES, SLICES, DEVICES_PER_PROCESS = 4, 2, 2
LOST_HOST = 3
WAIT_SECONDS = 300.0
RPC_TIMEOUT_SECONDS = 10.0


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    """``pred()``'s first truthy answer, polled every 20 ms; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


# --------------------------------------------------------------------------- the state (in each worker)

def leaf_specs(total_mib: int) -> list[tuple[str, tuple[int, ...], str, bool]]:
    """(name, global shape, dtype, 2-D) of the state: ~total_mib MiB, mixed shapes and dtypes."""
    total = total_mib << 20
    big = [("embed", 2048, "float32"), ("mlp_in", 1024, "bfloat16"), ("mlp_out", 4096, "float32"),
           ("attn", 512, "bfloat16"), ("opt_mu", 1024, "float32"), ("counts", 2048, "int32")]
    per = total * 95 // 100 // len(big)
    out = []
    for name, cols, dtype in big:
        item = 2 if dtype == "bfloat16" else 4
        rows = max(8, per // (cols * item) // 8 * 8)
        out.append((name, (rows, cols), dtype, True))
    small = total - sum(r * c * (2 if d == "bfloat16" else 4) for _, (r, c), d, _ in out)
    n_small = 16
    each = max(64, small // n_small // 4 // 64 * 64)
    out += [(f"bias{i}", (each,), "float32", False) for i in range(n_small)]
    return out


def _value(name: str, shape: tuple[int, ...], dtype: str, index: tuple[slice, ...]) -> Any:
    """The deterministic block ``index`` of leaf ``name`` (every host computes its own shards only)."""
    import numpy as np

    starts = [sl.start or 0 for sl in index]
    sizes = [(sl.stop if sl.stop is not None else n) - (sl.start or 0) for sl, n in zip(index, shape, strict=True)]
    seed = (sum(ord(c) for c in name) * 1_000_003 + starts[-1]) % (2**32)
    rng = np.random.default_rng(seed)
    if dtype == "int32":
        return rng.integers(-(2**31), 2**31 - 1, size=sizes, dtype=np.int32)
    x = rng.standard_normal(size=sizes, dtype=np.float32)
    return x.astype(dtype) if dtype != "float32" else x


def make_state(mesh: Any, total_mib: int) -> tuple[dict, dict]:
    """(state, abstract state) on ``mesh`` (axes ``replica``, ``model``): sharded within, replicated across."""
    import jax
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    state, abstract = {}, {}
    for name, shape, dtype, two_d in leaf_specs(total_mib):
        spec = P(None, "model") if two_d else P("model")
        sh = NamedSharding(mesh, spec)
        np_dtype = jax.numpy.dtype(dtype)
        state[name] = jax.make_array_from_callback(
            shape, sh, lambda idx, n=name, s=shape, d=dtype: _value(n, s, d, idx))
        abstract[name] = jax.ShapeDtypeStruct(shape, np_dtype, sharding=sh)
    return state, abstract


def abstract_state(mesh: Any, total_mib: int) -> dict:
    """The abstract state of :func:`make_state` (shapes, dtypes, shardings), without computing any value."""
    import jax
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return {name: jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype),
                                       sharding=NamedSharding(mesh, P(None, "model") if two_d else P("model")))
            for name, shape, dtype, two_d in leaf_specs(total_mib)}


def check_state(restored: dict, abstract: dict) -> int:
    """Raise ValueError unless every addressable shard is bit for bit what was saved, except for zeros whose
    sign was lost (a saved -0.0 restored as +0.0 or back: equal as numbers, not as bits), which are
    counted and returned: Orbax's emergency managers do that when they broadcast a replica's restored data
    to the other slices (a sum with the other replicas' zeros)."""
    import numpy as np

    sign_lost = 0
    for name, want in abstract.items():
        got = restored[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(f"{name}: restored {got.shape} {got.dtype}, saved {want.shape} {want.dtype}")
        for shard in got.addressable_shards:
            expect = np.asarray(_value(name, want.shape, str(want.dtype), shard.index))
            data = np.asarray(shard.data)
            if data.tobytes() == expect.tobytes():
                continue
            bits = np.dtype(f"u{expect.dtype.itemsize}")
            a, b = data.view(bits), expect.view(bits)
            differ = a != b
            floats = np.issubdtype(expect.dtype, np.floating) or expect.dtype.name == "bfloat16"
            if floats and np.all((data[differ] == 0) & (expect[differ] == 0)):
                sign_lost += int(differ.sum())
                continue
            raise ValueError(f"{name}: shard {shard.index} differs from what was saved "
                             f"({int(differ.sum())} of {differ.size} elements)")
    return sign_lost
