"""The whole actor-learner system for one run, on a local Ray or a cluster.

    vLLM inference actors  <-- weights --  learner workers (DeepSpeed ZeRO)
            |                                     ^
      generate                                    |  episode groups (Redis stream)
            v                                     |
    rollout actors (env instances inside)  -------+

The driver (this module) starts every part, then runs one learner update per iteration: in async mode the
rollout actors play continuously and the learner trains on the complete groups the stream holds; in sync mode
(`run.sync=true`) they play one batch with the current weights first (less the groups the stream still holds
untrained: a resume's lost updates). Every iteration it logs metrics,
publishes the status for `gigpo status` and applies `gigpo scale` commands.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import ray
from tqdm import tqdm

from actors.evaluation import evaluate_tasks
from actors.inference import create_inference_actors, remove_made_weights_dirs, with_weights_dir
from actors.rollout import create_rollout_actor
from common.config import ExperimentConfig, inference_actor_limit, rollout_actor_limit, to_dict, with_fields
from common.metrics import ActorMetrics
from common.processes.log_files import Terminal, run_output
from common.processes.placement import PLACEMENT_TIMEOUT_S, job_needs, node_label, wait_placeable
from common.stream.redis_client import connect
from common.stream.redis_server import redis_for
from common.weights import shm_cleanup
from common.run_dir import (LEARNER_STATE, REDIS_DIR, eval_dir, eval_result_file,
                            is_complete_checkpoint, logs_dir, prepare_output_dir)
from common.stream.redis_stream import stream_key
from deploy.autoscale import Autoscale
from deploy.control_channel import ControlChannel, write_job_file
from deploy.inference_pool import INFERENCE_STOP_S, InferencePool
from deploy.learner_pool import STEP_TIMEOUT_S, LearnerPool
from deploy.preflight import PreflightError, check_rollout_nodes
from deploy.reports import (PlacementWatch, append_eval_record, eval_line, eval_records, first_evaluation,
                            format_eval, format_summary, status_record, trim_records_after, waiting_state)
from deploy.rollout_pool import ROLLOUT_STOP_S, RolloutPool
from deploy.run_lifecycle import RunLost, SignalTrap, link_ray_logs, lost_parts, start_ray, stop_ray
from deploy.run_model import eval_model, initial_model, ship_model
from deploy.tracking import Tracker
from learner.group_record import GroupRecorder

log = logging.getLogger("gigpo")

LOST_STOP_S = 10         # rollout or inference actors, after the run lost a part: their node may be gone with it
RATE_WINDOW = 8          # updates the progress bar's env steps/s is measured over
WAIT_FOR_DATA_S = 10.0   # the learner's wait for a batch, between which the driver handles commands and status


def wire(system: "System") -> tuple[RolloutPool, InferencePool, LearnerPool]:
    """The run's three pools of actors, bound to each other here and nowhere else. What each is given:

    | when                                                  | what runs                                                |
    |-------------------------------------------------------|----------------------------------------------------------|
    | a rollout actor starts (or `gigpo scale` adds one)    | `create_rollout_actor` with the serving inference actors,|
    |                                                       | the stream's URL and the run's model                     |
    | inference actors start (first, or `--inference` adds) | `create_inference_actors` from the run's actor config    |
    |                                                       | (its weights directory) and model                        |
    | the serving inference actors change                   | every learner rank takes them (rank 0 pushes its weights |
    |                                                       | to one that lacks them), then every rollout actor        |
    | a learner call waits (an update, a push)              | `System.while_updating`: lost rollout actors noticed,    |
    |                                                       | the status published                                     |

    The hooks read the system's fields when they run (its model and Redis exist only after `start` began)."""
    learners = LearnerPool()

    def new_rollout_actor(actor_id: str):
        return create_rollout_actor(system.cfg, actor_id, inference.serving, system.redis_url,
                                    log_dir=system.log_dir, model=system.model)

    def new_inference_actors(**options) -> list:
        return create_inference_actors(system.actor_cfg, system.model, log_dir=system.log_dir, **options)

    def serve_with(actors: list) -> dict:
        info = learners.call("set_inference_actors", actors, timeout_s=push_timeout_s(system.cfg),
                             on_wait=system.while_updating)
        rollouts.tell_inference(actors)
        return info or {}

    rollouts = RolloutPool(system.cfg, new_rollout_actor)
    inference = InferencePool(new_inference_actors, serve_with, system.cfg.inference.generate_timeout_s)
    return rollouts, inference, learners


def push_timeout_s(cfg: ExperimentConfig) -> float:
    """How long the learner ranks may take to push their weights to the inference actors (two transfers,
    the base model's and the adapters' at most, and a gather)."""
    return 2 * cfg.inference.transfer_timeout_s + 60


class System:
    """Starts, runs and stops every part of one training run (or of `gigpo eval`'s evaluation)."""

    def __init__(self, cfg: ExperimentConfig, log_dir: str = ""):
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir or logs_dir(cfg.run.output_dir)      # each actor's log file goes here
        self.terminal: Terminal | None = None     # where the bar and eval lines go (None: stdout/stderr)
        self.signals = SignalTrap()
        self.rollouts, self.inference, self.learners = wire(self)
        self.placement = PlacementWatch()
        self.model = None                   # the policy as every actor receives it (a ModelSource)
        self.actor_cfg = cfg                # what inference actors are created from (weights_dir set by start)
        self.redis = None                   # the embedded Redis (None: stream.redis_url names the user's)
        self.redis_url: str | None = None
        self.channel: ControlChannel | None = None
        self.tracker: Tracker | None = None
        self.groups_file: GroupRecorder | None = None     # groups.jsonl (`gigpo view`), written by this process
        self.autoscale: Autoscale | None = None     # autoscale.enabled: sizes the actors between updates
        self.driver_metrics = ActorMetrics("driver", cfg.run.name)
        self.update = 0                     # learner updates done (more than 0 after a resume)
        self.last_eval: dict | None = None
        self._last_metrics: dict = {}
        self._evals_started = False         # this run has written evals.jsonl (see evaluate)
        self._training = False              # start() of a training run (not `gigpo eval`) has begun
        self.finished = False               # every update of the run done and checkpointed (`train`)
        self._lost: list[str] = []          # what the run lost (see run_lifecycle.lost_parts), once it has ended

    # -- start and stop --------------------------------------------------------------------------------

    def start(self, eval_only: bool = False, scratch_dir: str = "") -> None:
        """Start every part. eval_only: inference actors and a read-only learner serving the resumed
        checkpoint, and nothing is written into run.output_dir (a run still training is not disturbed);
        a model the run lacks is built in `scratch_dir`, which the caller removes."""
        cfg = self.cfg
        t0 = time.perf_counter()
        self._training = not eval_only
        if not eval_only:      # another run's checkpoints: refused (deleted with run.overwrite) before anything starts
            prepare_output_dir(cfg)
        address = start_ray(cfg)
        self.signals.trap()           # again: ray.init replaced the SIGTERM handler
        link_ray_logs(self.log_dir)
        if not eval_only:             # the env's data on every node that may host rollout actors, not only here
            check_rollout_nodes(cfg)
        progress = self.terminal.err if self.terminal else None
        self.model_path = eval_model(cfg, scratch_dir) if eval_only else initial_model(cfg, progress)
        if eval_only:
            # The actors load exactly this model (the rollout side its tokenizer), whatever model.path says.
            self.cfg = cfg = with_fields(cfg, {"model.path": self.model_path})
        self.model = ship_model(cfg, self.model_path)
        if not eval_only:
            # The embedded Redis keeps its append-only file in the run's directory: a driver killed mid-run
            # leaves the stream's unacknowledged groups there, and the resumed run starts Redis from them (its
            # learner trains each exactly once). A new run starts it empty; a finished one removes it.
            if not cfg.run.resume:
                shutil.rmtree(self.out / REDIS_DIR, ignore_errors=True)
            self.redis_url, self.redis = redis_for(cfg.stream, data_dir=str(self.out / REDIS_DIR))
            self.channel = ControlChannel(connect(self.redis_url), cfg.stream.run_id or cfg.run.name)
            write_job_file(cfg.run.output_dir, cfg.run.name, self.redis_url, address, run_id=cfg.stream.run_id,
                           stream=stream_key(cfg.stream), max_actors=self.max_actors)

        # One weights directory for the run's inference actors, those `gigpo scale --inference` adds included.
        self.actor_cfg = with_weights_dir(cfg)
        self.inference.start()
        # Resources no node has would leave an actor pending forever: say which, before waiting on any (the
        # learner checks its own need).
        needs = job_needs(cfg)
        wait_placeable({"an inference actor": needs["inference actor"][0],
                        "a rollout actor": needs["rollout actor"][0]}, PLACEMENT_TIMEOUT_S, log=log)
        self.learners.start(cfg, self.model, self.redis_url, self.inference.serving, read_only=eval_only,
                            log_dir=self.log_dir)
        state = self.learners.state()
        if eval_only and state["policy_version"] > 0:
            # The inference actors must serve the checkpoint's weights (a training learner pushes its own).
            self.learners.call("sync_weights", timeout_s=push_timeout_s(cfg))
        self.update = state["updates"]
        if not eval_only:
            # A resumed run retrains the updates after its checkpoint: their lines of the lost run go, so that
            # every record continues from the checkpoint's update without a gap or a repeat.
            if cfg.run.resume:
                trim_records_after(self.out, self.update, restore=state.get("resumed_record"))
            self.tracker = Tracker(cfg.run.output_dir, cfg.run.name, to_dict(cfg), resume=cfg.run.resume)
            self.groups_file = GroupRecorder(cfg, resume=cfg.run.resume)
        self.rollouts.start(0 if eval_only else cfg.rollout.num_actors)
        if cfg.autoscale.enabled and not eval_only:
            self.autoscale = Autoscale(cfg, self.rollouts, self.inference, {role: n[0] for role, n in needs.items()},
                                       self.driver_metrics)
        log.info("system up in %.0fs: %d inference, %d learner, %d rollout actors; outputs in %s",
                 time.perf_counter() - t0, len(self.inference.serving), len(self.learners.ranks),
                 len(self.rollouts.live), self.out.resolve())
        placement = self.refresh_placement(timeout_s=10.0)
        log.info("placement: %s", "; ".join(f"{name} on {node_label(node)}" for name, node in placement.items()))
        if self.channel is not None:     # `gigpo status` shows the placement before the first update
            self._publish_status({"update": self.update, "policy_version": state["policy_version"]},
                                 state="started")

    def refresh_placement(self, timeout_s: float = 0.0) -> dict[str, dict | None]:
        """{actor name: its node, None while it has not started} for every actor of the run, in role order,
        waiting up to timeout_s for the answers (the learner's ranks reported theirs at start)."""
        serving = self.inference.serving + [actor for actor, _ in self.inference.starting]
        actors = {f"inference-{i}": actor for i, actor in enumerate(serving)} | self.rollouts.handles()
        learners = {f"learner-{rank}": node for rank, node in enumerate(self.learners.nodes)}
        return learners | self.placement.refresh(actors, timeout_s)

    def close(self) -> None:
        """Stop every part and leave nothing behind, whatever state the run is in (also after Ctrl-C or
        SIGTERM, and half-way through start()). Each step has a deadline; a step that fails is logged and
        the next one still runs. Another Ctrl-C or SIGTERM meanwhile is noted and ignored."""
        self.signals.closing = True
        # After a lost part, actors on a lost node wait for a restart that may never come: a short deadline.
        rollout_stop_s = LOST_STOP_S if self._lost else ROLLOUT_STOP_S
        inference_stop_s = LOST_STOP_S if self._lost else INFERENCE_STOP_S
        say = self._say_closing
        steps = [("rollout actors", lambda: self.rollouts.stop_all(rollout_stop_s, say)),
                 ("learners", lambda: self.learners.stop_all(say=say)),
                 ("inference actors", lambda: self.inference.stop_all(inference_stop_s, say)),
                 # (what killed engines noted in the config's weights directory; one made for this run goes whole)
                 ("engine shared memory", lambda: shm_cleanup.remove_noted_in(self.cfg.inference.weights_dir)),
                 ("weights directory", remove_made_weights_dirs),
                 ("autoscale's request for nodes", lambda: self.autoscale and self.autoscale.close()),
                 ("tracker", lambda: self.tracker and self.tracker.close()),
                 ("redis", self._close_redis)]
        took = []       # (part, seconds): where a slow close spent its time, in the driver's log
        try:
            for name, step in steps:
                t0 = time.monotonic()
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - the next parts must still be stopped
                    say("closing %s failed: %s", name, exc)
                took.append((name, time.monotonic() - t0))
            t0 = time.monotonic()
            stop_ray()
            took.append(("ray", time.monotonic() - t0))
            log.info("closed in %.1f s: %s", sum(s for _, s in took), ", ".join(f"{n} {s:.1f} s" for n, s in took))
        finally:
            self.redis, self.tracker = None, None
            self.signals.restore()

    def _close_redis(self) -> None:
        """Stop the embedded Redis; its directory in the run goes once the run has finished (a run that ended
        early keeps it: its resume continues the stream)."""
        if self.redis is None:
            return
        self.redis.stop(cleanup=True)
        if self.finished and self.redis.data_dir == str((self.out / REDIS_DIR).resolve()):
            shutil.rmtree(self.redis.data_dir, ignore_errors=True)

    def _say_closing(self, msg: str, *args) -> None:
        """A part that failed to stop: a warning, but only a log line after a lost part (expected then)."""
        (log.info if self._lost else log.warning)(msg, *args)

    def __enter__(self) -> "System":
        self.signals.trap()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        learner_node = None
        if self._training and isinstance(exc, Exception) and not isinstance(exc, RunLost):
            # Before close() stops everything: was the failure a part the run cannot go on without?
            try:
                self._lost = lost_parts(self.learners, self.redis, self.redis_url, failure=exc)
                nodes = self.learners.nodes
                if nodes and nodes[0]["node_id"] != ray.get_runtime_context().get_node_id():
                    learner_node = nodes[0]
            except Exception as check:  # noqa: BLE001 - the failure itself is what the user then gets
                log.info("could not check which parts of the run are lost: %s", check)
        self.close()
        if self.signals.stopped_by == signal.SIGTERM:
            raise SystemExit(128 + signal.SIGTERM) from None     # the usual exit status of a terminated job
        if self._lost:
            raise RunLost(self._lost, str(self.out), learner_node) from exc

    # -- the loop --------------------------------------------------------------------------------------

    def while_updating(self) -> None:
        """Every ON_WAIT_EVERY_S of a long update: notice lost rollout actors and say so in the status."""
        self.rollouts.check_alive(self.inference.serving)
        self._publish_waiting_status(updating=True)

    def _publish_waiting_status(self, updating: bool = False) -> None:
        if self.channel is not None:
            self._publish_status(self._last_metrics, state=waiting_state(self.rollouts, updating))

    def _between_updates(self) -> None:
        """Between updates: apply `gigpo scale` commands and autoscale's decisions, collect retired actors, let
        started ones join."""
        self._apply_commands()
        if self.autoscale is not None and self.autoscale.due():
            placement = self.refresh_placement()
            self.autoscale.tick(pending=sum(1 for name, node in placement.items()
                                            if node is None and not name.startswith("learner")))
        self.rollouts.reap_retired()
        self.inference.join_started()
        self.inference.reap_retired()

    @property
    def max_actors(self) -> dict[str, int]:
        return {"rollout": rollout_actor_limit(self.cfg), "inference": inference_actor_limit(self.cfg)}

    def _apply_commands(self) -> None:
        for command in self.channel.pop_commands():
            op, n = command.get("op"), command.get("num_actors")
            plane = {"scale_rollout": "rollout", "scale_inference": "inference"}.get(op)
            if plane and isinstance(n, int) and n > self.max_actors[plane]:
                # The channel is a boundary: `gigpo scale` checks too, but anyone with the stream's password
                # can write a command.
                log.warning("refusing to scale %s actors to %d: %s.max_actors' bound is %d", plane, n, plane,
                            self.max_actors[plane])
                continue
            elif op == "scale_rollout" and isinstance(n, int):
                log.info("scaling rollout actors %d -> %d", len(self.rollouts.live), n)
                self.rollouts.scale(max(0, n), drain=bool(command.get("drain", True)))
            elif op == "scale_inference" and isinstance(n, int) and n >= 1:
                have = len(self.inference.serving) + len(self.inference.starting)
                log.info("scaling inference actors %d -> %d", have, n)
                self.inference.scale(n)
            else:
                log.warning("ignoring unknown command %r", command)
                continue
            if self.autoscale is not None:      # it goes on from the counts a person set
                self.autoscale.controller.reset()

    def _publish_status(self, metrics: dict, state: str) -> None:
        self.channel.publish_status(status_record(
            self.cfg, state, metrics, self.last_eval, self.rollouts, self.inference, self.refresh_placement(),
            self.out, autoscale_line=self.autoscale.status() if self.autoscale is not None else ""))

    def train(self) -> list[dict]:
        cfg = self.cfg
        history: list[dict] = []
        prev = self.rollouts.stats()
        prev_t = time.perf_counter()
        # The bar's env steps/s is over RATE_WINDOW updates: the rollout side plays in bursts (it waits while
        # the stream is full), so one update's delta swings between 0 and twice the mean.
        samples = deque([(prev_t, prev.get("env_steps", 0.0))], maxlen=RATE_WINDOW + 1)
        terminal = self.terminal or Terminal(sys.stdout, sys.stderr)
        bar = terminal.bar = tqdm(initial=self.update, total=cfg.run.iterations, desc="training",
                                  unit="update", dynamic_ncols=True, file=terminal.err)
        while self.update < cfg.run.iterations:
            self._between_updates()
            if cfg.run.sync:
                # Only the rest of a batch: after a resume the stream may hold groups of lost updates, which
                # the learner trains first; more played now would wait a version and be stale (or, past the lag
                # bound, never be admitted).
                self.rollouts.play_one_batch(max(cfg.learner.groups_per_batch - self.learners.untrained_groups(), 0))
            done = None
            while done is None:
                self.rollouts.check_alive(self.inference.serving)
                t_call = time.monotonic()
                done = self.learners.call("step", WAIT_FOR_DATA_S, timeout_s=WAIT_FOR_DATA_S + STEP_TIMEOUT_S,
                                          on_wait=self.while_updating)
                if done is None:           # no full batch yet: stay responsive (scale commands, status)
                    if self.autoscale is not None:
                        self.autoscale.learner_waited(time.monotonic() - t_call)
                    self._between_updates()
                    self._publish_waiting_status()
            metrics, groups_record = done
            if self.autoscale is not None:
                self.autoscale.learner_waited(metrics.get("time/wait_data_s", 0.0))
            self.groups_file.write(groups_record)      # here, not on learner rank 0's node: `gigpo view`
            now = time.perf_counter()
            stats = self.rollouts.stats()
            dt = max(now - prev_t, 1e-9)
            delta = {k: stats.get(k, 0.0) - prev.get(k, 0.0) for k in stats}
            prev, prev_t = stats, now
            metrics.update({
                "rollout/env_steps_per_s": delta.get("env_steps", 0.0) / dt,
                "rollout/generated_tokens_per_s": delta.get("generated_tokens", 0.0) / dt,
                "rollout/env_steps_total": stats.get("env_steps", 0.0),
                "rollout/success_rate": (delta.get("successes", 0.0) / delta["trajectories"]
                                         if delta.get("trajectories") else metrics.get("batch/success_rate", 0.0)),
                "rollout/actors": float(len(self.rollouts.live)),
                "inference/actors": float(len(self.inference.serving)),
                "rollout/invalid_action_share": (delta.get("invalid_actions", 0.0) / delta["env_steps"]
                                                 if delta.get("env_steps") else 0.0),
            })
            if self.autoscale is not None:
                metrics.update(self.autoscale.figures())
            for plane in ("rollout", "inference"):
                self.driver_metrics.set("actors", metrics[f"{plane}/actors"], plane=plane)
            samples.append((now, stats.get("env_steps", 0.0)))
            (t_first, steps_first), (t_last, steps_last) = samples[0], samples[-1]
            steps_per_s = (steps_last - steps_first) / max(t_last - t_first, 1e-9)
            update = self.update = int(metrics["update"])
            if cfg.run.eval_every and update % cfg.run.eval_every == 0 and update < cfg.run.iterations:
                self.last_eval = self.evaluate(record=f"after update {update}")
                metrics.update({f"eval/{k}": v for k, v in self.last_eval.items() if isinstance(v, float)})
                terminal.print(eval_line(f"after update {update}", self.last_eval))
            metrics["rollout/actor_restarts"] = float(self.rollouts.restarts)
            self.tracker.log(metrics, step=update)
            history.append(metrics)
            self._last_metrics = metrics
            self._publish_status(metrics, state="training")
            bar.update(1)
            bar.set_postfix(success=f"{metrics.get('batch/success_rate', 0.0):.2f}",
                            steps_s=f"{steps_per_s:.1f}",
                            lag=f"{metrics.get('lag/policy_versions_mean', 0.0):.1f}")
        bar.close()
        terminal.bar = None
        return history

    # -- evaluation ------------------------------------------------------------------------------------

    def evaluate(self, split: str = "", record: str = "") -> dict:
        """Play the eval split (or `split`) once per task with the current weights. record: when it is
        ("before training", "after update 8", ...): the result is appended to <run.output_dir>/evals.jsonl
        under that label, with the update and the policy version that played it."""
        cfg = self.cfg
        if split and split != cfg.env.eval_split:
            cfg = with_fields(cfg, {"env.eval_split": split})
        result = evaluate_tasks(cfg, self.inference.serving, log_dir=self.log_dir, model=self.model)
        if self.autoscale is not None:
            self.autoscale.restart_window()
        if result.get("episodes"):
            self.driver_metrics.set("success_rate", float(result["success"]), split="eval")
        if record:
            line = {"when": record, "update": self.update, "split": cfg.env.eval_split,
                    "policy_version": ray.get(self.inference.serving[0].policy_version.remote()), **result}
            # Appended by a resumed run, started anew otherwise (as metrics.jsonl).
            append_eval_record(self.out, line, fresh=not (self._evals_started or self.cfg.run.resume))
            self._evals_started = True
        return result


def train(cfg: ExperimentConfig) -> dict:
    """`gigpo train`: start, evaluate, train, evaluate, print a summary (every log in <run.output_dir>/logs/)."""
    log_dir = logs_dir(cfg.run.output_dir)
    with run_output(log_dir) as terminal, System(cfg) as system:
        system.terminal = terminal
        terminal.print(f"run {cfg.run.name}: starting (logs in {log_dir})")
        system.start()
        if system.update == 0:
            before = system.evaluate(record="before training") if cfg.run.eval_every else None
            if before:
                terminal.print(eval_line("before training", before))
        else:          # a resumed run: the summary is measured from the run's first evaluation
            before = first_evaluation(system.out) if cfg.run.eval_every else None
            terminal.print(f"resumed at update {system.update}"
                           + (f"; {eval_line('before training', before)}" if before else ""))
            update = system.update       # an evaluation due there that the stopped run did not finish
            if (cfg.run.eval_every and update % cfg.run.eval_every == 0 and update < cfg.run.iterations
                    and not any(r.get("update") == update for r in eval_records(system.out))):
                terminal.print(eval_line(f"after update {update}", system.evaluate(record=f"after update {update}")))
        t0 = time.perf_counter()
        history = system.train()
        train_s = time.perf_counter() - t0
        system.learners.call("save_checkpoint", timeout_s=STEP_TIMEOUT_S)
        system.finished = True
        after = system.evaluate(record="after training") if cfg.run.eval_every else None
        if after:
            terminal.print(eval_line("after training", after))
        system._publish_status(history[-1] if history else {}, state="finished")
        stats = system.rollouts.stats()
        summary = {"ok": True, "updates": len(history), "train_s": train_s,
                   "env_steps": stats.get("env_steps", 0.0), "before": before, "after": after,
                   "eval_split": cfg.env.eval_split, "outputs": str(system.out.resolve())}
        terminal.print(format_summary(summary))
        return summary


def checkpoint_location(checkpoint: str) -> tuple[str, str]:
    """(run.output_dir, run.resume_tag) of a checkpoint directory <output_dir>/checkpoints/<tag>;
    FileNotFoundError when it is not a complete checkpoint, UntrustedCheckpoint when this user did not write it
    or it would not load weights-only (learner.safe_load.check_loadable)."""
    path = Path(checkpoint).resolve()
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint directory (no {LEARNER_STATE} in it); "
                                f"pass one of <run.output_dir>/checkpoints/update_*")
    from learner.safe_load import check_loadable
    check_loadable(path)
    return str(path.parent.parent), path.name


def evaluate_only(cfg: ExperimentConfig, checkpoint: str = "", splits: list[str] | None = None) -> dict:
    """`gigpo eval`: the weights of `checkpoint`, else of the latest checkpoint in run.output_dir, else the
    initial model, on each of `splits` (default: env.eval_split). The result, {"update", "policy_version",
    "splits": {split: summary}}, is printed in the paper's table layout and saved as
    <output_dir>/eval/update_<N>.json, its logs in <output_dir>/eval/logs/; nothing else in the run is touched."""
    splits = list(splits or [cfg.env.eval_split])
    output_dir, resume_tag = checkpoint_location(checkpoint) if checkpoint else (cfg.run.output_dir,
                                                                                 cfg.run.resume_tag)
    if not Path(output_dir).is_dir():
        raise PreflightError(f"no run to evaluate in {output_dir!r}: train one there first, or set "
                             f"run.output_dir (or --checkpoint) to a run's directory")
    # The run's actors may be reading a configured weights directory: publish to a private one inside it.
    shared_dir = cfg.inference.weights_dir
    own_dir = os.path.join(shared_dir, f"eval-{os.getpid()}-{int(time.time())}") if shared_dir else ""
    cfg = with_fields(cfg, {"run.resume": True, "run.output_dir": output_dir, "run.resume_tag": resume_tag,
                            "inference.weights_dir": own_dir})
    eval_logs = logs_dir(eval_dir(output_dir))
    scratch = tempfile.mkdtemp(prefix="gigpo-eval-")
    try:
        with run_output(eval_logs) as terminal, System(cfg, log_dir=eval_logs) as system:
            system.terminal = terminal
            system.start(eval_only=True, scratch_dir=scratch)
            served = ray.get(system.inference.serving[0].policy_version.remote())
            result = {"update": system.update, "policy_version": served, "splits": {}}
            for split in splits:
                result["splits"][split] = system.evaluate(split)
                terminal.print(eval_line(f"({split})", result["splits"][split]))
            path = eval_result_file(output_dir, result["update"])
            path.write_text(json.dumps(result, indent=2))
            terminal.print(format_eval(f"update {result['update']} (policy version {served})", result["splits"]))
            terminal.print(f"saved to {path}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    return result
