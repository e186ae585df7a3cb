"""A memory cgroup of the test's own (issue #33, memory faults): made under the host's memory controller,
given a limit, a process moved into it by pid, its usage and OOM events read, and removed at teardown.

cgroup v1 (``/sys/fs/cgroup/memory``: ``memory.limit_in_bytes``, ``memory.failcnt``, ``memory.oom_control``)
and v2 (``memory.max``, ``memory.events``) are both supported; :func:`available` says why neither is when
not. The group is named ``mtc-test-<pid>-<random>`` so :func:`reap_stale` can remove what a run killed
outright left behind. Only processes the caller started are ever moved in; at :meth:`MemoryCgroup.remove`
they must have been stopped (by pid) already -- the kit never kills anything itself.

How the kernel charges memory matters to what a limit means: a page is charged to the cgroup of the
process that first brings it into memory -- anonymous memory (heap, buffers) and page cache alike, a
tmpfs's pages included. Page cache of a disk file is reclaimable (written back, then dropped), so a limit
on a process writing to disk bounds its own memory; a tmpfs's pages are not (no swap), so a process
writing N bytes into a tmpfs needs a limit above N whatever it buffers.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.kits.faultnet import pid_alive

ROOT = Path("/sys/fs/cgroup")
V1 = ROOT / "memory"
_OURS = re.compile(r"^mtc-test-(\d+)-[0-9a-f]{6}$")
REMOVE_TIMEOUT_SECONDS = 10.0


def _v2_root() -> Path | None:
    for cand in (ROOT, ROOT / "unified"):
        ctl = cand / "cgroup.controllers"
        if ctl.exists() and "memory" in ctl.read_text().split():
            return cand
    return None


def _base() -> tuple[Path, int] | None:
    """Where to make groups and the cgroup version, or None."""
    if (V1 / "memory.limit_in_bytes").exists():
        return V1, 1
    v2 = _v2_root()
    if v2 is not None and (v2 / "cgroup.subtree_control").exists() \
            and "memory" in (v2 / "cgroup.subtree_control").read_text().split():
        return v2, 2
    return None


def available() -> str:
    """"" when a memory cgroup can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if _base() is None:
        return "no cgroup memory controller (neither v1 /sys/fs/cgroup/memory nor v2 memory.max)"
    return ""


def reap_stale() -> list[str]:
    """Remove the empty groups an earlier run (a process no longer alive) left behind. Returns their names."""
    base = _base()
    if base is None:
        return []
    gone = []
    for d in base[0].iterdir():
        m = _OURS.match(d.name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                d.rmdir()
                gone.append(d.name)
    return gone


@contextlib.contextmanager
def sampling(sample: Callable[[], None], name: str, period: float = 0.05) -> Iterator[None]:
    """Call ``sample`` every ``period`` seconds in a thread while the block runs (OSError and ValueError, a
    group or a process going away, skipped), and stop it at the end."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period):
            with contextlib.suppress(OSError, ValueError):
                sample()

    t = threading.Thread(target=run, daemon=True, name=name)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)


class MemoryCgroup:
    """A memory cgroup ``mtc-test-<pid>-<rand>`` with a limit; a context manager removing it on exit."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        base = _base()
        if base is None:
            raise RuntimeError(available() or "no memory cgroup")
        root, self.version = base
        self.path = root / f"mtc-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.path.mkdir()
        if self.version == 1:
            # Every OOM in the group is a kill (no pause), as a container runtime sets it.
            with contextlib.suppress(OSError):
                (self.path / "memory.oom_control").write_text("0")
        if limit_bytes is not None:
            self.set_limit(limit_bytes)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def set_limit(self, nbytes: int) -> None:
        """The hard limit (v1 ``memory.limit_in_bytes``, v2 ``memory.max``); no swap beyond it."""
        if self.version == 1:
            # memory+swap must stay >= memory: lowered after it, raised before it.
            mem, memsw = self.path / "memory.limit_in_bytes", self.path / "memory.memsw.limit_in_bytes"
            order = [mem, memsw] if nbytes < int(mem.read_text()) else [memsw, mem]
            for f in order:
                if f.exists():  # memsw exists only with swap accounting
                    f.write_text(str(nbytes))
        else:
            (self.path / "memory.max").write_text(str(nbytes))
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")

    def add(self, pid: int) -> None:
        """Move process ``pid`` (one the caller started) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run already inside the group: a shell moves itself in, then execs ``argv`` (so nothing
        the command allocates is charged elsewhere first)."""
        return ["sh", "-c", f'echo $$ > {self.path / "cgroup.procs"} && exec "$@"', "sh", *argv]

    def usage(self) -> int:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return int((self.path / name).read_text())

    def peak(self) -> int | None:
        """The highest usage so far (page cache included), or None where the kernel does not keep it."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except OSError:
            return None

    def stat(self) -> dict[str, int]:
        out = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[k] = int(v)
        return out

    def anon(self) -> int:
        """Anonymous memory charged to the group now (v1 ``rss``, v2 ``anon``): what a process buffers."""
        s = self.stat()
        return s.get("rss", s.get("anon", 0))

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer killed in this group (0 where it is not counted)."""
        if self.version == 1:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
            return 0
        for line in (self.path / "memory.events").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def failcnt(self) -> int:
        """v1: how often usage hit the limit (reclaim ran); v2: ``max`` events."""
        if self.version == 1:
            return int((self.path / "memory.failcnt").read_text())
        for line in (self.path / "memory.events").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "max":
                return int(v)
        return 0

    def remove(self) -> None:
        """Remove the group, bounded: its processes must already be stopped by the caller (a process that
        is exiting may linger for a moment). Charged page cache moves to the parent with it."""
        if not self.path.exists():
            return
        deadline = time.monotonic() + REMOVE_TIMEOUT_SECONDS
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.path} still holds {self.pids()}") from None
                time.sleep(0.1)
