"""The Grafana dashboard and the alert rules against a real Prometheus scraping a real
``lmcache server`` with the NVMe tier (examples/mp-server.sh).

LMCache's own ``lmcache bench server --mode cpu`` drives the server: it stores prompts,
the server's L1 is emptied (``POST /cache/clear``), the same prompts are read back from
the tier, and more prompts than the budget holds force evictions.  Prometheus (Debian's
``prometheus``, installed on first use) scrapes the server's ``/metrics`` every second
and evaluates the alert rules; every query of every panel and variable then runs through
its HTTP API and must return series, so a renamed metric fails here, not in Grafana.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from support.monitoring import ALERTS, alert_rules, dashboard, panels
from support.mp_server import MPServer
from support.prometheus import Prometheus
from support.system_packages import ensure_programs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# 2 MiB chunks, 4 per request (support.mp_server.BENCH_KV_SHAPE)
BUDGET_GB = "0.1"  # 50 chunks: the third batch of requests forces evictions
# What Grafana puts in a query: "All" of each variable, and a rate window.
GRAFANA_VALUES = {"$__rate_interval": "1m", "$instance": ".*", "$adapter": ".*",
                  "$cache_dir": ".*"}


@dataclass
class Scrape:
    prometheus: Prometheus
    server: MPServer


def grafana(expr: str) -> str:
    for variable, value in GRAFANA_VALUES.items():
        expr = expr.replace(variable, value)
    return expr


def wait_for_first_scrape(prometheus: Prometheus) -> None:
    """Until Prometheus has scraped the server once: it applies its targets a few seconds
    after it is ready, and a rate needs a sample from before the traffic (a fast machine
    ran the whole workload before the first scrape, and every rate came out 0)."""
    deadline = time.monotonic() + 60
    while not prometheus.query("lmcache_nvme_served_chunks_total"):
        if time.monotonic() > deadline:
            raise AssertionError("prometheus never scraped the server")
        time.sleep(0.2)


def wait_for_scrape_of(prometheus: Prometheus, server: MPServer) -> None:
    """Until Prometheus holds the server's current served-chunk count, then two scrapes."""
    want = server.metrics()["lmcache_nvme_served_chunks_total"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = prometheus.query("sum(lmcache_nvme_served_chunks_total)")
        if got and float(got[0]["value"][1]) == want:
            time.sleep(2.5)
            return
        time.sleep(0.5)
    raise AssertionError(f"prometheus never scraped {want} served chunks")


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    programs = ensure_programs({"prometheus": "prometheus"})
    work = tmp_path_factory.mktemp("monitoring")
    server = MPServer(work / "cache", work / "server.log", MAX_SIZE_GB=BUDGET_GB,
                      MIN_FREE_GB="auto")
    try:
        prometheus = Prometheus(programs["prometheus"], work,
                                [f"127.0.0.1:{server.http_port}"], [ALERTS])
        try:
            wait_for_first_scrape(prometheus)
            server.bench(0, 8)     # stored: L1, then written to the tier
            server.clear_l1()
            server.bench(0, 8)     # the same prompts, read back from the tier
            server.bench(100, 140)  # more than the budget: evictions
            wait_for_scrape_of(prometheus, server)
            yield Scrape(prometheus, server)
        finally:
            prometheus.stop()
    finally:
        server.stop()


def test_the_traffic_went_through_the_tier(scrape: Scrape) -> None:
    seen = scrape.server.metrics()
    assert seen["lmcache_nvme_read_chunks_total{path=posix}"] > 0
    assert seen["lmcache_nvme_writes_total"] > 0
    assert seen["lmcache_nvme_evictions_total"] > 0
    assert seen["lmcache_nvme_checksum_failures_total"] == 0


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def test_every_panel_query_returns_series(scrape: Scrape) -> None:
    """Each target of each panel returns series; each panel shows at least one number.
    The summary printed (pytest -s) is what each panel showed from this scrape."""
    for panel in panels():
        finite = False
        lines = []
        for target in panel["targets"]:
            series = scrape.prometheus.query(grafana(target["expr"]))
            assert series, f"panel '{panel['title']}' {target['refId']}: no series for " \
                           f"{grafana(target['expr'])}"
            values = [(_legend(target["legendFormat"], s["metric"]), float(s["value"][1]))
                      for s in series]
            finite |= any(math.isfinite(v) for _, v in values)
            lines += [f"    {name}: {v:.4g}" for name, v in values if math.isfinite(v)]
        assert finite, f"panel '{panel['title']}' shows no number"
        print(f"{panel['title']}\n" + "\n".join(lines))


def test_every_variable_lists_values(scrape: Scrape) -> None:
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector, label = match.groups()
        values = scrape.prometheus.api(f"label/{label}/values",
                                       **{"match[]": grafana(selector)})
        assert values, f"variable {variable['name']}: no values"


def test_the_alert_rules_evaluate_on_real_series_and_stay_quiet(scrape: Scrape) -> None:
    deadline = time.monotonic() + 30
    while True:  # every rule evaluated at least once since the scrape
        groups = scrape.prometheus.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") and
                         r["health"] != "unknown" for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        assert rule["state"] != "firing", f"{rule['name']} fires on a healthy tier: {rule}"
