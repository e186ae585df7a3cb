"""Subprocess uploader of the multi-process tests: uploads one rank into an existing staging (rate 0 = unlimited)."""

import sys
from pathlib import Path

from replicator.backup.bucket import BackupOptions, BackupStore
from replicator.backup.storage import open_store


def main() -> None:
    url, job, staging_id, step_dir, rank, rate = sys.argv[1:7]
    backup = BackupStore(
        open_store(url), job, BackupOptions(max_parallel_uploads=1, max_bytes_per_second=float(rate) or None)
    )
    staging = backup.open_staging(staging_id)
    print("uploading", flush=True)
    backup.upload_rank(staging, int(rank), Path(step_dir))
    print("done", flush=True)


if __name__ == "__main__":
    main()
