"""A committed step as one byte stream and back; end to end: a group of real step directories encoded, one
host wiped, its step rebuilt from the others and their parity into files identical to the original."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replicator.erasure import GroupDecoder, GroupEncoder, StepStream, StripeCodec, code_groups, unpack_stream
from sidecar.checksums import ChecksumError, verify_step_dir
from sidecar.layout import MANIFEST_NAME
from tests.kits.storage import make_step


def _files(rank: int) -> dict[str, bytes]:
    return {
        "a.0.bin": os.urandom(1000 + rank * 333),
        "empty.bin": b"",
        "sub/dir/b.1.bin": os.urandom(70_000 + rank),
    }


def test_stream_is_the_manifest_then_the_files_in_manifest_order(tmp_path: Path) -> None:
    step = make_step(tmp_path, 3, 0, 4, _files(0))
    s = StepStream.open(step)
    whole = (step / MANIFEST_NAME).read_bytes() + b"".join((step / f.name).read_bytes() for f in s.manifest.files)
    assert s.length == len(whole)
    assert s.read(0, s.length + 100) == whole  # cut at the end, never padded
    for off, n in [(0, 1), (len(s.manifest_bytes) - 3, 10), (len(s.manifest_bytes) + 999, 5000), (s.length - 1, 9)]:
        assert s.read(off, n) == whole[off:off + n]


@pytest.mark.parametrize("chunk", [1 << 20, 4097, 13])
def test_unpack_writes_back_identical_files(tmp_path: Path, chunk: int) -> None:
    step = make_step(tmp_path / "src", 3, 1, 4, _files(1))
    s = StepStream.open(step)
    data = s.read(0, s.length) + bytes(200)  # padding past the stream is ignored
    out = tmp_path / "out"
    out.mkdir()
    man = unpack_stream((data[i:i + chunk] for i in range(0, len(data), chunk)), len(s.manifest_bytes), s.length, out)
    assert man == s.manifest
    verify_step_dir(out)
    for f in s.manifest.files:
        assert (out / f.name).read_bytes() == (step / f.name).read_bytes()


def test_unpack_refuses_a_corrupt_or_short_stream(tmp_path: Path) -> None:
    step = make_step(tmp_path / "src", 3, 1, 4, _files(1))
    s = StepStream.open(step)
    data = bytearray(s.read(0, s.length))
    data[-10] ^= 1
    (tmp_path / "a").mkdir()
    with pytest.raises(ChecksumError, match="sub/dir/b.1.bin"):
        unpack_stream([bytes(data)], len(s.manifest_bytes), s.length, tmp_path / "a")
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="early"):
        unpack_stream([bytes(data[:-100])], len(s.manifest_bytes), s.length, tmp_path / "b")


@pytest.mark.parametrize(("k", "m"), [(3, 1), (4, 2)])
def test_a_wiped_host_is_rebuilt_from_its_group(tmp_path: Path, k: int, m: int) -> None:
    (group,) = code_groups(1, k + m, k, m)
    streams = {r: StepStream.open(make_step(tmp_path / f"host{r}" / "steps", 5, r, k + m, _files(r)))
               for r in group.members}
    codec = StripeCodec(k, m)
    enc = GroupEncoder(codec, group, 5, [streams[r].length for r in group.members],
                       [len(streams[r].manifest_bytes) for r in group.members],
                       lambda r, off, n: streams[r].read(off, n), stripe_bytes=8192)
    parity: dict[tuple[int, int, int], bytearray] = {}
    for p in enc.stripes():
        parity.setdefault((p.holder, p.rotation, p.index), bytearray()).extend(p.data)
    manifest = enc.manifest()
    lost = group.members[:m]
    dec = GroupDecoder(codec, manifest, lambda r, off, n: streams[r].read(off, n),
                       lambda r, rot, j, off, n: bytes(parity[(r, rot, j)][off:off + n]), lost)
    for r in lost:
        out = tmp_path / f"rebuilt{r}"
        out.mkdir()
        unpack_stream(dec.stream(r), len(streams[r].manifest_bytes), streams[r].length, out)
        verify_step_dir(out)
        for name in [MANIFEST_NAME, *(f.name for f in streams[r].manifest.files)]:
            assert (out / name).read_bytes() == (streams[r].step_dir / name).read_bytes()
