"""The preemption timeline of the rendered worker Pods, driven as the kubelet drives it, against real replicators
and a real trainer.

Kubernetes, on a Pod's deletion (a preemption notice): runs every main container's preStop hook (exec, sleep)
at once; sends each main container SIGTERM when its own hook has returned; once every main container has
exited, stops the native sidecars (init containers with ``restartPolicy: Always``) in reverse start order;
SIGKILLs whatever still runs ``terminationGracePeriodSeconds`` after the deletion. :class:`Kubelet` does exactly
that with the hooks, sleeps and grace of the Pod `mtc manifests` renders, mapping its containers to the
test's processes. The newest step -- the one the training loop saves *after* the notice -- must be in the
bucket at the end, in native mode (Pathways Pod, our CheckpointManager) and in Orbax mode (multi-controller
Pod, unchanged Orbax).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller_client import manifests as mf  # noqa: E402
from replicator.backup.bucket import BackupStore  # noqa: E402
from replicator.backup.storage import open_store  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GRACE = 20  # terminationGracePeriodSeconds: save 6 s, flush 10 s, reserve 4 s


def _worker_pod(opts: mf.ManifestOptions) -> dict[str, Any]:
    js = mf.objects(opts)["jobset.yaml"]
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == "workers"]
    return rj["template"]["spec"]["template"]["spec"]


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


@dataclass
class Kubelet:
    """Terminates one rendered Pod: preStop hooks, then SIGTERM per main container, then native sidecars."""

    pod: dict[str, Any]
    local_dir: Path
    # main container name -> called at its SIGTERM, returns once it exited
    on_sigterm: dict[str, Callable[[float], None]]
    # native sidecar name -> (send SIGTERM, wait for exit until a deadline -> True when it exited)
    sidecars: dict[str, tuple[Callable[[], None], Callable[[float], bool]]]
    events: list[tuple[float, str]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)

    def _log(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    def _hook(self, c: dict[str, Any], deadline: float) -> None:
        pre = c.get("lifecycle", {}).get("preStop")
        if pre is None:
            return
        if "sleep" in pre:
            time.sleep(min(pre["sleep"]["seconds"], max(0.0, deadline - time.monotonic())))
            return
        cmd = pre["exec"]["command"]
        assert cmd[0] == "mtc", cmd
        argv = [sys.executable, "-m", "controller_client.cli", *cmd[1:]]
        argv = [str(self.local_dir) if a == self.pod_local else a for a in argv]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        subprocess.run(argv, env=env, timeout=max(1.0, deadline - time.monotonic()), check=False)

    @property
    def pod_local(self) -> str:
        (m,) = [m["mountPath"] for c in self.pod["containers"] for m in c.get("volumeMounts", [])
                if m["name"] == "ramdisk"][:1]
        return m

    def terminate(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.pod["terminationGracePeriodSeconds"]
        self._log("deleted")

        def main(c: dict[str, Any]) -> None:
            self._hook(c, deadline)
            self._log(f"SIGTERM {c['name']}")
            self.on_sigterm.get(c["name"], lambda _d: None)(deadline)
            self._log(f"exited {c['name']}")

        threads = [threading.Thread(target=main, args=(c,)) for c in self.pod["containers"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        natives = [c["name"] for c in self.pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        for name in reversed(natives):
            if name not in self.sidecars:
                continue
            send, wait = self.sidecars[name]
            self._log(f"SIGTERM {name}")
            send()
            if not wait(deadline):
                self.killed.append(name)
            self._log(f"exited {name}")

    def at(self, what: str) -> float:
        return next(t for t, w in self.events if w == what)


def _bucket_steps(url: str, job: str) -> list[int]:
    return BackupStore(open_store(url), job).committed_steps()


def _terminate_all(kubelets: list[Kubelet]) -> None:
    threads = [threading.Thread(target=k.terminate) for k in kubelets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GRACE + 10)


# --------------------------------------------------------------------------- native: the Pathways Pod


def test_native_pathways_pod_notice_reaches_the_trainer_which_saves_and_the_step_is_flushed(tmp_path: Path) -> None:
    import jax

    from controller_client.demo.cluster import LocalCluster
    from controller_client.manager import CheckpointManager, CheckpointManagerOptions
    from controller_client.topology import HostTopology
    from tests.kits.cluster import state, status, wait_for

    opts = mf.ManifestOptions(job="t", slices=2, hosts_per_slice=1, tpu_topology="2x2", backup_url="gs://b/ckpt",
                              termination_grace_seconds=GRACE)
    pod = _worker_pod(opts)
    assert [c["name"] for c in pod["containers"]] == ["pathways-worker", "preemption-notice"]
    (repl,) = [c for c in pod["initContainers"] if c["name"] == "mtc-replicator"]
    bucket = tmp_path / "bucket"
    cl = LocalCluster(tmp_path / "c", nodes=2, data_parallelism=2,
                      extra=["--backup-url", f"file://{bucket}", "--backup-interval-minutes", "30",
                             "--preemption-grace-seconds", _arg(repl, "--preemption-grace-seconds")])
    try:
        cl.start_all()
        devs = jax.devices()
        mgr = CheckpointManager(CheckpointManagerOptions(local_directory=cl.local_template, job_name="t",
                                                         coordinator_address=cl.coordinator, rpc_timeout_seconds=10),
                                devices=devs, topology=HostTopology.simulated(devs, 2, 1))
        for step in (10, 20):
            mgr.save(step, state(step))
            mgr.wait_until_finished()
        wait_for(lambda: status(cl).newest_complete_step == 20, what="step 20 complete")
        assert not mgr.reached_preemption(20)

        # The training loop (on the head): checks reached_preemption() every step; on a notice, saves and stops.
        trainer: dict[str, float] = {}

        def loop() -> None:
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline:
                if mgr.reached_preemption(20):
                    trainer["noticed"] = time.monotonic()
                    mgr.save(30, state(30))
                    mgr.wait_until_finished()
                    trainer["saved"] = time.monotonic()
                    return
                time.sleep(0.2)

        loop_thread = threading.Thread(target=loop)
        loop_thread.start()

        def sidecar(rank: int) -> tuple[Callable[[], None], Callable[[float], bool]]:
            p = cl.procs[rank]

            def wait(deadline: float) -> bool:
                try:
                    p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    return True
                except subprocess.TimeoutExpired:
                    p.kill()
                    return False
            return (lambda: p.signal(signal.SIGTERM)), wait

        kubelets = [Kubelet(pod, cl.ram(r), on_sigterm={}, sidecars={"mtc-replicator": sidecar(r)})
                    for r in range(2)]
        _terminate_all(kubelets)
        loop_thread.join(5)
        mgr.close()

        assert "saved" in trainer, f"the training loop never learned of the notice: {kubelets[0].events}"
        for k in kubelets:
            # The save went through pathways-worker and colocated Python: both were still up.
            assert trainer["saved"] < k.at("SIGTERM pathways-worker"), k.events
            assert k.at("SIGTERM mtc-replicator") > k.at("exited pathways-worker"), "native sidecar stopped last"
            assert not k.killed, f"killed at the end of the grace period: {k.killed}"
        assert _bucket_steps(f"file://{bucket}", "t")[-1] == 30, "the step saved after the notice is in the bucket"
        recs = [json.loads((cl.ram(r) / "preemption.json").read_text()) for r in range(2)]
        assert any(r["finished"] and r["step"] == 30 for r in recs), recs
    finally:
        cl.stop_all(signal.SIGKILL)


# --------------------------------------------------------------------------- Orbax: the multi-controller Pod


def test_orbax_multi_controller_pod_flushes_orbax_last_step_on_the_replicators_sigterm(tmp_path: Path) -> None:
    from tests.kits.orbax_replicator import OrbaxCluster, wait_for

    opts = mf.ManifestOptions(mode="multi-controller", job="t", slices=2, hosts_per_slice=1, tpu_topology="2x2",
                              backup_url="gs://b/ckpt", termination_grace_seconds=GRACE)
    assert opts.front_door_kind == "orbax"
    pod = _worker_pod(opts)
    (repl,) = [c for c in pod["initContainers"] if c["name"] == "mtc-replicator"]
    bucket = f"file://{tmp_path / 'bucket'}"
    cl = OrbaxCluster(tmp_path / "c", 2, ["--backup-url", bucket,
                                          "--preemption-grace-seconds", _arg(repl, "--preemption-grace-seconds")])
    try:
        cl.start_all()
        # The trainer: unchanged Orbax saving steps 1, 2, 3 (backups every 30 minutes: only the preemption
        # flush can put step 3 in the bucket). Its last save stands for Orbax's own save at the notice.
        result: dict[str, Any] = {}
        job = threading.Thread(target=lambda: result.update(
            res=cl.run_job("t", slices=2, save_steps="1,2,3", save_sleep=3.0, backup_interval_minutes=30,
                           timeout=120)))
        job.start()
        # Orbax commits ``<local>/2``; our store moves it to ``<local>/steps/2`` within a moment: either counts.
        def step_2_saved() -> bool:
            return all((cl.local(r) / "2").is_dir() or (cl.local(r) / "steps" / "2").is_dir() for r in range(2))
        wait_for(lambda: step_2_saved() or not job.is_alive(), timeout=90, what="step 2 saved")
        assert step_2_saved(), f"the job ended before step 2 was saved: {cl.describe(result.get('res'))}"

        def train_exit(deadline: float) -> None:
            job.join(max(0.1, deadline - time.monotonic()))  # Orbax saves its last step, then exits

        def sidecar(rank: int) -> tuple[Callable[[], None], Callable[[float], bool]]:
            d = cl.daemons[rank]

            def wait(deadline: float) -> bool:
                try:
                    d.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    return True
                except subprocess.TimeoutExpired:
                    d.stop(signal.SIGKILL)
                    return False
            return (lambda: d.proc.send_signal(signal.SIGTERM)), wait

        kubelets = [Kubelet(pod, cl.local(r), on_sigterm={"train": train_exit},
                            sidecars={"mtc-replicator": sidecar(r)}) for r in range(2)]
        _terminate_all(kubelets)
        res = result.get("res")
        assert res is not None and all(rc == 0 for rc in res.returncodes), cl.describe(res)
        for k in kubelets:
            assert k.at("SIGTERM mtc-replicator") >= k.at("exited train"), k.events
            assert not k.killed, f"killed at the end of the grace period: {k.killed}\n{cl.describe(res)}"
        steps = _bucket_steps(bucket, "t")
        assert steps and steps[-1] == 3, f"bucket holds {steps}\n{cl.describe(res)}"
        recs = [json.loads((cl.local(r) / "preemption.json").read_text()) for r in range(2)]
        assert any(r["finished"] and r["step"] == 3 for r in recs), recs
    finally:
        cl.stop_all(signal.SIGKILL)
