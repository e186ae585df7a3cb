"""Test-wide set-up: 8 CPU devices for JAX (must happen before jax is imported)."""

import os

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
