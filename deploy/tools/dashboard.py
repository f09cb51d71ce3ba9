"""The Grafana dashboard of a GiGPO run and the metrics' reference page, generated from the metric declarations
in common/metrics.py: a row per section, a panel per metric (and a few derived from two).

    python -m deploy.tools.dashboard            # (re)writes deploy/grafana/gigpo-dashboard.json and docs/metrics.md

The JSON is committed so that it can be imported as is (docs/deploy.md). Every query names metrics through
`exported_name`, so a renamed metric cannot leave a panel silently empty: tests compare the file with this builder.
"""
from __future__ import annotations

import json
from pathlib import Path

from common.metrics import COMMON_LABELS, SECTIONS, MetricSpec
from common.metrics import exported_name as N

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "grafana" / "gigpo-dashboard.json"
METRICS_DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
UID = "gigpo-rl"
# Series filter of every query: the chosen Ray session(s) and cluster(s).
F = 'SessionName=~"$SessionName",ray_io_cluster=~"$Cluster"'
RATE = "$__rate_interval"


def metric_panel(spec: MetricSpec) -> tuple[str, str, str, list[tuple[str, str]], bool]:
    """(title, unit, description, [(expr, legend)], stacked) of a metric's panel: a counter's rate, stacked
    (the top is the total); a gauge's value; a histogram's p50 and p95. Unlabelled series are split by actor."""
    name, title = N(spec.name), spec.name.replace("_", " ").capitalize()
    label = next(iter(spec.labels or {}), None)
    by, legend = (label, f"{{{{{label}}}}}") if label else ("kind, actor_id", "{{kind}} {{actor_id}}")
    if spec.type == "histogram":
        return (f"{title}: p50, p95", "s", spec.doc,
                [(f"histogram_quantile({q}, sum by (le) (rate({name}_bucket{{{F}}}[{RATE}])))", f"p{round(q * 100)}")
                 for q in (0.5, 0.95)], False)
    if spec.type == "counter":
        seconds = spec.name.endswith("_seconds")
        return (f"{title}: share of time" if seconds else f"{title} / s", "percentunit" if seconds else "short",
                spec.doc, [(f"sum by ({by}) (rate({name}{{{F}}}[{RATE}]))", legend)], True)
    share = spec.name.endswith(("_share", "_rate"))
    unit = "s" if spec.name.endswith("_seconds") else "percentunit" if share else "short"
    return title, unit, spec.doc, [(f"max by ({by}) ({name}{{{F}}})", legend)], False


# Panels of figures derived from two metrics, after their section's own.
DERIVED_PANELS = {
    "throughput": [
        ("Inference prefix-cache hit rate", "percentunit",
         "Share of the prompt tokens the inference engines found in their prefix cache (over the rate window): "
         "a group's N rollouts share their first prompt, and a step's prompt repeats the episode's start.",
         [(f"sum by (actor_id) (rate({N('inference_cached_prompt_tokens')}{{{F}}}[{RATE}])) / "
           f"sum by (actor_id) (rate({N('inference_prompt_tokens')}{{{F}}}[{RATE}]))", "{{actor_id}}")], False),
    ],
    "gigpo vs grpo": [
        ("Steps of successful episodes", "short",
         "Mean length of the successful trajectories the learner received (over the rate window); "
         "GiGPO's step signal favours shorter paths, so it should fall as training goes on.",
         [(f"sum(rate({N('successful_episode_steps')}{{{F}}}[{RATE}])) / "
           f"sum(rate({N('successful_episodes')}{{{F}}}[{RATE}]))", "steps")], False),
    ],
}


def _panel(pid: int, title: str, unit: str, description: str, targets: list[tuple[str, str]], stacked: bool,
           x: int, y: int) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title, "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": unit, **({"min": 0, "max": 1} if unit == "percentunit" else {}),
                         "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                    "showPoints": "never",
                                    "stacking": {"mode": "normal" if stacked else "none", "group": "A"}}},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [
            {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr,
             "legendFormat": legend, "refId": chr(ord("A") + i), "range": True}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _variable(name: str, description: str, query: str, all_value: str) -> dict:
    return {
        "name": name, "type": "query", "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "definition": query, "query": {"query": query, "refId": f"{name}Query"},
        "includeAll": True, "allValue": all_value, "multi": name == "Cluster",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2, "sort": 2, "hide": 0, "options": [], "regex": "",
    }


def build_dashboard() -> dict:
    panels, y = [], 0        # (a panel's id: its place in the list, from 1)
    for section, specs in SECTIONS.items():
        row_panels = [metric_panel(spec) for spec in specs] + DERIVED_PANELS.get(section, [])
        panels.append({"id": len(panels) + 1, "type": "row", "title": section.capitalize(), "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for i, panel in enumerate(row_panels):
            panels.append(_panel(len(panels) + 1, *panel, x=8 * (i % 3), y=y + 8 * (i // 3)))
        y += 8 * ((len(row_panels) + 2) // 3)
    version_metric = N("policy_version")
    return {
        "uid": UID, "title": "GiGPO actor-learner",
        "description": "Throughput, waits, lags, learning and health of a GiGPO run (metrics from "
                       "common/metrics.py, scraped from Ray's metrics agents).",
        "tags": ["gigpo", "ray"], "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "timepicker": {}, "timezone": "",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "description": "The Prometheus that scrapes Ray's metrics agents.",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [],
             "refresh": 1, "regex": ""},
            _variable("SessionName", "Ray session(s) to show.",
                      f"label_values({version_metric}, SessionName)", ".+"),
            _variable("Cluster", "Ray cluster(s): the ray_io_cluster label, set by the shipped scrape configs "
                                 "(deploy/prometheus/prometheus.yml, deploy/kuberay/podmonitor.yaml); empty "
                                 "where Prometheus sets none.",
                      f"label_values({version_metric}, ray_io_cluster)", ".*"),
        ]},
        "panels": panels,
    }


def dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of a dashboard JSON."""
    return [(panel["title"], target["refId"], target["expr"])
            for panel in dashboard["panels"] for target in panel.get("targets", [])]


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def render_metrics_doc() -> str:
    """docs/metrics.md: every declared metric, by the section of `gigpo status` that shows it."""
    lines = ["# Metrics", "",
             "Generated from `common/metrics.py` by `python -m deploy.tools.dashboard`; do not edit by hand. Ray serves",
             "each metric in Prometheus format under its exported name, with the labels "
             + ", ".join(f"`{label}`" for label in COMMON_LABELS) + " and Ray's own",
             "(`SessionName`, `NodeAddress`, ...). The last column is the key of the figure an update's metrics",
             "(`metrics.jsonl`, TensorBoard) hold for it, which `gigpo status` shows.", ""]
    for section, specs in SECTIONS.items():
        lines += [f"## {section}", "",
                  "| exported name | type | recorded by | extra labels | meaning | update figure |",
                  "|---|---|---|---|---|---|"]
        for spec in specs:
            labels = "; ".join(f"`{k}`: " + ", ".join(f"`{v}`" for v in values)
                               for k, values in (spec.labels or {}).items())
            figures = ", ".join(f"`{key}`" + (f" ({' '.join(lab.values())})" if lab else "")
                                for lab, key in spec.update_keys)
            lines.append(f"| `{spec.exported_name}` | {spec.type} | {', '.join(spec.recorded_by)} | {labels} "
                         f"| {spec.doc} | {figures} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(render())
    METRICS_DOC_PATH.write_text(render_metrics_doc())
    print(f"wrote {DASHBOARD_PATH} ({len(dashboard_queries(build_dashboard()))} queries) and {METRICS_DOC_PATH}")


if __name__ == "__main__":
    main()
