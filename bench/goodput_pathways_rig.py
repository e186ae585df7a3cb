"""What both systems of ``bench.goodput --pathways`` meet alike: the simulated Pathways, the slice losses and
returns, the train step, the clock and the records (bench/goodput_pathways_loop.py runs the loops).

The clock starts after calibration (step 2); every slice loss is checked for at a step boundary and struck
there; a lost slice comes back ``replace_seconds`` later from a background thread (as replacement hosts boot
on their own). The records: each step's weight (the fraction of slices it ran on, its last computation's),
and each pause: a slice loss from the failure to the survivors' next completed step (``detect``: to the
slice-down error caught by the loop; ``wait``: to the next attempt's start; ``restore``: its state back;
``first_step``: the next step done, its re-jit included) and a rejoin from the loop noticing the returned
slice to the next completed step on every slice (``resize``: ours' forced save, its scale-up signal and the
new attempt's start; Orbax's new mesh and ``device_put``; then ``restore``, ours' only, and ``first_step``).
A slice back before the survivors' first step extends the loss's pause (``rejoined``, ``until_rejoin``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controller_client.demo.cluster import LocalCluster
from controller_client.demo.elastic import HOSTS_PER_SLICE, SLICES, SimulatedSlices, quiet_simulated_failures
from controller_client.demo.ports import free_port

DEVICES_PER_SLICE = 4  # 2 hosts x 2 devices
CLOCK_STEP = 2  # the step calibration ends at: the clock starts there


@dataclasses.dataclass(frozen=True)
class PathwaysOptions:
    """One system's run (validated by bench.goodput_pathways's ``main``); ``losses``: (seconds after the
    clock starts, slice index) of each slice loss."""

    mib: int
    seconds: float
    step_seconds: float
    mtbf_seconds: float
    replace_seconds: float
    poll_seconds: float
    bucket_seconds: float
    losses: tuple[tuple[float, int], ...]


class CandidateCluster(LocalCluster):
    """Our replicators with a coordinator candidate on each slice's first host (what the replicator derives
    from its peer address template when deployed: a lost slice 0 fails over to slice 1's), on loopback."""

    def __init__(self, base: Path, extra: list[str]):
        super().__init__(base, SLICES * HOSTS_PER_SLICE, SLICES, extra=extra)
        self.candidates = {s * HOSTS_PER_SLICE: f"127.0.0.1:{free_port()}" for s in range(SLICES)}
        self.coordinator = ",".join(self.candidates.values())

    def _args(self, rank: int, listen: str) -> list[str]:
        args = super()._args(rank, listen)
        if "--coordinator" in args:
            i = args.index("--coordinator")
            del args[i : i + 2]
        return [*args, "--coordinator-candidates", ",".join(f"{r}={a}" for r, a in self.candidates.items())]

    def start(self, rank: int) -> str:
        from controller_client.demo.cluster import ReplicatorProcess

        listen = self.candidates.get(rank, "127.0.0.1:0")
        p = ReplicatorProcess(
            rank, self._args(rank, listen), self.base / "logs" / f"replicator-{rank}.log", self.env
        )
        self.procs[rank] = p
        return p.start()


class LosableSlices(SimulatedSlices):
    """Slices lost and back as tests/controller_client/test_pathways_sim_elastic.py's ``PathwaysSlices``
    makes them, on ``sim``; ``cluster`` (ours) the replicators that die and return with their hosts."""

    def __init__(self, sim: Any, cluster: LocalCluster | None):
        import jax

        super().__init__(jax.devices())
        self.sim, self.cluster = sim, cluster

    def lose(self, index: int) -> None:

        # Every buffer with a shard there is gone (reading one raises), the Snapshotter's replica there too.
        self.sim.lose_hosts(self.sim.hosts_of_slice(index), delete_arrays=True)
        self.fail(index)
        if self.cluster is not None:
            for rank in self.sim.hosts_of_slice(index):  # rank = host: both slice-major places
                self.cluster.procs[rank].kill()
                self.cluster.wipe(rank)

    def back(self, index: int) -> None:
        """Replacement hosts: empty RAM disks, new replicators; then healthy to the elastic Manager."""
        if self.cluster is not None:
            for rank in self.sim.hosts_of_slice(index):
                self.cluster.wipe(rank)
            self.cluster.start_many(self.sim.hosts_of_slice(index))
        self.sim.heal_hosts(self.sim.hosts_of_slice(index))
        self.heal(index)


class Rig:
    """The clock, the faults and the records of one system's run."""

    def __init__(
        self, opts: PathwaysOptions, slices: LosableSlices, cluster: LocalCluster | None, scratch: Path
    ):
        import jax

        self.opts, self.slices, self.cluster, self.scratch = opts, slices, cluster, scratch
        self.pending = sorted(opts.losses)
        self.t0: float | None = None
        self.t_end: float | None = None
        self.weights: dict[int, float] = {}  # step -> fraction of the slices its last computation ran on
        self.computed = 0  # steps computed after the clock started, recomputations included
        self.current = 0  # the step the loop's state is at
        self.records: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the pause in progress
        self.marks: list[tuple[str, float]] = []  # its events and their times (CLOCK_MONOTONIC)
        self.skipped: list[dict[str, Any]] = []
        self.timers: list[threading.Timer] = []
        self.back_at: dict[int, float] = {}
        self.returning: set[int] = set()

        @jax.jit
        def step_fn(state: dict) -> dict:
            return {**state, "step": state["step"] + 1, "bias0": state["bias0"] * 0.5 + 1.0}

        self._step_fn = step_fn

    # ------------------------------------------------------------------ the state
    def abstract(self, mesh: Any) -> dict:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from bench.emergency_common import abstract_state

        return {
            **abstract_state(mesh, self.opts.mib),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
        }

    def initial(self, mesh: Any) -> dict:
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from bench.emergency_common import make_state

        state, _ = make_state(mesh, self.opts.mib)
        return {**state, "step": jax.device_put(np.int32(0), NamedSharding(mesh, P()))}

    @staticmethod
    def step_of(state: dict) -> int:
        return int(state["step"])

    def young_daly(self, block: float, full: float) -> int:
        from bench.goodput_worker import young_daly

        return young_daly(block, full, self.opts.mtbf_seconds, self.opts.step_seconds)[1]

    # ------------------------------------------------------------------ the loop's events
    def train(self, state: dict, active: int) -> dict:
        """One step on ``active`` slices: the jitted update, then the accelerator's work (a sleep)."""
        import jax

        state = self._step_fn(state)
        jax.block_until_ready(state["step"])
        time.sleep(self.opts.step_seconds)
        self.current = self.step_of(state)
        if self.t0 is not None:
            self.computed += 1
            self.weights[self.current] = active / SLICES
        if self.open is not None and any(name == "restored" for name, _ in self.marks):
            self._close()
        return state

    def start_clock(self, state: dict) -> None:
        self.current = self.step_of(state)
        self.t0 = time.monotonic()

    def done(self) -> bool:
        if self.t0 is not None and time.monotonic() - self.t0 >= self.opts.seconds:
            self.t_end = self.t_end or time.monotonic()
            return True
        return False

    def before_step(self, active: list[int]) -> None:
        """A loss due strikes now (skipped, recorded, unless every slice is in and no pause is open); then a
        slice down among ``active`` raises the slice-down error Pathways raises at the next dispatch."""
        import jax

        now = time.monotonic()
        if self.pending and self.t0 is not None and now - self.t0 >= self.pending[0][0]:
            at, index = self.pending.pop(0)
            if self.open is None and len(active) == SLICES and not self.returning:
                self._lose(at, index)
            else:
                self.skipped.append({"scheduled_at": at, "slice": index, "at": round(now - self.t0, 3)})
        down = sorted(set(active) & self.slices.down)
        if down:
            raise jax.errors.JaxRuntimeError(f"DATA_LOSS: slice {down[0]} is down (simulated)")

    def _lose(self, at: float, index: int) -> None:
        """Slice ``index`` goes down; the pause's clock starts once it is gone (the harness's own work of
        taking it down, killing our replicators there among it, is no system's)."""
        self.returning.add(index)
        self.slices.lose(index)
        now = time.monotonic()
        self.open = {
            "kind": "slice_lost",
            "slice": index,
            "scheduled_at": at,
            "at": round(now - self.t0, 3),
            "step_at_failure": self.current,
        }
        self.marks = [("start", now)]
        timer = threading.Timer(self.opts.replace_seconds, self._back, (index,))
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _back(self, index: int) -> None:
        self.slices.back(index)
        self.back_at[index] = time.monotonic()

    def detected(self) -> None:
        if self.open is not None and all(name != "detect" for name, _ in self.marks):
            self._mark("detect")

    def attempt(self, slices: list[int]) -> None:
        if self.open is not None:
            self._mark("attempt")

    def noticed(self, new: list[int]) -> None:
        """The loop found returned slices ``new``: a rejoin pause opens (or, when a loss's pause is still
        open, that pause goes on until the first step on every slice, its ``rejoined`` set)."""
        now = time.monotonic()
        back = max((self.back_at.get(s, now) for s in new), default=now)
        self.returning.difference_update(new)
        if self.open is not None:
            self.open["rejoined"] = new
            self._mark("noticed")
            return
        self.open = {
            "kind": "rejoin",
            "slices": new,
            "at": round(now - (self.t0 or now), 3),
            "noticed_after_back_seconds": round(now - back, 4),
            "step_at_rejoin": self.current,
        }
        self.marks = [("start", now)]

    def restored(self, state: dict, source: str) -> None:
        """The attempt's state is back (at its step): the steps after it are to be computed again."""
        self.current = self.step_of(state)
        for s in [s for s in self.weights if s > self.current]:
            del self.weights[s]
        if self.open is not None:
            self._mark("restored")
            self.open.setdefault("source", source)
            self.open.setdefault("restored_step", self.current)

    def _mark(self, name: str) -> None:
        self.marks.append((name, time.monotonic()))

    def _close(self) -> None:
        """The pause ends with this completed step: its phases (each segment named by the mark ending it,
        summed where an attempt repeated) and what it cost."""
        self._mark("first_step")
        rec = self.open
        lost = rec["kind"] == "slice_lost"
        names = {
            "detect": "detect",
            "attempt": "wait" if lost else "resize",
            "restored": "restore",
            "noticed": "until_rejoin",
            "first_step": "first_step",
        }
        phases: dict[str, float] = {}
        for (_, before), (name, t) in zip(self.marks, self.marks[1:], strict=False):
            phases[names[name]] = round(phases.get(names[name], 0.0) + t - before, 4)
        rec["pause_seconds"] = round(self.marks[-1][1] - self.marks[0][1], 4)
        rec["phases"] = phases
        if lost:
            rec["steps_lost"] = rec["step_at_failure"] - rec.get("restored_step", rec["step_at_failure"])
        self.records.append(rec)
        self.open, self.marks = None, []

    # ------------------------------------------------------------------ the result
    def result(self) -> dict[str, Any]:
        end = self.t_end or time.monotonic()
        wall = end - (self.t0 or end)
        kept = sum(w for s, w in self.weights.items() if s > CLOCK_STEP)
        losses = [r for r in self.records if r["kind"] == "slice_lost"]
        pauses = [r["pause_seconds"] for r in losses]
        out: dict[str, Any] = {
            "wall_seconds": round(wall, 3),
            "final_step": self.current,
            "steps_computed": self.computed,
            "steps_kept": round(kept, 2),
            "ettr": round(kept * self.opts.step_seconds / wall, 4) if wall > 0 else None,
            "slice_lost_pause_seconds": pauses,
            "slice_lost_pause_median_seconds": round(statistics.median(pauses), 4) if pauses else None,
            "rejoin_pause_seconds": [r["pause_seconds"] for r in self.records if r["kind"] == "rejoin"],
            "events": self.records,
        }
        if self.open is not None:
            out["cut_at_end"] = self.open
        if self.skipped:
            out["skipped_losses"] = self.skipped
        return out

    def cancel(self) -> None:
        for t in self.timers:
            t.cancel()
            if t.is_alive():
                t.join(60)


@contextlib.contextmanager
def start_rig(system: str, options: dict[str, Any], scratch: Path) -> Iterator[Rig]:
    """The simulated Pathways (and, ours, the replicators) up; the rig inside pathwaysutils' patched health
    check; everything stopped after."""
    import signal

    from tests.kits.pathways_sim import PathwaysSim

    opts = PathwaysOptions(**{**options, "losses": tuple(tuple(x) for x in options["losses"])})
    cluster = None
    with PathwaysSim(SLICES, HOSTS_PER_SLICE, log_dir=scratch / "pathways") as sim:
        try:
            if system == "ours":
                cluster = CandidateCluster(
                    scratch / "replicators",
                    [
                        "--backup-url",
                        f"file://{scratch / 'persistent'}",
                        "--backup-interval-minutes",
                        f"{opts.bucket_seconds / 60:.4f}",
                    ],
                )
                cluster.start_all()
            rig = Rig(opts, LosableSlices(sim, cluster), cluster, scratch)
            with rig.slices.patched(), quiet_simulated_failures():
                try:
                    yield rig
                finally:
                    rig.cancel()
        finally:
            if cluster is not None:
                cluster.stop_all(signal.SIGKILL)
