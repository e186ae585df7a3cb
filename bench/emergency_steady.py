"""bench.emergency's steady state: the step time of a training loop that saves every N steps, against none.

The timed windows of bench.emergency start after a barrier and end when the step is safe; work a system
leaves running after that (our spare pool's fill, the peer copy, the backup) would land between windows. Here
nothing can: the same loop of ``steps`` train steps runs twice on every host, first without checkpointing,
then with ``save(step)`` every ``every`` steps, and the second window also holds the wait until the last
save's work is over (ours: the step redundant and the spare pool filled again). A train step is CPU work of
about ``step_seconds`` (a jitted chain of 256 x 256 matmuls, its length measured once, the slowest host's)
and then a barrier of the 4 processes, as a data-parallel step ends in a collective: on this box's 2 cores a
system's background work slows it, as it would slow the host's side of a real step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

KEYS = ("steady_no_checkpoint", "steady_checkpointing")
FIRST_STEP = 100  # after the scenario's steps 0-2
MATRIX = 256


@dataclasses.dataclass(frozen=True)
class SteadyOptions:
    """``steps`` train steps per window (0: no steady state), a save every ``every``, each step ~``step_seconds``."""

    steps: int = 24
    every: int = 8
    step_seconds: float = 0.5

    def __post_init__(self) -> None:
        if self.steps < 0 or self.every < 1 or self.step_seconds <= 0:
            raise ValueError("steady steps >= 0, every >= 1, step seconds > 0")


def make_step(seconds: float, barrier: Callable[[], None]) -> Callable[[], None]:
    """A train step of about ``seconds`` of CPU on the slowest host, ending at a barrier."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    w = jnp.full((MATRIX, MATRIX), 1.0 / MATRIX, jnp.float32)

    @jax.jit
    def work(x: Any, n: Any) -> Any:
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ x), x)

    work(w, 2).block_until_ready()  # compiled once: the trip count is an argument
    t = time.monotonic()
    work(w, 16).block_until_ready()
    per = float(np.asarray(multihost_utils.process_allgather(np.float64((time.monotonic() - t) / 16))).max())
    n = max(1, round(seconds / max(per, 1e-6)))

    def step() -> None:
        work(w, n).block_until_ready()
        barrier()

    return step


def measure(system: Any, state: dict, opts: SteadyOptions, barrier: Callable[[], None]) -> dict[str, float]:
    """This host's seconds per step without checkpointing and with a save every ``opts.every`` steps."""
    step = make_step(opts.step_seconds, barrier)

    def window(save: bool) -> float:
        barrier()
        t = time.monotonic()
        last = None
        for i in range(1, opts.steps + 1):
            step()
            if save and i % opts.every == 0:
                last = FIRST_STEP + i
                system.save(last, state)
        if last is not None:
            system.wait_quiet(last)
        barrier()
        return (time.monotonic() - t) / opts.steps

    return {"steady_no_checkpoint": window(False), "steady_checkpointing": window(True)}


def result(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``steady``: per system the medians over rounds (seconds per step, both windows) and the median ratio;
    ``steady_step_time_vs_no_checkpoint``: ours' ratio (absent when ours did not run the steady state)."""
    out: dict[str, Any] = {}
    steady: dict[str, dict[str, float]] = {}
    for name, rounds in runs.items():
        got = [r for r in rounds if all(k in r for k in KEYS)]
        if not got:
            continue
        steady[name] = {k: round(statistics.median(r[k] for r in got), 4) for k in KEYS}
        steady[name]["ratio"] = round(statistics.median(r["steady_checkpointing"] / r["steady_no_checkpoint"]
                                                        for r in got), 3)
    if steady:
        out["steady"] = steady
    if "ours" in steady:
        out["steady_step_time_vs_no_checkpoint"] = steady["ours"]["ratio"]
    return out
