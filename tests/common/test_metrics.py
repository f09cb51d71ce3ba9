"""common/metrics.py: the declared metrics, the facade's checks, and the real export path: actors in a
local Ray record every metric, the node's metrics agent serves them, and a plain HTTP scrape finds each
one under its documented name with the values recorded."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from common.metrics import (ACTOR_KINDS, GAUGE_REFRESH_S, METRICS, ActorMetrics, exported_name, metrics_url,
                            metrics_urls, ray_init_metrics_options)
from deploy.tools import synthetic_metrics
from deploy.tools.synthetic_metrics import HISTOGRAM_VALUE_S, label_sets
from tests.support.scrape import parse_prometheus_text, scrape

REPO = Path(__file__).resolve().parents[2]
RAY_EVICTION_S = 20.0     # Ray 2.60 drops a gauge series this long after its last set (measured: ~20 s)


def expected_after(ticks: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the scrape must show after `ticks` rounds of every kind (actor id "0"), keyed by
    (exported sample name, sorted labels that matter): a histogram by its `_count` and `_sum`."""
    want: dict = {}
    for spec in METRICS.values():
        for kind in spec.recorded_by:
            for labels in label_sets(spec):
                key = tuple(sorted({"kind": kind, **labels}.items()))
                if spec.type == "histogram":
                    want[(spec.exported_name + "_count", key)] = ticks
                    want[(spec.exported_name + "_sum", key)] = HISTOGRAM_VALUE_S * ticks
                else:
                    want[(spec.exported_name, key)] = ticks
    return want


def test_every_metric_is_recorded_by_actor_kinds_and_by_the_synthetic_workload():
    for spec in METRICS.values():
        assert spec.recorded_by and set(spec.recorded_by) <= set(ACTOR_KINDS), spec.name
    recorded = {key[0].removesuffix("_count") for key in expected_after(1)}
    assert {spec.exported_name for spec in METRICS.values()} <= recorded


def test_exported_names_follow_ray_conventions():
    assert exported_name("env_steps") == "ray_gigpo_env_steps_total"
    assert exported_name("stream_depth") == "ray_gigpo_stream_depth"
    assert exported_name("generate_seconds") == "ray_gigpo_generate_seconds"
    for spec in METRICS.values():
        assert spec.doc and spec.exported_name.startswith("ray_gigpo_")


def test_bad_calls_are_clear_errors_even_outside_ray():
    m = ActorMetrics("learner", 0)
    with pytest.raises(KeyError, match="did you mean 'env_steps'"):
        m.inc("env_step", 1)
    with pytest.raises(TypeError, match="is a gauge: use .set"):
        m.inc("stream_depth", 1)
    with pytest.raises(ValueError, match="takes labels \\['phase'\\]"):
        m.inc("learner_seconds", 1.0)
    with pytest.raises(ValueError, match="is not one of"):
        m.inc("learner_seconds", 1.0, phase="sleeping")
    with pytest.raises(ValueError, match="only goes up"):
        m.inc("groups_consumed", -1)
    with pytest.raises(ValueError, match="recorded by rollout, not by a learner"):
        m.inc("env_steps", 1)
    with pytest.raises(ValueError, match="finite"):
        m.set("learner_loss", math.nan)
    with pytest.raises(TypeError, match="must be a number"):
        m.set("learner_loss", "0.5")
    with pytest.raises(ValueError, match="actor kind"):
        ActorMetrics("trainer", 0)
    with pytest.raises(TypeError, match="is a gauge"):
        m.zero("stream_depth")


def test_outside_ray_recording_is_a_noop():
    """In a fresh interpreter (this one may hold another test's Ray): recording without Ray does nothing
    and never starts Ray."""
    script = """
import ray
from common.metrics import ActorMetrics
m = ActorMetrics("rollout", 3)
m.inc("env_steps", 5)
m.inc("env_steps", 0)                  # zero steps in a tick is fine
m.observe("generate_seconds", 0.1)
learner = ActorMetrics("learner", 0)
learner.zero("groups_dropped", reason="stale")
learner.set("stream_depth", 2)
learner.inc("learner_seconds", 0.5, phase="train")
assert not ray.is_initialized()       # recording never starts Ray
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_parse_prometheus_text_unescapes_labels():
    text = ('# HELP x a\n# TYPE x gauge\n'
            'x{a="q\\"uote",b="back\\\\slash"} 1.5\n'
            'y_total 3 1700000000000\n')
    samples = parse_prometheus_text(text)
    assert samples[0].labels == {"a": 'q"uote', "b": "back\\slash"} and samples[0].value == 1.5
    assert samples[1].name == "y_total" and samples[1].value == 3.0
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_prometheus_text("this is not {prometheus")


@pytest.fixture(scope="module")
def metrics_ray():
    """A local Ray like conftest's local_ray, exporting metrics on a port its agent binds itself (and with a
    session directory of its own, removed after)."""
    import ray
    temp_dir = tempfile.mkdtemp(prefix="ray-metrics-")
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False,
             _temp_dir=temp_dir, **ray_init_metrics_options())
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# The labels our series carry besides Ray's: the kind, and every extra label a metric declares.
OUR_LABELS = {"kind"} | {label for spec in METRICS.values() for label in (spec.labels or {})}


def _relevant(samples, want_keys):
    """Our samples keyed like `expected_after` (kind + the metric's own labels; Ray's labels dropped)."""
    got = {}
    for s in samples:
        if not s.name.startswith("ray_gigpo_") or s.labels.get("actor_id") != "0":
            continue
        keep = {k: v for k, v in s.labels.items() if k in OUR_LABELS}
        got[(s.name, tuple(sorted(keep.items())))] = s.value
    return {k: v for k, v in got.items() if k in want_keys}, got


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_metric_is_scraped_from_ray_with_its_values(metrics_ray):
    import ray
    url = metrics_url()
    assert url in metrics_urls() and not url.endswith(":0/metrics")     # the port the agent bound, registered

    actors = synthetic_metrics.start_actors()
    ticks = ray.get([a.tick.remote(3) for a in actors])
    assert ticks == [3] * len(actors)
    want = expected_after(3)

    deadline = time.monotonic() + 60       # workers report every second (ray_init_metrics_options)
    while True:
        got, everything = _relevant(scrape(url), want)
        if len(got) == len(want) or time.monotonic() > deadline:
            break
        time.sleep(1)
    missing = sorted(set(want) - set(got))
    assert not missing, f"not scraped: {missing}"
    hist_sum = (exported_name("generate_seconds") + "_sum", (("kind", "rollout"),))
    for key, value in want.items():
        if key == hist_sum:
            # Ray's exporter reports a histogram's sum from its buckets (3 x 0.3 s counts as 3 x 0.375, the
            # middle of the (0.25, 0.5] bucket), so only the bucket's range is certain.
            assert 3 * 0.25 <= got[key] <= 3 * 0.5, got[key]
        else:
            assert got[key] == pytest.approx(value), key

    # Every declared metric is there under its documented name; histograms with buckets.
    names = {k[0] for k in everything}
    for spec in METRICS.values():
        base = spec.exported_name
        assert base in names or base + "_count" in names, base
    buckets = [s for s in scrape(url) if s.name == exported_name("generate_seconds") + "_bucket"
               and s.labels.get("le") == "0.5"]
    assert buckets and buckets[0].value == 3
    # Each series names the actor that recorded it, and Ray's session label is there for dashboards.
    sample = next(s for s in scrape(url) if s.name == exported_name("env_steps"))
    assert sample.labels["kind"] == "rollout" and sample.labels["actor_id"] == "0"
    assert sample.labels["SessionName"].startswith("session_")
    for a in actors:
        ray.kill(a)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_gauge_holds_its_value_between_slow_updates(metrics_ray):
    """Ray 2.60 evicts a gauge series ~20 s after its last set; a learner update can take longer than
    that (the paper's: ~90 s), so common.metrics re-records every gauge it set. Set once, the gauge must
    be scraped at every look for longer than Ray's eviction age."""
    import ray

    @ray.remote(num_cpus=0)
    class OneGauge:
        def set(self) -> None:
            from common.metrics import ActorMetrics
            ActorMetrics("learner", "gauge-test").set("policy_version", 7)

    actor = OneGauge.remote()
    ray.get(actor.set.remote())
    url = metrics_url()

    def value():
        return [s.value for s in scrape(url) if s.name == exported_name("policy_version")
                and s.labels.get("actor_id") == "gauge-test"]

    deadline = time.monotonic() + 30
    while not value() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert value() == [7]
    # Ray evicts an un-refreshed gauge ~20 s after its last set (RAY_EVICTION_S): watched for longer than
    # that plus a refresh round (GAUGE_REFRESH_S), the gauge must be there at every look.
    held_until = time.monotonic() + RAY_EVICTION_S + 5 * GAUGE_REFRESH_S
    while time.monotonic() < held_until:
        assert value() == [7]
        time.sleep(1)
    ray.kill(actor)


# Run in a fresh interpreter: it starts two Ray sessions one after the other, as a notebook or a test suite
# does; the module's own Ray (metrics_ray) stays out of it.
_TWO_SESSIONS = """
import shutil, tempfile, time
import ray
from common.metrics import ActorMetrics, exported_name, metrics_url, ray_init_metrics_options
from tests.support.scrape import scrape

def session():
    temp_dir = tempfile.mkdtemp(prefix="ray-metrics-")
    ray.init(address="local", num_cpus=1, object_store_memory=100 * 1024**2, include_dashboard=False,
             _temp_dir=temp_dir, **ray_init_metrics_options())
    return temp_dir

first = session()
ActorMetrics("learner", "driver-gauge").set("policy_version", 3)     # set in the driver process itself
ray.shutdown(); shutil.rmtree(first, ignore_errors=True)
second = session()

@ray.remote(num_cpus=0)
class Learner:
    def set(self):
        ActorMetrics("learner", "actor-gauge").set("policy_version", 2)

actor = Learner.remote(); ray.get(actor.set.remote())
url, seen = metrics_url(), set()
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        samples = scrape(url)
    except OSError:      # the new session's metrics agent is not listening yet
        samples = []
    seen |= {(s.labels["actor_id"], s.value) for s in samples if s.name == exported_name("policy_version")}
    if ("actor-gauge", 2.0) in seen and time.monotonic() > deadline - 20:
        break      # 10 s and more after the new session began: several of the driver's refresh rounds
    time.sleep(0.5)
print(sorted(seen))
ray.shutdown(); shutil.rmtree(second, ignore_errors=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_gauge_of_an_earlier_session_is_not_exported_into_the_next():
    """A process that set a gauge in one Ray session and then joins another (ray.init again) exports only
    what it sets in the new one: the refresher that holds gauges forgets the old session's values."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _TWO_SESSIONS], cwd=repo, capture_output=True, text=True,
                          timeout=170, env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[('actor-gauge', 2.0)]", proc.stdout
