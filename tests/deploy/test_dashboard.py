"""deploy/grafana/gigpo-dashboard.json and docs/metrics.md: up to date with their builder, every declared
metric on a panel, every query on a declared metric; and (slow, needs Debian's prometheus: `make prometheus`) every query returns
data from a real Prometheus scraping a real Ray (deploy/tools/check_dashboard.py)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.metrics import METRICS, SECTIONS
from deploy.tools.dashboard import (DASHBOARD_PATH, METRICS_DOC_PATH, build_dashboard, dashboard_queries,
                              render, render_metrics_doc)

ROOT = Path(__file__).resolve().parents[2]


def metric_names_in(expr: str) -> set[str]:
    """The ray_gigpo_* metric names an expression reads (histogram suffixes stripped)."""
    names = set(re.findall(r"\bray_gigpo_[a-zA-Z0-9_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_committed_dashboard_and_metrics_page_are_the_builders_output():
    assert DASHBOARD_PATH.read_text() == render(), "run `python -m deploy.tools.dashboard` and commit the JSON"
    assert METRICS_DOC_PATH.read_text() == render_metrics_doc(), "run `python -m deploy.tools.dashboard`, commit docs/"


def test_every_metric_has_a_panel_and_every_query_a_declared_metric():
    queries = dashboard_queries(json.loads(DASHBOARD_PATH.read_text()))
    declared = {spec.exported_name for spec in METRICS.values()}
    used = set()
    for title, ref, expr in queries:
        names = metric_names_in(expr)
        assert names, f"{title} {ref}: reads no gigpo metric"
        assert names <= declared, f"{title} {ref}: undeclared {names - declared}"
        used |= names
    assert used == declared, f"no panel for {declared - used}"


def test_dashboard_is_importable_into_rays_grafana():
    dash = build_dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"SessionName", "Cluster"} <= set(variables)
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == [section.capitalize() for section in SECTIONS]      # one row per section of the metrics
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["description"]
        for target in panel["targets"]:
            assert 'SessionName=~"$SessionName"' in target["expr"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (`make prometheus`)")
def test_every_dashboard_query_returns_data_from_prometheus():
    proc = subprocess.run([sys.executable, str(ROOT / "deploy" / "tools" / "check_dashboard.py"), "--seconds", "12",
                           "--no-screenshot"], cwd=ROOT, capture_output=True, text=True, timeout=220)
    n = len(dashboard_queries(build_dashboard()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{n}/{n} dashboard queries returned data" in proc.stdout


def test_check_dashboard_asks_for_each_variables_values_and_the_scrape_configs_cluster_label():
    # deploy/tools/check_dashboard.py with a stand-in for Prometheus' label-values API (the real one: the slow test).
    from deploy.tools.check_dashboard import VARIABLES, check_variables, fill_variables

    class LabelValues:
        def __init__(self, values: dict):
            self.values, self.asked = values, []

        def label_values(self, label, match, start, end):
            self.asked.append((label, match))
            return self.values.get(label, [])

    prom = LabelValues({"SessionName": ["session_1"], "ray_io_cluster": ["gigpo"]})
    rows = {r[0]: r for r in check_variables(prom, 0.0, 1.0, {"ray_io_cluster": "gigpo"})}
    assert set(rows) == {"variable SessionName", "variable Cluster"}
    assert all(r[2] == "DATA" for r in rows.values())
    assert ("ray_io_cluster", "ray_gigpo_policy_version") in prom.asked
    # The label is there but not with the value the scrape config sets, or not at all: no data.
    rows = {r[0]: r for r in check_variables(LabelValues({"SessionName": ["s"], "ray_io_cluster": ["other"]}),
                                             0.0, 1.0, {"ray_io_cluster": "gigpo"})}
    assert rows["variable Cluster"][2] == "NO DATA" and rows["variable SessionName"][2] == "DATA"
    rows = {r[0]: r for r in check_variables(LabelValues({"SessionName": ["s"]}), 0.0, 1.0, {})}
    assert rows["variable Cluster"][2] == "NO DATA"
    # The queries run with $Cluster set to that value.
    expr = 'rate(x{SessionName=~"$SessionName",ray_io_cluster=~"$Cluster"}[$__rate_interval])'
    assert 'ray_io_cluster=~"gigpo"' in fill_variables(expr, dict(VARIABLES, **{"$Cluster": "gigpo"}))
    assert 'ray_io_cluster=~".*"' in fill_variables(expr)
