"""What a standard Orbax checkpoint is on disk, as ``orbax.checkpoint.StandardCheckpointer`` (0.12) writes
it and reads it back: the one place that knows.

- one OCDBT database at the checkpoint's root (``manifest.ocdbt``, ``d/``) holding a zarr v2 array per leaf
  (zstd level 1, as Orbax compresses), keyed by the leaf's parameter name (its keys joined with ``.``);
  scalars are 0-d arrays, ``None`` leaves have no data;
- ``_METADATA``: the tree (each leaf's keys and their kinds, its value type, its write shape) and the
  format flags (``use_ocdbt``, ``use_zarr3``);
- ``_sharding``: each array's sharding (base64 of its name -> a single device, ``cpu:0``, as an array
  saved from one host's CPU is restored);
- ``array_metadatas/process_0``: each array's write and chunk shape;
- ``_CHECKPOINT_METADATA``: the handler and the times, written last (the commit marker here).

Orbax writes the data of each process under ``ocdbt.process_<i>/`` and merges them into the root database
when it finalises; one writer writes the root database directly, which is what Orbax reads.
``tests/controller_client/test_export.py`` compares these files with Orbax's own for the same tree.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

from controller_client.export.leaves import Leaf

HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"  # written last: a directory without it is not a checkpoint
COMPRESSOR = {"id": "zstd", "level": 1}
SHARDING = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"})
# Orbax's OCDBT settings (orbax/checkpoint/_src/serialization/tensorstore_utils.py): small values (the
# .zarray files) inline in the tree, a single-file manifest. (Orbax's nodes are of up to 100 MB, one root
# node; the node size is the writer's choice, recorded in the manifest: the export passes its own.)
OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "manifest_kind": "single"}
OCDBT_TARGET_DATA_FILE_BYTES = 2**31


def ts_context(copy_threads: int, io_threads: int, ocdbt_cache_bytes: int) -> dict[str, Any]:
    """TensorStore's context for an export: no chunk cache (a written chunk is encoded, stored and dropped,
    so nothing accumulates), a small cache of OCDBT tree nodes, bounded thread pools."""
    return {
        "cache_pool": {"total_bytes_limit": 0},
        "cache_pool#ocdbt": {"total_bytes_limit": ocdbt_cache_bytes},
        "data_copy_concurrency": {"limit": copy_threads},
        "file_io_concurrency": {"limit": io_threads},
    }


def kvstore_spec(root: str, node_bytes: int) -> dict[str, Any]:
    """The OCDBT database at the checkpoint's root (an absolute local path), b-tree nodes of at most
    ``node_bytes``."""
    return {
        "driver": "ocdbt",
        "base": {"driver": "file", "path": root.rstrip("/") + "/"},
        "config": {**OCDBT_CONFIG, "max_decoded_node_bytes": node_bytes},
        "target_data_file_size": OCDBT_TARGET_DATA_FILE_BYTES,
        "cache_pool": "cache_pool#ocdbt",
    }


def array_spec(kvstore: dict[str, Any], leaf: Leaf, chunks: Sequence[int]) -> dict[str, Any]:
    """The zarr v2 array of one leaf in the database ``kvstore`` (created; it must not exist)."""
    return {
        "driver": "zarr",
        "kvstore": {**kvstore, "path": leaf.name},
        "dtype": leaf.dtype,
        "metadata": {"shape": list(leaf.shape), "chunks": list(chunks), "compressor": dict(COMPRESSOR)},
        "store_data_equal_to_fill_value": True,
        "create": True,
    }


def _value_metadata(leaf: Leaf) -> dict[str, Any]:
    if leaf.kind == "array":
        return {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(leaf.shape)}
    if leaf.kind == "scalar":
        return {"value_type": "scalar", "skip_deserialize": False}
    return {"value_type": "None", "skip_deserialize": True}


def metadata(leaves: Sequence[Leaf]) -> dict[str, Any]:
    """``_METADATA``: the tree Orbax rebuilds on restore."""
    tree = {
        str(leaf.keys): {
            "key_metadata": [{"key": k, "key_type": t} for k, t in zip(leaf.keys, leaf.key_types, strict=True)],
            "value_metadata": _value_metadata(leaf),
        }
        for leaf in leaves
    }
    return {"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def sharding(leaves: Sequence[Leaf]) -> dict[str, str]:
    """``_sharding``: every array on one CPU device (jax arrays come back whole, on ``cpu:0``)."""
    return {base64.b64encode(leaf.name.encode()).decode(): SHARDING for leaf in leaves if leaf.kind == "array"}


def array_metadatas(leaves: Sequence[Leaf], chunks: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``array_metadatas/process_0``: each array's write shape (the whole array) and chunk shape."""
    return {"array_metadatas": [
        {"array_metadata": {"param_name": leaf.name, "write_shape": list(leaf.shape),
                            "chunk_shape": list(chunks[leaf.name]), "ext_metadata": None}}
        for leaf in leaves if leaf.kind == "array"]}


def checkpoint_metadata(init_ns: int, commit_ns: int) -> dict[str, Any]:
    """``_CHECKPOINT_METADATA``: the handler that restores the checkpoint, and when it was written."""
    return {"item_handlers": HANDLER, "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": init_ns,
            "commit_timestamp_nsecs": commit_ns, "custom_metadata": {}}
