"""Child processes and RAM-disk scratch directories that do not outlive the harness that made them.

The benchmark harnesses (and the test kits that start replicators and JAX workers) start their children in
sessions of their own, so that a signal for one's process group reaches only it. A harness killed without
its ``finally`` blocks running (a CI timeout, a test run stopped with SIGKILL or SIGTERM) used to leave them
running, orphaned, holding ports and CPU, with their directories under /dev/shm: 9 GiB of them were found on
a dev box after a few stopped runs. Two remedies, both used wherever such children are started:

- :func:`bound_to_us`: the child gets SIGKILL when the thread that started it ends (Linux's parent-death
  signal, set by util-linux's ``setpriv --pdeathsig`` before it executes the command; nothing runs in the
  forked child of a threaded process). Start such children from a thread that lives as long as they should:
  every caller starts them from its main thread.
- :func:`scratch_dir`: a fresh directory on /dev/shm named after the harness's pid; making one first removes
  the directories of the same prefix whose harness is gone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
SETPRIV = shutil.which("setpriv")


def replicator_argv(*args: str) -> list[str]:
    """A replicator daemon's command line as the images run it (``mtc-replicator``: ``replicator.main``, verbose),
    not through ``mtc replicator``, whose ``mtc`` command line also loads the admin, manifests and demo commands
    (~80 ms more CPU per start that no deployed replicator pays)."""
    return [sys.executable, "-m", "replicator.main", "-v", *args]


def bound_to_us(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the child is SIGKILLed when the starting thread ends (unchanged without setpriv)."""
    if SETPRIV is None:
        return list(argv)
    return [SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (the owner of a scratch directory or of what a killed run left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scratch_dir(prefix: str) -> Path:
    """A new directory ``<prefix><pid>-XXXXXX`` on /dev/shm (the default temp dir where there is none), after
    removing the ones of the same prefix whose process is gone."""
    base = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    own = re.compile(re.escape(prefix) + r"(\d+)-")
    for d in base.glob(f"{prefix}*"):
        m = own.match(d.name)
        if m and d.is_dir() and not pid_alive(int(m.group(1))):
            log.info("removing %s, left by process %s that is gone", d, m.group(1))
            shutil.rmtree(d, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))
