"""The rollout actor: plays episode groups against its env instances and publishes them to the stream.

    actor = create_rollout_actor(cfg, "rollout-0", inference_actors, stream_url, model=model)
    done = actor.run.remote()            # runs until stop(); returns stats()
    ray.get(actor.stop.remote(drain=True))

One episode group = N trajectories of one task, reset with the same task id and seed, on its own N env
instances; the actor runs `rollout.groups_per_actor` groups at once in one asyncio loop, so while one
trajectory waits for its environment (EnvPool worker processes, awaited as futures) the others generate
(the inference actors batch concurrent requests). A group is published only when all its trajectories have
ended, as one stream entry, so a consumer never sees half a group. Each step's prompt and the action in
its response: actors/prompts/.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections import Counter

import ray

from actors.prompts.shared import build_user_message, parse_action, prompt_token_ids, response_regex
from common.config import ExperimentConfig, RolloutConfig
from common.metrics import ActorMetrics
from common.processes.cpu_placement import place_this_process
from common.processes.log_files import send_output_to
from common.processes.model_files import ModelSource
from common.processes.placement import this_node
from common.processes.process_env import apply_project_env
from common.seeds import stable_seed
from common.staleness import policy_lag_bound
from common.stream.interface import InMemoryTrajectories, TrajectorySink
from common.stream.records import EpisodeGroup, StepRow, Termination, Trajectory

log = logging.getLogger(__name__)

# Errors after which a request is retried (on another inference actor when there is one).
_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Rollout:
    """The actor's body (a plain class so that tests and benches can also drive it in-process)."""

    def __init__(self, cfg: ExperimentConfig, actor_id: str, inference_actors: list,
                 trajectories: str | TrajectorySink | None, cpus: str = "", nice: int = 0, log_dir: str = "",
                 model: ModelSource | None = None):
        """trajectories: where finished groups go (common.stream.interface.TrajectorySink): a Redis URL (the run's
        stream) or the sink itself; None: an in-memory one (`self.stream`, for tests and benches).
        model: where the tokenizer comes from (a ModelSource shipped by the driver, which this node may not
        see on disk); None: model.path as this node sees it (in-process use on one node)."""
        apply_project_env()     # vLLM's, DeepSpeed's, ... variables first
        send_output_to(log_dir, actor_id)    # <log_dir>/<actor_id>.log, before env workers inherit the fds
        place_this_process(cpus, nice)    # run.rollout_cpus / rollout_nice, before env workers are forked
        self.cfg = cfg
        self.actor_id = actor_id
        self.set_inference_actors(inference_actors)
        from transformers import AutoTokenizer
        if model is None:
            if self.cfg.model.path == "tiny":
                raise ValueError('model.path "tiny" is built by the driver: pass the built model as `model`')
            model = ModelSource(self.cfg.model.path)
        # Never built here: a node without the driver's output directory would build another model.
        self.model_path = model.local_path(weights=False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

        self.num_instances = self.cfg.rollout.groups_per_actor * self.cfg.rollout.group_size
        from env_servers.server import EnvPool
        self._env_pool = EnvPool(self.cfg.env, self.num_instances, seed=self.cfg.run.seed, metrics_id=actor_id)
        self.task_ids = self._env_pool.task_ids(self.cfg.env.train_split)
        if not self.task_ids:
            raise ValueError(f"env {self.cfg.env.name!r} has no tasks in split {self.cfg.env.train_split!r}")

        if isinstance(trajectories, str) and trajectories:
            from common.stream.redis_stream import TrajectoryStream
            trajectories = TrajectoryStream(trajectories, self.cfg.stream, consumer_name=f"producer-{actor_id}",
                                            lag_bound=policy_lag_bound(self.cfg))
        self.stream: TrajectorySink = trajectories or InMemoryTrajectories()
        self._rng = random.Random(stable_seed(self.cfg.run.seed, actor_id))
        self._stopping, self._drain = False, True
        self._running: asyncio.Future | None = None
        self._group_tasks: set[asyncio.Task] = set()
        self._admitted: set[str] = set()        # the stream's slots of the groups being played (renewed)
        self._started = 0.0
        self.counters: Counter = Counter()
        self.terminations: Counter = Counter()
        # Summed over concurrent trajectories (so they can exceed wall_s); weight_wait_s is the part of
        # gen_wait_s spent paused by weight updates.
        self.timers = {"gen_wait_s": 0.0, "weight_wait_s": 0.0, "admission_wait_s": 0.0, "env_wait_s": 0.0}
        self._wall_total = 0.0
        self.metrics = ActorMetrics("rollout", actor_id)
        # Series that may stay at 0 for a whole run exist from the start (the dashboard shows 0, not no data).
        self.metrics.zero("rollout_weight_wait_seconds")
        for why in Termination:
            self.metrics.zero("episodes", termination=why.value)

    def node(self) -> dict:
        """The node this actor runs on (`gigpo status`)."""
        return this_node()

    def set_inference_actors(self, inference_actors: list) -> int:
        """Send the requests of later steps to these inference actors (`gigpo scale --inference`: the driver
        calls it on every rollout actor). A request already sent finishes on its actor (or, should that
        actor die, is retried on these). Returns how many there are now."""
        actors = list(inference_actors)
        if not actors:
            raise ValueError("a rollout actor needs at least one inference actor")
        self.inference_actors = actors
        return len(actors)

    # -- control ----------------------------------------------------------------------------------------

    async def run(self, max_groups: int | None = None) -> dict:
        """Play groups until stop() (or until `max_groups` groups have completed); returns stats()."""
        if self._running is not None:
            raise RuntimeError(f"rollout actor {self.actor_id} is already running")
        loop = asyncio.get_running_loop()
        self._running = loop.create_future()
        self._stopping, self._drain = False, True
        self._started = time.perf_counter()
        self._max_groups = max_groups
        self._run_started = 0
        renewing = loop.create_task(self._renew_admitted())
        try:
            slots = [loop.create_task(self._slot_loop(s)) for s in range(self.cfg.rollout.groups_per_actor)]
            await asyncio.gather(*slots, return_exceptions=True)
            for t in slots:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        finally:
            renewing.cancel()
            self._wall_total += time.perf_counter() - self._started
            self._running.set_result(True)
            self._running = None
        return self.stats()

    async def play_tasks(self, task_ids: list[str], seed: int = 0) -> list[EpisodeGroup]:
        """Play each task once (a group of one trajectory, env seed `seed`), as many at a time as this actor
        has env instances; nothing is published. Used for evaluation."""
        if self._running is not None:
            raise RuntimeError(f"rollout actor {self.actor_id} is running: evaluate with another actor")
        queue = list(enumerate(task_ids))[::-1]
        results: list[EpisodeGroup | None] = [None] * len(task_ids)

        async def worker(instance: int) -> None:
            while queue:
                i, task_id = queue.pop()
                group_id = f"{self.actor_id}-task{i}"
                played = await self._play_trajectory(instance, task_id, seed, group_id, 0)
                results[i] = EpisodeGroup.pack(group_id, task_id, self.cfg.env.name, [played])

        await asyncio.gather(*[worker(k) for k in range(min(self.num_instances, len(task_ids)))])
        return [r for r in results if r is not None]

    async def stop(self, drain: bool = True) -> dict:
        """Stop: drain=True finishes and publishes the groups in flight; drain=False discards them.
        Returns when run() has returned."""
        self._stopping, self._drain = True, drain
        running = self._running
        if not drain:
            for t in list(self._group_tasks):
                t.cancel()
        if running is not None:
            await asyncio.shield(running)
        return self.stats()

    def stats(self) -> dict:
        # Counters add up over run() calls, and so does the wall time the rates divide by.
        running = self._running is not None
        wall = self._wall_total + (time.perf_counter() - self._started if running else 0.0)
        out = {key: 0 for key in ("env_steps", "generated_tokens", "groups_started", "groups_published",
                                  "groups_completed", "groups_discarded", "admission_waits", "trajectories",
                                  "invalid_actions", "successes", "env_calls")}
        out.update(self.counters, **self.timers, terminations=dict(self.terminations), wall_s=wall, running=running,
                   actor_id=self.actor_id)
        if wall > 0:
            out["env_steps_per_s"] = out["env_steps"] / wall
            out["generated_tokens_per_s"] = out["generated_tokens"] / wall
        return out

    def env_worker_pid(self, instance: int) -> int:
        """Process id of the env worker hosting `instance` (for fault tests)."""
        return self._env_pool.worker_pid(instance)

    def close(self) -> None:
        self._env_pool.close()
        self.stream.close()

    # -- one slot: groups back to back -------------------------------------------------------------------

    async def _slot_loop(self, slot: int) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if self._max_groups is not None and self._run_started >= self._max_groups:
                return
            self._run_started += 1         # per run() call: sync mode calls run(max_groups=k) repeatedly
            admitted = await self._admit()
            if admitted is None:           # stopped while waiting: nothing started
                return
            self.counters["groups_started"] += 1
            task_id = self._rng.choice(self.task_ids)
            env_seed = self._rng.randrange(2**31)
            # Only the playing is cancellable (stop(drain=False)); a publish in progress always finishes,
            # so the counters say exactly what reached the stream.
            play = loop.create_task(self._play_group(slot, task_id, env_seed))
            self._group_tasks.add(play)
            try:
                group = await play
            except asyncio.CancelledError:
                self.counters["groups_discarded"] += 1
                await self._give_back(admitted)
                return
            finally:
                self._group_tasks.discard(play)
            self.counters["groups_completed"] += 1
            await self._publish(group, admitted)

    async def _admit(self) -> str | None:
        """The stream's slot for the next group (`common.staleness.policy_lag_bound`: no more groups are started
        than the learner trains before they would go stale); None once stopping. Short waits, so that a stop
        is honoured while the bound is reached. The wait is counted after every try, not only at its end: the
        stats of a slot that has waited long already show it (rollout autoscale reads them per interval)."""
        mark = time.perf_counter()

        def count_wait() -> None:
            nonlocal mark
            now = time.perf_counter()
            self.timers["admission_wait_s"] += now - mark
            mark = now
        try:
            while not self._stopping:
                try:
                    admitted = await asyncio.to_thread(self.stream.admit, 1.0)
                except TimeoutError:
                    self.counters["admission_waits"] += 1
                    count_wait()
                    continue
                if self._stopping:        # stopped while it waited (the slot may be one a stop just freed)
                    await asyncio.to_thread(self.stream.release, admitted)
                    break
                self._admitted.add(admitted)
                return admitted
            return None
        finally:
            count_wait()

    async def _renew_admitted(self) -> None:
        """Keeps the slots of the groups being played alive (a killed actor's lapse within the slot's TTL)."""
        from common.stream.redis_stream import RENEW_EVERY_S
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            if self._admitted:
                try:
                    await asyncio.to_thread(self.stream.renew, list(self._admitted))
                except Exception as exc:    # noqa: BLE001 - Redis away for a moment: the next round renews
                    log.warning("renewing the stream's admitted slots failed: %s", exc)

    async def _give_back(self, admitted: str) -> None:
        self._admitted.discard(admitted)
        await asyncio.to_thread(self.stream.release, admitted)

    async def _publish(self, group: EpisodeGroup, admitted: str) -> None:
        if group.num_rows == 0:          # e.g. every reset failed: nothing to train on
            self.counters["groups_empty"] += 1
            await self._give_back(admitted)
            return
        if self._stopping and not self._drain:
            self.counters["groups_discarded"] += 1
            await self._give_back(admitted)
            return
        # Admitted before it was played: appended at once, also by an actor being removed (draining), so
        # scaling down never waits on the learner and loses nothing.
        await asyncio.to_thread(self.stream.publish, group, None, admitted)
        self._admitted.discard(admitted)
        self.counters["groups_published"] += 1
        self.metrics.inc("groups_published")

    async def _play_group(self, slot: int, task_id: str, env_seed: int) -> EpisodeGroup:
        n = self.cfg.rollout.group_size
        group_id = f"{self.actor_id}-{uuid.uuid4().hex[:16]}"
        played = await asyncio.gather(*[
            self._play_trajectory(slot * n + j, task_id, env_seed, group_id, j) for j in range(n)])
        try:
            return EpisodeGroup.pack(group_id, task_id, self.cfg.env.name, played, created_at=time.time(),
                                     producer=self.actor_id)
        except ValueError as exc:       # e.g. a NaN log-prob from a broken engine: nothing a learner can use
            log.error("group %s of %s dropped, its steps do not fit the row schema: %s", group_id, task_id, exc)
            self.counters["groups_invalid"] += 1
            return EpisodeGroup(group_id, task_id, self.cfg.env.name)      # no rows: not published

    # -- one trajectory ---------------------------------------------------------------------------------

    async def _env_call(self, kind: str, request: tuple):
        """kind "reset": (instance, task_id, seed); kind "step": (instance, action). -> InstanceResult, awaited
        without blocking the loop (instances in different worker processes step in parallel)."""
        t0 = time.perf_counter()
        try:
            submit = self._env_pool.submit_resets if kind == "reset" else self._env_pool.submit_steps
            return await asyncio.wrap_future(submit([request])[0])
        finally:
            self.counters["env_calls"] += 1
            self.timers["env_wait_s"] += time.perf_counter() - t0

    async def _play_trajectory(self, instance: int, task_id: str, env_seed: int, group_id: str,
                               member: int) -> tuple[Trajectory, list[StepRow]]:
        cfg = self.cfg
        traj = Trajectory(traj_id=f"{group_id}-{member}")
        steps: list[StepRow] = []
        self.counters["trajectories"] += 1
        res = await self._env_call("reset", (instance, task_id, env_seed))
        if res.error is not None or res.report is None:
            log.warning("reset of %s on instance %d failed: %s", task_id, instance, res.error)
            return self._end(traj, steps, Termination.ENV_ERROR)
        report = res.report
        task = report.task
        traj.task_type = report.task_type
        history: list[tuple[str, str]] = []
        for step in range(cfg.env.max_steps):
            message = build_user_message(cfg.env.name, task, report.observation, report.admissible_actions,
                                         history, step, cfg.rollout.history_length)
            prompt_ids = prompt_token_ids(self.tokenizer, message)
            if len(prompt_ids) > cfg.model.max_prompt_tokens:
                return self._end(traj, steps, Termination.TRUNCATED)
            grammar = (response_regex(report.admissible_actions, cfg.model.max_response_tokens)
                       if cfg.rollout.constrain_actions and report.admissible_actions else "")
            sampling = step_sampling(cfg, traj.traj_id, step, grammar)
            out = await self._generate(instance, prompt_ids, sampling)
            # Decoded here, not vLLM's text: that one is detokenized in the context of the prompt.
            parsed = parse_action(self.tokenizer.decode(out["response_ids"], skip_special_tokens=True))
            res = await self._env_call("step", (instance, parsed.action))
            if res.error is not None or res.report is None:
                # The step's outcome is unknown: its row is dropped, the trajectory ends marked.
                log.warning("step of %s on instance %d failed: %s", traj.traj_id, instance, res.error)
                return self._end(traj, steps, Termination.ENV_ERROR)
            nxt = res.report
            steps.append(StepRow(
                prompt_ids=prompt_ids, response_ids=out["response_ids"], response_logprobs=out["logprobs"],
                reward=step_reward(cfg.rollout, nxt), anchor=report.anchor, valid=parsed.valid, step=step,
                policy_version=int(out["policy_version"]), action=parsed.action,
                grammar=grammar))
            self.counters.update({"env_steps": 1, "generated_tokens": len(out["response_ids"]),
                                  "invalid_actions": int(not parsed.valid), f"finish_{out['finish_reason']}": 1})
            self.metrics.inc("env_steps")
            self.metrics.inc("generated_tokens", len(out["response_ids"]))
            history.append((report.observation, parsed.action))
            report = nxt
            if nxt.done:
                traj.success = bool(nxt.won)
                traj.score = float(nxt.score)
                return self._end(traj, steps, Termination.DONE)
        return self._end(traj, steps, Termination.MAX_STEPS)

    def _end(self, traj: Trajectory, steps: list[StepRow], why: Termination) -> tuple[Trajectory, list[StepRow]]:
        traj.termination = why
        traj.num_steps = len(steps)
        traj.episode_return = float(sum(s.reward for s in steps))
        self.terminations[why.value] += 1
        # (env_errors/env_restarts are counted by the env pool or server that saw the failure.)
        self.metrics.inc("episodes", termination=why.value)
        self.counters["successes"] += int(traj.success)
        return traj, steps

    async def _generate(self, instance: int, prompt_ids: list[int], sampling: dict) -> dict:
        """One generation. An inference actor that died is retried (on the next actor when there are several;
        Ray restarts a dead one, which reloads the newest weights) for up to `inference.generate_timeout_s`;
        one that has not answered within that deadline (hung, or on a lost node) is given up and the request
        sent to the next actor. Fails, naming the actor, when every actor timed out or none came back."""
        t0 = time.perf_counter()
        timeout_s = self.cfg.inference.generate_timeout_s
        deadline = time.monotonic() + timeout_s
        delay, timeouts = 0.5, 0
        try:
            for attempt in itertools.count():
                # The list as it is now: `set_inference_actors` may have replaced it since the last attempt.
                actors = self.inference_actors
                n = len(actors)
                index = (instance + attempt) % n
                t1 = time.perf_counter()
                ref = actors[index].generate.remote(prompt_ids, sampling)
                try:
                    out = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
                except asyncio.TimeoutError:
                    ray.cancel(ref)          # a hung call must not run on later
                    timeouts += 1
                    self.counters["inference_timeouts"] += 1
                    log.warning("inference actor %d gave no answer within %.0f s", index, timeout_s)
                    if timeouts >= n:
                        raise RuntimeError(f"inference actor {index} gave no answer within "
                                           f"inference.generate_timeout_s ({timeout_s:.0f} s)"
                                           + (f", nor did the other {n - 1}" if n > 1 else "")) from None
                except _RETRYABLE as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"inference actor {index} unavailable for inference.generate_timeout_s "
                                           f"({timeout_s:.0f} s): {e}") from e
                else:
                    self.metrics.observe("generate_seconds", time.perf_counter() - t1)
                    weight_wait = float(out.get("weight_wait_s", 0.0))
                    self.timers["weight_wait_s"] += weight_wait
                    if weight_wait:
                        self.metrics.inc("rollout_weight_wait_seconds", weight_wait)
                    return out
                self.counters["inference_retries"] += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        finally:
            self.timers["gen_wait_s"] += time.perf_counter() - t0


def step_sampling(cfg: ExperimentConfig, traj_id: str, step: int, grammar: str) -> dict:
    """The sampling a trajectory's step asks the inference actor for: the rollout's temperature, the response
    budget, a seed of its own (the run's seed, the trajectory, the step), and the action grammar ("" if none)."""
    sampling = {"temperature": cfg.rollout.temperature, "max_tokens": cfg.model.max_response_tokens,
                "seed": stable_seed(cfg.run.seed, traj_id, step)}
    if grammar:
        sampling["regex"] = grammar
    return sampling


# What a step earns by rollout.reward, one entry per choice the config declares: "success" gives
# success_reward on the winning step, "score" gives success_reward x the env's native score on the last step.
STEP_REWARDS = {
    "success": lambda rollout_cfg, report: rollout_cfg.success_reward if report.won else 0.0,
    "score": lambda rollout_cfg, report: rollout_cfg.success_reward * float(report.score) if report.done else 0.0,
}


def step_reward(rollout_cfg: RolloutConfig, report) -> float:
    """The reward of the step that led to `report` (an EnvReport), by rollout.reward (STEP_REWARDS)."""
    return STEP_REWARDS[rollout_cfg.reward](rollout_cfg, report)


RolloutActor = ray.remote(Rollout)


def create_rollout_actor(cfg: ExperimentConfig, actor_id: str, inference_actors: list, stream_url: str | None,
                         log_dir: str = "", model: ModelSource | None = None):
    """A rollout actor with the CPU share and the custom resources (`rollout.resources`: which nodes it may
    run on) the config asks for; log_dir: its output goes to <log_dir>/<actor_id>.log; model: see `Rollout`."""
    # max_restarts=-1: an actor lost with its process or node comes back whenever Ray can place it again
    # (deploy.rollout_pool restarts its loop); its run() is not retried by Ray, so the driver sees the loss.
    return RolloutActor.options(num_cpus=cfg.rollout.cpus_per_actor, resources=cfg.rollout.resources or None,
                                name=None, max_concurrency=1000, max_restarts=-1, max_task_retries=0).remote(
        cfg, actor_id, inference_actors, stream_url, cfg.run.rollout_cpus, cfg.run.rollout_nice, log_dir, model)
