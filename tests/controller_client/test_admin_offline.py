"""`mtc backups` / `export` / `verify --tier bucket` with only the bucket: every daemon stopped first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from controller_client.demo.cluster import REPO, LocalCluster
from replicator.backup.bucket import BackupStore
from replicator.backup.storage import open_store
from sidecar import checksums
from tests.kits.admin import mtc
from tests.kits.cluster import manager, save_steps, wait_for

pytestmark = pytest.mark.slow


def _load_with_plain_orbax(path: str) -> dict:
    """Restore in a fresh interpreter that imports only orbax (not this package) and return leaves as bytes."""
    code = (
        "import sys, pickle, numpy as np\n"
        "from absl import flags; flags.FLAGS(['x'])\n"
        "import orbax.checkpoint as ocp\n"
        "t = ocp.StandardCheckpointer().restore(sys.argv[1])\n"
        "out = {k: (np.asarray(v).dtype.name, np.asarray(v).shape, np.asarray(v).tobytes()) if hasattr(v, 'shape')"
        " else v for k, v in t.items()}\n"
        "sys.stdout.buffer.write(pickle.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # this package is not importable there
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, timeout=300, cwd="/", env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    import pickle

    return pickle.loads(proc.stdout)


def test_backups_list_download_export_and_verify_after_the_job_is_gone(tmp_path) -> None:
    import jax

    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    cl = LocalCluster(tmp_path / "c", 4, 2, extra=["--backup-url", url, "--backup-interval-steps", "1"])
    try:
        cl.start_all()
        mgr = manager(cl, 2, 2)
        trees = save_steps(mgr, [4])
        backups = BackupStore(open_store(url), "t")
        wait_for(lambda: 4 in backups.committed_steps(), what="step 4 backed up", timeout=60)
        mgr.close()
    finally:
        cl.stop_all(signal.SIGTERM)
    assert not any(p.alive for p in cl.procs.values())

    r = mtc("backups", "list", "-o", "json", "--backup-url", url)
    assert r.code == 0, r
    doc = r.json()
    assert doc["job"] == "t" and [b["step"] for b in doc["backups"]] == [4]
    assert doc["backups"][0]["nodes"] == 4 and doc["backups"][0]["bytes"] > 0
    r = mtc("backups", "list", "--backup-url", url)
    assert r.code == 0 and "backups of job t" in r.out and "4" in r.out, r
    assert mtc("backups", "list", "--backup-url", f"file://{tmp_path / 'empty'}").code == 2  # no job there

    r = mtc("inspect", "4", "-o", "json", "--backup-url", url)
    assert r.code == 0 and {x["path"] for x in r.json()["leaves"]} == {"['w']", "['b']", "['rng']", "['step']"}, r

    dest = tmp_path / "dl"
    r = mtc("backups", "download", "4", "--backup-url", url, "--dest", str(dest), "-o", "json")
    assert r.code == 0 and r.json()["verified"], r
    for rank in range(4):
        m = checksums.verify_step_dir(dest / str(rank) / "steps" / "4")
        assert m.rank == rank
    r = mtc("backups", "download", "4", "--backup-url", url, "--dest", str(dest))
    assert r.code == 1 and "exists" in r.err, r

    out = tmp_path / "exported"
    r = mtc("export", "4", "--backup-url", url, "--dest", str(out))
    assert r.code == 0 and "Orbax checkpoint" in r.out, r
    got = _load_with_plain_orbax(str(out))
    want = trees[4]
    for k in ("w", "b"):
        a = np.asarray(want[k])
        assert got[k] == (a.dtype.name, a.shape, a.tobytes()), k
    key_data = np.asarray(jax.random.key_data(want["rng"]))
    assert got["rng"] == (key_data.dtype.name, key_data.shape, key_data.tobytes())
    assert got["step"] == 4

    r = mtc("verify", "4", "--tier", "bucket", "--backup-url", url, "-o", "json")
    assert r.code == 0 and r.json()["ok"], r
    data_files = sorted(p for p in bucket.rglob("*") if p.is_file() and "/data/" in str(p))
    victim = data_files[0]
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 0xFF
    victim.write_bytes(bytes(raw))
    r = mtc("verify", "4", "--tier", "bucket", "--backup-url", url)
    assert r.code == 1 and "bad file" in r.err and victim.name in r.err, r
    assert mtc("verify", "4", "--backup-url", url).code == 2  # local/peer tiers need the coordinator
    assert REPO.is_dir()


def test_backups_from_an_emulated_gcs_bucket(tmp_path) -> None:
    from tests.kits.storage import BUCKET, Emulator

    (tmp_path / "emu").mkdir()
    emu = Emulator("fake-gcs", tmp_path / "emu")
    url = f"gs://{BUCKET}/mtc"
    env = {"STORAGE_EMULATOR_HOST": emu.url}
    cl = LocalCluster(tmp_path / "c", 4, 2, extra=["--backup-url", url, "--backup-interval-steps", "1"])
    cl.env = env
    try:
        cl.start_all()
        mgr = manager(cl, 2, 2)
        save_steps(mgr, [2])
        wait_for(lambda: mtc("backups", "list", "-o", "json", "--backup-url", url, env=env).code == 0,
                 what="step 2 backed up to the emulator", timeout=90, interval=1.0)
        mgr.close()
        cl.stop_all()
        r = mtc("backups", "list", "-o", "json", "--backup-url", url, env=env)
        assert r.code == 0 and [b["step"] for b in r.json()["backups"]] == [2], r
        r = mtc("backups", "download", "2", "--backup-url", url, "--dest", str(tmp_path / "dl"), env=env)
        assert r.code == 0 and "every file verified" in r.out, r
        for rank in range(4):
            checksums.verify_step_dir(tmp_path / "dl" / str(rank) / "steps" / "2")
        r = mtc("verify", "2", "--tier", "bucket", "--backup-url", url, "-o", "json", env=env)
        assert r.code == 0 and len(r.json()["copies"]) == 4, r
    finally:
        cl.stop_all(signal.SIGKILL)
        emu.stop()
