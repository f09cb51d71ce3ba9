"""Checks the Grafana dashboard end to end on this machine, without Grafana:

a local Ray, Debian's `prometheus` with the shipped scrape config, a workload, then EVERY query and variable of
deploy/grafana/gigpo-dashboard.json asked of Prometheus, and a chromium screenshot of Prometheus' graph page
(docs/dashboard-check.png). docs/deploy.md ("Check it locally") says more.

    python deploy/tools/check_dashboard.py [--seconds 30] [--workload synthetic] [--command CMD] [--png PATH]
                                           [--screenshot-expr PROMQL ...]

Exit status 0 when every query returned data and every variable has values, 1 when not, 2 when a tool is
missing. Every process it starts is stopped before it exits; ports are free ones.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:          # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from common.metrics import exported_name, metrics_urls, ray_init_metrics_options  # noqa: E402
from common.processes.placement import free_port  # noqa: E402
from deploy.tools.dashboard import DASHBOARD_PATH, dashboard_queries  # noqa: E402

PROMETHEUS_CONFIG_PATH = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SCRAPE_INTERVAL_S = 2
# What Grafana would put in for the dashboard's variables ($__rate_interval: at least 4 scrape intervals);
# main() puts in the cluster label's value the scrape config sets for $Cluster.
VARIABLES = {"$SessionName": ".+", "$Cluster": ".*", "$__rate_interval": f"{4 * SCRAPE_INTERVAL_S * 2}s"}
SCREENSHOT_EXPRS = (f'sum(rate({exported_name("env_steps")}[{VARIABLES["$__rate_interval"]}]))',
                    f'max by (stat) ({exported_name("policy_lag")})')


def fill_variables(expr: str, variables: dict | None = None) -> str:
    for name, value in (variables or VARIABLES).items():
        expr = expr.replace(name, value)
    return expr


def http_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read().decode())


def render_prometheus_config(config: dict, discovery_file: Path, interval_s: float = SCRAPE_INTERVAL_S) -> dict:
    """The shipped scrape config for a local run: every file_sd_configs entry reads `discovery_file` (the
    local Ray's), and every interval is `interval_s`; everything else stays as shipped."""
    config = copy.deepcopy(config)
    interval = f"{interval_s:g}s"
    config.setdefault("global", {}).update(scrape_interval=interval, evaluation_interval=interval)
    entries = [sd for job in config.get("scrape_configs", []) for sd in job.get("file_sd_configs", [])]
    if not entries:
        raise ValueError("the scrape config has no file_sd_configs entry to point at Ray's discovery file")
    for sd in entries:
        sd.update(files=[str(discovery_file)], refresh_interval=interval)
    return config


def set_labels(config: dict) -> dict[str, str]:
    """{label: value} the config's relabelling sets on every target (a target_label without source labels)."""
    labels = {}
    for job in config.get("scrape_configs", []):
        for rule in job.get("relabel_configs", []):
            if rule.get("action", "replace") == "replace" and not rule.get("source_labels") and "target_label" in rule:
                labels[rule["target_label"]] = rule.get("replacement", "$1")
    return labels


def wait_for_discovery(path: Path, targets: list[str], timeout_s: float = 60.0) -> list[str]:
    """Wait until Ray's service discovery file at `path` lists every target (host:port); its targets."""
    deadline = time.monotonic() + timeout_s
    listed: list[str] = []
    while time.monotonic() < deadline:
        try:
            listed = [t for group in json.loads(path.read_text()) for t in group["targets"]]
            if set(targets) <= set(listed):
                return listed
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Ray's service discovery file {path} does not list {targets} after {timeout_s:.0f}s "
                       f"(it lists {listed}); Ray's dashboard writes it")


class Prometheus:
    """A throw-away Prometheus server on a free port with its data in a temp dir."""

    def __init__(self, binary: str, config: dict, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2))      # JSON is YAML: no YAML writer needed
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prometheus not ready after {timeout_s}s; see {self.log.name}")

    def targets_up(self) -> bool:
        active = http_json(self.url + "/api/v1/targets")["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def query_range(self, expr: str, start: float, end: float) -> dict:
        params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                         "step": f"{SCRAPE_INTERVAL_S}s"})
        return http_json(f"{self.url}/api/v1/query_range?{params}")

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        params = urllib.parse.urlencode({"match[]": match, "start": f"{start:.3f}", "end": f"{end:.3f}"})
        return http_json(f"{self.url}/api/v1/label/{urllib.parse.quote(label)}/values?{params}")["data"]

    def graph_url(self, exprs: tuple[str, ...], range_s: int) -> str:
        params = {f"g{i}.{key}": value for i, expr in enumerate(exprs)
                  for key, value in (("expr", expr), ("tab", "0"), ("range_input", f"{range_s}s"))}
        return f"{self.url}/graph?{urllib.parse.urlencode(params)}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def headless_chromium(chromium: str, url: str, profile: Path | str, *flags: str, timeout_s: float = 120
                      ) -> tuple[int, bytes, bytes]:
    """Run headless `chromium` on `url` with `flags` (--screenshot=..., --dump-dom, ...) and a fresh profile;
    (exit status, stdout, stderr). Killed with its children after `timeout_s`."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", *flags, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"chromium did not finish in {timeout_s:.0f} s: {' '.join(flags)}") from None
    return proc.returncode, out, err


def screenshot(chromium: str, url: str, png: Path, workdir: Path, size: str = "1400,1500") -> None:
    """Headless chromium screenshot of `url`; the virtual-time budget lets the page's JS fetch and draw."""
    png.parent.mkdir(parents=True, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)
    code, out, err = headless_chromium(chromium, url, profile, "--hide-scrollbars", "--virtual-time-budget=15000",
                                       f"--window-size={size}", f"--screenshot={png}")
    if not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot (exit {code}): {(out + err).decode()[-2000:]}")


def run_workload(args, ray_address: str) -> None:
    if args.command:
        env = dict(os.environ, RAY_ADDRESS=ray_address)
        print(f"workload: {args.command}  (RAY_ADDRESS={ray_address})", flush=True)
        subprocess.run(args.command, shell=True, check=True, env=env, cwd=ROOT)
    elif args.workload == "synthetic":
        from deploy.tools import synthetic_metrics
        ticks = synthetic_metrics.run(args.seconds, interval_s=1.0)
        print(f"workload: synthetic, {ticks} ticks of every actor kind in {args.seconds:.0f}s", flush=True)
    else:
        module, _, func = args.workload.partition(":")
        if not func:
            raise SystemExit(f"--workload must be 'synthetic' or 'module:function', got {args.workload!r}")
        print(f"workload: {args.workload}()", flush=True)
        getattr(importlib.import_module(module), func)()


def check_variables(prom: Prometheus, start: float, end: float,
                    expected: dict[str, str]) -> list[tuple[str, str, str, int, str]]:
    """(variable, "", status, values, detail) for every `label_values(metric, label)` variable of the dashboard:
    NO DATA when Grafana would offer no values, or lack the value `expected` ({label: value}) names."""
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    rows = []
    for var in dashboard["templating"]["list"]:
        found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", str(var.get("definition", "")))
        if not found:
            continue
        metric, label = found.groups()
        values = prom.label_values(label, metric, start, end)
        ok = bool(values) and (label not in expected or expected[label] in values)
        rows.append((f"variable {var['name']}", "", "DATA" if ok else "NO DATA", len(values),
                     f"{label}: {values[:4]}" + (f" (expected {expected[label]!r})" if label in expected else "")))
    return rows


def check_queries(prom: Prometheus, start: float, end: float,
                  variables: dict | None = None) -> list[tuple[str, str, str, int, str]]:
    """(panel, refId, status, series, detail) for every query of the dashboard JSON."""
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    rows = []
    for title, ref, expr in dashboard_queries(dashboard):
        filled = fill_variables(expr, variables)
        try:
            result = prom.query_range(filled, start, end)
        except urllib.error.HTTPError as exc:
            rows.append((title, ref, "ERROR", 0, exc.read().decode()[:300]))
            continue
        series = result["data"]["result"]
        if series:
            peaks = [max(float(v[1]) for v in s["values"]) for s in series]
            rows.append((title, ref, "DATA", len(series), "max=" + ",".join(f"{p:.4g}" for p in peaks[:4])))
        else:
            rows.append((title, ref, "NO DATA", 0, filled))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the synthetic workload")
    parser.add_argument("--workload", default="synthetic", help="'synthetic' or 'module:function'")
    parser.add_argument("--command", default="", help="shell command to run as the workload instead")
    parser.add_argument("--png", default=str(ROOT / "docs" / "dashboard-check.png"))
    parser.add_argument("--no-screenshot", action="store_true")
    parser.add_argument("--screenshot-expr", action="append", default=[],
                        help="a PromQL expression the screenshot graphs (repeatable; the dashboard's variables may "
                             "be used); default: env steps/s and policy lag")
    args = parser.parse_args(argv)

    prom_bin = shutil.which("prometheus")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not prom_bin or (not chromium and not args.no_screenshot):
        print("needs Debian's prometheus and chromium: `make prometheus chromium`", file=sys.stderr)
        return 2

    import ray
    workdir = Path(tempfile.mkdtemp(prefix="gigpo-dashcheck-"))
    prom = None
    try:
        shipped = yaml.safe_load(PROMETHEUS_CONFIG_PATH.read_text())
        t0 = time.monotonic()
        # The dashboard is on here (unlike a run's own ray.init) because it writes the discovery file. Its
        # port and the metrics agent's are Ray's to pick (it retries a taken one): one picked here can be taken
        # before Ray binds it.
        ctx = ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2,
                       include_dashboard=True, dashboard_host="127.0.0.1",
                       _temp_dir=str(workdir / "ray"), **ray_init_metrics_options())
        targets = [u.split("//", 1)[1].split("/", 1)[0] for u in metrics_urls()]
        # The shipped config reads /tmp/ray/<file>: this Ray's temp dir stands in for /tmp/ray.
        shipped_files = [f for job in shipped["scrape_configs"] for sd in job.get("file_sd_configs", [])
                         for f in sd["files"]]
        discovery = workdir / "ray" / Path(shipped_files[0]).name
        listed = wait_for_discovery(discovery, targets)
        print(f"ray up in {time.monotonic() - t0:.1f}s; metrics endpoints: {targets}; Ray's discovery file "
              f"lists {listed}", flush=True)
        config = render_prometheus_config(shipped, discovery)
        labels = set_labels(config)
        variables = dict(VARIABLES)
        if "ray_io_cluster" in labels:         # what the dashboard's Cluster variable filters on
            variables["$Cluster"] = re.escape(labels["ray_io_cluster"])
        prom = Prometheus(prom_bin, config, workdir)
        prom.wait_ready()
        print(f"prometheus up at {prom.url} with {PROMETHEUS_CONFIG_PATH.relative_to(ROOT)} (labels it sets: "
              f"{labels})", flush=True)

        start = time.time()
        run_workload(args, ctx.address_info["gcs_address"])
        time.sleep(3 * SCRAPE_INTERVAL_S)     # the last values reach the agent and get scraped
        end = time.time()
        if not prom.targets_up():
            print("warning: a scrape target is not up", file=sys.stderr)

        rows = check_queries(prom, start, end, variables)
        var_rows = check_variables(prom, start, end, labels)
        width = max(len(r[0]) for r in rows + var_rows) + 4
        for title, ref, status, n, detail in rows + var_rows:
            print(f"{status:8s} {title + ' ' + ref:{width}s} series={n} {detail}")
        for found, says in ((rows, "dashboard queries returned data"), (var_rows, "dashboard variables have values")):
            print(f"{sum(r[2] == 'DATA' for r in found)}/{len(found)} {says}", flush=True)

        if not args.no_screenshot:
            png = Path(args.png)
            exprs = [fill_variables(e, variables) for e in args.screenshot_expr] or SCREENSHOT_EXPRS
            screenshot(chromium, prom.graph_url(exprs, int(end - start) + 5), png, workdir,
                       size=f"1400,{max(1500, 750 * len(exprs))}")      # (a graph is ~700 px tall)
            print(f"screenshot of Prometheus' graph page ({'; '.join(exprs)}): {png}")
        return 0 if all(r[2] == "DATA" for r in rows + var_rows) else 1
    finally:
        if prom is not None:
            prom.stop()
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
