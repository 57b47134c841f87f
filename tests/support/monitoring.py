"""The shipped dashboard and alert rules (examples/), read for the monitoring tests."""

from __future__ import annotations

import json
from typing import Any

import yaml

from .paths import EXAMPLES_DIR

ALERTS = EXAMPLES_DIR / "lmcache-nvme-alerts.yml"
DASHBOARD = EXAMPLES_DIR / "grafana-lmcache-nvme.json"


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard model."""
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, rows left out."""
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of every group of the alert rules file."""
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
