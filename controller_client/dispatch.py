"""Reaching the hosts: one narrow interface, two implementations (colocated Python and in-process).

``ColocatedDispatcher`` runs the sidecar's host functions through ``jax.experimental.colocated_python`` —
on Pathways each call runs on every worker host; on CPU it runs inline in this process.
``InProcessDispatcher`` is for multi-controller jobs where every process is a host.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sidecar import failures, host, tree

log = logging.getLogger(__name__)

# Size of the per-device answer buffer of a colocated query or of a restore's plain values (JSON, one row per
# device). A host's answer does not grow with the job's size (ranks travel as ranges, see sidecar.saves): a
# STEPS answer is ~100 bytes per held step at any node count.
QUERY_BYTES = 1 << 16
# Size of the per-device status row a colocated save returns (empty, or a failure record: sidecar.failures).
STATUS_BYTES = 1 << 12


class Dispatcher(abc.ABC):
    """Runs a sidecar host operation on every host and gathers per-rank answers."""

    def __init__(self, config: host.HostConfig):
        self.config = config

    @abc.abstractmethod
    def save(self, request: host.SaveRequest, arrays: Sequence[jax.Array]) -> None:
        """Start saving ``request`` (``arrays``: its device arrays); returns once host copies are taken, or
        (:class:`ColocatedDispatcher`) once they are dispatched: the next call waits for them and raises
        their failure."""

    def finish_save(self) -> None:  # noqa: B027 - a no-op where save returns once the copies are taken
        """Wait until the last save's host copies are taken (raise its failure); its files may still be written."""

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

    def save(self, request, arrays):
        host.save_on_hosts(self.config, self.ranks, request, arrays)

    def restore(self, step, leaves, all_paths):
        return host.restore_on_hosts(self.config, self.ranks, step, leaves, all_paths)

    def query(self, query, arg=None):
        local = host.query_on_hosts(self.config, self.ranks, query, arg)
        if jax.process_count() == 1:
            return local

        mine = host.encode_result(query, local, QUERY_BYTES)
        rows = np.asarray(multihost_utils.process_allgather(mine))
        out: dict[int, Any] = {}
        for row in rows.reshape(-1, QUERY_BYTES):
            out.update(host.decode_result(query, row))
        return out


class _PendingSave:
    """A colocated save running in the background: its call and the read of its status (which waits for the
    hosts' copies). Its failure is kept for :meth:`finish`, the caller's next dispatch. Not a daemon thread:
    a program that ends without waiting (no ``wait_until_finished``/``close``) still has the hosts take the
    save's copies before the interpreter exits, as the save itself waited for them before."""

    def __init__(self, step: int, run: Callable[[], None]):
        self.step = step
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"mtc-save-{step}", daemon=False)
        self._thread.start()

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - raised by finish(), in the caller's thread
            self._error = e
            log.warning("the save of step %d failed in the background (raised at the next call): %s: %s",
                        self.step, type(e).__name__, e)

    def finish(self) -> None:
        self._thread.join()
        if self._error is not None:
            self._error.add_note(f"(from the save of step {self.step}, which ran in the background)")
            raise self._error


def _spec(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _has_colocation_id(device: Any) -> bool:
    try:
        device.colocation_id  # noqa: B018 - only whether the runtime defines it
    except AttributeError:
        return False
    return True


def _colocated_cpu(colocated_python: Any, devices: Sequence[Any]) -> list[Any]:
    """One colocated CPU device per device, order kept (``colocated_cpu_devices``: on Pathways each
    accelerator device's host CPU device). Plain CPU devices, which define no ``colocation_id``, are their own:
    JAX's CPU fallback would hand out process 0's first CPU devices, so the devices of slice 1 alone would map
    to slice 0's."""
    if all(getattr(d, "platform", None) == "cpu" and not _has_colocation_id(d) for d in devices):
        return list(devices)
    return list(colocated_python.colocated_cpu_devices(tuple(devices)))


def _install_pathways_ids() -> None:
    """Runs where a colocated call is unpickled: has JAX's colocated deserialization resolve the controller's
    device ids (on a Pathways worker, CPU devices have local ids and carry the controller-side one as
    ``PjRtIFRTDeviceId=`` in their repr) with Orbax's patch for exactly that (orbax-checkpoint is in [jax])."""
    # Imported here: Orbax's Pathways patch only where a colocated call is unpickled (one owner of it).
    from sidecar.pathways_start import install_orbax_patch

    install_orbax_patch()


class _PathwaysIds:
    """Pickled as the first keyword of every colocated call, so that unpickling it on the worker installs
    :func:`_install_pathways_ids` before the call's shardings (later in the same pickle) are resolved."""

    def __reduce__(self):
        return _pathways_ids, ()


def _pathways_ids() -> None:
    _install_pathways_ids()


def _ranks_handle(ranks: Sequence[int], sharding: NamedSharding) -> jax.Array:
    """One int32 per colocated CPU device: the rank of its host. It travels as data, so that a host
    function learns which rank each of the devices it sees belongs to whatever the ids are where it runs
    (on Pathways the worker's CPU device ids are not the controller's)."""
    return jax.device_put(np.asarray(ranks, np.int32), sharding)


def _host_config(config: host.HostConfig, handle: jax.Array) -> host.HostConfig:
    """``config`` with ``device_rank`` keyed by the devices this host function sees (the handle's shards)."""
    device_rank = {s.device.id: int(np.asarray(s.data).reshape(-1)[0]) for s in handle.addressable_shards}
    return dataclasses.replace(config, device_rank=device_rank)


def _row(payload: Any, size: int) -> np.ndarray:
    """``payload`` as one zero-padded row of ``size`` bytes (all zeros for None)."""
    row = np.zeros(size, np.uint8)
    if payload is not None:
        data = failures.encode_row(payload, size)
        row[: len(data)] = np.frombuffer(data, np.uint8)
    return row


def _status_rows(handle: jax.Array, payload: Any) -> jax.Array:
    """One status row per device of ``handle`` (empty, or a failure record), built where the call runs."""
    row = _row(payload, STATUS_BYTES)
    sharding = NamedSharding(handle.sharding.mesh, PartitionSpec("d", None))
    bufs = [jax.device_put(row[None], s.device) for s in handle.addressable_shards]
    return jax.make_array_from_single_device_arrays((handle.shape[0], STATUS_BYTES), sharding, bufs)


def _failure(e: Exception, ranks: Sequence[int]) -> dict[str, Any]:
    log.warning("host function for ranks %s failed: %s", list(ranks), e)
    return failures.failure_payload(failures.capture(e, list(ranks)))


def _coloc_save(handle, arrays, *, _ids=None, config, request):
    config = _host_config(config, handle)
    ranks = host.ranks_of(config, [s.device for s in handle.addressable_shards])
    try:
        host.save_on_hosts(config, ranks, request, arrays)
    except Exception as e:  # noqa: BLE001 - every failure travels back as data (sidecar.failures)
        return _status_rows(handle, _failure(e, ranks))
    return _status_rows(handle, None)


def _placeholder(lf: host.RestoreLeaf) -> jax.Array:
    """A zero array of a restore's output ``lf`` (its outputs must exist even when the host function failed)."""
    if lf.as_bytes:
        shape, dtype = (int(np.prod(lf.shape, dtype=np.int64)) * tree.dtype_from_name(lf.dtype).itemsize,), np.uint8
    else:
        shape, dtype = tuple(lf.shape), tree.dtype_from_name(lf.dtype)
    arr = jax.make_array_from_callback(shape, lf.sharding, lambda idx: np.zeros(
        tuple(len(range(*i.indices(n))) for i, n in zip(idx, shape, strict=True)), dtype))
    return jax.random.wrap_key_data(arr, impl=lf.key_impl) if lf.key_impl else arr


def _coloc_restore(handle, rows, *, _ids=None, config, step, leaves, all_paths):
    config = _host_config(config, handle)
    ranks = host.ranks_of(config, [s.device for s in handle.addressable_shards])
    try:
        res = host.restore_on_hosts(config, ranks, step, leaves, all_paths)
        arrays, payload = list(res.arrays), res.values
    except Exception as e:  # noqa: BLE001 - every failure travels back as data (sidecar.failures)
        arrays, payload = [_placeholder(lf) for lf in leaves], _failure(e, ranks)
    # The plain values travel back in the same call, one row per device (every rank read the same values).
    row = encode_values(payload)
    bufs = [jax.device_put(row[None], s.device) for s in rows.addressable_shards]
    return arrays, jax.make_array_from_single_device_arrays(rows.shape, rows.sharding, bufs)


def encode_values(values: dict[str, Any]) -> np.ndarray:
    """A restore's plain values (or its failure record) as one row (length-prefixed JSON; they are JSON-able
    by construction)."""
    try:
        return _row(values, QUERY_BYTES)
    except ValueError as e:
        raise ValueError(f"the plain values of the step do not fit in {QUERY_BYTES - 4} bytes: {e}") from None


def decode_values(row: np.ndarray) -> dict[str, Any]:
    return failures.decode_row(bytes(row)) or {}


def raise_host_failures(payloads: Sequence[Any]) -> None:
    """Raise the first host failure among decoded rows (the others named in a note); nothing if none."""
    found: dict[tuple[int, ...], failures.Failure] = {}
    for p in payloads:
        f = failures.failure_of(p)
        if f is not None:
            found.setdefault(f.ranks, f)
    if not found:
        return
    first, *rest = [found[k] for k in sorted(found)]
    err = failures.revive(first)
    if rest:
        err.add_note("other hosts failed too: " + "; ".join(f"ranks {list(f.ranks)}: {f.type}: {f.message}"
                                                            for f in rest))
    raise err


def _restore_out_specs(leaves: Sequence[host.RestoreLeaf]) -> list[jax.ShapeDtypeStruct]:
    """The arrays a colocated restore returns, known on the controller: without them JAX learns the output
    specs from the workers, pickled with the workers' device ids (which on Pathways are not the controller's)."""
    out = []
    for lf in leaves:
        if lf.as_bytes:
            nbytes = int(np.prod(lf.shape, dtype=np.int64)) * tree.dtype_from_name(lf.dtype).itemsize
            out.append(jax.ShapeDtypeStruct((nbytes,), np.uint8, sharding=lf.sharding))
        elif lf.key_impl:
            phys = jax.ShapeDtypeStruct(lf.shape, np.uint32)
            key = jax.eval_shape(lambda x, impl=lf.key_impl: jax.random.wrap_key_data(x, impl=impl), phys)
            spec = tuple(lf.sharding.spec)[:len(key.shape)] if isinstance(lf.sharding, NamedSharding) else ()
            sharding = NamedSharding(lf.sharding.mesh, PartitionSpec(*spec)) if isinstance(
                lf.sharding, NamedSharding) else lf.sharding
            out.append(jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding))
        else:
            out.append(jax.ShapeDtypeStruct(lf.shape, tree.dtype_from_name(lf.dtype), sharding=lf.sharding))
    return out


def _coloc_query(handle, rows, *, _ids=None, config, query, arg):
    config = _host_config(config, handle)
    ranks = host.ranks_of(config, [s.device for s in rows.addressable_shards])
    try:
        answers = host.query_on_hosts(config, ranks, query, arg)
        encoded = {r: host.encode_result(query, {r: answers[r]}, QUERY_BYTES) for r in ranks}
    except Exception as e:  # noqa: BLE001 - every failure travels back as data (sidecar.failures)
        encoded = dict.fromkeys(ranks, _row(_failure(e, ranks), QUERY_BYTES))
    bufs = [jax.device_put(encoded[config.device_rank[s.device.id]][None], s.device) for s in rows.addressable_shards]
    return jax.make_array_from_single_device_arrays(rows.shape, rows.sharding, bufs)


class ColocatedDispatcher(Dispatcher):
    """Host operations through colocated Python on the CPU devices colocated with the job's devices.

    A colocated call takes arrays on one device list: the handle's, which is ``devices`` in their order (their
    colocated CPU devices). A leaf on other devices or another sharding kind (a single-device array such as
    ``jax.random.key(0)``, a mesh over other devices or in another order) is first placed on that list:
    replicated, or with its own partitioning over a mesh of the same shape. Saves move each leaf to the CPU
    devices and restores move each back onto the target's sharding, as Pathways does between a TPU and its
    host. A host function's own exception comes back as data and is raised here as its own type
    (``sidecar.failures``); a ``JaxRuntimeError`` from a call is the runtime's (a host or slice lost).

    A save blocks only while its leaves are put on the CPU devices (dispatched, as on Pathways a copy from
    a TPU to its host is): the call and the wait for the hosts' copies run in the background, as Orbax's
    in-memory snapshot does, and every later call of this dispatcher (a save, restore or query but
    ``PREEMPTION``, hence the manager's ``wait_until_finished`` and ``close``) first waits for it and raises
    its failure. The arrays
    on the CPU devices are the save's own (a copy): the training step may donate the originals meanwhile.
    """

    def __init__(self, config: host.HostConfig, devices: Sequence[Any]):
        # Imported here: colocated Python / Orbax's Pathways patch only when dispatching to Pathways workers.
        from jax.experimental import colocated_python

        self._cp = colocated_python
        self.devices = list(devices)
        self._ids = tuple(d.id for d in self.devices)
        self.cpu_devices = _colocated_cpu(colocated_python, self.devices)
        # The host functions see the colocated CPU devices: map those to ranks.
        rank_by_cpu = {c.id: config.device_rank[d.id] for d, c in zip(self.devices, self.cpu_devices, strict=True)}
        super().__init__(config)
        self.cpu_config = host.HostConfig(**{**config.__dict__, "device_rank": rank_by_cpu})
        self._mesh = Mesh(np.array(self.cpu_devices), ("d",))
        self._handle_sharding = NamedSharding(self._mesh, PartitionSpec("d"))
        self._rows_sharding = NamedSharding(self._mesh, PartitionSpec("d", None))
        self._replicated = NamedSharding(Mesh(np.array(self.devices), ("d",)), PartitionSpec())
        self._same_devices = [d.id for d in self.devices] == [c.id for c in self.cpu_devices]
        self._pending: _PendingSave | None = None

    def finish_save(self) -> None:
        """Wait for the save in the background, if any; raise its failure (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()

    def _handle(self) -> jax.Array:
        return _ranks_handle([self.cpu_config.device_rank[c.id] for c in self.cpu_devices], self._handle_sharding)

    def on_devices(self, sharding: Any, any_order: bool = False) -> Any:
        """``sharding`` itself when it is a ``NamedSharding`` over ``devices`` in their order (``any_order``: in
        any order); else the layout a colocated call can take: its partitioning over a mesh of ``devices`` of
        the same shape (same devices, another order), or replicated over ``devices`` (a single device, other
        devices, other kinds). A call's inputs must be on the handle's device list; its outputs (a restore's
        arrays) may be on the same devices in another order."""
        if isinstance(sharding, NamedSharding):
            ids = tuple(d.id for d in sharding.mesh.devices.flat)
            if ids == self._ids or (any_order and sorted(ids) == sorted(self._ids)):
                return sharding
            if sorted(ids) == sorted(self._ids):
                devs = np.array(self.devices, dtype=object).reshape(sharding.mesh.devices.shape)
                return NamedSharding(Mesh(devs, sharding.mesh.axis_names), sharding.spec)
        return self._replicated

    def _to_cpu(self, x: jax.Array, path: str) -> jax.Array:
        """``x`` on the colocated CPU devices, in the handle's device order."""
        try:
            on = self.on_devices(x.sharding)
            if on is not x.sharding:
                x = jax.device_put(x, on)
            if not self._same_devices:
                x = jax.device_put(x, self.cpu_sharding(x.sharding))
        except Exception as e:
            e.add_note(f"while moving leaf {path!r} ({x.shape} {x.dtype}, {type(x.sharding).__name__}) to the hosts")
            raise
        return x

    def cpu_sharding(self, sharding: Any) -> Any:
        """The same layout over the colocated CPU devices (``sharding`` is one of :meth:`on_devices`)."""
        if self._same_devices or sharding is None:
            return sharding
        if not isinstance(sharding, NamedSharding):
            raise ValueError(f"colocated restore needs NamedSharding targets, got {type(sharding).__name__}")
        by_id = {d.id: c for d, c in zip(self.devices, self.cpu_devices, strict=True)}
        devs = np.vectorize(lambda d: by_id[d.id], otypes=[object])(sharding.mesh.devices)
        return NamedSharding(Mesh(devs, sharding.mesh.axis_names), sharding.spec)

    def save(self, request, arrays):
        self.finish_save()  # one save at a time, in order: the previous one's copies and failure first
        # The arrays are the call's array argument (moved to the workers by JAX); the request is pickled.
        moved = [self._to_cpu(a, m.path) for a, m in zip(arrays, request.metas, strict=True)]
        fn = functools.partial(_coloc_save, _ids=_PathwaysIds(), config=self.cpu_config, request=request)
        h = self._handle()
        status_spec = jax.ShapeDtypeStruct((len(self.cpu_devices), STATUS_BYTES), np.uint8,
                                           sharding=self._rows_sharding)
        call = self._cp.colocated_python(fn).specialize(out_specs_fn=lambda *a, **k: status_spec)

        def run() -> None:
            status = call(h, moved)
            # Reading the status waits for the host copies (the files are written in the background).
            raise_host_failures([failures.decode_row(bytes(r)) for r in np.asarray(status)])

        if self._same_devices:
            run()  # no copy of ours: the arrays are the caller's own, which its next step may donate
        else:
            self._pending = _PendingSave(request.step, run)

    def restore(self, step, leaves, all_paths):
        self.finish_save()
        placed = [dataclasses.replace(lf, sharding=self.on_devices(lf.sharding, any_order=True)) for lf in leaves]
        cpu_leaves = [dataclasses.replace(lf, sharding=self.cpu_sharding(lf.sharding)) for lf in placed]
        fn = functools.partial(_coloc_restore, _ids=_PathwaysIds(), config=self.cpu_config, step=step,
                               leaves=cpu_leaves, all_paths=list(all_paths))
        rows = jax.device_put(np.zeros((len(self.cpu_devices), QUERY_BYTES), np.uint8), self._rows_sharding)
        specs = (_restore_out_specs(cpu_leaves), _spec(rows))
        out, vals = self._cp.colocated_python(fn).specialize(out_specs_fn=lambda *a, **k: specs)(
            self._handle(), rows)
        raise_host_failures([failures.decode_row(bytes(r)) for r in np.asarray(vals)])
        values = decode_values(np.asarray(vals.addressable_shards[0].data)[0])
        # Each leaf onto its target's own (logical) sharding: a PRNG key leaf's request carries its key data's.
        wanted = _restore_out_specs(leaves)
        out = [x if x.sharding == spec.sharding else jax.device_put(x, spec.sharding)
               for x, spec in zip(out, wanted, strict=True)]
        return host.RestoreResult(list(out), values)

    def query(self, query, arg=None):
        if host.HostQuery(query) is not host.HostQuery.PREEMPTION:  # the one question a save cannot change
            self.finish_save()  # (a loop asks it every step: it must not wait for the save in the background)
        rows = jax.device_put(np.zeros((len(self.cpu_devices), QUERY_BYTES), np.uint8), self._rows_sharding)
        fn = functools.partial(_coloc_query, _ids=_PathwaysIds(), config=self.cpu_config,
                               query=host.HostQuery(query).value, arg=arg)
        res = self._cp.colocated_python(fn).specialize(out_specs_fn=lambda *a, **k: _spec(rows))(self._handle(), rows)
        payloads = [failures.decode_row(bytes(r)) for r in np.asarray(res)]
        raise_host_failures(payloads)
        out: dict[int, Any] = {}
        for row in np.asarray(res):
            out.update(host.decode_result(query, row))
        return out
