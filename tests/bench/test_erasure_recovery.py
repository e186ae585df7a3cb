"""bench.erasure's recovery on real hosts at a tiny size: the keys of its JSON line per code, every rebuilt and
copied step compared byte for byte (the count of those checks), and a check that does fail on a differing
byte; times nothing, but for the one bound that shows ``--link-mbit``'s links are in the restores' path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import erasure


def test_recovery_keys_per_code_and_every_restore_checked() -> None:
    out = erasure.run(mib=0.0625, stripe_bytes=16 << 10, codes=[(2, 1), (4, 2)], repeats=1, recovery_mib=0.2,
                      recovery_files=3)
    json.dumps(out)
    for key in ("ec_recovery_vs_copy_recovery", "ec_recovery_seconds", "copy_recovery_seconds",
                "ec_direct_recovery_vs_copy_recovery", "ec_direct_recovery_seconds", "ec_pipelined_recovery_vs_copy_recovery",
                "rebuild_mode", "encode_seconds_per_host", "recovery_rebuilds_checked", "encode_gib_per_s_per_core",
                "losses_survived"):
        assert set(out[key]) == {"2+1", "4+2"}, key
    assert set(out["ec_recovery_two_lost_seconds"]) == {"4+2"}  # two hosts lost: only a code with M >= 2
    # a warm-up rebuild (spread), pipelined rebuild, rebuild decoded here and copy, then one of each per
    # repeat; 4+2 also rebuilds hosts 0 and 1 lost together
    assert out["recovery_rebuilds_checked"] == {"2+1": 8, "4+2": 10}
    assert out["rebuild_mode"]["4+2"] == {"ec": ["spread"], "pipelined": ["pipelined"], "direct": ["here"],
                                          "ec2": ["spread"]}
    assert out["recovery_mib_per_host"] == 0.2
    assert out["link_mbit"] == 0
    assert out["copy_recovery_floor_seconds"] == {}  # no link, no floor


@pytest.mark.skipif(bool(erasure.links_unavailable()), reason=erasure.links_unavailable() or "available")
def test_link_mbit_puts_every_host_and_the_replacement_behind_a_throttled_link() -> None:
    mbit, mib = 200, 2
    out = erasure.run(mib=0.0625, stripe_bytes=64 << 10, codes=[(2, 1)], repeats=1, recovery_mib=mib,
                      recovery_files=2, link_mbit=mbit)
    json.dumps(out)
    assert out["link_mbit"] == mbit
    floor = out["copy_recovery_floor_seconds"]["2+1"]
    assert floor == pytest.approx(mib * erasure.MIB * 8 / (mbit * 1e6), abs=1e-4)
    assert out["recovery_rebuilds_checked"] == {"2+1": 8}
    # each link's bytes over a copy's: the wiped host's none, the replacement's its step once (and a little)
    for key in ("link_bytes_vs_copy", "pipelined_link_bytes_vs_copy"):
        shares = out[key]["2+1"]
        assert shares["0"] == 0 and 0.9 < shares["new"] < 1.2, (key, shares)
        assert all(v <= 1.2 for v in shares.values()), (key, shares)
    # On loopback the same 2 MiB copy takes a few ms; through two 200 Mbit/s token buckets it cannot beat
    # the floor (the buckets' 64 KiB bursts aside), and the rebuild reads at least as many bytes.
    assert out["copy_recovery_seconds"]["2+1"] >= 0.8 * floor
    assert out["ec_recovery_seconds"]["2+1"] >= 0.8 * floor


def test_the_byte_check_fails_on_a_differing_byte_or_a_missing_file(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "state").mkdir(parents=True)
        (d / "state" / "0.bin").write_bytes(b"\x00" * 1000)
        (d / "MANIFEST.json").write_bytes(b"{}")
    erasure._check_same(a, b)
    (b / "state" / "0.bin").write_bytes(b"\x00" * 999 + b"\x01")
    with pytest.raises(RuntimeError, match="differs"):
        erasure._check_same(a, b)
    (b / "state" / "0.bin").unlink()
    with pytest.raises(RuntimeError, match="holds files"):
        erasure._check_same(a, b)
