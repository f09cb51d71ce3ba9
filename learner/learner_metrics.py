"""The learner's Prometheus metrics (declared in common/metrics.py): what an update, or a wait that brought no
batch, adds. Rank 0 alone records them (its phases are the learner's); outside Ray every call is a no-op."""
from __future__ import annotations

import time

import numpy as np

from common.metrics import METRICS, ActorMetrics

# The gauges set from an update's metrics (MetricSpec.update_key; the learner's own, not inference's or driver's).
UPDATE_GAUGES = [spec for spec in METRICS.values()
                 if spec.type == "gauge" and spec.update_key and "learner" in spec.recorded_by]
# The drops counted in the trajectory source's stats, {reason: stats key}, as groups_dropped declares them.
STREAM_DROPS = {labels["reason"]: key.removeprefix("stream/")
                for labels, key in METRICS["groups_dropped"].update_keys if key.startswith("stream/")}


class LearnerMetrics(ActorMetrics):
    def __init__(self, rank: int, stream):
        """`stream`: rank 0's trajectory source (None: groups come through `Learner.step(groups)`)."""
        super().__init__("learner", rank)
        self.stream = stream
        self._stream_stats_seen: dict[str, int] = {}    # stream.stats at the last report (for deltas)
        for reason in ("stale", "duplicate", "dead_letter", "dynamic_sampling"):
            self.zero("groups_dropped", reason=reason)

    def record_update(self, metrics: dict[str, float], groups: list, received: list | None,
                      skipped_ids: list[str]) -> None:
        """One update: the metrics `Learner.step` returns, its groups, the stream entries they came in (None:
        given to step), the ids of the groups dynamic sampling skipped."""
        wait_s, push_s = metrics["time/wait_data_s"], metrics["time/push_weights_s"]
        self.inc("learner_seconds", wait_s, phase="wait_data")
        self.inc("learner_seconds", push_s, phase="push_weights")
        # Everything else of the step is the learner's own work: batching, training, checkpointing.
        self.inc("learner_seconds", max(metrics["time/step_s"] - wait_s - push_s, 0.0), phase="train")
        self.inc("groups_consumed", len(groups))
        self.inc("groups_dropped", len(skipped_ids), reason="dynamic_sampling")
        # Counters that can stay at 0 for long: zero() makes their series exist from the first update on.
        for name, key, labels in (("groups_dropped", "batch/groups_dropped_env_error", {"reason": "env_error"}),
                                  ("successful_episodes", "diag/successful_trajectories", {}),
                                  ("successful_episode_steps", "diag/successful_trajectory_steps", {})):
            if metrics.get(key):
                self.inc(name, metrics[key], **labels)
            else:
                self.zero(name, **labels)
        for spec in UPDATE_GAUGES:
            for labels, key in spec.update_keys:
                value = metrics.get(key)
                # Absent (no KL term when learner.kl_coef=0; no anchors for GRPO; no lag without versions) or
                # NaN (nothing trained): the gauge keeps its last value rather than showing a made-up one.
                if value is not None and np.isfinite(value):
                    self.set(spec.name, value, **labels)
        self._record_stream(received)

    def record_no_batch(self, waited_s: float) -> None:
        """A step that found no full batch: the time waited is still spent."""
        self.inc("learner_seconds", waited_s, phase="wait_data")
        self._record_stream(None)

    def _record_stream(self, received: list | None) -> None:
        """Stream depth, the lag of the last read, and drops the source counted since the last report."""
        if self.stream is None:
            return
        stats = dict(self.stream.stats)
        for reason, key in STREAM_DROPS.items():
            self.inc("groups_dropped", stats.get(key, 0) - self._stream_stats_seen.get(key, 0), reason=reason)
        self._stream_stats_seen = stats
        self.set("stream_depth", self.stream.depth())
        if received:
            # A Redis stream entry id starts with the publish time in ms (the Redis server's clock).
            published = [int(r.entry_id.split("-", 1)[0]) / 1000.0 for r in received]
            self.set("stream_lag_seconds", max(0.0, time.time() - min(published)))
