"""The daemon's options and the `mtc` / `mtc-replicator` command lines, driven as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller_client.cli import build_parser
from replicator import logs
from replicator.options import ConfigError, ReplicatorOptions, from_args

REPO = Path(__file__).resolve().parents[2]


def _opts(argv: list[str], environ: dict[str, str] | None = None) -> ReplicatorOptions:
    return from_args(build_parser().parse_args(["replicator", *argv]), environ or {})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rank", "abc", "--nodes", "2"], "--rank: expected an integer, got 'abc'"),
        (["--rank", "1", "--nodes", "2.5"], "--nodes: expected an integer, got '2.5'"),
        (["--heartbeat-seconds", "soon"], "--heartbeat-seconds: expected a number, got 'soon'"),
        (["--rank", "3", "--nodes", "2"], "--rank 3 is outside 0..1"),
        (["--heartbeat-seconds", "0"], "--heartbeat-seconds must be > 0"),
    ],
)
def test_bad_values_name_the_flag(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _opts(["--local-dir", str(tmp_path), "--peers", "0=h:1,1=h:2", *argv])
    assert str(ei.value) == message


def test_env_and_yaml_values_are_parsed_by_the_same_rule(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^--rank: expected an integer, got 'x'$"):
        _opts(["--local-dir", str(tmp_path)], {"MTC_RANK": "x", "MTC_NODES": "2"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bulk-priority: fast\n")
    with pytest.raises(ConfigError, match="--bulk-priority: expected one of idle, low, normal, got 'fast'"):
        _opts(["--local-dir", str(tmp_path), "--config", str(cfg)])
    cfg.write_text("rank: true\nnodes: 2\n")
    with pytest.raises(ConfigError, match="--rank: expected an integer, got True"):
        _opts(["--local-dir", str(tmp_path), "--config", str(cfg)])


def test_every_option_has_one_description_and_typed_choices() -> None:
    import dataclasses

    for f in dataclasses.fields(ReplicatorOptions):
        assert f.metadata.get("help"), f"option {f.name} has no help"
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices["replicator"]  # noqa: SLF001 - argparse introspection
    bulk = next(a for a in sub._actions if a.dest == "bulk_priority")
    assert tuple(bulk.choices) == ("idle", "low", "normal")


def test_log_level_before_or_after_the_subcommand_and_from_env() -> None:
    p = build_parser()
    assert logs.level_from(p.parse_args(["replicator", "--local-dir", "/x", "--log-level", "info"]), {}) == "info"
    assert logs.level_from(p.parse_args(["--log-level", "debug", "replicator", "--local-dir", "/x"]), {}) == "debug"
    assert logs.level_from(p.parse_args(["status", "-v"]), {}) == "info"
    assert logs.level_from(p.parse_args(["status"]), {"MTC_LOG_LEVEL": "ERROR"}) == "error"
    assert logs.level_from(p.parse_args(["status"]), {}) == "warning"


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=str(REPO),
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_version_and_usage_errors_exit_2_naming_the_flag(tmp_path: Path) -> None:
    r = _run([sys.executable, "-m", "controller_client.cli", "--version"])
    assert r.returncode == 0 and r.stdout.startswith("mtc "), r
    r = _run([sys.executable, "-m", "replicator.main", "--local-dir", str(tmp_path), "--rank", "abc",
              "--nodes", "2"])
    assert r.returncode == 2
    assert r.stderr.strip() == "mtc-replicator: --rank: expected an integer, got 'abc'"
    r = _run([sys.executable, "-m", "controller_client.cli", "replicator", "--local-dir", str(tmp_path),
              "--nodes", "2"])
    assert r.returncode == 2 and r.stderr.startswith("mtc replicator: --rank and --nodes go together"), r


_NO_JAX = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'orbax'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import replicator, sidecar.layout, sidecar.checksums, sidecar.commit, sidecar.spares, sidecar.parse, sidecar.notify, controller_client.cli
for m in pkgutil.walk_packages(replicator.__path__, 'replicator.'):
    importlib.import_module(m.name)
sys.argv = ['mtc', 'replicator', '--help']
try:
    controller_client.cli.main()
except SystemExit as e:
    assert e.code == 0, e.code
print('OK')
"""


def test_the_replicator_and_the_cli_run_without_jax() -> None:
    """The core distribution has no JAX: every replicator module and `mtc replicator --help` must work."""
    r = _run([sys.executable, "-c", _NO_JAX])
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-2000:]


def test_core_distribution_declares_no_jax() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    assert not any(n in core for n in ("jax", "orbax", "cloudpickle")), core
    assert {"jax", "dev"} <= set(project["optional-dependencies"])
    assert project["scripts"]["mtc-replicator"] == "replicator.main:main"
    pins = [ln for ln in (REPO / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert pins and all("==" in ln for ln in pins), "constraints.txt pins exact versions"


def test_coordinator_candidates_by_allocation_index_may_lie_beyond_the_node_count(tmp_path: Path) -> None:
    """Orbax mode after a shrink: the candidates are the allocation's (host 2 of 4) while the job has 2 nodes."""
    base = ["--local-dir", str(tmp_path), "--rank", "0", "--nodes", "2", "--coordinator-candidates", "0=h:1,2=h:3"]
    with pytest.raises(ConfigError, match=r"--coordinator-candidates ranks must be within 0..1"):
        _opts(base)
    o = _opts([*base, "--allocation-index", "2"])
    assert o.coordinator_candidate_list() == [(0, "h:1"), (2, "h:3")] and o.allocation_index == 2
    with pytest.raises(ConfigError, match="--allocation-index must be >= 0, got -1"):
        _opts(["--local-dir", str(tmp_path), "--peers", "0=h:1", "--allocation-index", "-1"])


def test_at_most_256_coordinator_candidates(tmp_path: Path) -> None:
    """An epoch's low 8 bits name the candidate that chose it (no two candidates share an epoch)."""
    cands = ",".join(f"{r}=h:{r + 1}" for r in range(257))
    with pytest.raises(ConfigError, match="--coordinator-candidates lists 257; at most 256"):
        _opts(["--local-dir", str(tmp_path), "--rank", "0", "--nodes", "300", "--coordinator-candidates", cands])
