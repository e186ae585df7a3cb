"""Test kit: build the two images with Debian's buildah and run them with Debian's podman, from one private store.

Both tools run as root with their own storage under one temporary directory (vfs driver; buildah with chroot
isolation, podman with runc), so that every image and container here is this kit's and nothing of the host's
store is touched. Facts of these hosts (docs/deploy.md, "Building the images here"):

- crun cannot start containers here ("cgroups in hybrid mode not supported"): podman uses runc, with the
  cgroupfs manager (no systemd), from a ``containers.conf`` passed via ``CONTAINERS_CONF``.
- runc cannot apply podman's default nproc limit here (``error setting rlimit type 6: operation not
  permitted``): the ``containers.conf`` sets nproc and nofile limits of a few thousand.
- Podman's default network adds bridges and iptables chains and turns on ip_forward: every container here runs
  with ``--network host`` (loopback only; the processes bind 127.0.0.1) or ``--network none``.

The base is a ``python:3.11-slim`` stand-in made by ``debootstrap`` (bookworm's python3 is 3.11), because this
machine reaches Debian's archive and PyPI but no container registry. It differs from ``python:3.11-slim`` in
two ways only: Debian's pip marker ``EXTERNALLY-MANAGED`` is removed (the python image has none), and this
machine's CA bundle replaces Debian's (its network reaches PyPI through an intercepting proxy).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.kits.jax_procs import REPO

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = "python3,python3-pip,python3-venv,python-is-python3,ca-certificates"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
BASE = "localhost/mtc-test-base:bookworm"
TOOLS = ("buildah", "podman", "runc", "debootstrap")
# Where a container sees the repository's tests/ (read-only): a folder without the product's packages, so
# that a container's sidecar/, replicator/ and controller_client/ are the ones its image installed.
TESTS_MOUNT = "/mtc-tests"

CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
netns = "host"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def pinned(name: str) -> str:
    """``name``'s version in constraints.txt."""
    return next(ln.split("==")[1].strip() for ln in (REPO / "constraints.txt").read_text().splitlines()
                if ln.split("==")[0].strip().lower() == name)


def check_tools() -> None:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    assert not missing, (f"{missing} not installed: `make image-test` installs Debian's buildah, podman, runc and "
                         "debootstrap (apt-get install buildah podman runc debootstrap)")
    assert os.geteuid() == 0, "debootstrap, buildah's chroot isolation and podman's host mounts need root here"


def _run(argv: list[str], what: str, timeout: float, check: bool, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(cwd) if cwd else None)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


class Store:
    """One private image store under ``root``, used by buildah (builds) and podman (runs)."""

    def __init__(self, root: Path):
        self.root = root
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        self.conf = root / "containers.conf"
        self.conf.write_text(CONTAINERS_CONF)
        self.env = dict(os.environ, CONTAINERS_CONF=str(self.conf), TMPDIR=str(root / "tmp"))
        common = ["--root", str(root / "storage"), "--runroot", str(root / "run"), "--storage-driver", "vfs"]
        self.buildah_args = ["buildah", *common]
        self.base = BASE
        self.podman_args = ["podman", *common, "--tmpdir", str(root / "podman")]
        self._names = itertools.count()

    # ------------------------------------------------------------------ buildah
    def buildah(self, *args: str, timeout: float = 900, check: bool = True,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
        return _run([*self.buildah_args, *args], f"buildah {' '.join(args[:2])}", timeout, check, self.env, cwd)

    def build(self, dockerfile: Path, tag: str, context: Path, *build_args: str,
              check: bool = True) -> subprocess.CompletedProcess:
        flags = [a for kv in build_args for a in ("--build-arg", kv)]
        return self.buildah("bud", "--isolation", "chroot", "--layers=false", "-f", str(dockerfile), "-t", tag,
                            *flags, str(context), check=check, cwd=context)  # fmt: skip

    def make_base(self) -> str:
        """``localhost/mtc-test-base:bookworm``, the python:3.11-slim stand-in (module docstring)."""
        rootfs = self.root / "rootfs"
        proc = subprocess.run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(rootfs),
                               MIRROR], capture_output=True, text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0, f"debootstrap failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        if HOST_CA.is_file():
            shutil.copyfile(HOST_CA, rootfs / "etc/ssl/certs/ca-certificates.crt")
        ctx = self.root / "base"
        ctx.mkdir()
        with tarfile.open(ctx / "rootfs.tar", "w") as tar:
            tar.add(rootfs, arcname=".")
        shutil.rmtree(rootfs)
        (ctx / "Containerfile").write_text('FROM scratch\nADD rootfs.tar /\nCMD ["python3"]\n')
        self.build(ctx / "Containerfile", BASE, ctx)
        shutil.rmtree(ctx)
        return BASE

    def make_colocated_base(self, jax_version: str, cloudpickle_version: str,
                            tag: str = "localhost/mtc-test-colocated:base") -> str:
        """A stand-in for Google's colocated-Python image: jax, jaxlib and cloudpickle (no orbax-checkpoint) in
        /opt/venv, with /opt/venv/server_constraints.txt (as Google's samples install with)."""
        ctx = self.root / "colocated"
        ctx.mkdir()
        (ctx / "Containerfile").write_text(
            f"FROM {BASE}\n"
            f"RUN python -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir jax=={jax_version} "
            f"jaxlib=={jax_version} numpy==2.2.6 cloudpickle=={cloudpickle_version} "
            "&& /opt/venv/bin/pip freeze > /opt/venv/server_constraints.txt\n"
            "ENV PATH=/opt/venv/bin:$PATH\n")
        self.build(ctx / "Containerfile", tag, ctx)
        return tag

    def buildah_run(self, image: str, *cmd: str, volumes: Sequence[str] = ()) -> subprocess.CompletedProcess:
        """``cmd`` in a container of ``image``; ``volumes``: ``HOST:CONTAINER[:OPTIONS]`` bind mounts."""
        container = self.buildah("from", image).stdout.strip().splitlines()[-1]
        flags = [a for v in volumes for a in ("--volume", v)]
        try:
            return self.buildah("run", "--isolation", "chroot", *flags, container, "--", *cmd, check=False,
                                timeout=120)
        finally:
            self.buildah("rm", container, check=False)

    # ------------------------------------------------------------------ podman
    def podman(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.podman_args, *args], f"podman {' '.join(args[:2])}", timeout, check, self.env)

    def podman_command(self, *args: str) -> list[str]:
        """argv of a podman call for a caller that starts it itself (with any environment)."""
        return ["env", f"CONTAINERS_CONF={self.conf}", f"TMPDIR={self.root / 'tmp'}", *self.podman_args, *args]

    def sim_worker_command(self, image: str, shared: Sequence[Path],
                           user: str | None = None) -> Callable[[list[str], dict[str, str]], list[str]]:
        """``PathwaysSim(worker_command=...)``: each simulated worker runs as ``python -m
        tests.kits.pathways_sim worker ...`` in a container of ``image`` (host network: the workers reach the
        controller and each other on 127.0.0.1) as ``user`` (default: the image's), with tests/ at
        :data:`TESTS_MOUNT` and each of ``shared`` at its own path (the hosts' RAM disks, the replicators'
        sockets)."""

        def wrap(argv: list[str], env: dict[str, str]) -> list[str]:
            env = {**env, "PYTHONPATH": TESTS_MOUNT}
            mounts = [f"{REPO / 'tests'}:{TESTS_MOUNT}/tests:ro", *(f"{p}:{p}" for p in shared)]
            return self.podman_command(
                "run", "--rm", "--name", f"mtc-sim-worker-{next(self._names)}", "--network", "host",
                *(["--user", user] if user else []), "--workdir", TESTS_MOUNT, *(a for m in mounts for a in ("--volume", m)),
                *(a for k, v in env.items() for a in ("--env", f"{k}={v}")), image, "python", *argv[1:])

        return wrap

    def close(self) -> None:
        """Every container and image of this store, then the store."""
        self.podman("rm", "--all", "--force", "--time", "0", check=False, timeout=300)
        self.buildah("rm", "--all", check=False)
        self.buildah("rmi", "--all", "--force", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
