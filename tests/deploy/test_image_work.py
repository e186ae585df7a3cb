"""The built images doing real work (issue #30, item 1): podman runs them from buildah's store (tests/kits/images.py).

- **Sidecar image** on a stand-in for Google's colocated-Python image (jax, jaxlib, cloudpickle; no orbax): the
  simulated Pathways job's worker processes (tests/kits/pathways_sim.py) run inside containers of the built image,
  so the colocated programs of a native save, a restore onto another mesh and Orbax's colocated checkpointing run
  on the packages the image installed. Only the repository's ``tests/`` is mounted (at a path holding none of the
  product's packages); each worker reports where its ``sidecar`` comes from and what was in place at its start
  (tests/kits/image_worker.py). In the native test each host is a worker container and a replicator container
  of the replicator image, both as UID 1000 on the host's RAM disk; in Orbax's, the replicators (Orbax mode)
  are host processes as root, so its worker containers run as root (the control socket is mode 0600).
- **Replicator image**: four containers as on a node (user 1000, read-only root filesystem but /tmp, no
  capabilities, a memory limit, a size-limited tmpfs as ``/local``) serve a save made from outside them (a sidecar-image container with the same
  user: tests/kits/image_trainer.py); one is killed and started again with its ``/local`` kept (the CSI RAM disk
  outlives a Pod restart on the node) and the restore reads its own RAM disk; one starts with an empty
  ``/local`` and is refilled from its data-parallel peer.

Shown failing before the change (issue #30): on the old Dockerfile.sidecar every test here fails (no
orbax-checkpoint in the image: ``ModuleNotFoundError: No module named 'orbax'`` on the worker's first program);
with orbax-checkpoint but without the start hook, the Orbax test fails at Orbax's init with ``Invalid device ID
2``.

Marked ``image`` (``make image-test``; left out of ``make test``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from sidecar import checksums, layout
from tests.kits.image_trainer import differences, state, target_on
from tests.kits.image_worker import REPORT_ENV
from tests.kits.images import TESTS_MOUNT, Store, pinned
from tests.kits.jax_procs import REPO, free_port
from tests.kits.pathways_sim import PathwaysSim
from tests.replicator.orbax.test_colocated_pathways import pathways_orbax  # noqa: F401  (fixture)

pytestmark = [pytest.mark.image, pytest.mark.timeout(1500)]

SITE = "/opt/venv/lib/python3.11/site-packages"  # the colocated-Python stand-in's environment


def assert_equal(want: dict, got: dict) -> None:
    assert not differences(want, got), differences(want, got)


# --------------------------------------------------------------------------- the sidecar image

def _sim(store: Store, image: str, base: Path, shared: list[Path], setup_env: dict[str, str] | None = None,
         user: str | None = None) -> PathwaysSim:
    """2 slices x 2 hosts whose workers run in containers of ``image`` as ``user`` (default: the image's), with
    ``shared`` and ``<base>/reports`` (their reports) at their own paths."""
    reports = base / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    reports.chmod(0o777)  # written by the workers' user
    return PathwaysSim(2, 2, log_dir=base / "logs", worker_setup="tests.kits.image_worker:setup",
                       worker_env={REPORT_ENV: str(reports), **(setup_env or {})},
                       worker_command=store.sim_worker_command(image, [reports, *shared], user=user))


def _assert_workers_ran_the_image(base: Path, uid: int) -> None:
    """Every worker ran on the image's packages (none from the mounted tests/), on the base's jax, with Orbax's
    patch and parsed absl flags in place at its start by the image's own doing."""
    reports = [json.loads((base / "reports" / f"worker-{p}.json").read_text()) for p in range(4)]
    for r in reports:
        for pkg in ("sidecar", "controller_client", "replicator", "orbax.checkpoint"):
            assert r[pkg] is not None and r[pkg].startswith(f"{SITE}/{pkg.replace('.', '/')}/"), r
            assert not r[pkg].startswith(TESTS_MOUNT), r
        assert r["jax"] == pinned("jax") and r["jax_file"].startswith(SITE), r
        assert r["orbax_patch_at_start"] is True, r
        assert r["absl_flags_parsed_at_start"] is True, r
        assert r["uid"] == uid, r


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    # Not /dev/shm: the worker containers get their own /dev/shm, under which a bind mount would hide.
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_sidecar_image_runs_the_pathways_workers_native_save_and_restore(
        store: Store, sidecar_image: str, replicator_image: str, workdir: Path) -> None:
    """Native path, each host as its Pod runs it: a worker container of the sidecar image and a replicator
    container, both as UID 1000 on the host's RAM disk. Save two steps, restore onto the saved mesh and onto
    another one; every colocated program ran in the image's containers (``_PathwaysIds`` imports Orbax's patch
    on the worker: an image without orbax-checkpoint fails the first save with ModuleNotFoundError)."""
    ram = workdir / "ram"
    with contextlib.ExitStack() as stack:
        reps = _replicators_on_ram_disks(stack, store, replicator_image, ram)
        # Each RAM disk on its own (pytest's tmp_path is mode 0700: the workers' user could not pass it).
        sim = stack.enter_context(_sim(store, sidecar_image, workdir, [ram / str(r) for r in range(4)]))
        devs = jax.devices()
        opts = CheckpointManagerOptions(local_directory=str(ram / "{host}"), job_name="t",
                                        coordinator_address=reps.coordinator, restore_wait_seconds=60,
                                        rpc_timeout_seconds=10)
        mgr = CheckpointManager(opts, devices=devs)
        assert mgr.topology.nodes == 4
        trees = {}
        for step in (1, 2):
            trees[step] = state(step, devs)
            assert mgr.save(step, trees[step])
            mgr.wait_until_finished()
        for r in range(4):  # each host's shards, written by its worker container as UID 1000
            step_dir = layout.steps_dir(ram / str(r)) / "2"
            checksums.verify_step_dir(step_dir)
            assert step_dir.stat().st_uid == 1000
        assert mgr.latest_step() == 2
        assert_equal(trees[2], mgr.restore(None, target_on(trees[2], devs, (2, 4))))
        assert_equal(trees[1], mgr.restore(1, target_on(trees[1], devs, (4, 2))))  # another mesh
        mgr.close()
        assert {hosts for _, hosts in sim.calls} == {(0, 1, 2, 3)}
    _assert_workers_ran_the_image(workdir, uid=1000)


def test_sidecar_image_runs_orbax_colocated_checkpointing(store: Store, sidecar_image: str, workdir: Path,
                                                          pathways_orbax) -> None:  # noqa: F811
    """Unchanged Orbax (``use_colocated_python=True``) against real replicators in Orbax mode: init, save, a
    new incarnation's init, latest_step and a bit-exact restore, every worker in the image's containers. The
    test's worker setup leaves Orbax's patch off (``MTC_SIM_ORBAX_PATCH=0``): the image's start hook installs
    it before Orbax's first program, whose shardings name controller-side device ids (``Invalid device ID 2``
    without it). The workers pickle controller-side ids (``MTC_SIM_WORKER_PICKLES_GLOBAL_IDS``), the
    simulation's assumption about Pathways that Orbax 0.12.8's restore needs (docs/pathways.md)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        replicator_checkpoint_manager as rcm,
    )

    from tests.kits.orbax_colocated import (
        GLOBAL_IDS_ENV,
        HOST_CWD_ENV,
        LOCAL_DIR,
        PATCH_ENV,
        ColocatedCluster,
    )
    from tests.kits.orbax_replicator import wait_for
    from tests.kits.orbax_replicator_worker import expected_state

    cl = ColocatedCluster(workdir / "orbax", 4)
    try:
        cl.start_all()
        env = {HOST_CWD_ENV: cl.host_cwd_template, PATCH_ENV: "0", GLOBAL_IDS_ENV: "1"}
        # As root: these replicators are host processes (as root), whose control sockets are mode 0600.
        with _sim(store, sidecar_image, workdir, [cl.base], env, user="0:0"):
            devs = jax.devices()
            mesh = Mesh(np.array(devs).reshape(2, -1), ("data", "model"))
            sharding = NamedSharding(mesh, P("model"))

            def init_and_manager():
                initialization.initialize_multi_tier_checkpointing(
                    LOCAL_DIR, run_name="img", num_slices=2, backup_interval_minutes=30,
                    jax_initialization_timeout_seconds=90, use_colocated_python=True, devices=devs)
                return rcm.ReplicatorCheckpointManager(LOCAL_DIR, rcm.ReplicatorCheckpointManagerOptions(
                    save_interval_steps=1, use_colocated_python=True), global_mesh=mesh)

            mgr = init_and_manager()
            assert mgr.latest_step() is None
            for step in (1, 2):
                tree = {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
                        for k, v in expected_state(step, 8).items()}
                assert mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
                mgr.wait_until_finished()
            wait_for(lambda: all((cl.local(h) / "steps" / "2" / layout.MANIFEST_NAME).is_file() for h in range(4)),
                     what="step 2 ingested on every host")
            mgr = init_and_manager()  # the next incarnation: the replicators hand step 2 back
            assert mgr.latest_step() == 2
            want = expected_state(2, 8)
            abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in want.items()}
            got = mgr.restore(None, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))["state"]
            for k, v in want.items():
                assert np.asarray(got[k]).tobytes() == v.tobytes(), k
            mgr.close()
        _assert_workers_ran_the_image(workdir, uid=0)
    finally:
        cl.stop_all(signal.SIGKILL)


# --------------------------------------------------------------------------- the replicator image

LOCAL_BYTES = 64 << 20  # each host's RAM disk
MEMORY_LIMIT = "512m"


@contextlib.contextmanager
def ram_disk(path: Path) -> Iterator[Path]:
    """A size-limited tmpfs at ``path``, owned by UID 1000 (what the CSI driver mounts on the node); unmounted
    after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LOCAL_BYTES},uid=1000,gid=1000,mode=0755", "mtc-test-ram",
                    str(path)], check=True, timeout=30)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, timeout=30)


class Replicators:
    """``nodes`` replicator containers of one job on the host network; rank 0 serves the coordinator."""

    def __init__(self, store: Store, image: str, ram: Path, nodes: int):
        self.store, self.image, self.ram, self.nodes = store, image, ram, nodes
        self.ports = [free_port() for _ in range(nodes)]
        self.coordinator = f"127.0.0.1:{self.ports[0]}"

    def name(self, rank: int) -> str:
        return f"mtc-replicator-{rank}"

    def start(self, rank: int) -> None:
        args = ["--local-dir", "/local", "--listen", f"127.0.0.1:{self.ports[rank]}", "--job", "t", "--rank",
                str(rank), "--nodes", str(self.nodes), "--data-parallelism", "2", "--heartbeat-seconds", "0.2",
                "--rpc-timeout-seconds", "5", "--transfer-timeout-seconds", "60"]
        if rank != 0:
            args += ["--coordinator", self.coordinator]
        # As the Pod spec runs it (controller_client/manifests_jobsets.py): read-only root with only /tmp
        # writable (podman's own /run and /var/tmp tmpfs left out), no capabilities, no privilege escalation.
        self.store.podman("run", "--detach", "--name", self.name(rank), "--network", "host", "--read-only",
                          "--read-only-tmpfs=false", "--tmpfs", "/tmp:size=64m", "--cap-drop", "all",
                          "--security-opt", "no-new-privileges", "--memory", MEMORY_LIMIT,
                          "--volume", f"{self.ram / str(rank)}:/local", self.image, "-v", *args)  # fmt: skip
        self.wait_listening(rank)

    def wait_listening(self, rank: int, timeout_seconds: float = 90) -> None:
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.ports[rank]}") as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=timeout_seconds)
            except grpc.FutureTimeoutError:
                raise AssertionError(f"replicator {rank} not listening:\n{self.logs(rank)}") from None

    def kill(self, rank: int) -> None:
        self.store.podman("kill", "--signal", "KILL", self.name(rank))
        self.store.podman("rm", "--force", self.name(rank))

    def logs(self, rank: int) -> str:
        out = self.store.podman("logs", self.name(rank), check=False)
        return (out.stdout + out.stderr)[-3000:]

    def stop_all(self) -> None:
        for r in range(self.nodes):
            self.store.podman("rm", "--force", "--time", "0", self.name(r), check=False)


def _replicators_on_ram_disks(stack: contextlib.ExitStack, store: Store, image: str, ram: Path) -> Replicators:
    """Four replicator containers, each on its own RAM disk ``ram/<rank>``, stopped when ``stack`` closes."""
    reps = Replicators(store, image, ram, 4)
    for r in range(4):
        stack.enter_context(ram_disk(ram / str(r)))
    stack.callback(reps.stop_all)
    for r in range(4):
        reps.start(r)
    return reps


def _files(step_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(step_dir)): p.stat().st_ino for p in sorted(step_dir.rglob("*")) if p.is_file()}


def _trainer(store: Store, image: str, ram: Path, reps: Replicators, *args: str) -> dict:
    """tests/kits/image_trainer.py in a container of the sidecar image, as its user (UID 1000, the replicator's:
    they share the RAM disk), every host's RAM disk at its own path."""
    mounts = [f"{REPO / 'tests'}:{TESTS_MOUNT}/tests:ro", *(f"{ram / str(r)}:{ram / str(r)}" for r in range(4))]
    out = store.podman("run", "--rm", "--network", "host", "--workdir", TESTS_MOUNT, "--env",
                       f"PYTHONPATH={TESTS_MOUNT}", *(a for m in mounts for a in ("--volume", m)), image, "python",
                       "-m", "tests.kits.image_trainer", *args, "--ram", str(ram), "--coordinator", reps.coordinator,
                       check=False, timeout=300)  # fmt: skip
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-5000:]}\n" + "\n".join(
        reps.logs(r) for r in range(reps.nodes))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_replicator_image_serves_kills_and_refills_on_ram_disks(store: Store, replicator_image: str,
                                                               sidecar_image: str, workdir: Path) -> None:
    """Four replicator containers as on a node: user 1000, read-only root, a memory limit, a 64 MiB tmpfs as
    /local. The save and restores come from the training side: here a container of the sidecar image with the
    same user (a host process as root creates directories such as ``<local>/fetch`` that the replicator's user
    then cannot write into), 8 CPU devices as 2 slices x 2 hosts."""
    ram = workdir / "ram"
    with contextlib.ExitStack() as stack:
        reps = _replicators_on_ram_disks(stack, store, replicator_image, ram)
        # The containers as a Pod spec runs them (docs/deploy.md), checked on a running one.
        inspect = json.loads(store.podman("inspect", reps.name(1)).stdout)[0]
        assert inspect["HostConfig"]["ReadonlyRootfs"] is True
        assert inspect["HostConfig"]["Memory"] == 512 << 20
        assert store.podman("exec", reps.name(1), "id", "-u").stdout.strip() == "1000"
        for path in ("/usr/x", "/run/x", "/var/tmp/x"):
            assert store.podman("exec", reps.name(1), "touch", path, check=False).returncode != 0, path
        status = store.podman("exec", reps.name(1), "cat", "/proc/self/status").stdout
        assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status, status
        df = store.podman("exec", reps.name(1), "df", "-B1", "--output=fstype,size", "/local").stdout.split()
        assert df[-2:] == ["tmpfs", str(LOCAL_BYTES)], df

        assert _trainer(store, sidecar_image, ram, reps, "save", "--steps", "1", "2") == {"saved": [1, 2]}
        deadline = time.monotonic() + 60
        while not all(any((ram / str(r)).glob("peer/*/2")) for r in range(4)):
            assert time.monotonic() < deadline, "no peer copies of step 2:\n" + "\n".join(
                reps.logs(r) for r in range(4))
            time.sleep(0.2)

        # Host 1's replicator is killed and comes back with its RAM disk. Its peers' copies of its step are
        # dropped: the restore can only read host 1's own copy, which stays as it was.
        own = _files(layout.steps_dir(ram / "1") / "2")
        reps.kill(1)
        reps.start(1)
        for r in range(4):
            shutil.rmtree(layout.peer_dir(ram / str(r), 1) / "2", ignore_errors=True)
        assert _trainer(store, sidecar_image, ram, reps, "restore") == {"step": 2, "differences": []}
        assert _files(layout.steps_dir(ram / "1") / "2") == own

        # Host 3 comes back with an empty RAM disk: refilled from its data-parallel peer (host 1).
        reps.kill(3)
        subprocess.run(["umount", str(ram / "3")], check=True, timeout=30)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={LOCAL_BYTES},uid=1000,gid=1000,mode=0755",
                        "mtc-test-ram", str(ram / "3")], check=True, timeout=30)  # fmt: skip
        assert not any((ram / "3").iterdir())
        reps.start(3)
        got = _trainer(store, sidecar_image, ram, reps, "restore", "--steps", "2", "--shape", "4x2")
        assert got == {"step": 2, "differences": []}
        refilled = [d for d in [layout.steps_dir(ram / "3") / "2", *(ram / "3").glob("peer/*/2")]
                    if (d / layout.MANIFEST_NAME).is_file()]
        assert refilled, os.listdir(ram / "3")
        for d in refilled:
            checksums.verify_step_dir(d)
