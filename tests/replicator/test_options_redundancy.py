"""`--redundancy` (copies:N | ec:K+M): parsed from flags, env and YAML by one rule, validated once at startup."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from controller_client.cli import build_parser
from replicator.erasure.redundancy import Redundancy
from replicator.options import ConfigError, ReplicatorOptions, from_args


def _opts(argv: list[str], environ: dict[str, str] | None = None) -> ReplicatorOptions:
    return from_args(build_parser().parse_args(["replicator", *argv]), environ or {})


def _job(tmp_path: Path, nodes: int = 8, slices: int = 1) -> list[str]:
    peers = ",".join(f"{r}=127.0.0.1:{7000 + r}" for r in range(nodes))
    return ["--local-dir", str(tmp_path), "--rank", "0", "--nodes", str(nodes), "--data-parallelism", str(slices),
            "--peers", peers, "--listen", "127.0.0.1:0"]


def test_the_default_is_copies_of_replicas(tmp_path: Path) -> None:
    assert _opts(_job(tmp_path)).effective_redundancy == Redundancy.copies_of(1)
    assert _opts([*_job(tmp_path), "--replicas", "2"]).effective_redundancy == Redundancy.copies_of(2)
    assert _opts([*_job(tmp_path), "--replicas", "0"]).effective_redundancy == Redundancy.copies_of(0)


def test_copies_n_alone_sets_replicas(tmp_path: Path) -> None:
    """What reads ``replicas`` (the daemon's JobTopology) sees N without knowing of --redundancy."""
    assert _opts([*_job(tmp_path), "--redundancy", "copies:2"]).replicas == 2
    assert _opts([*_job(tmp_path), "--redundancy", "copies:0"]).replicas == 0
    assert _opts([*_job(tmp_path), "--redundancy", "ec:4+2"]).replicas == 1  # untouched: ec keeps no copies


def test_flag_env_and_yaml_are_one_rule(tmp_path: Path) -> None:
    assert _opts([*_job(tmp_path), "--redundancy", "ec:4+2"]).effective_redundancy == Redundancy.ec(4, 2)
    assert _opts(_job(tmp_path), {"MTC_REDUNDANCY": "ec:3+1"}).effective_redundancy == Redundancy.ec(3, 1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("redundancy: copies:2\n")
    assert _opts([*_job(tmp_path), "--config", str(cfg)]).effective_redundancy == Redundancy.copies_of(2)
    # Flags over env over YAML, as for every option.
    o = _opts([*_job(tmp_path), "--config", str(cfg), "--redundancy", "ec:5+3"], {"MTC_REDUNDANCY": "ec:3+1"})
    assert str(o.effective_redundancy) == "ec:5+3"


@pytest.mark.parametrize(("spec", "says"), [
    ("ec:4", r"'copies:N' \(N >= 0\) or 'ec:K\+M'"), ("raid6", r"'copies:N' \(N >= 0\) or 'ec:K\+M'"),
    ("copies:-1", r"'copies:N' \(N >= 0\) or 'ec:K\+M'"), ("EC:4+2", r"'copies:N' \(N >= 0\) or 'ec:K\+M'"),
    ("copies:1,ec:4+2", r"'copies:N' \(N >= 0\) or 'ec:K\+M'"),
    ("ec:0+2", r"K >= 1 and M >= 1, got ec:0\+2"), ("ec:4+0", r"K >= 1 and M >= 1, got ec:4\+0"),
    ("ec:30+3", r"K \+ M <= 32, got ec:30\+3"),
])
def test_bad_specs_say_what_is_accepted(tmp_path: Path, spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"^--redundancy: .*" + says):
        _opts([*_job(tmp_path), "--redundancy", spec])


def test_surrounding_blanks_are_tolerated(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("redundancy: ' ec:4+2 '\n")
    assert _opts([*_job(tmp_path), "--config", str(cfg)]).effective_redundancy == Redundancy.ec(4, 2)


def test_a_non_default_replicas_that_disagrees_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--replicas 2 \(= copies:2\) and --redundancy ec:4\+2 disagree"):
        _opts([*_job(tmp_path), "--replicas", "2", "--redundancy", "ec:4+2"])
    with pytest.raises(ConfigError, match=r"^--replicas 0 \(= copies:0\) and --redundancy copies:2 disagree"):
        _opts([*_job(tmp_path), "--replicas", "0", "--redundancy", "copies:2"])
    # Agreeing, or --replicas at its default (a rendered ConfigMap always carries replicas: 1): accepted.
    assert _opts([*_job(tmp_path), "--replicas", "2", "--redundancy", "copies:2"]).effective_redundancy.copies == 2
    cfg = tmp_path / "c.yaml"
    cfg.write_text("replicas: 1\n")
    o = _opts([*_job(tmp_path), "--config", str(cfg), "--redundancy", "ec:4+2"])
    assert o.effective_redundancy == Redundancy.ec(4, 2)


def test_ec_needs_k_plus_m_hosts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--redundancy ec:6\+3 needs at least 9 hosts \(K\+M\); the job has 8"):
        _opts([*_job(tmp_path, 8), "--redundancy", "ec:6+3"])
    assert _opts([*_job(tmp_path, 9), "--redundancy", "ec:6+3"]).effective_redundancy == Redundancy.ec(6, 3)
    # copies:N needs no host count of its own (copies are capped at nodes - 1, as --replicas always was).
    assert _opts([*_job(tmp_path, 2), "--redundancy", "copies:3"]).effective_redundancy.copies == 3


def test_ec_is_refused_in_orbax_mode(tmp_path: Path) -> None:
    """Orbax mode may change the node count between incarnations (elastic): every code group would change."""
    with pytest.raises(ConfigError, match=r"^--redundancy ec:4\+2 is not supported in Orbax mode"):
        _opts(["--local-dir", str(tmp_path), "--coordinator", "h:1", "--redundancy", "ec:4+2"])
    assert _opts(["--local-dir", str(tmp_path), "--coordinator", "h:1", "--redundancy", "copies:1"]).orbax_mode


def test_a_lost_slice_not_survived_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="replicator.options"):
        _opts([*_job(tmp_path, 8, 2), "--redundancy", "ec:3+1"])  # 2 slices: 2 fragments of a rotation per slice
    assert any("a whole slice lost is NOT survived" in r.getMessage() and "ec:3+1" in r.getMessage()
               for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="replicator.options"):
        _opts([*_job(tmp_path, 16, 4), "--redundancy", "ec:3+1"])  # 4 slices: one fragment per slice
        _opts([*_job(tmp_path, 8, 1), "--redundancy", "ec:3+1"])  # one slice: nothing to say
    assert not caplog.records, caplog.text


def test_help_names_the_default() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["replicator"]  # noqa: SLF001 - argparse introspection
    action = next(a for a in sub._actions if a.dest == "redundancy")
    assert "copies:<--replicas>" in action.help and "ec:K+M" in action.help
