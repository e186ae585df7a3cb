"""The parity store on its own: whole or nothing on disk (a failed write, ENOSPC included, leaves nothing and
frees the recycled pages), bad records and short shards dropped, names and digests checked."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from replicator.erasure import GroupEncoder, GroupLayout, StripeCodec
from replicator.erasure import holder as holder_mod
from replicator.erasure.holder import RECORD_NAME, ParityRecord, ParityStore, check_digest, parse_shard_name
from replicator.erasure.wire import CodeGroupSpec
from sidecar import spares

STEP = 9
SPEC = CodeGroupSpec(2, 1, (0, 1, 2), ("a" * 64, "b" * 64, "c" * 64), ("", "", ""))
STREAMS = {0: os.urandom(3000), 1: os.urandom(2000), 2: os.urandom(100)}


def encode(store: ParityStore) -> ParityRecord:
    lay = GroupLayout(2, 1, SPEC.members)
    enc = GroupEncoder(StripeCodec(2, 1), lay, STEP, [len(STREAMS[r]) for r in lay.members], [5, 5, 5],
                       lambda r, off, n: STREAMS[r][off:off + n], stripe_bytes=256)
    rotations = [r for r, _ in lay.parity_held(store.rank)]
    stripes = (p for p in enc.stripes(rotations) if p.holder == store.rank)
    return store.write_all(STEP, SPEC, stripes, lambda: enc.manifest(rotations))


def test_a_written_parity_is_listed_read_and_its_record_round_trips(tmp_path: Path) -> None:
    store = ParityStore(tmp_path, 1)
    rec = encode(store)
    (held,) = store.holdings()
    assert (held.step, held.digest, held.size, held.group) == (STEP, SPEC.digest(), rec.parity_bytes, SPEC)
    raw = (store.parity_dir(STEP, SPEC.digest()) / RECORD_NAME).read_bytes()
    assert ParityRecord.from_json(raw) == rec
    (r, j), = SPEC.layout.parity_held(1)
    assert len(store.read(STEP, SPEC.digest(), r, j, 0, 10_000)) == rec.manifest.shard_bytes
    with pytest.raises(FileExistsError):
        store.writer(STEP, SPEC)


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, errno_: int) -> None:
    store = ParityStore(tmp_path, 1)
    spare = spares.spare_dir(tmp_path)
    spare.mkdir()
    (spare / "4096-x").write_bytes(bytes(4096))  # recycled pages of a deleted step
    calls = [0]
    real = os.pwrite

    def failing(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno_, os.strerror(errno_))
        return real(fd, data, offset)

    monkeypatch.setattr(holder_mod.os, "pwrite", failing)
    with pytest.raises(OSError) as e:
        encode(store)
    assert e.value.errno == errno_
    assert list((tmp_path / "parity" / str(STEP)).iterdir()) == []  # the temporary directory is gone
    assert store.holdings() == []
    assert (spare / "4096-x").exists() == (errno_ != errno.ENOSPC)  # ENOSPC frees the recycled pages


def test_bad_records_and_short_shards_are_dropped(tmp_path: Path) -> None:
    store = ParityStore(tmp_path, 1)
    encode(store)
    d = store.parity_dir(STEP, SPEC.digest())
    (r, j), = SPEC.layout.parity_held(1)
    with open(d / f"r{r}-p{j}", "r+b") as f:
        f.truncate(10)
    assert store.holdings() == []
    assert not d.exists()
    encode(store)
    rec = json.loads((d / RECORD_NAME).read_bytes())
    rec["content_hashes"][0] = "d" * 64  # no longer the group its digest names
    (d / RECORD_NAME).write_text(json.dumps(rec))
    assert store.holdings() == []
    assert not d.exists()


def test_names_and_digests_are_checked() -> None:
    assert check_digest(SPEC.digest()) == SPEC.digest()
    for bad in ("../x", "ec1-" + "0" * 31, "ec1-" + "G" * 32, "", "ec1-" + "0" * 32 + "/.."):
        with pytest.raises(ValueError):
            check_digest(bad)
    assert parse_shard_name("r12-p1") == (12, 1)
    for bad in ("r1-p1/..", "../r1-p1", "r01-p1", "GROUP.json", "r1-p"):
        with pytest.raises(ValueError):
            parse_shard_name(bad)
    rec = ParityRecord.from_json  # a record naming another holder's shards is refused
    with pytest.raises(ValueError):
        rec(b'{"format_version": 1}')
