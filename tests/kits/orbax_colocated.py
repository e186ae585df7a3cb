"""Test kit: unchanged Orbax's colocated multi-tier checkpointing (``use_colocated_python=True``) run by this
process as the Pathways controller of a simulated Pathways job (tests/kits/pathways_sim.py), against real
`mtc replicator` daemons in Orbax mode (tests/kits/orbax_replicator.py).

Orbax gives every worker the same local-directory string. On Pathways each worker resolves it on its own
node's RAM disk; here the workers share one filesystem, so each simulated worker runs in its own working
directory (``<base>/host<h>``, set by :func:`worker_setup`) and the job passes :data:`LOCAL_DIR`,
``/proc/self/cwd/mtc``: an absolute path (Orbax refuses relative ones) that every process resolves in its
own working directory, so worker ``h`` reads and writes ``<base>/host<h>/mtc``, host ``h``'s daemon's
``--local-dir``.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.kits.orbax_replicator import OrbaxCluster

LOCAL_NAME = "mtc"
LOCAL_DIR = f"/proc/self/cwd/{LOCAL_NAME}"
HOST_CWD_ENV = "MTC_SIM_HOST_CWD"  # a template with {host}
# "0": the worker does not install Orbax's serialization patch at start (to show what then fails).
PATCH_ENV = "MTC_SIM_ORBAX_PATCH"
# "1": what a worker pickles (the output specs JAX learns from the worker) names its devices by their
# controller-side (PjRt-IFRT) ids, not its local ids -- an assumption about Pathways (docs/pathways.md).
GLOBAL_IDS_ENV = "MTC_SIM_WORKER_PICKLES_GLOBAL_IDS"


def worker_setup() -> None:
    """Run by each simulated worker before it serves (what a sidecar image would run at start): its own
    disk (cwd), absl flags parsed (Orbax's restore reads them), and Orbax's colocated serialization patch.

    Orbax installs that patch on the controller and in ``WorkerCheckpointManager.__init__`` on the worker,
    i.e. only after the worker has unpickled its first program; that first program (the init's ``_setup``)
    names the worker's CPU devices by controller-side ids, which JAX's own lookup cannot resolve on a worker
    whose ids differ (``Invalid device ID 2``): the sidecar must have the patch before it (docs/pathways.md).
    """
    import jax
    from absl import flags

    host = jax.process_index()  # the workers' jax.distributed process id is the host index
    cwd = Path(os.environ[HOST_CWD_ENV].format(host=host))
    cwd.mkdir(parents=True, exist_ok=True)
    os.chdir(cwd)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["pathways-sidecar"])
    if os.environ.get(PATCH_ENV, "1") != "0":
        from orbax.checkpoint._src.multihost import colocated_transport

        colocated_transport.install_pathways_colocated_serialization_patch()
    if os.environ.get(GLOBAL_IDS_ENV) == "1":
        _pickle_global_ids()


def _pickle_global_ids() -> None:
    """JAX's colocated reducers on this worker write each device's PjRt-IFRT id (from its repr) instead of
    its local ``device.id``; unpickling is unchanged (Orbax's lookup resolves both)."""
    import numpy as np
    from jax.experimental.colocated_python import serialization as ser
    from orbax.checkpoint._src.multihost import colocated_transport

    def gid(d) -> int:
        g = colocated_transport._extract_pjrt_ifrt_device_id(d)
        return d.id if g is None else g

    def reduce_mesh(mesh):
        ids = np.vectorize(gid, otypes=[int])(mesh.devices)
        return ser._unreduce_mesh, (ids, mesh.axis_names, mesh.axis_types)

    def reduce_device_list(device_list):
        return ser._unreduce_device_list, ([gid(d) for d in device_list],)

    def reduce_single_device_sharding(sharding):
        return ser._unreduce_single_device_sharding, (gid(next(iter(sharding.device_set))), sharding.memory_kind)

    ser._reduce_mesh = ser._make_reduce_func_with_common_obj(reduce_mesh)
    ser._reduce_device_list = ser._make_reduce_func_with_common_obj(reduce_device_list)
    ser._reduce_single_device_sharding = ser._make_reduce_func_with_common_obj(reduce_single_device_sharding)


class ColocatedCluster(OrbaxCluster):
    """An :class:`OrbaxCluster` whose host ``h`` keeps its local directory at ``<base>/host<h>/mtc``."""

    def local(self, rank: int) -> Path:
        return self.base / f"host{rank}" / LOCAL_NAME

    @property
    def host_cwd_template(self) -> str:
        return str(self.base / "host{host}")
