"""Test-wide set-up: 8 CPU devices for JAX (must happen before jax is imported); SIGTERM stops a run cleanly."""

import os
import signal

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The crash-point and in-flight matrices' fixtures and report hooks (tests/crash/report.py).
from tests.crash.report import (  # noqa: E402,F401
    crash_matrix,
    inflight_matrix,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (a CI timeout, ``kill`` of the run's process group) as Ctrl-C: the running test's ``finally`` blocks
    and fixtures' teardowns stop the processes it started. Without this the interpreter died at once, and
    children started in sessions of their own (the benchmark harnesses' replicators and JAX workers) ran on,
    orphaned, with their RAM-disk directories under /dev/shm."""
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _terminated)
