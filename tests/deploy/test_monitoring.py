"""deploy/monitoring and docs/operations.md name only metrics the replicator really exports, and every one; the
alert rules pass ``promtool check rules`` and their unit tests (deploy/monitoring/rules_test.yaml), and those
tests fail when an alert cannot fire."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from replicator.metrics import ClusterView, ReplicatorMetrics

REPO = Path(__file__).resolve().parents[2]
MON = REPO / "deploy" / "monitoring"
_NAME = re.compile(r"\bmtc_[a-z_]+\b")
PROMTOOL_TIMEOUT_SECONDS = 60.0


def exported_families(tmp_path: Path) -> set[str]:
    """Every metric family of a coordinator's replicator with a bucket (the fullest set)."""
    m = ReplicatorMetrics(tmp_path)
    m.cluster_view = lambda: ClusterView(newest_complete_step=3, newest_redundant=True, hosts=4, hosts_registered=4,
                                         hosts_lost=0, backup_configured=True, backup_last_success_unix=1.0,
                                         backup_interval_seconds=60.0)
    m.observe_transfer("peer_copy", 0.1)
    text = generate_latest(m.registry).decode()
    return {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def _base(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_dashboard_and_rules_use_real_metrics(tmp_path) -> None:
    families = exported_families(tmp_path)
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 8
    rules = yaml.safe_load((MON / "rules.yaml").read_text())
    assert rules["kind"] == "Rules" and rules["apiVersion"] == "monitoring.googleapis.com/v1"
    alerts = {r["alert"]: r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]}
    assert {"MtcBackupOverdue", "MtcNoRedundantStep", "MtcHostLost", "MtcRamDiskNearlyFull"} <= set(alerts)
    pm = yaml.safe_load((MON / "podmonitoring.yaml").read_text())
    assert pm["kind"] == "PodMonitoring" and pm["spec"]["endpoints"][0]["path"] == "/metrics"
    used = {_base(n) for e in exprs + list(alerts.values()) for n in _NAME.findall(e)}
    assert used and used <= families, sorted(used - families)
    for e in exprs + list(alerts.values()):
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e


def test_operations_doc_lists_every_metric(tmp_path) -> None:
    doc = (REPO / "docs" / "operations.md").read_text()
    documented = {_base(n) for n in _NAME.findall(doc)}
    families = exported_families(tmp_path)
    assert families <= documented, sorted(families - documented)
    assert documented - families <= {"mtc_demo"}, sorted(documented - families)
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |"):
        assert code in doc


# ---------------------------------------------------------------------------------------------- promtool
def _promtool() -> str:
    """promtool's path; missing, a failure under CI=true (`make test` installs it), else a skip."""
    path = shutil.which("promtool")
    if path is None:
        why = ("promtool is missing: install Debian's `prometheus` package "
               "(apt-get install prometheus; `make test` does)")
        if os.environ.get("CI") == "true":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return path


def _alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((MON / "rules.yaml").read_text())
    return [r for g in rules["spec"]["groups"] for r in g["rules"] if "alert" in r]


def _promtool_dir(tmp_path: Path, exprs: dict[str, str] | None = None) -> Path:
    """rules.yaml's spec.groups as a plain rule file (promtool does not read the GMP ``Rules`` object), next to a
    copy of rules_test.yaml; ``exprs`` replaces the expressions of the alerts it names."""
    groups = yaml.safe_load((MON / "rules.yaml").read_text())["spec"]["groups"]
    for rule in (r for g in groups for r in g["rules"]):
        if exprs and rule.get("alert") in exprs:
            rule["expr"] = exprs[rule["alert"]]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(MON / "rules_test.yaml", tmp_path / "rules_test.yaml")
    return tmp_path


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_SECONDS, check=False)


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    d = _promtool_dir(tmp_path)
    r = _run([_promtool(), "check", "rules", str(d / "rules.yaml")])
    assert r.returncode == 0, f"promtool check rules:\n{r.stdout}{r.stderr}"
    assert f"SUCCESS: {len(_alert_rules())} rules found" in r.stdout, r.stdout


def test_rules_pass_their_unit_tests(tmp_path: Path) -> None:
    d = _promtool_dir(tmp_path)
    r = _run([_promtool(), "test", "rules", str(d / "rules_test.yaml")])
    assert r.returncode == 0, f"promtool test rules:\n{r.stdout}{r.stderr}"


def test_unit_tests_fail_when_no_alert_can_fire(tmp_path: Path) -> None:
    """The unit tests are evidence: with every alert's expression replaced by one that never holds, promtool fails
    on each alert (a test group whose every expectation is "no alert" would pass)."""
    names = [r["alert"] for r in _alert_rules()]
    d = _promtool_dir(tmp_path, dict.fromkeys(names, "vector(1) < 0"))
    r = _run([_promtool(), "test", "rules", str(d / "rules_test.yaml")])
    assert r.returncode != 0, f"promtool test rules passed with alerts that cannot fire:\n{r.stdout}{r.stderr}"
    out = r.stdout + r.stderr
    assert "got:[]" in out, out
    silent = [n for n in names if f"alertname: {n}," not in out]
    assert not silent, f"no failing expectation for {silent}:\n{out}"


def test_every_alert_has_a_firing_and_a_healthy_case(tmp_path: Path) -> None:
    """Each alert has a test group with an expected firing alert and a healthy series (a label value starting with
    "healthy") of a metric the alert reads, which no expectation lets fire; the series are real metrics."""
    suite = yaml.safe_load((MON / "rules_test.yaml").read_text())
    assert suite["rule_files"] == ["rules.yaml"]
    families = exported_families(tmp_path)
    covered = set()
    for alert in _alert_rules():
        reads = {_base(n) for n in _NAME.findall(alert["expr"])}
        for group in suite["tests"]:
            cases = [t for t in group.get("alert_rule_test", []) if t["alertname"] == alert["alert"]]
            expected = [a["exp_labels"] for t in cases for a in t.get("exp_alerts") or []]
            series = [s["series"] for s in group["input_series"]]
            healthy = [s for s in series if _base(s.split("{")[0]) in reads and '="healthy' in s]
            if expected and healthy and not any(str(v).startswith("healthy") for e in expected for v in e.values()):
                covered.add(alert["alert"])
    assert covered == {r["alert"] for r in _alert_rules()}, sorted({r["alert"] for r in _alert_rules()} - covered)
    used = {_base(s["series"].split("{")[0]) for g in suite["tests"] for s in g["input_series"]}
    assert used <= families, sorted(used - families)
