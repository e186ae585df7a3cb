"""`mtc export`: a downloaded native step as a standard Orbax checkpoint that plain ``orbax.checkpoint`` loads.

Streamed (:mod:`.stream`): each saved shard is read once, piece by piece, verified by its crc32c, and written
chunk by chunk into the checkpoint's OCDBT database with TensorStore, so memory stays bounded whatever the
state's size. The tree is rebuilt from the saved leaf paths (:mod:`.leaves`); the on-disk format is
:mod:`.orbax_files`'; the chunking :mod:`.plan`'s. Typed PRNG keys are written as their ``uint32`` key data
(``jax.random.wrap_key_data(data, impl=...)`` brings them back; the impl is in the manifest and in
``mtc inspect``). Needs TensorStore (the ``[jax]`` extra); imports no JAX.
"""

from __future__ import annotations

from controller_client.export.leaves import build_tree, parse_path
from controller_client.export.stream import CHUNK_BYTES, ExportOptions, export_step, working_set_bytes

__all__ = ["CHUNK_BYTES", "ExportOptions", "build_tree", "export_step", "parse_path", "working_set_bytes"]
