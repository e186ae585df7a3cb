"""One host's saver for the fault tests, started inside that host's network namespace
(:meth:`tests.kits.faultnet.FaultNetwork.command`): it saves the host's own rank through the sidecar's writer
(:class:`sidecar.writer.HostWriter`: the step written and committed on the host's RAM dir, then the host's
replicator told over its local control socket), the product path from a save to the replicator that copies it
to its peers over the test network.

Each line on stdin ``{"step": S, "nbytes": N}`` is one save; each answer is one JSON line on stdout: ``step``,
``ok``, ``error``, ``seconds`` (the write, its commit and the notification) and ``notified`` (the host's
replicator answered its local status right after: a daemon that no longer answers its own host fails it).
Ends when stdin closes (the parent stops it by pid otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sidecar import remote, writer
from tests.kits.fault_cluster import host_step

SAVE_TIMEOUT_SECONDS = 60.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fault_saver")
    p.add_argument("--root", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--timeout", type=float, default=SAVE_TIMEOUT_SECONDS)
    args = p.parse_args(argv)
    root = Path(args.root)
    # No spare pool: the rig's RAM dirs are directories of the test's disk, and the pool (a step-sized file
    # per host) is the spare-pool tests' subject, not this one's.
    w = writer.HostWriter(root, prewarm=False)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            step, nbytes = int(req["step"]), int(req["nbytes"])
            t0 = time.monotonic()
            rec: dict = {"step": step, "ok": True, "error": ""}
            try:
                w.submit(host_step(root, args.rank, step, nbytes), keep=None, notify=True)
                w.wait(args.timeout)
            except (writer.SaveError, OSError, TimeoutError, ValueError) as e:
                rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            rec["seconds"] = time.monotonic() - t0
            rec["notified"] = remote.replicator_rank(root) == args.rank
            print(json.dumps(rec), flush=True)
    finally:
        w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
