"""The start of a colocated-Python sidecar on a Pathways worker: Orbax's colocated serialization patch and parsed
absl flags, in place before the worker unpickles its first program.

The sidecar image (Dockerfile.sidecar) runs :func:`arm` from a ``.pth`` file at every interpreter start, which
only registers an import hook (no JAX, no Orbax loaded); the hook acts once ``jax.experimental.colocated_python``
has been imported, i.e. in the process that serves colocated programs, before it deserializes any.

Why at start, not later:

- Orbax installs its patch on a worker only in ``WorkerCheckpointManager.__init__``, after the worker has
  unpickled its first program (the colocated init's ``_setup``), whose shardings name the worker's CPU devices by
  controller-side ids; JAX's own lookup then fails (``Invalid device ID 2``, docs/pathways.md). Our own calls
  install it while they unpickle (``controller_client.dispatch._PathwaysIds``); Orbax's do not.
- Orbax's restore reads absl flags, which a process outside ``absl.app`` has not parsed
  (``UnparsedFlagAccessError``): they are marked parsed with their defaults unless someone parsed them already.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

COLOCATED_PYTHON = "jax.experimental.colocated_python"

_lock = threading.Lock()


def install_orbax_patch() -> None:
    """Has JAX's colocated deserialization resolve controller-side device ids (Orbax's patch for exactly that;
    idempotent)."""
    from orbax.checkpoint._src.multihost import colocated_transport

    colocated_transport.install_pathways_colocated_serialization_patch()


def prepare_worker() -> None:
    """What a colocated-Python worker needs before its first program: Orbax's patch, absl flags parsed."""
    install_orbax_patch()
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class _Loader(importlib.abc.Loader):
    """Runs the real loader of ``jax.experimental.colocated_python``, then :func:`prepare_worker`."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        prepare_worker()

    def __getattr__(self, name: str) -> Any:  # the rest (resources, source) from the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``jax.experimental.colocated_python`` with the other finders and wraps its loader (once)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != COLOCATED_PYTHON:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def arm() -> None:
    """Prepare the worker as soon as colocated Python is imported (at once when it already is)."""
    if COLOCATED_PYTHON in sys.modules:
        prepare_worker()
        return
    with _lock:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
