"""Two state tiers for elastic training on Pathways: Orbax's in-memory ``Snapshotter`` for elastic events,
the :class:`CheckpointManager` for everything else; a restore takes whichever holds the newer step.

The Pathways guide's loop snapshots the train state to pinned host memory every step
(``ocp.v1.training.pathways.Snapshotter``) and keeps multi-tier checkpoints for what a snapshot cannot
serve. :class:`ElasticCheckpointer` is that loop's state tier, done so that the combination is safe:

- ``restore(target)`` compares the snapshot's step with the newest complete checkpoint and takes the newer
  (the snapshot on a tie: it is host memory, milliseconds). A snapshot that cannot rebuild the state is
  skipped for the checkpoint: none in this process (a restart), every replica of a leaf gone, or a leaf
  partitioned along the replica (slice) axis whose part on a lost slice is gone (FSDP state: the
  Snapshotter then returns a smaller array, which is detected by its shape).
- After a snapshot restore older than the checkpoint's newest step, saving forward replaces the abandoned
  newer steps (``CheckpointManager.mark_restored``: the same generations that make a rollback safe)
  instead of failing with ``FileExistsError``.
- ``save`` follows the state's devices: after an in-place scale-up (the loop adds the returned slices to
  ``active_slice_indices``, rebuilds its mesh and ``device_put``s the state) the next save goes to a manager
  over the new active devices, with the same options and the full-allocation topology (ranks never change).
- ``reached_preemption`` / ``backup_now`` serve suspend-resume, from the checkpoint tier; ``noticed_slices``
  and :class:`LeavingSlices` let an elastic loop drop the slices that got a notice and go on with the others.

Needs orbax-checkpoint >= 0.12.6 (the Snapshotter) and pathwaysutils (its split/concatenate by mesh axis).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.suspend import DurableStep
from controller_client.topology import HostTopology

log = logging.getLogger(__name__)

Source = Literal["snapshot", "checkpoint"]


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`ElasticCheckpointer.restore` brought back: the state, its step, which tier, how long."""

    state: Any
    step: int
    source: Source
    seconds: float


def devices_of(tree: Any) -> list[Any]:
    """The devices the arrays (or ``ShapeDtypeStruct``s with shardings) of ``tree`` live on, by id."""
    found: dict[int, Any] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and hasattr(sharding, "device_set"):
            found.update((d.id, d) for d in sharding.device_set)
    return [found[i] for i in sorted(found)]


def close_after_failure(manager: CheckpointManager, why: str = "after a failure") -> None:
    """Close ``manager`` when its hosts may be gone (an attempt ended by a slice-down error): the wait for
    pending saves reaches the lost hosts and fails too (on Pathways: whatever the runtime raises for them),
    so its error is logged, not raised, and the error that ended the attempt stays the one
    ``elastic_retry`` decides on. Its coordinator connection is closed either way."""
    try:
        manager.close()
    except Exception as e:  # noqa: BLE001 (a failed slice's error is whatever its runtime raises)
        log.warning("closing the manager of hosts %s %s: %s", manager.active_ranks, why, e)


def _shape_mismatch(restored: Any, target: Any) -> str | None:
    """The first array leaf whose shape is not the target's (a snapshot missing a lost replica's part)."""
    got, _ = jax.tree_util.tree_flatten_with_path(restored)
    want = jax.tree_util.tree_leaves(target)
    if len(got) != len(want):
        return f"{len(got)} leaves, target has {len(want)}"
    for (path, g), w in zip(got, want, strict=True):
        if hasattr(w, "shape") and tuple(getattr(g, "shape", ())) != tuple(w.shape):
            return f"leaf {jax.tree_util.keystr(path)} has shape {tuple(g.shape)}, target {tuple(w.shape)}"
    return None


class LeavingSlices:
    """Slices an elastic loop dropped for their preemption notice, kept out of scale-ups until they are gone.

    A noticed slice stays healthy until Kubernetes kills its Pods, at the latest ``terminationGracePeriodSeconds``
    after the notice; until then pathwaysutils' monitor reports it in ``available_inactive_slices`` and an
    in-place scale-up would take it back. ``hold_seconds``: the grace period plus the monitor's poll interval
    (a report of the slice from before its Pods died is stale by then); after it the monitor's word stands
    (the slice's re-created Pods, or a notice withdrawn).
    """

    def __init__(self, hold_seconds: float, clock: Callable[[], float] = time.monotonic):
        if hold_seconds < 0:
            raise ValueError("hold_seconds must be >= 0")
        self.hold_seconds = hold_seconds
        self._clock = clock
        self._since: dict[int, float] = {}

    def drop(self, slices: frozenset[int] | set[int]) -> None:
        """These slices got a notice now (a slice dropped again keeps its first notice's time)."""
        now = self._clock()
        for s in slices:
            self._since.setdefault(s, now)

    @property
    def leaving(self) -> frozenset[int]:
        now = self._clock()
        self._since = {s: t for s, t in self._since.items() if now - t < self.hold_seconds}
        return frozenset(self._since)

    def returnable(self, available: frozenset[int] | set[int]) -> frozenset[int]:
        """Of ``available`` (``available_inactive_slices``), the slices a scale-up may take."""
        return frozenset(available) - self.leaving


    def keep_out(self, elastic_manager: Any) -> None:
        """At an attempt's start (``elastic_retry`` took every healthy slice): the leaving slices stay out of
        ``elastic_manager.active_slice_indices``, unless nothing else is left."""
        keep = frozenset(elastic_manager.active_slice_indices) - self.leaving
        if keep and keep != frozenset(elastic_manager.active_slice_indices):
            elastic_manager.active_slice_indices = keep


class ElasticCheckpointer:
    """The snapshot tier and the checkpoint tier behind one save / restore, for an elastic training loop.

    Args:
      options: the :class:`CheckpointManager` options (``save_interval_steps`` is the checkpoint interval).
      topology: the full allocation (ranks are places in it and never change).
      devices: the active devices now.
      snapshotter: an ``orbax.checkpoint.experimental.v1.training.pathways.Snapshotter`` (``ocp.v1...``), or
        ``None`` for a checkpoint tier alone.
      snapshot_interval_steps: snapshot when ``step % snapshot_interval_steps == 0``.
      manager_factory: builds the manager for a set of active devices (tests inject dispatchers here).
    """

    def __init__(
        self,
        options: CheckpointManagerOptions,
        *,
        topology: HostTopology,
        devices: Sequence[Any],
        snapshotter: Any = None,
        snapshot_interval_steps: int = 1,
        manager_factory: Callable[[Sequence[Any]], CheckpointManager] | None = None,
    ):
        if snapshot_interval_steps < 1:
            raise ValueError("snapshot_interval_steps must be >= 1")
        self.options = options
        self.topology = topology
        self.snapshotter = snapshotter
        self.snapshot_interval_steps = snapshot_interval_steps
        self._factory = manager_factory or (
            lambda devs: CheckpointManager(options, devices=devs, topology=topology))
        self._restored_step: int | None = None
        self.manager = self._factory(list(devices))

    # ------------------------------------------------------------------ devices
    @property
    def devices(self) -> list[Any]:
        return self.manager.devices

    def set_devices(self, devices: Sequence[Any]) -> None:
        """Serve a new set of active devices (an in-place scale-up or shrink). Pending saves finish first;
        a rollback in effect carries over."""
        devices = list(devices)
        if {d.id for d in devices} == {d.id for d in self.manager.devices}:
            return
        old = self.manager
        if {d.id for d in devices} >= {d.id for d in old.devices}:
            old.close()  # growing: every old host is healthy, its pending saves must finish
        else:
            # Shrinking after a slice failed: the lost hosts cannot answer; what they held is on peers.
            close_after_failure(old, "after a shrink")
        self.manager = self._factory(devices)
        if self._restored_step is not None:
            self.manager.mark_restored(self._restored_step)
        log.info("checkpoint tier now on hosts %s (was %s)", self.manager.active_ranks, old.active_ranks)

    def _follow(self, tree: Any) -> None:
        devices = devices_of(tree)
        if devices:
            self.set_devices(devices)

    # ------------------------------------------------------------------ steps
    def snapshot_step(self) -> int | None:
        """The step of the newest in-memory snapshot (None: none in this process)."""
        if self.snapshotter is None:
            return None
        latest = self.snapshotter.latest
        return None if latest is None else int(latest.step)

    def latest_step(self) -> int | None:
        """The newer of the snapshot's step and the newest complete checkpoint (None: neither exists)."""
        steps = [s for s in (self.snapshot_step(), self.manager.latest_step()) if s is not None]
        return max(steps) if steps else None

    # ------------------------------------------------------------------ restore
    def restore(self, target: Any) -> Restored | None:
        """Restore the newest state onto ``target``'s shardings (``ShapeDtypeStruct``s, as for
        ``CheckpointManager.restore``); ``None`` when neither tier holds a step (start from scratch).

        The snapshot serves when its step is at least the checkpoint's and it can rebuild every leaf; else
        the checkpoint (every tier: RAM disk, peer, bucket). The state restored is snapshotted again, so
        the next elastic event finds a snapshot on the current devices.
        """
        self._follow(target)
        t0 = time.monotonic()
        snap = self.snapshot_step()
        ckpt_steps = self.manager.all_steps()
        ckpt = ckpt_steps[-1] if ckpt_steps else None
        if snap is not None and (ckpt is None or snap >= ckpt):
            state = self._load_snapshot(target, snap)
            if state is not None:
                self._restored(snap, state)
                return Restored(state, snap, "snapshot", time.monotonic() - t0)
        for step in reversed(ckpt_steps):
            try:
                state = self.manager.restore(step, target)
            except (FileNotFoundError, OSError) as e:
                log.warning("step %d cannot be restored (%s); trying an older one", step, e)
                continue
            self._restored(step, state)
            return Restored(state, step, "checkpoint", time.monotonic() - t0)
        if ckpt_steps:
            raise FileNotFoundError(f"none of the complete steps {ckpt_steps} can be restored onto hosts "
                                    f"{self.manager.active_ranks}")
        return None

    def _load_snapshot(self, target: Any, step: int) -> Any:
        try:
            state = self.snapshotter.load(target, reset_snapshot_state=False)
        except (RuntimeError, ValueError) as e:  # "No active replicas found", a leaf that cannot be rebuilt
            log.info("snapshot of step %d cannot be restored (%s): restoring from the checkpoint", step, e)
            return None
        bad = _shape_mismatch(state, target)
        if bad is not None:
            # A leaf partitioned along the replica axis lost its part on a failed slice (FSDP state).
            log.info("snapshot of step %d lacks a lost slice's part (%s): restoring from the checkpoint", step, bad)
            return None
        return state

    def _restored(self, step: int, state: Any) -> None:
        self._restored_step = step
        # Saving forward from here replaces abandoned newer checkpoint steps (a snapshot may be older than
        # the newest checkpoint, or the newest checkpoint was never complete).
        self.manager.mark_restored(step)
        if self.snapshotter is not None:
            self.snapshotter.save(step, state)
            self.snapshotter.join()

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Snapshot ``state`` (every ``snapshot_interval_steps``) and save it to the checkpoint tier (every
        ``save_interval_steps``, or ``force``); True when a checkpoint save started. Follows the state's
        devices (an in-place scale-up needs nothing else)."""
        self._follow(state)
        if self.snapshotter is not None and (force or step % self.snapshot_interval_steps == 0):
            self.snapshotter.save(step, state)
        return self.manager.save(step, state, force=force)

    def wait_until_finished(self) -> None:
        """Block until the pending snapshot is in host memory and every checkpoint save is committed."""
        if self.snapshotter is not None:
            self.snapshotter.join()
        self.manager.wait_until_finished()

    # ------------------------------------------------------------------ suspend-resume
    def noticed_slices(self) -> frozenset[int]:
        """The active slices with a preemption notice of their own (:meth:`CheckpointManager.noticed_slices`)."""
        return self.manager.noticed_slices()

    def reached_preemption(self, step: int) -> bool:
        """True once the job must suspend (:meth:`CheckpointManager.reached_preemption`; with
        ``preemption_scope="slices"``, once every active slice has a notice): save ``step`` with ``force``, call
        :meth:`backup_now` with ``wait=True`` and exit 75 (a snapshot does not outlive the process)."""
        return self.manager.reached_preemption(step)

    def backup_now(self, *, wait: bool = False, timeout_seconds: float = 30.0) -> DurableStep | None:
        """:meth:`CheckpointManager.backup_now` (the snapshot has no durable tier of its own)."""
        return self.manager.backup_now(wait=wait, timeout_seconds=timeout_seconds)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self.snapshotter is not None:
            self.snapshotter.join()
        self.manager.close()

    def __enter__(self) -> ElasticCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
