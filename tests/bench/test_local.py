"""bench.local's plain-read baseline reads the saved steps' bytes, not the spare pool's (which a writer may
be filling while it reads)."""

from __future__ import annotations

from pathlib import Path

from bench import local
from sidecar import spares


def test_plain_read_reads_the_steps_and_not_the_spare_pool(tmp_path: Path) -> None:
    step = tmp_path / "0" / "steps" / "1"
    step.mkdir(parents=True)
    (step / "0.0.bin").write_bytes(b"x" * 1000)
    (step / "MANIFEST.json").write_bytes(b"{}")
    pool = spares.spare_dir(tmp_path / "0")
    pool.mkdir()
    (pool / f"{2 << 20}-abc").write_bytes(bytes(2 << 20))
    (pool / f"{spares.WARM_PREFIX}def").write_bytes(b"being filled")
    assert local.plain_read(tmp_path) == 1002
