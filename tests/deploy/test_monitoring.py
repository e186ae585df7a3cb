"""deploy/monitoring and docs/operations.md name only metrics the replicator really exports, and every one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from replicator.metrics import ClusterView, ReplicatorMetrics

REPO = Path(__file__).resolve().parents[2]
MON = REPO / "deploy" / "monitoring"
_NAME = re.compile(r"\bmtc_[a-z_]+\b")


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
