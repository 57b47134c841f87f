"""examples/lmcache-nvme-alerts.yml and examples/grafana-lmcache-nvme.json as shipped: every
metric they name is exported, the rules pass ``promtool check rules`` and the unit tests of
``promtool test rules`` (alerts_test.yml), and the dashboard is a well-formed Grafana model
whose panels cover what an operator watches."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support.monitoring import ALERTS, DASHBOARD, alert_rules, dashboard, panels
from support.system_packages import ensure_programs

from lmcache_nvme_backend.metrics import HISTOGRAMS, PREFIX, metric_names

RULES_TEST = Path(__file__).resolve().parent / "alerts_test.yml"
METRIC_RE = re.compile(rf"\b{PREFIX}_[a-z_]+\b")


def exported_names() -> set[str]:
    histograms = {f"{PREFIX}_{name}{suffix}" for name, *_ in HISTOGRAMS
                  for suffix in ("_bucket", "_sum", "_count")}
    return set(metric_names()) | histograms


@pytest.fixture(scope="module")
def promtool() -> str:
    return ensure_programs({"promtool": "prometheus"})["promtool"]


def test_promtool_checks_the_rules(promtool: str) -> None:
    proc = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


def test_promtool_unit_tests_of_every_alert_pass(promtool: str) -> None:
    proc = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=120, cwd=RULES_TEST.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES_TEST.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "an alert without a unit test"


def test_the_alerts_cover_what_operators_page_on() -> None:
    exprs = " ".join(r["expr"] for r in alert_rules())
    for metric in ("checksum_failures_total", "root_in_service", "dropped_writes_total",
                   "used_bytes", "capacity_bytes", "root_free_bytes", "root_min_free_bytes"):
        assert f"{PREFIX}_{metric}" in exprs, metric
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize("source", [ALERTS, DASHBOARD], ids=lambda p: p.name)
def test_every_metric_named_is_exported(source: Path) -> None:
    named = set(METRIC_RE.findall(source.read_text()))
    assert named, "no metric found"
    assert named <= exported_names(), f"not exported: {sorted(named - exported_names())}"


def test_the_dashboard_is_a_grafana_model_usable_as_shipped() -> None:
    doc = dashboard()
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 36
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "adapter", "cache_dir"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    boxes = []
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["title"] and panel["description"], panel["id"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"] for t in panel["targets"])
        for target in panel["targets"]:  # every selector follows the dashboard's variables
            for selector in re.findall(rf"{PREFIX}_[a-z_]+{{([^}}]*)}}", target["expr"]):
                assert 'instance=~"$instance"' in selector, target["expr"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        boxes.append((g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"], panel["title"]))
    for i, a in enumerate(boxes):  # no panel hides another
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)


def test_the_dashboard_shows_what_operators_watch() -> None:
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    for metric in ("hits_total", "lookups_total", "read_bytes_total",
                   "read_latency_seconds_bucket", "write_latency_seconds_bucket",
                   "write_queue_bytes", "dropped_writes_total", "evictions_total",
                   "used_bytes", "capacity_bytes", "root_free_bytes", "root_min_free_bytes",
                   "checksum_failures_total", "root_in_service"):
        assert f"{PREFIX}_{metric}" in exprs, metric
    assert "by (le, instance, adapter, cache_dir, path)" in exprs  # per read path


def test_the_scrape_config_loads_the_rules(promtool: str) -> None:
    proc = subprocess.run([promtool, "check", "config", str(ALERTS.parent / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout
