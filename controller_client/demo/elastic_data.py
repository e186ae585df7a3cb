"""The elastic demo's input pipeline: a grain dataset read through grain's ``ElasticIterator``, one data
shard per active slice, whose state travels in the checkpoint with the train state.

``grain.experimental.ElasticIterator`` takes an unbatched, unsharded ``MapDataset``, the *global* batch size
and the shard (``shard_index`` of ``shard_count``); shard ``i`` of ``n`` reads records
``next + i, next + i + n, ...`` and batches ``global_batch / n`` of them. Its state is one number, the
global index of the next record (``{"global_next_index": ...}``), the same on every shard once they have
all advanced the same number of steps, so the state of any shard restores every shard of any shard count.
Whatever the number of active slices, step ``s`` therefore trains on the same records, those at positions
``(s - 1) * global_batch ... s * global_batch - 1`` of the shuffled, repeated dataset; only their order
inside the global batch differs (interleaved by shard), which a mean over the batch does not see beyond
float rounding.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

GLOBAL_BATCH = 64
FEATURES = 32
RECORDS = 4096  # one epoch; the dataset repeats (reshuffled each epoch)
DATA_AXIS = "data"


def _example(seed: int, w_true: np.ndarray, index: Any) -> dict[str, np.ndarray]:
    i = int(index)
    x = np.random.default_rng([seed, i]).standard_normal(w_true.shape[0]).astype(np.float32)
    return {"id": np.int32(i), "x": x, "y": x @ w_true}


def make_dataset(w_true: np.ndarray, seed: int = 1000, records: int = RECORDS) -> Any:
    """Records ``{"id", "x", "y"}``: ``x`` drawn from (seed, id), ``y = x @ w_true``; globally shuffled,
    repeated forever (a ``grain.MapDataset``, unbatched and unsharded as ``ElasticIterator`` wants it)."""
    # Imported here: grain is in the [elastic] extra, needed only by the elastic demos.
    import grain

    return (grain.MapDataset.range(records).shuffle(seed=seed)
            .map(functools.partial(_example, seed, np.asarray(w_true, np.float32))).repeat())


class ElasticBatches:
    """Global batches on ``mesh``: one ``ElasticIterator`` shard per row of the mesh's ``"data"`` axis
    (one per active slice), each shard's rows placed on that row's devices.

    ``get_state()`` is the JSON of the shards' common ``ElasticIterator`` state (a ``str`` leaf for the
    checkpointed tree); ``set_state()`` gives it to every shard, whatever the shard count was at save.
    """

    def __init__(self, dataset: Any, mesh: Mesh, global_batch: int = GLOBAL_BATCH,
                 read_options: Any = None):
        # Imported here: grain is in the [elastic] extra, needed only by the elastic demos.
        import grain
        from grain.experimental import ElasticIterator

        self.mesh = mesh
        self.shards = mesh.shape[DATA_AXIS]
        self.global_batch = global_batch
        if global_batch % self.shards:
            raise ValueError(f"global batch {global_batch} is not divisible by {self.shards} data shards")
        self.shard_batch = global_batch // self.shards
        # One reader thread per shard: records are cheap here, and the host has 2 cores. Prefetching does
        # not affect the state: it counts the records handed out, not the records read ahead.
        opts = read_options or grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.shard_batch)
        self._iterators = [
            ElasticIterator(dataset, global_batch, grain.sharding.ShardOptions(i, self.shards, drop_remainder=True),
                            read_options=opts)
            for i in range(self.shards)
        ]

    def __iter__(self) -> ElasticBatches:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        """The next global batch: ``{"id", "x", "y"}``, each sharded over ``"data"`` (shard i on row i)."""
        parts = [next(it) for it in self._iterators]
        out = {}
        for key in parts[0]:
            blocks = [np.asarray(p[key]) for p in parts]
            shape = (self.global_batch, *blocks[0].shape[1:])
            sharding = NamedSharding(self.mesh, P(DATA_AXIS))
            out[key] = jax.make_array_from_callback(
                shape, sharding, lambda index, blocks=blocks: blocks[(index[0].start or 0) // self.shard_batch])
        return out

    def get_state(self) -> str:
        """The iterator state to checkpoint (JSON text). Every shard must agree: a shard that advanced a
        different number of steps would make the state meaningless for the others."""
        states = [it.get_state() for it in self._iterators]
        if any(s != states[0] for s in states[1:]):
            raise RuntimeError(f"data shards are out of step: {states}")
        return json.dumps(states[0], sort_keys=True)

    def set_state(self, state: str) -> None:
        """Continue from a checkpointed ``get_state()``, saved with any number of shards."""
        decoded = json.loads(state)
        if not isinstance(decoded, dict):
            raise ValueError(f"not a data iterator state: {state!r}")
        for it in self._iterators:
            it.set_state(decoded)

    def close(self) -> None:
        for it in self._iterators:
            it.close()
