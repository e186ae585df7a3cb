"""Test kit for the admin CLI: run `mtc ...` as a subprocess, as an operator would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from controller_client.demo.cluster import REPO


class Result:
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> Any:
        try:
            return json.loads(self.out)
        except json.JSONDecodeError as e:
            raise AssertionError(f"not JSON (exit {self.code}): {self.out!r} {self.err!r}") from e

    def __repr__(self) -> str:
        return f"<exit {self.code}\nstdout:\n{self.out}\nstderr:\n{self.err}>"


def mtc(*argv: str, timeout: float = 180.0, env: dict[str, str] | None = None) -> Result:
    # Wide tables whatever the runner's terminal says (pytest-xdist workers inherit COLUMNS=80).
    e = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    e.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "controller_client.cli", *argv], capture_output=True, text=True,
                          env=e, cwd=str(REPO), timeout=timeout)
    return Result(proc)
