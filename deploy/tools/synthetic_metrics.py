"""A synthetic workload: every declared metric recorded from a Ray actor of each kind that records it, with
values that follow from the tick alone (a counter adds 1 per label value, a gauge is the tick, a histogram
observes 0.3 s), so that tests and deploy/tools/check_dashboard.py can check the scrape without the real planes.
"""
from __future__ import annotations

import time

import ray

from common.metrics import ACTOR_KINDS, METRICS, ActorMetrics, MetricSpec

HISTOGRAM_VALUE_S = 0.3


def label_sets(spec: MetricSpec) -> list[dict[str, str]]:
    """Every labelling of `spec`'s series: {} without an extra label, else one per value of its label."""
    return [{label: value} for label, values in (spec.labels or {}).items() for value in values] or [{}]


@ray.remote(num_cpus=0)
class SyntheticActor:
    """Stands in for one actor of `kind`: records its metrics, one round per `tick` (counted from 1)."""

    def __init__(self, kind: str, actor_id: str = "0"):
        self.metrics = ActorMetrics(kind, actor_id)
        self.series = [(spec, labels) for spec in METRICS.values() if kind in spec.recorded_by
                       for labels in label_sets(spec)]
        self.ticks = 0

    def tick(self, rounds: int = 1) -> int:
        m = self.metrics
        for _ in range(rounds):
            self.ticks += 1
            for spec, labels in self.series:
                if spec.type == "counter":
                    m.inc(spec.name, 1, **labels)
                elif spec.type == "gauge":
                    m.set(spec.name, self.ticks, **labels)
                else:
                    m.observe(spec.name, HISTOGRAM_VALUE_S, **labels)
        return self.ticks


def start_actors() -> list:
    """One synthetic actor per kind."""
    return [SyntheticActor.remote(kind) for kind in ACTOR_KINDS]


def run(seconds: float, interval_s: float = 1.0) -> int:
    """Tick every kind once per `interval_s` for `seconds` (needs ray.init); returns the ticks done."""
    actors = start_actors()
    ticks = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ray.get([a.tick.remote() for a in actors])
        ticks += 1
        time.sleep(interval_s)
    for a in actors:
        ray.kill(a)
    return ticks

