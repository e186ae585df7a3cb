"""replicator.orbax.contract against the pinned Orbax 0.12.8's own file-handling functions (in-process).

Orbax's private helpers in ``multi_tier_checkpointing.initialization`` are the other side of the contract:
they write our input (replicator.yaml) and read our output (markers, reports, jax-init-info.txt).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization as orbax_init

from replicator.orbax import contract as oc

pytestmark = pytest.mark.timeout(60)


def _orbax_yaml(local: Path, **kw) -> None:
    args = dict(
        run_name="job-1", num_nodes=4, data_parallelism=2, node_rank=1, peer_ranks=[3],
        backup_interval_minutes=30, backup_interval_steps=None,
    )  # fmt: skip
    args.update(kw)
    orbax_init._create_replicator_file(local, **args)


def _fake_step(path: Path) -> Path:
    """A directory with the two files Orbax finalizes a step with (enough for marker validation)."""
    path.mkdir(parents=True)
    (path / oc.CHECKPOINT_METADATA_FILE).write_text("{}")
    (path / oc.COMMIT_SUCCESS_FILE).write_text("ok")
    return path


# --------------------------------------------------------------------------- replicator.yaml


def test_reads_what_orbax_writes(tmp_path: Path) -> None:
    assert oc.read_config(tmp_path) is None
    _orbax_yaml(tmp_path)
    assert oc.read_config(tmp_path) == oc.ReplicatorConfig(
        job_name="job-1", framework="orbax", assume_data_parallelism=2, node_rank=1, nodes=4,
        peer_ranks=(3,), backup_interval_minutes=30,
    )  # fmt: skip
    (tmp_path / oc.REPLICATOR_FILE).unlink()
    _orbax_yaml(tmp_path, run_name="1e3", num_nodes=1, node_rank=0, peer_ranks=[],
                backup_interval_minutes=None, backup_interval_steps=7)  # fmt: skip
    cfg = oc.read_config(tmp_path)
    # The job name is kept verbatim (a YAML float/bool reading would break marker names).
    assert cfg is not None and cfg.job_name == "1e3" and cfg.peer_ranks == ()
    assert cfg.backup_interval_steps == 7 and cfg.backup_interval_minutes is None
    assert oc.ReplicatorConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="nodes: expected an integer"):
        oc.ReplicatorConfig("j", "orbax", 1, 0, "2", (), backup_interval_steps=1)  # type: ignore[arg-type]


GOOD = (
    "job-name: j\nframework: orbax\nassume-data-parallelism: 1\nnode-rank: 0\nnodes: 2\n"
    "peer-ranks: [1]\nbackup-interval-minutes: 30\n"
)


@pytest.mark.parametrize(
    "old,new,key",
    [
        ("job-name: j\n", "", "job-name"),
        ("job-name: j\n", "job-name: a/b\n", "job-name"),
        ("framework: orbax\n", "framework: torch\n", "framework"),
        ("assume-data-parallelism: 1\n", "assume-data-parallelism: 0\n", "assume-data-parallelism"),
        ("node-rank: 0\n", "node-rank: 2\n", "node-rank"),
        ("node-rank: 0\n", "node-rank: x\n", "node-rank"),
        ("nodes: 2\n", "nodes: 1.5\n", "nodes"),
        ("peer-ranks: [1]\n", "peer-ranks: [0]\n", "peer-ranks"),
        ("peer-ranks: [1]\n", "peer-ranks: [5]\n", "peer-ranks"),
        ("peer-ranks: [1]\n", "peer-ranks: 1\n", "peer-ranks"),
        ("backup-interval-minutes: 30\n", "", "backup-interval"),
        (
            "backup-interval-minutes: 30\n",
            "backup-interval-minutes: 30\nbackup-interval-steps: 3\n",
            "backup-interval",
        ),
        ("backup-interval-minutes: 30\n", "backup-interval-minutes: -1\n", "backup-interval-minutes"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, old: str, new: str, key: str) -> None:
    assert old in GOOD
    (tmp_path / oc.REPLICATOR_FILE).write_text(GOOD.replace(old, new))
    with pytest.raises(ValueError, match=key):
        oc.read_config(tmp_path)
    assert (tmp_path / oc.REPLICATOR_FILE).exists()  # reading changes nothing


def test_not_yaml_or_not_a_mapping(tmp_path: Path) -> None:
    for text in ("job-name: [unclosed\n", "- a\n- b\n"):
        (tmp_path / oc.REPLICATOR_FILE).write_text(text)
        with pytest.raises(ValueError, match="replicator.yaml"):
            oc.read_config(tmp_path)


def test_acknowledge(tmp_path: Path) -> None:
    _orbax_yaml(tmp_path)
    cfg = oc.read_config(tmp_path)
    other = oc.ReplicatorConfig.from_dict({**cfg.to_dict(), "node-rank": 2})
    with pytest.raises(ValueError, match="changed"):
        oc.acknowledge(tmp_path, other)
    assert (tmp_path / oc.REPLICATOR_FILE).exists()
    oc.acknowledge(tmp_path, cfg)
    assert not (tmp_path / oc.REPLICATOR_FILE).exists()
    with pytest.raises(FileNotFoundError):
        oc.acknowledge(tmp_path)
    oc.acknowledge(tmp_path, missing_ok=True)
    # What Orbax does next: its ack wait returns at once (timeout in whole seconds, 1 s polls).
    orbax_init._wait_for_replicator_file_to_disappear(tmp_path, timeout_seconds=1)
    # ... but a timeout of 0 (jax_initialization_timeout_seconds=0) never even looks: unusable.
    with pytest.raises(TimeoutError):
        orbax_init._wait_for_replicator_file_to_disappear(tmp_path, timeout_seconds=0)


# --------------------------------------------------------------------------- errors


def test_reports_as_orbax_reads_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    oc.report_error(tmp_path, "first")
    oc.report_error(tmp_path, "second\n")
    assert (tmp_path / oc.ERRORS_FILE).read_text() == "first\nsecond\n"
    orbax_init._check_for_replicator_errors(tmp_path)  # non-fatal: logged and deleted
    assert not (tmp_path / oc.ERRORS_FILE).exists()
    oc.report_fatal(tmp_path, "disk gone")
    with pytest.raises(RuntimeError, match="Replicator fatal errors: disk gone"):
        orbax_init._check_for_replicator_errors(tmp_path)
    assert not (tmp_path / oc.FAILED_FILE).exists()
    for fn in (oc.report_error, oc.report_fatal):
        with pytest.raises(ValueError, match="non-empty"):
            fn(tmp_path, "  \n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_orbax_ignores_an_empty_failed_file(tmp_path: Path) -> None:
    # The reason report_fatal refuses empty text and writes via tmp + rename.
    (tmp_path / oc.FAILED_FILE).touch()
    orbax_init._check_for_replicator_errors(tmp_path)
    assert not (tmp_path / oc.FAILED_FILE).exists()


# --------------------------------------------------------------------------- markers


def test_marker_names_match_orbax() -> None:
    name = oc.marker_name("my-job-s3-n1", 12, 5)
    assert name == "my-job-s3-n1-s12-n5-w0.restore"
    assert orbax_init._extract_step(name) == "12" and oc.parse_marker_name(name) == 12
    assert oc.parse_marker_name("job.restore") is None
    with pytest.raises(ValueError):
        orbax_init._extract_step("job.restore")  # why prepare_for_restore removes every *.restore
    for bad in (("a/b", 1, 0), ("", 1, 0), ("j", -1, 0), ("j", 1, -2), ("j", True, 0)):
        with pytest.raises(ValueError):
            oc.marker_name(*bad)


def test_no_restore_marker_is_consumed_by_orbax(tmp_path: Path) -> None:
    marker = oc.write_no_restore_marker(tmp_path, "job", 3)
    assert marker.name == "job-s0-n3-w0.restore" and marker.is_file() and marker.stat().st_size == 0
    with pytest.raises(FileExistsError):
        oc.write_no_restore_marker(tmp_path, "job", 3)
    assert orbax_init._block_and_process_restore_dir(tmp_path, timeout_seconds=2) is True
    assert list(tmp_path.iterdir()) == []


def test_restore_marker_is_renamed_by_orbax(tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    target = _fake_step(tmp_path / "store" / "7")
    with pytest.raises(ValueError, match="finalized"):
        oc.write_restore_marker(local, "job", 7, 0, tmp_path / "store")
    with pytest.raises(NotADirectoryError):
        oc.write_restore_marker(local, "job", 7, 0, tmp_path / "nowhere")
    (local / "7").mkdir()
    with pytest.raises(FileExistsError, match="prepare_for_restore"):
        oc.write_restore_marker(local, "job", 7, 0, target)
    (local / "7").rmdir()
    _fake_step(local / "6")
    with pytest.raises(ValueError, match="step directories"):
        oc.write_restore_marker(local, "job", 7, 0, local / "6")
    shutil.rmtree(local / "6")
    marker = oc.write_restore_marker(local, "job", 7, 0, target)
    assert marker.is_dir() and not marker.is_symlink() and marker.name == "job-s7-n0-w0.restore"
    assert sorted(p.name for p in local.iterdir()) == [marker.name]
    assert orbax_init._block_and_process_restore_dir(local, timeout_seconds=2) is True
    assert (local / "7").is_dir() and oc.is_restored_copy(local / "7")
    assert os.path.samefile(local / "7" / oc.COMMIT_SUCCESS_FILE, target / oc.COMMIT_SUCCESS_FILE)
    assert oc.committed_orbax_steps(local) == [7]


@pytest.mark.parametrize("num_threads", [None, 4])
def test_orbax_deleting_a_restored_step_keeps_our_copy(tmp_path: Path, num_threads: int | None) -> None:
    """Orbax's own step deleter (``CheckpointManager.delete``, preservation policies; threaded on hosts with
    >= 4 CPUs) on a restored ``<local>/<N>`` removes only links: our copy keeps every file, manifest included.
    With a symlink marker it walked into the target and unlinked our files."""
    from orbax.checkpoint._src.path import deleter as orbax_deleter
    from orbax.checkpoint._src.path import step as step_lib

    target = _fake_step(tmp_path / "store" / "steps" / "3")
    (target / "state" / "ocdbt.process_0" / "d").mkdir(parents=True)
    (target / "state" / "ocdbt.process_0" / "d" / "blob").write_bytes(b"x" * 4096)
    (target / "MANIFEST.json").write_text("{}")
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    local = tmp_path / "local"
    local.mkdir()
    oc.write_restore_marker(local, "job", 3, 0, target)
    assert orbax_init._block_and_process_restore_dir(local, timeout_seconds=2) is True
    assert not (local / "3" / "MANIFEST.json").exists()  # Orbax sees Orbax's files only
    d = orbax_deleter.create_checkpoint_deleter(local, name_format=step_lib.standard_name_format(),
                                                primary_host=None, num_threads=num_threads)
    d.delete(3)
    d.close()
    assert not os.path.lexists(local / "3")
    after = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert after == before


def test_orbax_rename_collides_with_an_existing_step_dir(tmp_path: Path) -> None:
    # The fact behind prepare_for_restore: Orbax's os.replace(marker, <local>/<N>) fails on a real dir.
    target = _fake_step(tmp_path / "store" / "4")
    local = tmp_path / "local"
    _fake_step(local / "4")
    os.symlink(target, local / "job-s4-n0-w0.restore")
    with pytest.raises(OSError):
        orbax_init._block_and_process_restore_dir(local, timeout_seconds=2)


def test_prepare_for_restore(tmp_path: Path) -> None:
    local = tmp_path / "local"
    for s in (1, 2, 3):
        _fake_step(local / str(s))
    elsewhere = _fake_step(tmp_path / "store" / "4")
    os.symlink(elsewhere, local / "4")
    (local / "5.orbax-checkpoint-tmp").mkdir()
    (local / "job-s0-n0-w0.restore").touch()
    (local / "junk.restore").touch()
    (local / "jax-init-info.txt").write_text("0\nh:1\n")
    (local / "notes").mkdir()
    with pytest.raises(ValueError):
        oc.prepare_for_restore(local, -1)
    with pytest.raises(NotADirectoryError):
        oc.prepare_for_restore(tmp_path / "absent", 1)
    assert oc.committed_orbax_steps(local) == [1, 2, 3, 4]
    removed = oc.prepare_for_restore(local, 2)
    assert sorted(p.name for p in removed) == sorted(
        ["2", "3", "4", "5.orbax-checkpoint-tmp", "job-s0-n0-w0.restore", "junk.restore"]
    )
    assert sorted(p.name for p in local.iterdir()) == ["1", "jax-init-info.txt", "notes"]
    assert (elsewhere / oc.COMMIT_SUCCESS_FILE).exists()  # a link is unlinked, never followed
    oc.prepare_for_restore(local, None)
    assert sorted(p.name for p in local.iterdir()) == ["jax-init-info.txt", "notes"]


def test_committed_orbax_steps_and_backup_request(tmp_path: Path) -> None:
    assert oc.committed_orbax_steps(tmp_path / "absent") == []
    _fake_step(tmp_path / "3")
    _fake_step(tmp_path / "10")
    (tmp_path / "4").mkdir()  # no commit_success.txt: not finalized
    _fake_step(tmp_path / "5.orbax-checkpoint-tmp")
    _fake_step(tmp_path / "007")
    (tmp_path / "8").write_text("a file")
    assert oc.committed_orbax_steps(tmp_path) == [3, 10]
    assert not oc.backup_requested(tmp_path / "3")
    (tmp_path / "3" / oc.BACKUP_REQUESTED_FILE).touch()
    assert oc.backup_requested(tmp_path / "3")


# --------------------------------------------------------------------------- jax-init-info.txt


def test_jax_init_info_read_by_orbax(tmp_path: Path) -> None:
    path = oc.write_jax_init_info(tmp_path, 3, "10.0.0.1:8476")
    assert path.read_text() == "3\n10.0.0.1:8476\n"
    assert orbax_init._retrieve_jax_init_info(tmp_path, timeout_seconds=1) == ["3", "10.0.0.1:8476"]
    oc.write_jax_init_info(tmp_path, 0, "[::1]:9")  # overwrites atomically
    assert orbax_init._retrieve_jax_init_info(tmp_path, timeout_seconds=1) == ["0", "[::1]:9"]
    for pid, addr in ((-1, "h:1"), (1, "h"), (1, "h:0"), (1, ":80"), (1, "h:70000"), (1, "h :1"), (1, None)):
        with pytest.raises(ValueError):
            oc.write_jax_init_info(tmp_path, pid, addr)
    assert sorted(p.name for p in tmp_path.iterdir()) == [oc.JAX_INIT_INFO_FILE]


@pytest.mark.parametrize("piece", [64, 1 << 20])
def test_ocdbt_digests_read_in_pieces_equal_whole_value_digest(tmp_path: Path, monkeypatch, piece: int) -> None:
    """Values read in byte ranges (past a value's end tensorstore answers OUT_OF_RANGE: the rest is read
    instead) hash exactly as the whole values do, at every size around a piece boundary; a key listed without
    a value and an unreadable database are errors."""
    import tensorstore as ts
    import xxhash

    monkeypatch.setattr(oc, "_HASH_PIECE_BYTES", piece)
    monkeypatch.setattr(oc, "_READ_AHEAD_KEYS", 3)  # fewer than the keys: the read-ahead refills
    sizes = [0, 1, 63, 64, 65, 128, 129, 64 * 5 + 3, 1000, 7]
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": f"{tmp_path}/"}}).result()
    want = {}
    for i, n in enumerate(sizes):
        value = bytes((i * 31 + j) % 251 for j in range(n))
        key = f"k/{i:02d}".encode()
        kv.write(key, value).result()
        want[key] = xxhash.xxh3_128_hexdigest(value)
    del kv
    assert dict(oc._ocdbt_digests(tmp_path)) == want
    assert [k for k, _ in oc._ocdbt_digests(tmp_path)] == sorted(want)
    (tmp_path / oc.OCDBT_MANIFEST_FILE).write_bytes(b"not a manifest")
    with pytest.raises(ValueError, match="cannot read OCDBT database"):
        list(oc._ocdbt_digests(tmp_path))


def test_ocdbt_digests_without_tensorstore_name_the_cause(tmp_path: Path, monkeypatch) -> None:
    """tensorstore is a dependency of ours (the replicator image holds it; Orbax mode hashes OCDBT steps,
    Orbax's default format, through it): an installation without it says so instead of a bare import error."""
    import sys

    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": f"{tmp_path}/"}}).result()
    kv.write(b"k", b"v").result()
    del kv
    assert len(list(oc._ocdbt_digests(tmp_path))) == 1
    monkeypatch.setitem(sys.modules, "tensorstore", None)  # as if not installed: import raises
    with pytest.raises(ValueError, match="tensorstore is not installed"):
        list(oc._ocdbt_digests(tmp_path))
