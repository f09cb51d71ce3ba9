"""The whole actor-learner system for one run, on a local Ray or a cluster.

    vLLM inference actors  <-- weights --  learner workers (DeepSpeed ZeRO)
            |                                     ^
      generate                                    |  episode groups (Redis stream)
            v                                     |
    rollout actors (env instances inside)  -------+

The driver (this module) starts every part, then loops: one learner update per iteration; in async mode
(the default) the rollout actors play continuously and the learner trains on whatever complete groups the
stream holds (dropping those older than `stream.max_policy_lag` versions); in sync mode (`run.sync=true`,
the reference's schedule) the rollout actors play exactly one batch with the current weights, then the
learner trains on it. Every iteration it logs metrics (TensorBoard + metrics.jsonl), publishes a status
record for `gigpo status`, and applies `gigpo scale` commands.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path

import ray

from common.config import ExperimentConfig, to_dict

log = logging.getLogger("gigpo")


def start_ray(cfg: ExperimentConfig) -> str:
    """Connect to `run.ray_address` / RAY_ADDRESS, or start a local Ray sized for this machine."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")
    env = {"env_vars": {k: v for k, v in os.environ.items()
                        if k.startswith(("DS_", "VLLM_", "HF_", "TOKENIZERS_", "ALFWORLD_", "WEBSHOP_",
                                         "TORCH_EXTENSIONS_DIR", "PYTHONPATH", "OMP_NUM_THREADS"))}}
    if address:
        ray.init(address=address, runtime_env=env, namespace="gigpo", log_to_driver=True)
    else:
        from common.metrics import ray_init_metrics_options
        ray.init(address="local", num_cpus=os.cpu_count() or 1, runtime_env=env, namespace="gigpo",
                 object_store_memory=200 * 1024**2, include_dashboard=False, **ray_init_metrics_options())
    return ray.get_runtime_context().gcs_address


class System:
    """Starts, runs and stops every part of one training run."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.redis = None
        self.rollouts: dict[str, object] = {}       # actor id -> handle
        self.rollout_runs: dict[str, object] = {}   # actor id -> ObjectRef of its run() (async mode)
        self.retiring: dict[str, tuple] = {}        # actor id -> (handle, ObjectRef of its stop())
        self._next_rollout = 0
        self.inference: list = []
        self.learners: list = []
        self.tracker = None
        self.channel = None
        self.last_eval: dict | None = None
        self._rollout_totals: dict[str, dict] = {}

    # -- start and stop --------------------------------------------------------------------------------

    def start(self, eval_only: bool = False) -> None:
        """Start every part. eval_only: inference actors and a read-only learner that serves the resumed
        checkpoint, nothing else; nothing is written into run.output_dir (no job file, no logs), so a
        run that is still training is not disturbed."""
        from common.redis_server import connect, redis_for
        from common.tiny_model import resolve_model_path
        from deploy.control import ControlChannel, write_job_file
        from deploy.tracking import Tracker

        cfg = self.cfg
        t0 = time.perf_counter()
        from common.cpu_placement import parse_cpu_list
        for name in ("learner_cpus", "rollout_cpus"):      # a typo fails here, not later inside an actor
            try:
                parse_cpu_list(getattr(cfg.run, name))
            except ValueError as exc:
                raise ValueError(f"run.{name}: {exc}") from None
        address = start_ray(cfg)
        self.model_path = resolve_model_path(cfg.model.path, cfg.run.output_dir)
        if cfg.model.warm_start_steps > 0:    # supervised warm start on training walkthroughs (cached)
            from deploy.warm_start import warm_start
            self.model_path = warm_start(cfg, self.model_path)
        self.redis_url = None
        if not eval_only:
            self.redis_url, self.redis = redis_for(cfg.stream)
            self.channel = ControlChannel(connect(self.redis_url), cfg.run.name)
            write_job_file(cfg.run.output_dir, cfg.run.name, self.redis_url, address)
            self.tracker = Tracker(cfg.run.output_dir, cfg.run.name, to_dict(cfg))

        from actors.inference import create_inference_actors
        from learner.actor import create_learner_workers
        self.inference = create_inference_actors(to_dict(cfg), self.model_path)
        self.learners = create_learner_workers(cfg, self.model_path, self.redis_url, self.inference,
                                               read_only=eval_only)
        state = ray.get(self.learners[0].state.remote())
        if state["policy_version"] > 0:
            # Resumed: the inference actors must serve the checkpoint's weights, not the initial ones.
            ray.get([w.sync_weights.remote() for w in self.learners])
        self.update = state["updates"]       # learner updates done (more than 0 after a resume)
        self.scale_rollout(0 if eval_only else cfg.rollout.num_actors)
        log.info("system up in %.0fs: %d inference, %d learner, %d rollout actors; outputs in %s",
                 time.perf_counter() - t0, len(self.inference), len(self.learners), len(self.rollouts),
                 self.out.resolve())

    def close(self) -> None:
        self.scale_rollout(0, drain=False)
        self.reap_retired(timeout_s=60)
        for worker in self.learners:
            try:
                ray.get(worker.close.remote())
            except Exception as exc:          # a dead learner has nothing left to save
                log.warning("learner close failed: %s", exc)
        for actor in self.inference:
            ray.kill(actor)
        if self.tracker is not None:
            self.tracker.close()
        if self.redis is not None:
            self.redis.stop()
        if ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> "System":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- rollout actors --------------------------------------------------------------------------------

    def scale_rollout(self, num_actors: int, drain: bool = True) -> None:
        """Add or remove rollout actors. A removed actor finishes (drain) or discards its in-flight groups;
        a group is never half-published either way. Draining runs in the background (its last groups may
        wait for room in the stream, which the learner keeps making); `reap_retired` collects it."""
        from actors.rollout import create_rollout_actor
        while len(self.rollouts) < num_actors:
            actor_id = f"rollout-{self._next_rollout}"
            self._next_rollout += 1
            actor = create_rollout_actor(to_dict(self.cfg), actor_id, self.inference, self.redis_url)
            self.rollouts[actor_id] = actor
            if not self.cfg.run.sync:
                self.rollout_runs[actor_id] = actor.run.remote()
        while len(self.rollouts) > num_actors:
            actor_id = list(self.rollouts)[-1]
            actor = self.rollouts.pop(actor_id)
            self.rollout_runs.pop(actor_id, None)
            self.retiring[actor_id] = (actor, actor.stop.remote(drain=drain))

    def reap_retired(self, timeout_s: float = 0.0) -> None:
        """Collect the retiring actors whose stop() has returned (waiting up to timeout_s for them)."""
        for actor_id, (actor, stop_ref) in list(self.retiring.items()):
            done, _ = ray.wait([stop_ref], timeout=timeout_s)
            if not done:
                continue
            del self.retiring[actor_id]
            try:
                self._rollout_totals[actor_id] = ray.get(stop_ref)
                ray.get(actor.close.remote(), timeout=60)
            except Exception as exc:
                log.warning("rollout actor %s did not stop cleanly: %s", actor_id, exc)
            ray.kill(actor)

    def rollout_stats(self) -> dict:
        """Totals over live, retiring and removed rollout actors."""
        handles = list(self.rollouts.values()) + [a for a, _ in self.retiring.values()]
        refs = [a.stats.remote() for a in handles]
        # An actor still waiting for CPUs (or starting) cannot answer yet: count it next time.
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=10.0)
        if waiting:
            log.warning("%d rollout actor(s) not started yet (waiting for free CPUs? see `ray status`)",
                        len(waiting))
        total: dict = defaultdict(float)
        for stats in ray.get(ready) + list(self._rollout_totals.values()):
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] += value
        return dict(total)

    # -- the loop --------------------------------------------------------------------------------------

    def _collect_sync_batch(self) -> None:
        """Sync mode: the rollout actors play exactly one batch of groups with the current weights."""
        b, n = self.cfg.learner.groups_per_batch, len(self.rollouts)
        shares = [b // n + (1 if i < b % n else 0) for i in range(n)]
        ray.get([a.run.remote(max_groups=k) for a, k in zip(self.rollouts.values(), shares) if k > 0])

    def train(self) -> list[dict]:
        from learner.actor import step_learner
        from tqdm import tqdm
        cfg = self.cfg
        history: list[dict] = []
        prev = self.rollout_stats()
        prev_t = time.perf_counter()
        bar = tqdm(initial=self.update, total=cfg.run.iterations, desc="training", unit="update",
                   dynamic_ncols=True)
        while self.update < cfg.run.iterations:
            self._apply_commands()
            self.reap_retired()
            if cfg.run.sync:
                self._collect_sync_batch()
            metrics = None
            while metrics is None:
                self._check_rollouts_alive()
                metrics = step_learner(self.learners, timeout_s=60.0)
            now = time.perf_counter()
            stats = self.rollout_stats()
            dt = max(now - prev_t, 1e-9)
            delta = {k: stats.get(k, 0.0) - prev.get(k, 0.0) for k in stats}
            prev, prev_t = stats, now
            metrics.update({
                "rollout/env_steps_per_s": delta.get("env_steps", 0.0) / dt,
                "rollout/generated_tokens_per_s": delta.get("generated_tokens", 0.0) / dt,
                "rollout/env_steps_total": stats.get("env_steps", 0.0),
                "rollout/success_rate": (delta.get("successes", 0.0) / delta["trajectories"]
                                         if delta.get("trajectories") else metrics.get("batch/success_rate", 0.0)),
                "rollout/actors": float(len(self.rollouts)),
                "rollout/invalid_action_share": (delta.get("invalid_actions", 0.0) / delta["env_steps"]
                                                 if delta.get("env_steps") else 0.0),
            })
            update = self.update = int(metrics["update"])
            if cfg.run.eval_every and update % cfg.run.eval_every == 0 and update < cfg.run.iterations:
                self.last_eval = self.evaluate()
                metrics.update({f"eval/{k}": v for k, v in self.last_eval.items() if isinstance(v, float)})
            self.tracker.log(metrics, step=update)
            history.append(metrics)
            self._publish_status(metrics, state="training")
            bar.update(1)
            bar.set_postfix(success=f"{metrics.get('batch/success_rate', 0.0):.2f}",
                            steps_s=f"{metrics['rollout/env_steps_per_s']:.1f}",
                            lag=f"{metrics.get('lag/policy_versions_mean', 0.0):.1f}")
        bar.close()
        return history

    def _check_rollouts_alive(self) -> None:
        for actor_id, ref in list(self.rollout_runs.items()):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(done[0])
                    raise RuntimeError(f"rollout actor {actor_id} stopped unexpectedly")
                except ray.exceptions.RayError as exc:
                    raise RuntimeError(f"rollout actor {actor_id} failed: {exc}") from exc

    def _apply_commands(self) -> None:
        for command in self.channel.pop_commands():
            if command.get("op") == "scale_rollout" and isinstance(command.get("num_actors"), int):
                log.info("scaling rollout actors %d -> %d", len(self.rollouts), command["num_actors"])
                self.scale_rollout(max(0, command["num_actors"]), drain=bool(command.get("drain", True)))
            else:
                log.warning("ignoring unknown command %r", command)

    def _publish_status(self, metrics: dict, state: str) -> None:
        ev = self.last_eval or {}
        self.channel.publish_status({
            "run": self.cfg.run.name, "state": state, "iteration": int(metrics.get("update", 0)),
            "iterations": self.cfg.run.iterations, "policy_version": int(metrics.get("policy_version", 0)),
            "rollout_actors": len(self.rollouts), "inference_actors": len(self.inference),
            "env_instances": len(self.rollouts) * self.cfg.rollout.groups_per_actor * self.cfg.rollout.group_size,
            "env_steps_per_s": metrics.get("rollout/env_steps_per_s", 0.0),
            "tokens_per_s": metrics.get("rollout/generated_tokens_per_s", 0.0),
            "groups_per_s": self.cfg.learner.groups_per_batch / max(
                sum(metrics.get(k, 0.0) for k in ("time/wait_data_s", "time/train_s", "time/push_weights_s")), 1e-9),
            "stream_depth": int(metrics.get("stream/depth", 0)),
            "policy_lag_min": int(metrics.get("lag/policy_versions_min", 0)),
            "policy_lag_avg": metrics.get("lag/policy_versions_mean", 0.0),
            "policy_lag_max": int(metrics.get("lag/policy_versions_max", 0)),
            "dropped_stale": int(metrics.get("stream/dropped_stale", 0)),
            "learner_wait_s": metrics.get("time/wait_data_s", 0.0),
            "learner_train_s": metrics.get("time/train_s", 0.0),
            "learner_push_s": metrics.get("time/push_weights_s", 0.0),
            "success_rate": metrics.get("rollout/success_rate", 0.0),
            "eval_success": f"{ev['success']:.2f}" if "success" in ev else "n/a",
            "outputs": str(self.out.resolve()),
        })

    # -- evaluation ------------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """Play the eval split once per task (group size 1, eval temperature) with the current weights."""
        from actors.evaluation import evaluate_tasks
        from common.metrics import ActorMetrics
        result = evaluate_tasks(self.cfg, self.inference)
        if result.get("episodes"):
            ActorMetrics("driver", self.cfg.run.name).set("success_rate", float(result["success"]), split="eval")
        return result


def train(cfg: ExperimentConfig) -> dict:
    """`gigpo train`: start, evaluate, train, evaluate, print a summary."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with System(cfg) as system:
        system.start()
        before = system.evaluate() if cfg.run.eval_every else None
        if before:
            print(format_eval("before training", before), flush=True)
        t0 = time.perf_counter()
        history = system.train()
        train_s = time.perf_counter() - t0
        ray.get([w.save_checkpoint.remote() for w in system.learners])
        after = system.evaluate() if cfg.run.eval_every else None
        system._publish_status(history[-1] if history else {}, state="finished")
        stats = system.rollout_stats()
        summary = {"ok": True, "updates": len(history), "train_s": train_s,
                   "env_steps": stats.get("env_steps", 0.0), "before": before, "after": after,
                   "outputs": str(system.out.resolve())}
        print(format_summary(summary), flush=True)
        return summary


def checkpoint_location(checkpoint: str) -> tuple[str, str]:
    """(run.output_dir, run.resume_tag) of a checkpoint directory <output_dir>/checkpoints/<tag>; raises
    FileNotFoundError when `checkpoint` is not a complete checkpoint written by the learner."""
    from learner.trainer import LEARNER_STATE, is_complete_checkpoint   # (torch: only when one is named)

    path = Path(checkpoint).resolve()
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint directory (no {LEARNER_STATE} in it); "
                                f"pass one of <run.output_dir>/checkpoints/update_*")
    return str(path.parent.parent), path.name


def evaluate_only(cfg: ExperimentConfig, checkpoint: str = "") -> dict:
    """`gigpo eval`: the weights of `checkpoint` (a checkpoint directory), else of the latest checkpoint
    in run.output_dir, else the initial model. The result, with the update and policy version evaluated,
    is printed and saved as <output_dir>/eval/update_<N>.json; nothing else in the run is touched (it may
    still be training)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg.run.resume = True
    if checkpoint:
        cfg.run.output_dir, cfg.run.resume_tag = checkpoint_location(checkpoint)
    shared_dir = cfg.inference.weights_dir
    if shared_dir:      # the run's actors may be reading this directory: publish to a private one inside it
        cfg.inference.weights_dir = os.path.join(shared_dir, f"eval-{os.getpid()}-{int(time.time())}")
    try:
        with System(cfg) as system:
            system.start(eval_only=True)
            served = ray.get(system.inference[0].policy_version.remote())
            result = {**system.evaluate(), "update": system.update, "policy_version": served}
    finally:
        if shared_dir:
            shutil.rmtree(cfg.inference.weights_dir, ignore_errors=True)
    path = Path(cfg.run.output_dir) / "eval" / f"update_{result['update']:07d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(format_eval(f"evaluation ({cfg.env.eval_split}) of update {result['update']}", result), flush=True)
    print(f"saved to {path}", flush=True)
    return result


def format_eval(title: str, result: dict) -> str:
    """The paper's table layout: success per task type and overall (WebShop: score and success)."""
    lines = [f"== {title}: {result.get('episodes', 0)} episodes"]
    per_type = result.get("per_task_type", {})
    if per_type:
        names = sorted(per_type)
        lines.append(" | ".join(f"{n[:12]:>12}" for n in names) + " |          All")
        lines.append(" | ".join(f"{100 * per_type[n]:12.1f}" for n in names) + f" | {100 * result['success']:12.1f}")
    else:
        lines.append(f"success {100 * result.get('success', 0.0):.1f}%")
    if "score" in result:
        lines.append(f"score {100 * result['score']:.1f}")
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = ["", "=" * 72, f"trained {summary['updates']} updates in {summary['train_s'] / 60:.1f} min, "
             f"{summary['env_steps']:.0f} env steps"]
    if summary.get("before") and summary.get("after"):
        b, a = summary["before"]["success"], summary["after"]["success"]
        lines.append(f"success before {100 * b:.1f}%  ->  after {100 * a:.1f}%   ({100 * (a - b):+.1f} points)")
        lines.append(format_eval("after training", summary["after"]))
    lines.append(f"outputs: {summary['outputs']} (tensorboard --logdir {summary['outputs']}/tensorboard)")
    lines.append("=" * 72)
    return "\n".join(lines)

