"""A process for the crash matrix to kill: ``python child.py <op> <json args>`` (fault point from the env).

Ops: ``save`` (the sidecar's background writer: write, local GC, notify), ``backup`` (upload every rank of a
step, commit, retention), ``retention``, ``download`` (restore one rank from the bucket), ``jax_save``
(CheckpointManager with the in-process dispatcher).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    op, args = sys.argv[1], json.loads(sys.argv[2])
    if op == "save":
        from sidecar import writer
        from tests.crash import kit

        w = writer.HostWriter(Path(args["root"]))
        for step in args["steps"]:
            w.submit(kit.host_step(Path(args["root"]), args["rank"], args["nodes"], step), args.get("keep"),
                     notify=True)
            w.wait(60)
    elif op in ("backup", "retention", "download"):
        from replicator.backup.bucket import BackupOptions, BackupStore
        from replicator.backup.storage import open_store

        bs = BackupStore(open_store(args["url"]), args["job"], BackupOptions(commit_strategy=args["strategy"]))
        bs.check_capabilities()
        if op == "backup":
            staging = bs.begin(args["step"], len(args["roots"]))
            for rank, root in enumerate(args["roots"]):
                bs.upload_rank(staging, rank, Path(root) / "steps" / str(args["step"]))
            bs.commit(staging)
        elif op == "retention":
            bs.apply_retention(args["keep"])
        else:
            bs.download_rank(args["step"], args["rank"], Path(args["dest"]))
    elif op == "jax_save":
        from tests.crash import jax_state

        mgr = jax_state.manager(args["template"])
        for step in args["steps"]:
            mgr.save(step, jax_state.state(step))
            mgr.wait_until_finished()
    else:
        raise SystemExit(f"unknown op {op!r}")


if __name__ == "__main__":
    main()
