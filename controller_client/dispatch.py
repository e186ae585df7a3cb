"""Reaching the hosts: one narrow interface, two implementations (colocated Python and in-process).

``ColocatedDispatcher`` runs the sidecar's host functions through ``jax.experimental.colocated_python`` —
on Pathways each call runs on every worker host; on CPU it runs inline in this process.
``InProcessDispatcher`` is for multi-controller jobs where every process is a host.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sidecar import host

# Size of the per-device answer buffer of a colocated query or of a restore's plain values (JSON, one row per
# device). A host's answer does not grow with the job's size (ranks travel as ranges, see sidecar.saves): a
# STEPS answer is ~100 bytes per held step at any node count.
QUERY_BYTES = 1 << 16


class Dispatcher(abc.ABC):
    """Runs a sidecar host operation on every host and gathers per-rank answers."""

    def __init__(self, config: host.HostConfig):
        self.config = config

    @abc.abstractmethod
    def save(self, step: int, arrays: Sequence[jax.Array], metas: Sequence[host.ArrayMeta],
             host_arrays: Sequence[tuple[str, np.ndarray]], values: Sequence[Any], generation: int = 0,
             replace: bool = False) -> None:
        """Start saving (returns once host copies are taken)."""

    @abc.abstractmethod
    def restore(self, step: int, leaves: Sequence[host.RestoreLeaf], all_paths: Sequence[str]) -> host.RestoreResult:
        """Arrays for each leaf, sharded as asked, and the step's plain values: one fan-out."""

    @abc.abstractmethod
    def query(self, query: host.HostQuery, arg: Any = None) -> dict[int, Any]:
        """Every rank's answer to ``query`` (see :class:`sidecar.host.HostQuery`)."""


class InProcessDispatcher(Dispatcher):
    """Each process is a host (multi-controller JAX); answers are gathered across processes."""

    def __init__(self, config: host.HostConfig, local_devices: Sequence[Any] | None = None):
        super().__init__(config)
        self.ranks = host.ranks_of(config, local_devices if local_devices is not None else jax.local_devices())

    def save(self, step, arrays, metas, host_arrays, values, generation=0, replace=False):
        host.save_on_hosts(self.config, self.ranks, step, arrays, metas, host_arrays, values, generation, replace)

    def restore(self, step, leaves, all_paths):
        return host.restore_on_hosts(self.config, self.ranks, step, leaves, all_paths)

    def query(self, query, arg=None):
        local = host.query_on_hosts(self.config, self.ranks, query, arg)
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        mine = host.encode_result(query, local, QUERY_BYTES)
        rows = np.asarray(multihost_utils.process_allgather(mine))
        out: dict[int, Any] = {}
        for row in rows.reshape(-1, QUERY_BYTES):
            out.update(host.decode_result(query, row))
        return out


def _spec(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _coloc_save(handle, arrays, *, config, step, metas, host_arrays, values, generation=0, replace=False):
    ranks = host.ranks_of(config, [s.device for s in handle.addressable_shards])
    host.save_on_hosts(config, ranks, step, arrays, metas, host_arrays, values, generation, replace)
    return handle


def _coloc_restore(handle, rows, *, config, step, leaves, all_paths):
    ranks = host.ranks_of(config, [s.device for s in handle.addressable_shards])
    res = host.restore_on_hosts(config, ranks, step, leaves, all_paths)
    # The plain values travel back in the same call, one row per device (every rank read the same values).
    row = encode_values(res.values)
    bufs = [jax.device_put(row[None], s.device) for s in rows.addressable_shards]
    return res.arrays, jax.make_array_from_single_device_arrays(rows.shape, rows.sharding, bufs)


def encode_values(values: dict[str, Any]) -> np.ndarray:
    """A restore's plain values as one row (length-prefixed JSON; they are JSON-able by construction)."""
    data = json.dumps(values).encode()
    if len(data) > QUERY_BYTES - 4:
        raise ValueError(f"the plain values of the step take {len(data)} bytes, more than {QUERY_BYTES - 4}")
    buf = np.zeros(QUERY_BYTES, dtype=np.uint8)
    buf[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
    buf[4 : 4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf


def decode_values(row: np.ndarray) -> dict[str, Any]:
    n = int.from_bytes(bytes(row[:4]), "little")
    return json.loads(bytes(row[4 : 4 + n])) if n else {}


def _coloc_query(rows, *, config, query, arg):
    ranks = host.ranks_of(config, [s.device for s in rows.addressable_shards])
    answers = host.query_on_hosts(config, ranks, query, arg)
    bufs = []
    for s in rows.addressable_shards:
        r = config.device_rank[s.device.id]
        bufs.append(jax.device_put(host.encode_result(query, {r: answers[r]}, QUERY_BYTES)[None], s.device))
    return jax.make_array_from_single_device_arrays(rows.shape, rows.sharding, bufs)


class ColocatedDispatcher(Dispatcher):
    """Host operations through colocated Python on the CPU devices colocated with the job's devices."""

    def __init__(self, config: host.HostConfig, devices: Sequence[Any]):
        from jax.experimental import colocated_python

        self._cp = colocated_python
        self.devices = list(devices)
        self.cpu_devices = list(colocated_python.colocated_cpu_devices(self.devices))
        # The host functions see the colocated CPU devices: map those to ranks.
        rank_by_cpu = {c.id: config.device_rank[d.id] for d, c in zip(self.devices, self.cpu_devices, strict=True)}
        super().__init__(config)
        self.cpu_config = host.HostConfig(**{**config.__dict__, "device_rank": rank_by_cpu})
        self._mesh = Mesh(np.array(self.cpu_devices), ("d",))
        self._handle_sharding = NamedSharding(self._mesh, PartitionSpec("d"))
        self._rows_sharding = NamedSharding(self._mesh, PartitionSpec("d", None))
        self._same_devices = [d.id for d in self.devices] == [c.id for c in self.cpu_devices]

    def _handle(self) -> jax.Array:
        return jax.device_put(np.zeros(len(self.cpu_devices), np.uint8), self._handle_sharding)

    def _to_cpu(self, x: jax.Array) -> jax.Array:
        if self._same_devices:
            return x
        return jax.device_put(x, self.cpu_sharding(x.sharding))

    def cpu_sharding(self, sharding: Any) -> Any:
        """The same layout over the colocated CPU devices."""
        if self._same_devices or sharding is None:
            return sharding
        if not isinstance(sharding, NamedSharding):
            raise ValueError(f"colocated restore needs NamedSharding targets, got {type(sharding).__name__}")
        by_id = {d.id: c for d, c in zip(self.devices, self.cpu_devices, strict=True)}
        devs = np.vectorize(lambda d: by_id[d.id], otypes=[object])(sharding.mesh.devices)
        return NamedSharding(Mesh(devs, sharding.mesh.axis_names), sharding.spec)

    def save(self, step, arrays, metas, host_arrays, values, generation=0, replace=False):
        fn = functools.partial(_coloc_save, config=self.cpu_config, step=step, metas=list(metas),
                               host_arrays=list(host_arrays), values=list(values), generation=generation,
                               replace=replace)
        h = self._handle()
        self._cp.colocated_python(fn).specialize(out_specs_fn=lambda *a, **k: _spec(h))(
            h, [self._to_cpu(a) for a in arrays])

    def restore(self, step, leaves, all_paths):
        cpu_leaves = [dataclasses.replace(lf, sharding=self.cpu_sharding(lf.sharding)) for lf in leaves]
        fn = functools.partial(_coloc_restore, config=self.cpu_config, step=step, leaves=cpu_leaves,
                               all_paths=list(all_paths))
        rows = jax.device_put(np.zeros((len(self.cpu_devices), QUERY_BYTES), np.uint8), self._rows_sharding)
        out, vals = self._cp.colocated_python(fn)(self._handle(), rows)
        values = decode_values(np.asarray(vals.addressable_shards[0].data)[0])
        if not self._same_devices:
            out = [jax.device_put(x, lf.sharding) for x, lf in zip(out, leaves, strict=True)]
        return host.RestoreResult(list(out), values)

    def query(self, query, arg=None):
        rows = jax.device_put(np.zeros((len(self.cpu_devices), QUERY_BYTES), np.uint8), self._rows_sharding)
        fn = functools.partial(_coloc_query, config=self.cpu_config, query=host.HostQuery(query).value, arg=arg)
        res = self._cp.colocated_python(fn).specialize(out_specs_fn=lambda *a, **k: _spec(rows))(rows)
        out: dict[int, Any] = {}
        for row in np.asarray(res):
            out.update(host.decode_result(query, row))
        return out
