"""A container's first process: builds the container's view of the filesystem, then chroots and execs it.

The node agent runs ``python container_init.py SPEC.json`` inside ``ip netns exec <pod namespace> unshare
--mount --uts --propagation private``, so every mount made here lives only in the container's own mount
namespace (private: nothing propagates to the host) and goes away with its last process. The view is a
tmpfs root whose entries are the host's top-level entries (bind mounts, symlinks copied), then the Pod's
volumes at their mount paths. A mount path that does not exist is never created in the host's real
filesystem: its parent is *shadowed* (a tmpfs holding binds of the parent's children, moved over it), and
the entry is made in that tmpfs; inside a kit-owned volume directory it is made directly, as the kubelet
does. SPEC (JSON): ``root`` (an empty directory to mount the tmpfs root on), ``hostname``, ``mounts``
(``source``, ``target``, ``readOnly``, ``owned``: a kit directory where entries may be created), ``argv``,
``env``, ``workingDir``. Standard library only: it runs before the container's PATH exists.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MAX_SYMLINKS = 40
STAGING = "/.mtck-staging"

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype}, {flags:#x}): {os.strerror(err)}")


class View:
    """The container's filesystem tree under ``root`` (paths given as the container sees them)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.ours = {"/"}  # directories on a tmpfs of ours: entries may be created there
        self.owned: list[str] = []  # kit-owned volume directories: entries may be created in them too

    def real(self, path: str) -> str:
        return self.root + path

    def resolve(self, path: str) -> str:
        """``path`` with symlinks followed inside the view (``/var/run`` -> ``/run``)."""
        parts = [p for p in path.split("/") if p]
        done = ""
        hops = 0
        while parts:
            nxt = done + "/" + parts.pop(0)
            real = self.real(nxt)
            if os.path.islink(real):
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise OSError(40, f"too many symlinks resolving {path}")
                link = os.readlink(real)
                base = "" if link.startswith("/") else done
                parts = [p for p in (base + "/" + link).split("/") if p] + parts
                done = ""
                continue
            if parts and os.path.isdir(real) is False and os.path.lexists(real):
                raise NotADirectoryError(f"{nxt} in the container is not a directory")
            done = nxt
        return done or "/"

    def writable(self, path: str) -> bool:
        return path in self.ours or any(path == o or path.startswith(o + "/") for o in self.owned)

    def ensure(self, path: str, is_dir: bool) -> str:
        """The resolved ``path``, created (as a directory or an empty file) when missing."""
        path = self.resolve(path)
        if os.path.lexists(self.real(path)):
            return path
        parent = self.ensure(os.path.dirname(path), True)
        path = parent.rstrip("/") + "/" + os.path.basename(path)
        if not self.writable(parent):
            self.shadow(parent)
        # Another container's init may create it meanwhile where the view is the agent's own tree (the elastic
        # scenario's colocated-python-sidecar failed "File exists: .../rootfs/tmp/sidecar" once and restarted).
        if is_dir:
            try:
                os.mkdir(self.real(path), 0o755)
            except FileExistsError:
                pass
            if parent in self.ours:
                self.ours.add(path)
        else:
            try:
                with open(self.real(path), "x"):
                    pass
            except FileExistsError:
                pass
        return path

    def shadow(self, path: str) -> None:
        """Replace directory ``path`` in the view by a tmpfs holding binds of its children (the host's
        directory is not touched)."""
        staging = self.real(STAGING)
        os.mkdir(staging, 0o755)
        mount("tmpfs", staging, "tmpfs", 0, "mode=0755")
        src = self.real(path)
        for entry in os.scandir(src):
            self.replicate(entry, staging + "/" + entry.name)
        mount(staging, src, None, MS_MOVE)
        os.rmdir(staging)
        self.ours.add(path)

    def replicate(self, entry: os.DirEntry[str], dest: str) -> None:
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dest)
            return
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(dest, 0o755)
        else:
            with open(dest, "x"):
                pass
        mount(entry.path, dest, None, MS_BIND | MS_REC)

    def bind(self, source: str, target: str, read_only: bool) -> None:
        target = self.ensure(target, os.path.isdir(source))
        mount(source, self.real(target), None, MS_BIND | MS_REC)
        if read_only:
            mount(None, self.real(target), None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def build(spec: dict) -> None:
    view = View(spec["root"])
    mount("tmpfs", view.root, "tmpfs", 0, "mode=0755")
    for entry in os.scandir("/"):
        view.replicate(entry, view.real("/" + entry.name))
    for m in spec["mounts"]:
        view.bind(m["source"], m["target"], bool(m.get("readOnly")))
        if m.get("owned"):
            view.owned.append(view.resolve(m["target"]))


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        if spec.get("hostname"):
            socket.sethostname(spec["hostname"])
        build(spec)
        os.chroot(spec["root"])
        os.chdir(spec.get("workingDir") or "/")
    except OSError as e:
        print(f"container init: {e}", file=sys.stderr, flush=True)
        return 128
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        print(f"container init: exec {argv[0]}: {e}", file=sys.stderr, flush=True)
        return 127 if isinstance(e, FileNotFoundError) else 126


if __name__ == "__main__":
    sys.exit(main())
