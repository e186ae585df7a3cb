"""The user's CheckpointManager: save / restore / latest_step / wait, reaching every host via a dispatcher."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import grpc
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from controller_client import exit_guard, suspend
from controller_client.dispatch import ColocatedDispatcher, Dispatcher, InProcessDispatcher
from controller_client.topology import HostTopology
from replicator.coordinator.client import CoordinatorClient
from replicator.net.security import TlsOptions
from sidecar import host, layout, remote, saves, tree
from sidecar.failures import StepAlreadyExistsError

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "StepAlreadyExistsError"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
    """Options of :class:`CheckpointManager`.

    Attributes:
      local_directory: each host's RAM-disk directory. May contain ``{host}`` (the host's rank) so that
        simulated hosts on one machine get their own directories.
      job_name: recorded in every manifest.
      save_interval_steps: ``save(step)`` saves when ``step % save_interval_steps == 0`` (or ``force``).
      max_to_keep: committed steps kept per host; the newest committed step is never deleted.
        ``None`` leaves deletion to the replicator.
      write_threads: file-writing threads per host (2 matches a 2-core host).
      dispatcher: ``"colocated"`` (Pathways / single controller) or ``"in_process"`` (multi-controller).
      cross_host_reads: let a host read other hosts' directories when they are on the same machine
        (simulated hosts); without a replicator this is the only way to restore onto a different mesh.
      wait_timeout_seconds: bound on ``wait_until_finished`` and the wait before a restore.
      coordinator_address: ``HOST:PORT`` of the replicators' coordinator, or its ordered candidates
        comma-separated (``h0:7070,h2:7070``: calls fail over to the next one). When set, ``latest_step`` and
        ``all_steps`` report globally complete steps, ``restore`` first has every host fetch what it
        lacks (peer, then bucket), deletion is left to the replicators and hosts never read each
        other's directories.
      token_file: file with the replicators' bearer token.
      tls_cert_file, tls_key_file, tls_ca_file: TLS for the coordinator connection (as the replicators'
        ``--tls-cert/--tls-key/--tls-ca``; with a CA the client presents the certificate: mutual TLS).
      restore_wait_seconds: how long ``restore`` waits for every host to hold its data; with replicators
        it also retries (backoff) a restore that fails for want of data the coordinator still counts
        complete on some tier (a host being replaced, a replicator restarting) for this long.
      newest_wait_seconds: how long ``restore()`` without a step waits for the newest step that
        ``latest_step``/``all_steps`` reported to be complete again (a replicator restarting, a host being
        replaced and refilled) before it restores an older one; that restore logs a warning naming both
        steps, and :attr:`CheckpointManager.last_restored_step` tells which step was restored.
      rpc_timeout_seconds: deadline of each call to the coordinator.
      replicator_wait_seconds: with replicators and the ``"in_process"`` dispatcher (multi-controller: the
        JobSet starts each training process together with its host's replicator sidecar, not after it), how
        long the first call that needs the other tiers (``latest_step``, ``all_steps``, ``restore``, the first
        ``save``, the preemption and backup calls) waits for this process's hosts' replicators to answer on
        their control sockets (asked every 20 ms); then :class:`TimeoutError` naming the socket.
      preemption_scope: what :meth:`CheckpointManager.reached_preemption` stops for. ``"job"``: a notice to any
        host (the coordinator tells every host of it): the whole job suspends. ``"slices"`` (elastic training):
        only once every active slice has a notice of its own; a notice to some slices only is for the loop to
        drop them (:meth:`CheckpointManager.noticed_slices`) and go on with the others.
    """

    local_directory: str
    job_name: str = "mtc"
    save_interval_steps: int = 1
    max_to_keep: int | None = 2
    write_threads: int = 2
    dispatcher: Literal["colocated", "in_process"] = "colocated"
    cross_host_reads: bool = True
    wait_timeout_seconds: float = 600.0
    coordinator_address: str | None = None
    token_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    restore_wait_seconds: float = 300.0
    newest_wait_seconds: float = 15.0
    rpc_timeout_seconds: float = 30.0
    replicator_wait_seconds: float = remote.REPLICATOR_WAIT_SECONDS
    preemption_scope: Literal["job", "slices"] = "job"

    def __post_init__(self) -> None:
        if self.save_interval_steps < 1:
            raise ValueError("save_interval_steps must be >= 1")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError("max_to_keep must be >= 1 or None")
        if self.dispatcher not in ("colocated", "in_process"):
            raise ValueError(f"unknown dispatcher {self.dispatcher!r}")
        if self.preemption_scope not in ("job", "slices"):
            raise ValueError(f"unknown preemption_scope {self.preemption_scope!r}")


class CheckpointManager:
    """Save and restore pytrees of sharded JAX arrays to every host's RAM disk.

    ``save`` returns once a host copy of the data is taken (on Pathways once its copy to the hosts is
    dispatched); the files are written in the background and a failure surfaces at the next call or at
    :meth:`wait_until_finished`.

    Cost of a restore right after a save, in dispatcher fan-outs (one call reaching every host; counted
    by tests/controller_client/test_manager.py, see docs/elastic.md): without a coordinator ``WAIT``, ``STEPS``
    (only when ``step`` is not given) and the restore itself, which returns arrays and plain values
    together: 3 (2 with ``step``). With a coordinator one ``WAKE`` more (4, or 3 with ``step``), plus
    coordinator calls, not fan-outs: one long-polling ``GetSteps(wait, min_step)``, ``GetSteps`` for a
    forced step and for the complete steps, ``PinRestore``. An unrestorable newest step adds one restore
    fan-out per older step tried.
    """

    def __init__(
        self,
        options: CheckpointManagerOptions,
        *,
        devices: Sequence[Any] | None = None,
        topology: HostTopology | None = None,
        dispatcher: Dispatcher | None = None,
    ):
        self.options = options
        self.devices = list(devices if devices is not None else jax.devices())
        self.topology = topology or HostTopology.from_devices(self.devices)
        # Elastic training: ranks are places in the full allocation (the topology); the active hosts are
        # those of ``devices``. They save (the manifests record them) and restore; the others are left alone.
        self.active_ranks = self.topology.check_active(self.devices)
        savers = () if self.active_ranks == list(range(self.topology.nodes)) else tuple(self.active_ranks)
        self.config = host.HostConfig(
            job=options.job_name,
            local_directory=options.local_directory,
            nodes=self.topology.nodes,
            device_rank=dict(self.topology.device_rank),
            write_threads=options.write_threads,
            keep_local=None if options.coordinator_address else options.max_to_keep,
            cross_host_reads=options.cross_host_reads and not options.coordinator_address,
            notify_replicator=bool(options.coordinator_address),
            savers=savers,
            remote_fetch=bool(options.coordinator_address),
            fetch_timeout_seconds=options.restore_wait_seconds,
            owner=uuid.uuid4().hex,  # its saves' failures are its own (sidecar.writer.HostWriter.raise_if_failed)
        )
        self._coordinator = self._coordinator_client(options.rpc_timeout_seconds) if options.coordinator_address else None
        if dispatcher is None:
            if options.dispatcher == "colocated":
                dispatcher = ColocatedDispatcher(self.config, self.devices)
            else:
                active = {d.id for d in self.devices}
                dispatcher = InProcessDispatcher(self.config, [d for d in jax.local_devices() if d.id in active])
        self.dispatcher = dispatcher
        if isinstance(dispatcher, InProcessDispatcher):
            exit_guard.install()  # multi-controller: ending, this process waits for no lost peer (exit_guard.py)
        # In-process: this process is its hosts, and their replicators start beside it (_await_replicators).
        # Colocated (Pathways): each worker's colocated Python starts once its replicator serves (the
        # replicator's startup probe), so there is nothing to wait for here.
        self._replicator_roots = ([self.config.root(r) for r in dispatcher.ranks]
                                  if options.coordinator_address and isinstance(dispatcher, InProcessDispatcher)
                                  else [])
        self._replicated = NamedSharding(Mesh(np.array(self.devices), ("all",)), PartitionSpec())
        self._last_saved: int | None = None  # the save the next wait has the coordinator count complete
        self._saved_last: int | None = None  # the step this manager saved last (backup_now waits for it)
        # Steps known saved (complete), for the rule of :meth:`save`; None until the first save asks the hosts.
        self._saved: set[int] | None = None
        self._skipping: int | None = None  # the first step of the current run of skipped saves
        self._restored_step: int | None = None
        # The newest complete step this manager has reported (latest_step/all_steps) since its last
        # restore: a restore without a step does not quietly go back past it.
        self._newest_reported: int | None = None

    # ------------------------------------------------------------------ save
    def should_save(self, step: int) -> bool:
        return step % self.options.save_interval_steps == 0

    def save(self, step: int, pytree: Any, force: bool = False) -> bool:
        """Save ``pytree`` as ``step`` if the interval (or ``force``) says so; True when a save started.

        As Orbax's ``CheckpointManager.save``: a step at or below the newest saved step is not saved again
        (False, logged once per run of such steps) unless ``force``, and ``force`` on a step that is already
        saved raises :class:`StepAlreadyExistsError` naming it. After ``restore`` (or ``mark_restored``) of an
        older step the newer steps are abandoned: saving forward replaces them. A step saved on some hosts
        only (the job failed during its save) is not saved: it is saved again, replacing those copies.
        """
        layout.step_name(step)
        if not force and not self.should_save(step):
            return False
        if self._already_saved(step, force):
            return False
        leaves, _ = tree.flatten(pytree)
        arrays, metas, host_arrays, values = [], [], [], []
        for path, leaf in leaves:
            if isinstance(leaf, jax.Array):
                if tree.is_key_dtype(leaf.dtype):
                    metas.append(host.ArrayMeta(path, tree.key_impl_name(leaf)))
                    leaf = jax.random.key_data(leaf)
                else:
                    metas.append(host.ArrayMeta(path, None))
                arrays.append(leaf)
            elif isinstance(leaf, (np.ndarray, np.generic)):
                host_arrays.append((path, np.asarray(leaf)))
            elif isinstance(leaf, tree.PLAIN_TYPES):
                values.append(layout.ValueEntry(path, leaf))
            else:
                raise TypeError(f"leaf {path!r} of type {type(leaf).__name__} cannot be checkpointed")
        t0 = time.monotonic()
        # After a restore of an older step (a rollback), newer steps are abandoned: saving one replaces it.
        replace = self._restored_step is not None and step > self._restored_step
        try:
            self.dispatcher.save(host.SaveRequest(step, tuple(metas), tuple(host_arrays), tuple(values),
                                                  self._generation(), replace), arrays)
        except BaseException:
            self._saved = None  # whatever the hosts hold now is asked again at the next save
            raise
        self._last_saved = self._saved_last = step
        if self._saved is not None:
            self._saved.add(step)
        self._skipping = None
        log.info("save of step %d started (blocked %.3fs)", step, time.monotonic() - t0)
        return True

    def _already_saved(self, step: int, force: bool) -> bool:
        """Orbax's rule for a step not newer than the newest saved one: True to skip it (logged once per run
        of skipped steps); with ``force``, :class:`StepAlreadyExistsError` when it is saved. The steps are
        asked once per manager (at its first save, unless ``all_steps``/``latest_step`` asked already: one
        ``STEPS`` fan-out, ~5 ms on 8 CPU devices), then followed here; a step that looks saved is asked
        again, once the hosts' queued saves are written, before it is skipped or refused (a save cut short
        by a failure is saved again)."""
        if self._saved is None:
            self._saved = self._saved_steps()
        if not self._covers(step, force):
            return False
        self.dispatcher.query(host.HostQuery.WAIT, self.options.wait_timeout_seconds)
        self._saved = self._saved_steps()
        if not self._covers(step, force):
            return False
        newest = max(self._saved)
        if force:
            raise StepAlreadyExistsError(f"step {step} is already saved (the newest saved step is {newest}); "
                                         "restore an older step first to save it again")
        if self._skipping is None:
            self._skipping = step
            log.info("step %d is not newer than step %d, the newest saved step: not saved again (as Orbax's "
                     "CheckpointManager; force=True raises)", step, newest)
        return True

    def _covers(self, step: int, force: bool) -> bool:
        """Whether the known saved steps make ``step`` one not to save (``force``: one already saved)."""
        if force:
            return step in self._saved
        return bool(self._saved) and step <= max(self._saved)

    def _saved_steps(self) -> set[int]:
        """The complete steps, less those a restore of an older step abandoned (unless saved since)."""
        steps = set(self._complete_steps())
        if self._restored_step is not None:
            steps = {s for s in steps if s <= self._restored_step or s in (self._saved or ())}
        return steps

    def _generation(self) -> int:
        """This save's generation: the controller's clock, the same on every host (a later save of a step
        number, after a rollback, supersedes the earlier one)."""
        gen = time.time_ns()
        if jax.process_count() > 1:
            # Two 31-bit halves: without jax_enable_x64 an int64 would be truncated to int32 (negative).
            hi, lo = multihost_utils.broadcast_one_to_all(np.array([gen >> 31, gen & (2**31 - 1)], np.int32))
            gen = (int(hi) << 31) | int(lo)
        return gen

    def wait_until_finished(self) -> None:
        """Block until every host has committed its queued saves; raise the first background failure."""
        self._wait_until_finished()

    def _wait_until_finished(self) -> bool:
        """:meth:`wait_until_finished`; True when it woke every host's replicator (a ``WAKE`` fan-out)."""
        self.dispatcher.query(host.HostQuery.WAIT, self.options.wait_timeout_seconds)
        if self._coordinator is not None and self._last_saved is not None:
            self._await_coordinator(self._last_saved)
            return True
        return False

    def _coordinator_client(self, rpc_timeout_seconds: float, failover_seconds: float | None = None,
                            ) -> CoordinatorClient:
        o = self.options
        tls = TlsOptions.from_args(o.tls_cert_file, o.tls_key_file, o.tls_ca_file)
        # The hosts of this manager's topology that hold no active device are gone (on Pathways: their slice
        # is counted down): the coordinator declares them lost at once (replicator/coordinator/gone.py).
        gone = sorted(set(range(self.topology.nodes)) - set(self.active_ranks))
        return CoordinatorClient(o.coordinator_address, o.token_file, rpc_timeout_seconds, tls=tls,
                                 failover_seconds=failover_seconds, gone_ranks=gone)

    def _await_replicators(self) -> None:
        """Before this manager's first decision that needs the other tiers: its hosts' replicators serve.

        Deciding earlier would be deciding wrongly: a RAM disk a restart emptied reads as "no checkpoint"
        (start from step 0), a step held only on a peer or in the bucket as unrestorable (restore an older
        one). Each host is asked every 20 ms, for up to ``replicator_wait_seconds`` (TimeoutError naming its
        control socket); once all served, never again (a replicator restarting later is the restore's retry)."""
        while self._replicator_roots:
            root = self._replicator_roots[0]
            waited = remote.wait_for_replicator(root, self.options.replicator_wait_seconds)
            if waited >= 0.1:
                log.info("waited %.2fs for the replicator serving %s", waited, root)
            self._replicator_roots.pop(0)

    def _pin(self, step: int) -> None:
        """Best effort: the coordinator keeps ``step`` from GC while we restore it and has every host
        refill its data in the background; the restore itself fetches what it lacks either way."""

        try:
            resp = self._coordinator.pin_restore(step)
            if resp.step != step:
                log.info("coordinator did not pin step %d: %s", step, resp.reason)
        except grpc.RpcError as e:
            log.warning("coordinator unreachable to pin step %d (%s); restoring anyway", step, e.code())

    def _await_coordinator(self, step: int) -> None:
        """Have the coordinator count ``step`` complete before returning, so that ``latest_step`` is truthful
        from any host set at once (an elastic event right after a save must not roll back past it)."""

        # One WAKE (every replicator reports now), then the coordinator long-polls until it counts the step
        # complete; its wait per call is bounded, so a few calls may cover the deadline (no host fan-out).
        self.dispatcher.query(host.HostQuery.WAKE)
        # Done with this save whatever the coordinator answers: the next wait must not WAKE again on some
        # processes only (multi-controller: every fan-out is a collective all processes must make).
        self._last_saved = None
        deadline = time.monotonic() + self.options.rpc_timeout_seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                resp = self._coordinator.steps(wait_seconds=left, min_step=step)
            except grpc.RpcError as e:  # the hosts' own RAM disks still answer latest_step
                log.warning("coordinator unreachable after saving step %d: %s", step, e.code())
                return
            if step in resp.complete_steps or resp.newest_complete_step > step:
                return
        log.warning("the coordinator does not count step %d complete after %.0fs", step,
                    self.options.rpc_timeout_seconds)

    # ------------------------------------------------------------------ steps
    def _host_steps(self) -> dict[int, host.StepsAnswer]:
        answers = self.dispatcher.query(host.HostQuery.STEPS)
        missing = set(self.active_ranks) - set(answers)
        if missing:
            raise RuntimeError(f"active hosts {sorted(missing)} did not answer")
        return answers

    def _held_complete_steps(self) -> list[int]:
        """Steps whose every saver's data the active hosts can read right now (their RAM disks, and other
        hosts' directories when ``cross_host_reads``): complete without asking anybody else."""
        return saves.complete_steps(s for answer in self._host_steps().values() for s in answer.held)

    def all_steps(self) -> list[int]:
        """Complete steps, ascending: every rank that saved the step has its data on some tier.

        Reported at once after ``save`` + ``wait_until_finished`` (the hosts' own RAM disks are asked), and,
        with a coordinator, also steps complete elsewhere (peers, the bucket).
        """
        steps = self._complete_steps()
        if steps and (self._newest_reported is None or steps[-1] > self._newest_reported):
            self._newest_reported = steps[-1]
        if self._saved is None and self._restored_step is None:
            self._saved = set(steps)  # what the first save would ask (a job asks latest_step() first)
        return steps

    @property
    def last_restored_step(self) -> int | None:
        """The step the last ``restore`` returned (or :meth:`mark_restored` named); None before any."""
        return self._restored_step

    def _complete_steps(self) -> list[int]:
        self._await_replicators()
        local = set(self._held_complete_steps())
        if self._coordinator is not None:
            try:
                local |= set(self._coordinator.complete_steps())
            except grpc.RpcError as e:
                log.warning("coordinator unreachable (%s): complete steps from the active hosts only", e.code())
        return sorted(local)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ restore
    def _leaf_for(self, path: str, leaf: Any) -> host.RestoreLeaf:
        """The restore request for one target leaf (numpy targets travel as raw bytes: ``as_bytes``)."""
        as_numpy = isinstance(leaf, (np.ndarray, np.generic))
        shape, dtype = tuple(leaf.shape), leaf.dtype
        sharding = getattr(leaf, "sharding", None) if not as_numpy else None
        if sharding is None:
            sharding = self._replicated
        if tree.is_key_dtype(dtype):
            impl = tree.key_impl_name(leaf) if isinstance(leaf, jax.Array) else str(dtype._impl.name)
            data_shape = tree.key_data_shape(shape, impl)
            if isinstance(sharding, NamedSharding):
                spec = tuple(sharding.spec) + (None,) * (len(data_shape) - len(sharding.spec))
                sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
            elif not sharding.is_fully_replicated:
                raise ValueError(f"leaf {path!r}: PRNG keys restore onto NamedSharding or replicated targets")
            return host.RestoreLeaf(path, data_shape, "uint32", impl, sharding)
        return host.RestoreLeaf(path, shape, tree.dtype_name(dtype), None, sharding, as_bytes=as_numpy)

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Restore ``step`` (default: the latest) into the structure, shapes, dtypes and shardings of
        ``target`` (a pytree of ``jax.ShapeDtypeStruct`` with shardings, or of concrete arrays)."""
        if target is None:
            raise ValueError("restore needs a target pytree (jax.ShapeDtypeStruct leaves with shardings)")
        self._await_replicators()
        woke = self._wait_until_finished()
        if self._coordinator is not None and not woke:
            # Have every host report now: what it lacks is located through the coordinator.
            self.dispatcher.query(host.HostQuery.WAKE)
        if step is None and self._coordinator is not None:
            forced = self._coordinator.steps().forced_restore_step
            if forced >= 0:
                log.info("restoring step %d as the operator forced (--restore-from-backup)", forced)
                step = forced
        if step is None:
            steps = self._steps_reaching_newest_reported()
            if not steps:
                where = "on any tier" if self._coordinator is not None else f"in {self.options.local_directory}"
                raise FileNotFoundError(f"no committed step {where} (none complete)")
            # The newest complete step, else (its data unreachable now: a lost slice held the only copy)
            # the next older one.
            for older in reversed(steps[:-1]):
                try:
                    return self._restore(steps[-1], target)
                except (FileNotFoundError, OSError) as e:
                    log.warning("step %d cannot be restored (%s); trying step %d", steps[-1], e, older)
                    steps = steps[:-1]
            return self._restore(steps[-1], target)
        return self._restore(step, target)

    def _restore(self, step: int, target: Any) -> Any:
        layout.step_name(step)
        if self._coordinator is not None:
            self._pin(step)
        leaves, treedef = tree.flatten(target)
        all_paths = [p for p, _ in leaves]
        requests, positions = [], []
        for i, (path, leaf) in enumerate(leaves):
            if tree.is_array_like(leaf):
                requests.append(self._leaf_for(path, leaf))
                positions.append(i)
        t0 = time.monotonic()
        restored = self._restore_waiting(step, requests, all_paths)
        arrays, values = restored.arrays, restored.values
        out = [None] * len(leaves)
        for i, req, arr in zip(positions, requests, arrays, strict=True):
            if req.as_bytes:
                arr = np.asarray(arr).view(tree.dtype_from_name(req.dtype)).reshape(req.shape).copy()
            out[i] = arr
        for i, (path, leaf) in enumerate(leaves):
            if not tree.is_array_like(leaf):
                if path not in values:
                    raise ValueError(f"leaf {path!r} is an array in step {step}, target has a {type(leaf).__name__}")
                out[i] = values[path]
        log.info("restored step %d in %.3fs", step, time.monotonic() - t0)
        self._restored(step)
        return tree.unflatten(treedef, out)

    def _restore_waiting(self, step: int, requests: list[host.RestoreLeaf], all_paths: list[str]) -> Any:
        """One restore fan-out; with replicators, repeated (backoff) for up to ``restore_wait_seconds``
        while it fails for want of data that the coordinator still counts complete on some tier (a host
        being replaced or a replicator restarting mid-restore: its data comes back in seconds)."""
        deadline = time.monotonic() + self.options.restore_wait_seconds
        pause = 0.5
        # Multi-controller: each process decides alone, and a retry is a collective the others would not
        # make; there a restore is tried once (as before).
        retry = self._coordinator is not None and jax.process_count() == 1
        while True:
            try:
                return self.dispatcher.restore(step, requests, all_paths)
            except FileNotFoundError as e:
                why = f"restore of step {step} onto hosts {self.active_ranks}: {e}"
                if (not retry or time.monotonic() + pause > deadline
                        or step not in self._complete_steps()):
                    raise FileNotFoundError(why) from e
                log.warning("%s; step %d is complete on some tier: retrying in %.1fs", why, step, pause)
                time.sleep(pause)
                pause = min(5.0, pause * 2)

    def _steps_reaching_newest_reported(self) -> list[int]:
        """The complete steps, once the newest includes the newest this manager reported, or after
        ``newest_wait_seconds`` as they are (with a warning when that goes back past the reported one)."""
        # Multi-controller: the waiting loop's fan-outs are collectives; the processes could leave it at
        # different rounds, so there it asks once (as before).
        want = self._newest_reported if jax.process_count() == 1 else None
        deadline = time.monotonic() + self.options.newest_wait_seconds
        while True:
            steps = self.all_steps()
            if want is None or (steps and steps[-1] >= want):
                return steps
            if time.monotonic() >= deadline:
                log.warning("step %d, which latest_step() reported, is not complete on any tier after %.0fs "
                            "(hosts lost or restarting); restoring %s instead", want,
                            self.options.newest_wait_seconds, f"step {steps[-1]}" if steps else "nothing")
                return steps
            time.sleep(0.25)

    def mark_restored(self, step: int) -> None:
        """The train state is now ``step``, restored from elsewhere (an in-memory snapshot): saving forward
        replaces the abandoned newer steps, as after ``restore(step)``, instead of ``FileExistsError``."""
        layout.step_name(step)
        self._restored(step)

    def _restored(self, step: int) -> None:
        """The train state is ``step`` now: newer steps are abandoned (saving forward replaces them)."""
        self._restored_step = self._newest_reported = step
        self._saved = {s for s in self._saved if s <= step} if self._saved is not None else {step}

    # ------------------------------------------------------------------ suspend-resume
    @property
    def active_slices(self) -> frozenset[int]:
        """The slices (places in the full allocation) of the active hosts."""
        return frozenset(self.topology.slice_of(r) for r in self.active_ranks)

    def noticed_slices(self) -> frozenset[int]:
        """The active slices with a host whose own replicator got a preemption notice (its Pod's preStop hook
        or its SIGTERM): they go away within their grace period. One ``PREEMPTION`` fan-out; empty without
        replicators."""
        if self._coordinator is None:
            return frozenset()
        self._await_replicators()
        return suspend.noticed_slices(self.dispatcher.query(host.HostQuery.PREEMPTION), self.topology)

    def reached_preemption(self, step: int) -> bool:
        """True once the job must suspend: save ``step`` now, :meth:`backup_now` with ``wait=True`` and exit 75
        (:func:`controller_client.preemption_exit.finish_preempted`). Needs the replicators (False without a
        coordinator). ``preemption_scope="job"``: any host's replicator knows of a notice; ``"slices"``: every
        active slice got one of its own (fewer noticed slices: see :meth:`noticed_slices`)."""
        if self._coordinator is None:
            return False
        self._await_replicators()
        answers = self.dispatcher.query(host.HostQuery.PREEMPTION)
        if self.options.preemption_scope == "slices":
            return suspend.noticed_slices(answers, self.topology) >= self.active_slices
        return suspend.job_noticed(answers)

    def backup_now(self, *, wait: bool = False, timeout_seconds: float = 30.0) -> suspend.DurableStep | None:
        """Ask the replicators to back the newest complete step up to the bucket at once (no interval).

        ``wait``: then return once the step this manager saved last (or, when it saved none, the newest
        complete step), or a newer one, is durable: committed in the bucket, or, when the job has no bucket,
        redundant (every rank's data on two hosts) — a :class:`~controller_client.suspend.DurableStep`. The
        pending saves' wait and every coordinator call included, within ``timeout_seconds``; else
        :class:`TimeoutError` naming the step and how far it got. Without ``wait``: None, at once.
        """
        if self._coordinator is None:
            raise RuntimeError("backup_now needs the replicators (coordinator_address)")
        self._await_replicators()
        if not wait:
            self.wait_until_finished()
            self.dispatcher.query(host.HostQuery.WAKE)
            self.dispatcher.query(host.HostQuery.BACKUP_NOW)
            return None
        deadline = time.monotonic() + timeout_seconds
        self.dispatcher.query(host.HostQuery.WAIT, max(0.0, min(self.options.wait_timeout_seconds,
                                                                 deadline - time.monotonic())))
        self._last_saved = None  # done with the save: the coordinator's view is waited for below
        self.dispatcher.query(host.HostQuery.WAKE)  # every replicator reports its saves now ...
        self.dispatcher.query(host.HostQuery.BACKUP_NOW)  # ... then asks for the backup of its newest one
        # Each status call bounded by what is left, and no failover rounds beyond it: a coordinator being
        # deleted must not hold the program past the grace period.
        call_seconds = max(0.5, min(self.options.rpc_timeout_seconds, timeout_seconds / 4))
        client = self._coordinator_client(call_seconds, failover_seconds=0.0)
        try:
            return suspend.wait_durable(client.status, self._saved_last, deadline)
        finally:
            client.close()

    # ------------------------------------------------------------------ lifecycle
    def for_devices(self, devices: Sequence[Any]) -> CheckpointManager:
        """A manager over ``devices`` (an in-place scale-up: the state put on a new mesh) with the same options
        and topology that knows what this one knew (the steps saved, a rollback in effect, the save a wait
        is to see complete), so its first save asks the hosts and the coordinator nothing. This one's last
        save is first taken by the hosts (its failure raised; they go on writing its files, which the new
        manager's waits include); then this one's coordinator connection is closed. After a slice failed,
        close this one with ``close_after_failure`` and build a new one instead."""
        self.dispatcher.finish_save()
        if self._coordinator is not None:
            self._coordinator.close()
        new = CheckpointManager(self.options, devices=devices, topology=self.topology)
        new._saved = None if self._saved is None else set(self._saved)
        new._last_saved, new._saved_last, new._restored_step = self._last_saved, self._saved_last, self._restored_step
        new._newest_reported = self._newest_reported
        return new

    def close(self) -> None:
        """Wait for the pending saves (their failure is raised), then drop the coordinator connection, also
        when the wait fails (a lost slice's hosts cannot answer it)."""
        try:
            self.wait_until_finished()
        finally:
            if self._coordinator is not None:
                self._coordinator.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
