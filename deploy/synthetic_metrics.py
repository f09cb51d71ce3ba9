"""A synthetic workload that records every declared metric from Ray actors of each kind, with values
that follow from the tick number alone, so that a test (or `deploy/check_dashboard.py`) can check what
the scrape endpoint and Prometheus show without running the real planes.

Which kind records what is the same split the real planes use: rollout actors count env steps, tokens,
episodes and published groups; env pools count errors and restarts; inference actors report their
queue and served version; the learner reports the stream, lags, phases and learning figures (train
success: its last batch); the driver reports evaluation success.
"""
from __future__ import annotations

import time

import ray

from common.metrics import ActorMetrics

EMITTED_BY: dict[str, tuple[str, ...]] = {
    "rollout": ("env_steps", "generated_tokens", "episodes", "groups_published",
                "rollout_weight_wait_seconds", "generate_seconds"),
    "env_server": ("env_errors", "env_restarts"),
    "inference": ("inference_queue_depth", "policy_version"),
    "learner": ("groups_consumed", "groups_dropped", "learner_seconds", "stream_depth", "stream_lag_seconds",
                "policy_lag", "policy_version", "learner_loss", "learner_kl", "learner_entropy",
                "anchor_singleton_share", "anchor_large_share", "anchor_mean_size", "step_adv_nonzero_share",
                "adv_cosine_vs_grpo", "adv_sign_differs_share", "groups_all_success_share",
                "successful_episodes", "successful_episode_steps", "success_rate"),
    "driver": ("success_rate",),
}


def record_tick(m: ActorMetrics, tick: int) -> None:
    """Record one round of the metrics `m.kind` emits; tick counts from 1."""
    t = tick
    if m.kind == "rollout":
        m.inc("env_steps", 16)
        m.inc("generated_tokens", 16 * 40)
        m.inc("episodes", 2, termination="done")
        m.inc("episodes", 1, termination="max_steps")
        m.inc("groups_published", 1)
        m.inc("rollout_weight_wait_seconds", 0.25)
        m.observe("generate_seconds", 0.3)
    elif m.kind == "env_server":
        m.inc("env_errors", 1)
        m.inc("env_restarts", 1)
    elif m.kind == "inference":
        m.set("inference_queue_depth", 8 + t)
        m.set("policy_version", t)
    elif m.kind == "learner":
        m.inc("groups_consumed", 2)
        m.inc("groups_dropped", 1, reason="stale")
        m.inc("learner_seconds", 0.5, phase="wait_data")
        m.inc("learner_seconds", 2.0, phase="train")
        m.inc("learner_seconds", 0.25, phase="push_weights")
        m.set("stream_depth", 3)
        m.set("stream_lag_seconds", 1.5)
        m.set("policy_lag", 0, stat="min")
        m.set("policy_lag", 1.5, stat="mean")
        m.set("policy_lag", 3, stat="max")
        m.set("policy_version", t)
        m.set("learner_loss", 0.5 / t)
        m.set("learner_kl", 0.01 * t)
        m.set("learner_entropy", 2.0 - 0.01 * t)
        m.set("anchor_singleton_share", 0.4)
        m.set("anchor_large_share", 0.1)
        m.set("anchor_mean_size", 3.5)
        m.set("step_adv_nonzero_share", 0.6)
        m.set("adv_cosine_vs_grpo", 0.9)
        m.set("adv_sign_differs_share", 0.2)
        m.set("groups_all_success_share", 0.25)
        m.inc("successful_episodes", 2)
        m.inc("successful_episode_steps", 24)
        m.set("success_rate", min(1.0, 0.1 * t), split="train")
    elif m.kind == "driver":
        m.set("success_rate", 0.25, split="eval")


def expected_after(ticks: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the scrape must show after `ticks` rounds of every kind (actor id "0"), keyed by
    (exported sample name, sorted labels that matter)."""
    from common.metrics import exported_name
    want: dict = {}

    def put(name: str, kind: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted({"kind": kind, **labels}.items())))
        want[key] = value

    n = ticks
    put(exported_name("env_steps"), "rollout", 16 * n)
    put(exported_name("generated_tokens"), "rollout", 640 * n)
    put(exported_name("episodes"), "rollout", 2 * n, termination="done")
    put(exported_name("episodes"), "rollout", n, termination="max_steps")
    put(exported_name("groups_published"), "rollout", n)
    put(exported_name("rollout_weight_wait_seconds"), "rollout", 0.25 * n)
    put(exported_name("generate_seconds") + "_count", "rollout", n)
    put(exported_name("generate_seconds") + "_sum", "rollout", 0.3 * n)
    put(exported_name("success_rate"), "learner", min(1.0, 0.1 * n), split="train")
    put(exported_name("env_errors"), "env_server", n)
    put(exported_name("env_restarts"), "env_server", n)
    put(exported_name("inference_queue_depth"), "inference", 8 + n)
    put(exported_name("policy_version"), "inference", n)
    put(exported_name("groups_consumed"), "learner", 2 * n)
    put(exported_name("groups_dropped"), "learner", n, reason="stale")
    put(exported_name("learner_seconds"), "learner", 0.5 * n, phase="wait_data")
    put(exported_name("learner_seconds"), "learner", 2.0 * n, phase="train")
    put(exported_name("learner_seconds"), "learner", 0.25 * n, phase="push_weights")
    put(exported_name("stream_depth"), "learner", 3)
    put(exported_name("stream_lag_seconds"), "learner", 1.5)
    put(exported_name("policy_lag"), "learner", 0, stat="min")
    put(exported_name("policy_lag"), "learner", 1.5, stat="mean")
    put(exported_name("policy_lag"), "learner", 3, stat="max")
    put(exported_name("policy_version"), "learner", n)
    put(exported_name("learner_loss"), "learner", 0.5 / n)
    put(exported_name("learner_kl"), "learner", 0.01 * n)
    put(exported_name("learner_entropy"), "learner", 2.0 - 0.01 * n)
    put(exported_name("anchor_singleton_share"), "learner", 0.4)
    put(exported_name("anchor_large_share"), "learner", 0.1)
    put(exported_name("anchor_mean_size"), "learner", 3.5)
    put(exported_name("step_adv_nonzero_share"), "learner", 0.6)
    put(exported_name("adv_cosine_vs_grpo"), "learner", 0.9)
    put(exported_name("adv_sign_differs_share"), "learner", 0.2)
    put(exported_name("groups_all_success_share"), "learner", 0.25)
    put(exported_name("successful_episodes"), "learner", 2 * n)
    put(exported_name("successful_episode_steps"), "learner", 24 * n)
    put(exported_name("success_rate"), "driver", 0.25, split="eval")
    return want


@ray.remote(num_cpus=0)
class SyntheticActor:
    """Stands in for one actor of `kind`: records its metrics, one round per `tick`."""

    def __init__(self, kind: str, actor_id: str = "0"):
        self.metrics = ActorMetrics(kind, actor_id)
        self.ticks = 0

    def tick(self, rounds: int = 1) -> int:
        for _ in range(rounds):
            self.ticks += 1
            record_tick(self.metrics, self.ticks)
        return self.ticks


def start_actors() -> list:
    """One synthetic actor per kind."""
    return [SyntheticActor.remote(kind) for kind in EMITTED_BY]


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

