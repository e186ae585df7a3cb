"""`mtc plan --redundancy`: the RAM disk per host for copies:N and ec:K+M, the code groups and what they survive."""

from __future__ import annotations

import json

import pytest

from controller_client.admin.plan import ec_ram_disk_plan, groups_summary
from controller_client.cli import main
from replicator.erasure.placement import code_groups


@pytest.fixture(autouse=True)
def _wide_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table tests read cells whole: pytest-xdist's workers inherit COLUMNS=80, which wraps them."""
    monkeypatch.setenv("COLUMNS", "200")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", "--keep", "2", "-o", "json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _align(n: int) -> int:
    return -(-n // 64) * 64


def test_copies_1_is_todays_budget(capsys: pytest.CaptureFixture[str]) -> None:
    p = _plan(capsys, "--state-bytes", "8e9", "--hosts", "4", "--redundancy", "copies:1")
    assert p["redundancy"] == "copies:1" and p["mode"] == "copies" and p["losses_survived"] == 1
    assert p["own_bytes_per_step"] == 2 * 10**9 and p["byte_copies_per_rank"] == 1
    assert p["ram_disk_bytes_per_host"] == 3 * 2 * 2 * 10**9 * 11 // 10  # (2 + 1) x 2e9 x (1 + 1) x 1.1
    # --replicas 1 (the default) is the same plan.
    assert _plan(capsys, "--state-bytes", "8e9", "--hosts", "4") == p
    assert not p["survives_slice_loss"] and "code_groups" not in p


def test_ec_3_plus_1(capsys: pytest.CaptureFixture[str]) -> None:
    p = _plan(capsys, "--state-bytes", "8e9", "--hosts", "4", "--redundancy", "ec:3+1")
    own = 2 * 10**9
    parity = _align(-(-own // 3))  # one shard of ceil(2e9 / 3) bytes, 64-byte aligned: 666,666,688
    assert parity == 666_666_688
    assert p["redundancy"] == "ec:3+1" and p["mode"] == "ec" and p["byte_copies_per_rank"] == 0
    assert p["parity_bytes_per_host"] == parity and p["parity_factor"] == pytest.approx(1 / 3)
    assert p["padding"] == pytest.approx(parity / own - 1 / 3) and 0 < p["padding"] < 1e-7  # the alignment only
    assert p["ram_disk_bytes_per_host"] == -(-3 * (own + parity) * 11 // 10) == 8_800_000_071
    assert p["ram_disk_bytes_per_host"] == pytest.approx(3 * own * (1 + 1 / 3) * 1.1, abs=100)
    assert p["losses_survived"] == 1 and p["losses_survived_per"] == "code group"
    groups = p["code_groups"]
    assert groups["count"] == 1 and groups["summary"] == "1 group of 4"
    assert groups["groups"][0]["members"] == [0, 1, 2, 3] and groups["groups"][0]["losses_survived"] == 1
    assert not p["survives_slice_loss"]  # one slice: losing it is losing the job


def test_ec_4_plus_2_over_four_slices(capsys: pytest.CaptureFixture[str]) -> None:
    p = _plan(capsys, "--state-bytes", "8e9", "--hosts", "12", "--slices", "4", "--redundancy", "ec:4+2")
    own = -(-8 * 10**9 // 3)  # 8e9 over 3 hosts per slice, rounded up
    parity = 2 * _align(-(-own // 4))
    assert p["own_bytes_per_step"] == own and p["parity_bytes_per_host"] == parity
    assert p["ram_disk_bytes_per_host"] == -(-3 * (own + parity) * 11 // 10)
    assert p["ram_disk_bytes_per_host"] == pytest.approx(3 * own * 1.5 * 1.1, rel=1e-7)
    groups = p["code_groups"]
    assert groups["summary"] == "2 groups of 6"
    # Slice-inner order: consecutive positions in different slices, so a lost slice costs each rotation
    # at most 2 = M fragments.
    assert groups["groups"][0]["members"] == [0, 3, 6, 9, 1, 4]
    assert all(g["max_fragments_in_a_slice"] <= 2 and g["survives_slice_loss"] for g in groups["groups"])
    assert p["survives_slice_loss"] and "copies:3 costs no RAM" in p["note"]


def test_shorter_steps_are_padded_to_the_groups_longest() -> None:
    p = ec_ram_disk_plan({0: 1000, 1: 4000, 2: 4000, 3: 4000}, slices=1, k=3, m=1, keep=2)
    shard = _align(-(-4000 // 3))  # 1344: every member holds one parity shard of the longest stream's size
    assert p["parity_bytes_per_host"] == shard and p["own_bytes_per_step"] == 4000
    assert p["ram_disk_bytes_per_host"] == -(-3 * (4000 + shard) * 11 // 10)
    assert p["padding"] == pytest.approx(shard / 4000 - 1 / 3)
    # The stream (MANIFEST.json + files) is what is coded: a longer stream makes larger shards.
    q = ec_ram_disk_plan({0: 1000, 1: 4000, 2: 4000, 3: 4000}, slices=1, k=3, m=1, keep=2,
                         stream_bytes={0: 1500, 1: 4500, 2: 4500, 3: 4500})
    assert q["parity_bytes_per_host"] == _align(1500)


def test_groups_summary_is_one_line_for_thousands_of_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    assert groups_summary(code_groups(1, 13, 4, 2)) == "1 group of 7, 1 of 6"
    assert groups_summary(code_groups(4, 1025, 4, 2)) == "2 groups of 7, 681 of 6"
    assert main(["plan", "--state-bytes", "8e12", "--hosts", "4100", "--slices", "4", "--redundancy", "ec:4+2"]) == 0
    out = capsys.readouterr().out
    assert "2 groups of 7, 681 of 6 hosts" in out and "680 more (-o json lists every group)" in out
    assert len(out.splitlines()) < 40
    assert "ec:4+2 (survives 2 lost hosts per code group)" in out and "yes (at most 2 fragment(s)" in out


def test_the_table_says_the_mode_and_a_lost_slice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--state-bytes", "8e9", "--hosts", "8", "--slices", "2", "--redundancy", "ec:3+1"]) == 0
    out = capsys.readouterr().out
    assert "ec:3+1 (survives 1 lost host per code group)" in out and "code groups" in out
    assert "NO: a slice holds up to 2 fragments of a rotation, more than M=1" in out
    assert main(["plan", "--state-bytes", "8e9", "--hosts", "8", "--slices", "2"]) == 0
    out = capsys.readouterr().out
    assert "copies:1 (survives 1 lost host)" in out and "yes (copies go to other slices first)" in out


@pytest.mark.parametrize(("args", "says"), [
    (["--redundancy", "ec:4+2"], "needs at least 6 hosts (K+M); the job has 4"),
    (["--redundancy", "ec:4"], "--redundancy: redundancy must be 'copies:N'"),
    (["--redundancy", "ec:3+1", "--replicas", "2"], "--replicas 2 (= copies:2) and --redundancy ec:3+1 disagree"),
])
def test_bad_redundancy_is_a_usage_error(capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    assert main(["plan", "--state-bytes", "8e9", "--hosts", "4", *args]) == 2
    assert says in capsys.readouterr().err
