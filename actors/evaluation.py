"""Evaluation: play each task of the eval split once with the current weights, at the eval temperature,
without publishing anything; report success per task type and overall (and WebShop's score), the layout
of the paper's tables."""
from __future__ import annotations

import copy
from collections import defaultdict

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.rollout import RolloutActor
from common.config import ExperimentConfig
from common.processes.model_files import ModelSource
from common.processes.placement import actor_need, pinned_node
from common.stream.records import EpisodeGroup


def eval_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The rollout settings of an evaluation: eval split, eval temperature, one trajectory per task."""
    ev = copy.deepcopy(cfg)
    ev.env.train_split = cfg.env.eval_split
    ev.rollout.temperature = cfg.rollout.eval_temperature
    ev.rollout.group_size = 1
    ev.rollout.groups_per_actor = max(1, cfg.rollout.groups_per_actor * cfg.rollout.group_size)
    return ev


def episode_record(episode: EpisodeGroup) -> dict:
    """One episode of an evaluation (a group of one trajectory), JSON-ready, for comparing runs game by
    game. policy_version: the version of the weights that played it (its rows'; -1 without a row: ended at
    reset); should the rows disagree (weights pushed while it played), the oldest, and policy_version_max
    says up to which."""
    t = episode.trajectories[0]
    oldest, newest = episode.policy_versions
    record = {
        "task_id": str(episode.task_id), "task_type": t.task_type, "success": bool(t.success),
        "steps": t.num_steps, "return": float(t.episode_return), "score": float(t.score),
        "termination": t.termination.value, "policy_version": oldest,
    }
    if newest != oldest:
        record["policy_version_max"] = newest
    return record


def summarize(episodes: list[EpisodeGroup]) -> dict:
    """Success overall and per task type, mean steps, the share of valid responses (and WebShop's mean
    score), and `episodes_detail`: one `episode_record` per episode, in the order played."""
    trajectories = [e.trajectories[0] for e in episodes]
    per_type: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        per_type[t.task_type or "all"].append(t.success)
    n = max(len(trajectories), 1)
    steps = sum(e.num_rows for e in episodes)
    out = {
        "episodes": len(trajectories),
        "success": sum(t.success for t in trajectories) / n,
        "per_task_type": {k: sum(v) / len(v) for k, v in sorted(per_type.items())},
        "mean_steps": sum(t.num_steps for t in trajectories) / n,
        # Responses in the <think>/<action> format (actors.prompts.shared.parse_action), of all steps played.
        "valid_action_share": sum(int(e.rows["valid"].sum()) for e in episodes) / max(steps, 1),
    }
    if any(t.task_type == "webshop" for t in trajectories):     # (ALFWorld's score is its success: no column)
        out["score"] = sum(t.score for t in trajectories) / n
    out["episodes_detail"] = [episode_record(e) for e in episodes]
    return out


def evaluate_tasks(cfg: ExperimentConfig, inference_actors: list, log_dir: str = "",
                   model: ModelSource | None = None) -> dict:
    """Evaluate in a short-lived Ray actor (its env instances are freed afterwards); log_dir: its output
    goes to <log_dir>/eval.log; model: see `actors.rollout.Rollout`.

    The actor runs on a node that could run a rollout actor (where the env's data and settings are), the
    same one every time (`pinned_node`), so that evaluations of one run, and of runs on one cluster, are
    played on the same machine. It reserves nothing there (num_cpus=0): it mostly waits on inference and
    borrows the rollout actors' share, which it could otherwise wait for forever."""
    ev = eval_config(cfg)
    node_id = pinned_node(actor_need(cfg.rollout.cpus_per_actor, 0, cfg.rollout.resources))
    actor = RolloutActor.options(
        num_cpus=0, max_concurrency=1000,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(ev, "eval", inference_actors, None, log_dir=log_dir, model=model)
    try:
        task_ids = ray.get(actor.__ray_call__.remote(lambda self: list(self.task_ids)))
        if cfg.run.eval_episodes:
            task_ids = task_ids[: cfg.run.eval_episodes]
        episodes = ray.get(actor.play_tasks.remote(task_ids, cfg.run.seed))
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)
    return summarize(episodes)

