"""A FUSE filesystem for the disk-fault tests (issue #33): a passthrough of a backing directory that turns a
chosen write or read into a real I/O error at byte N of a file, as a failing disk would.

``python -m tests.kits.faultfs BACKING MOUNTPOINT CONTROL`` serves BACKING at MOUNTPOINT (libfuse 3 through
PyPI ``mfusepy``; Debian ``fuse3``). The faults are rules in the JSON file CONTROL, re-read whenever it
changes, so a test arms and clears them while daemons work on the mount:

``{"op": "write" | "read" | "create", "glob": "steps/.tmp-*/*", "at": N, "errno": "EIO" | "ENOSPC",
"files": [[ino, mtime_ns], ...]}``

- ``write``: a write to a file whose path (relative to the mount, ``fnmatch``) matches ``glob`` writes the
  bytes before offset ``at`` and fails with ``errno`` from there on (a short write, then the error);
- ``read``: a read of a matching file that covers byte ``at`` or any beyond fails (the whole request);
  ``files`` (optional) limits the rule to those backing files, by inode number and mtime (one bad copy of a
  file: a rewritten file with the same name reads well, even where the filesystem reuses the inode number);
- ``create``: creating a matching file or directory fails (a full file table).

Each error served is appended as a JSON line to ``CONTROL.hits``, so a test can tell that its fault fired.
Mounted with ``direct_io``: every read and write reaches this process (no page cache answers for it).
:class:`FaultMount` mounts and unmounts it (by its own mountpoint, its process stopped by pid);
:class:`Tmpfs` is a small tmpfs that fills by bytes or by files.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MOUNT_TIMEOUT_SECONDS = 20.0
STOP_TIMEOUT_SECONDS = 10.0
REPO = Path(__file__).resolve().parents[2]


class Rules:
    """The rules of CONTROL, re-read when its mtime changes; hits logged to ``CONTROL.hits``."""

    def __init__(self, control: Path) -> None:
        self.control = control
        self.hits = Path(str(control) + ".hits")
        self._stamp: int | None = None
        self._rules: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def current(self) -> list[dict[str, Any]]:
        try:
            stamp = self.control.stat().st_mtime_ns
        except FileNotFoundError:
            return []
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._rules = json.loads(self.control.read_text() or "[]")
                except ValueError:
                    return self._rules  # caught mid-write: the old rules until the next change
                self._stamp = stamp
            return self._rules

    def match(self, op: str, path: str, st: os.stat_result | None = None) -> dict[str, Any] | None:
        rel = path.lstrip("/")
        for r in self.current():
            if r["op"] == op and fnmatch.fnmatchcase(rel, r.get("glob", "*")) and (
                    st is None or not r.get("files") or [st.st_ino, st.st_mtime_ns] in r["files"]):
                return r
        return None

    def hit(self, rule: dict[str, Any], path: str, offset: int, size: int = 0) -> int:
        err = getattr(errno, rule["errno"])
        with self._lock, open(self.hits, "a") as f:
            f.write(json.dumps({"t": time.time(), "op": rule["op"], "path": path.lstrip("/"), "offset": offset,
                                "size": size, "errno": rule["errno"]}) + "\n")
        return err


def _serve(backing: str, mountpoint: str, control: str) -> None:
    import mfusepy

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = libc.renameat2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    rules = Rules(Path(control))

    class FaultFS(mfusepy.Operations):
        use_ns = True

        def _b(self, path: str) -> str:
            return os.path.join(backing, path.lstrip("/"))

        def _created(self, path: str) -> None:
            rule = rules.match("create", path)
            if rule is not None:
                raise mfusepy.FuseOSError(rules.hit(rule, path, 0))

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = os.fstat(fh) if fh is not None else os.lstat(self._b(path))
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid",
                                                 "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_ino")} | {
                "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._b(path))]

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._b(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            s = os.statvfs(self._b(path))
            return {k: getattr(s, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def mkdir(self, path: str, mode: int) -> int:
            self._created(path)
            os.mkdir(self._b(path), mode)
            return 0

        def mknod(self, path: str, mode: int, dev: int) -> int:
            self._created(path)
            os.mknod(self._b(path), mode, dev)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(self._b(path))
            return 0

        def unlink(self, path: str) -> int:
            os.unlink(self._b(path))
            return 0

        def symlink(self, target: str, source: str) -> int:
            os.symlink(source, self._b(target))
            return 0

        def readlink(self, path: str) -> str:
            return os.readlink(self._b(path))

        def link(self, target: str, source: str) -> int:
            os.link(self._b(source), self._b(target))
            return 0

        def rename(self, old: str, new: str, flags: int = 0) -> int:
            if renameat2(at_fdcwd, os.fsencode(self._b(old)), at_fdcwd, os.fsencode(self._b(new)), flags):
                e = ctypes.get_errno()
                raise mfusepy.FuseOSError(e)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._b(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(self._b(path), uid, gid)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            os.utime(self._b(path), ns=times) if times else os.utime(self._b(path))
            return 0

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._b(path), length)
            return 0

        def open(self, path: str, flags: int) -> int:
            return os.open(self._b(path), flags)

        def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
            self._created(path)
            return os.open(self._b(path), flags | os.O_CREAT, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            rule = rules.match("read", path, os.fstat(fh))
            if rule is not None and offset + size > rule["at"]:
                # The whole request fails: a short read would be taken for the end of the file (FUSE then
                # shrinks its idea of the file's size, and sendfile sees EOF, not an error).
                raise mfusepy.FuseOSError(rules.hit(rule, path, offset, size))
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            rule = rules.match("write", path)
            if rule is not None and offset + len(data) > rule["at"]:
                if offset >= rule["at"]:
                    raise mfusepy.FuseOSError(rules.hit(rule, path, offset))
                data = data[: rule["at"] - offset]  # a short write; the rest fails
            return os.pwrite(fh, data, offset)

        def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
            if mode:
                raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
            os.posix_fallocate(fh, offset, size)
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            os.fsync(fh)
            return 0

        def release(self, path: str, fh: int) -> int:
            os.close(fh)
            return 0

    class FlagsFUSE(mfusepy.FUSE):
        """mfusepy drops rename's flags (RENAME_NOREPLACE, RENAME_EXCHANGE): pass them on."""

        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            return self.operations.rename(old.decode(self.encoding, self.errors),
                                          new.decode(self.encoding, self.errors), flags)

    FlagsFUSE(FaultFS(), mountpoint, foreground=True, nothreads=False, direct_io=True, fsname="mtc-faultfs")


class FaultMount:
    """``backing`` served at ``mountpoint`` by a faultfs process; rules written to ``control``."""

    def __init__(self, backing: Path, mountpoint: Path, control: Path) -> None:
        self.backing, self.mountpoint, self.control = Path(backing), Path(mountpoint), Path(control)
        self.hits = Path(str(control) + ".hits")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> FaultMount:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.set([])
        log = open(str(self.control) + ".log", "ab")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.kits.faultfs", str(self.backing),
                                      str(self.mountpoint), str(self.control)], stdout=log, stderr=log,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
        log.close()
        deadline = time.monotonic() + MOUNT_TIMEOUT_SECONDS
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"faultfs did not mount {self.mountpoint}: "
                                   f"{Path(str(self.control) + '.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def set(self, rules: list[dict[str, Any]]) -> None:
        """Arm ``rules`` (an empty list clears them); atomically, so the filesystem sees old or new."""
        tmp = self.control.with_suffix(".new")
        tmp.write_text(json.dumps(rules))
        os.replace(tmp, self.control)

    def hit_records(self) -> list[dict[str, Any]]:
        if not self.hits.exists():
            return []
        return [json.loads(line) for line in self.hits.read_text().splitlines() if line.endswith("}")]

    def __exit__(self, *_: object) -> None:
        if os.path.ismount(self.mountpoint):  # only our own mountpoint; lazily if still busy
            r = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True, check=False)
            if r.returncode:
                subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], capture_output=True, check=False)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_SECONDS)


class Tmpfs:
    """A tmpfs of ``size`` bytes and ``inodes`` files mounted at ``mountpoint`` (a directory of the test's own),
    unmounted on exit (lazily if still busy); :meth:`fill_bytes` and :meth:`fill_inodes` fill it up and
    :meth:`free` gives the room back."""

    def __init__(self, mountpoint: Path, size: int, inodes: int) -> None:
        self.mountpoint, self.size, self.inodes = Path(mountpoint), size, inodes
        self.filler = self.mountpoint / ".test-filler"

    def __enter__(self) -> Tmpfs:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size},nr_inodes={self.inodes},mode=0755",
                        "mtc-test-tmpfs", str(self.mountpoint)], check=True, capture_output=True)
        return self

    def fill_bytes(self) -> int:
        """Take every free byte (a file grown until ENOSPC); returns how many."""
        self.filler.mkdir(exist_ok=True)
        n = 0
        with open(self.filler / "bytes", "wb", buffering=0) as f:
            chunk = b"\0" * (64 << 10)
            while True:
                try:
                    n += f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        return n
                    chunk = chunk[: len(chunk) // 2]

    def fill_inodes(self) -> int:
        """Take every free inode (empty files until ENOSPC); returns how many."""
        self.filler.mkdir(exist_ok=True)
        n = 0
        while True:
            try:
                (self.filler / str(n)).touch()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return n
            n += 1

    def free(self) -> None:
        if self.filler.exists():
            for p in self.filler.iterdir():
                p.unlink()
            self.filler.rmdir()

    def __exit__(self, *_: object) -> None:
        if os.path.ismount(self.mountpoint):
            r = subprocess.run(["umount", str(self.mountpoint)], capture_output=True, check=False)
            if r.returncode:
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, check=False)


def available() -> str:
    """Why faultfs cannot run here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (FUSE mounts)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy or libfuse3 missing: {e}"
    return ""


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
