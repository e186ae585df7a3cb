"""Google's Pathways images, as the node agent runs them: the simulated Pathways of
``tests/kits/pathways_remote.py`` across the rendered Pods.

The rendered Pathways JobSet runs three of Google's programs we cannot run: the resource manager
(``pathways-rm``, the head), the IFRT proxy (``pathways-proxy``, the head) and the Pathways worker
(``pathways-worker``, one per TPU host). :func:`images` maps their images to this module, which reads the
flags the manifests give them:

- ``server --node_type=resource_manager --server_port=P --instance_count=N --instance_type=tpuv6e:AxB``: the
  workers' recoverable ``jax.distributed`` coordination service on ``P`` (N slices of A*B/4 hosts);
- ``server --resource_manager_address=HEAD:P --server_port=W``: a worker. Its slice is the Pod's
  ``MEGASCALE_SLICE_ID`` (the JobSet job index), its index in the slice the completion index ending the
  Pod's hostname (``<jobset>-workers-<job>-<index>``); it dials the controller at ``HEAD:`` :data:`PROXY_PORT`,
  the coordination service at ``HEAD:P``, and answers on ``W`` (``mtc preempt --hold-while-port`` watches it);
- ``proxy``: nothing to do (the controller process plays the proxy and the Pathways client at once: it
  listens for the workers on the proxy's port, :data:`PROXY_PORT`); it waits for SIGTERM;
- ``colocated-python``: the ``colocated-python-sidecar`` container, idle: colocated Python runs in the
  simulated worker itself (as ``pathways_sim``'s workers run it).

The key the workers and the controller share is ``MTC_SIM_AUTHKEY`` (hex) of the image rules' environment.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

from tests.cluster.pod_spec import VENV_BIN, ImageRule

REPO = Path(__file__).resolve().parents[2]
PROXY_PORT = 29000  # the rendered proxy's --server_port; the controller listens there for the workers
SERVER_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:*"
PROXY_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:*"
CHIPS_PER_HOST = 4  # a v6e/v5e/v5p TPU VM (ct6e-standard-4t)


def images(authkey_hex: str, env: dict[str, str] | None = None) -> dict[str, ImageRule]:
    """The image rules of the Pathways server and proxy images (this module's modes)."""
    run = [str(VENV_BIN / "python"), "-m", "tests.cluster.pathways_images"]
    base = {"PYTHONPATH": str(REPO), "MTC_SIM_AUTHKEY": authkey_hex, **(env or {})}
    return {SERVER_IMAGE: ImageRule(path=[str(VENV_BIN)], env=base, command=[*run, "server"]),
            PROXY_IMAGE: ImageRule(path=[str(VENV_BIN)], env=base, command=[*run, "proxy"])}


def sidecar_command() -> list[str]:
    """The ``colocated-python-sidecar`` container's command (the sidecar image's rule sets it)."""
    return [str(VENV_BIN / "python"), "-m", "tests.cluster.pathways_images", "colocated-python"]


def hosts_of(instance_type: str) -> int:
    """Hosts of one slice of ``tpuv6e:2x4`` (chips / 4, at least 1)."""
    topology = instance_type.split(":", 1)[1]
    return max(1, math.prod(int(x) for x in topology.split("x")) // CHIPS_PER_HOST)


def _wait_for_sigterm() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    return 143


def _server(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pathways server")
    p.add_argument("--server_port", type=int, required=True)
    p.add_argument("--node_type", default="worker")
    p.add_argument("--instance_count", type=int, default=0)
    p.add_argument("--instance_type", default="")
    p.add_argument("--resource_manager_address", default="")
    args, _ = p.parse_known_args(argv)  # the scratch location, the sidecar's shm folder: nothing to do here
    if args.node_type == "resource_manager":
        from tests.kits.pathways_remote import serve_coordination

        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        serve_coordination(args.server_port, args.instance_count * hosts_of(args.instance_type), stop)
        return 143
    from tests.kits.pathways_remote import dial_main

    head = args.resource_manager_address.rsplit(":", 1)[0]
    task = int(os.environ["HOSTNAME"].rsplit("-", 1)[1])
    return dial_main(f"{head}:{PROXY_PORT}", args.resource_manager_address, int(os.environ["MEGASCALE_SLICE_ID"]),
                     task, bytes.fromhex(os.environ["MTC_SIM_AUTHKEY"]), server_port=args.server_port)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mode = argv[0] if argv else ""
    if mode == "server":
        return _server(argv[1:])
    if mode in ("proxy", "colocated-python"):
        return _wait_for_sigterm()
    print(f"usage: python -m tests.cluster.pathways_images server|proxy|colocated-python [flags]; not {mode!r}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
