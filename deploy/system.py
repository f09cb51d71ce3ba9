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

import copy
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import ray

from common.config import ExperimentConfig, to_dict
from common.log_files import Terminal, run_log_dir, run_output
from common.metrics import update_figures
from common.placement import node_label

log = logging.getLogger("gigpo")

LEARNER_CLOSE_S = 300    # a learner's close may save a checkpoint (of a large model: minutes)
ROLLOUT_STOP_S = 30      # rollout actors told to stop without draining (they discard what is in flight)
INFERENCE_STOP_S = 60    # inference actors told to shut down their engines, before they are killed
LOST_STOP_S = 10         # either, after the run lost a part (lost_parts): their node may be gone with it
ROLLOUT_TELL_S = 30      # rollout actors told of added or removed inference actors
RATE_WINDOW = 8      # updates the progress bar's env steps/s is measured over
WAIT_FOR_DATA_S = 10.0   # the learner's wait for a batch, between which the driver handles commands and status
EVALS_FILE = "evals.jsonl"     # a training run's evaluations, one line each (System.evaluate)
LOST_CHECK_S = 15.0      # how long the driver waits for a learner rank's answer whether it lives, after a failure
LOST_DECIDE_S = 90.0     # ... and how long it asks again one that Ray calls unavailable (a node that stopped
                         # answering is declared dead by Ray's health checks, 15-60 s by its defaults)
LOST_ASK_AGAIN_S = 1.0
EXIT_LOST = 3            # `gigpo train`'s exit status when the run lost a part it needs (RunLost)


class RunLost(RuntimeError):
    """The run lost a part it cannot go on without: a learner rank (its process, or its node), or its Redis.
    `lost`: one line per part; `output_dir`: the run's; `learner_node`: learner rank 0's node when it is not
    the driver's (its checkpoints are written there). `lost_run_message` says it to the user."""

    def __init__(self, lost: list[str], output_dir: str, learner_node: dict | None = None):
        super().__init__("the run lost " + "; ".join(lost))
        self.lost, self.output_dir, self.learner_node = list(lost), output_dir, learner_node


def lost_run_message(exc: RunLost, resume_command: list[str]) -> str:
    """What `gigpo train` prints (a few lines, no traceback) when the run lost a part it needs: what was
    lost, the newest complete checkpoint (or that there is none) and the command that resumes from it."""
    import shlex

    from learner.trainer import checkpoint_tags, is_complete_checkpoint, tag_update
    root = Path(exc.output_dir) / "checkpoints"
    complete = [tag for tag in checkpoint_tags(root) if is_complete_checkpoint(tag)]
    lines = [f"gigpo: the run lost {part}" for part in exc.lost]
    if complete:
        lines.append(f"newest complete checkpoint: {complete[-1]} (update {tag_update(complete[-1].name)}); "
                     f"updates done after it are trained again")
    else:
        lines.append(f"no complete checkpoint in {root} on this node"
                     + (f" (learner rank 0 wrote its checkpoints on its own node, {node_label(exc.learner_node)}: "
                        "there, unless a filesystem both nodes mount holds run.output_dir)" if exc.learner_node
                        else "") + ": a resumed run starts from update 0")
    lines.append(f"resume with: {shlex.join(resume_command)}")
    return "\n".join(lines)


def start_ray(cfg: ExperimentConfig) -> str:
    """Connect to `run.ray_address` / RAY_ADDRESS, or start a local Ray sized for this machine.

    The project's own environment (common.process_env) is set here first, so that a local Ray's processes
    inherit it; on a cluster every actor sets it itself. The runtime env carries only the user's settings
    from this environment, and under `ray job submit` only those the job's runtime env does not already
    set (Ray refuses to merge two that name one variable)."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    from common.process_env import apply_project_env, driver_runtime_env
    apply_project_env()
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")
    env = driver_runtime_env(os.environ)
    if address:
        # Actors on other nodes write their log files there; streaming their output to the driver (into
        # its driver.log, see common.log_files) keeps one copy of everything where the run was started.
        ray.init(address=address, runtime_env=env, namespace="gigpo", log_to_driver=True)
    else:
        from common.metrics import ray_init_metrics_options
        # log_to_driver=False: every actor writes its own log file under the run's logs/ already.
        ray.init(address="local", num_cpus=os.cpu_count() or 1, runtime_env=env, namespace="gigpo",
                 object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False,
                 **ray_init_metrics_options())
    return ray.get_runtime_context().gcs_address


def link_ray_logs(log_dir: str) -> None:
    """<log_dir>/ray -> this node's Ray session logs (raylet, GCS, and each worker's output before its actor
    took over its own log file). Best effort: Ray does not publish the path through a public API."""
    try:
        ray_logs = ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - no local node (a client connection) or Ray moved it
        return
    link = Path(log_dir) / "ray"
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ray_logs, target_is_directory=True)
    except OSError as exc:
        log.info("could not link Ray's logs %s into %s: %s", ray_logs, log_dir, exc)


class System:
    """Starts, runs and stops every part of one training run."""

    def __init__(self, cfg: ExperimentConfig):
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._evals_started = False       # this run has written evals.jsonl (see evaluate)
        self.redis = None
        self.rollouts: dict[str, object] = {}       # actor id -> handle
        self.rollout_runs: dict[str, object] = {}   # actor id -> ObjectRef of its run() (async mode)
        self.retiring: dict[str, tuple] = {}        # actor id -> (handle, ObjectRef of its stop())
        self._next_rollout = 0
        self.inference: list = []                   # serving: the learner pushes to them, rollout actors use them
        self.inference_starting: list[tuple] = []   # (handle, ObjectRef of its node()) added, engine starting
        self.inference_retiring: list[list] = []    # [handle, deadline, ObjectRef of stats() | None] removed ones
        self._actor_cfg: dict = {}                  # the config inference actors are created from (weights_dir set)
        self._lost: list[str] = []                  # what the run lost (see lost_parts), once it has ended
        self._learner_lost = False                  # ... a learner rank among it: the others are not closed
        self._training = False                      # start() of a training run (not `gigpo eval`) has begun
        self.learners: list = []
        self.model = None                           # the policy as every actor receives it (a ModelSource)
        self.placement: dict[str, dict | None] = {}  # actor name -> the node it answered from (None: not yet)
        self._node_asks: dict[str, object] = {}     # actor name -> ObjectRef of its node() call in flight
        self.tracker = None
        self.channel = None
        self.last_eval: dict | None = None
        self._rollout_totals: dict[str, dict] = {}
        self._last_stats: dict[str, dict] = {}      # live rollout actor id -> its last stats (kept over a restart)
        self.rollout_restarts = 0
        self.restarting: dict[str, object] = {}     # rollout actor id -> ObjectRef of a ping (it is coming back)
        self._last_metrics: dict = {}
        self._closing = False                       # close() is running: further signals are ignored
        self._stopped_by: int | None = None         # the signal that stopped the run
        self._saved_handlers: dict | None = None    # SIGINT/SIGTERM handlers before this System's own
        # Each actor's log file goes here (`gigpo eval` points it into the eval's own directory).
        self.log_dir = run_log_dir(cfg.run.output_dir)
        self.terminal: Terminal | None = None     # where the bar and eval lines go (None: stdout/stderr)

    # -- start and stop --------------------------------------------------------------------------------

    def start(self, eval_only: bool = False, scratch_dir: str = "") -> None:
        """Start every part. eval_only: inference actors and a read-only learner that serves the resumed
        checkpoint, nothing else; nothing is written into run.output_dir (no job file, no metrics, no
        model builds; the actors' logs go to self.log_dir), so a run that is still training is not
        disturbed. What such an evaluation must build (a model the run does not have) goes into
        `scratch_dir`, which the caller removes."""
        from common.redis_server import connect, redis_for
        from deploy.control import ControlChannel, write_job_file
        from deploy.tracking import Tracker

        cfg = self.cfg
        t0 = time.perf_counter()
        self._training = not eval_only
        if not eval_only:      # another run's checkpoints: refused (deleted with run.overwrite) before anything starts
            from learner.trainer import prepare_output_dir
            prepare_output_dir(cfg)
        address = start_ray(cfg)
        self._trap_signals()          # again: ray.init replaced the SIGTERM handler
        link_ray_logs(self.log_dir)
        self.model_path = self._eval_model(scratch_dir) if eval_only else self._initial_model()
        if eval_only:
            # The actors load exactly this model (the rollout side its tokenizer), whatever model.path says.
            cfg.model.path = self.model_path
        self.model = self._ship_model(self.model_path)
        self.redis_url = None
        if not eval_only:
            self.redis_url, self.redis = redis_for(cfg.stream)
            self.channel = ControlChannel(connect(self.redis_url), cfg.stream.run_id or cfg.run.name)
            write_job_file(cfg.run.output_dir, cfg.run.name, self.redis_url, address, run_id=cfg.stream.run_id)
            self.tracker = Tracker(cfg.run.output_dir, cfg.run.name, to_dict(cfg), resume=cfg.run.resume)

        from actors.inference import create_inference_actors, with_weights_dir
        from common.placement import PLACEMENT_TIMEOUT_S, wait_placeable
        from learner.actor import create_learner_workers
        # One weights directory for the run's inference actors, those `gigpo scale --inference` adds included.
        self._actor_cfg = with_weights_dir(to_dict(cfg))
        self.inference = create_inference_actors(self._actor_cfg, self.model, log_dir=self.log_dir)
        # Resources no node has would leave an actor pending forever: say which, before waiting on any.
        # (The learner checks its own need, in create_learner_workers.)
        wait_placeable(self.role_needs(), PLACEMENT_TIMEOUT_S, log=log)
        self.learners = create_learner_workers(cfg, self.model, self.redis_url, self.inference,
                                               read_only=eval_only, log_dir=self.log_dir)
        state = ray.get(self.learners[0].state.remote())
        if eval_only and state["policy_version"] > 0:
            # The inference actors must serve the checkpoint's weights, not the initial ones. (A resumed
            # training learner has pushed them itself, as a new version: Learner._resume.)
            ray.get([w.sync_weights.remote() for w in self.learners])
        self.update = state["updates"]       # learner updates done (more than 0 after a resume)
        self.scale_rollout(0 if eval_only else cfg.rollout.num_actors)
        log.info("system up in %.0fs: %d inference, %d learner, %d rollout actors; outputs in %s",
                 time.perf_counter() - t0, len(self.inference), len(self.learners), len(self.rollouts),
                 self.out.resolve())
        placement = self.refresh_placement(timeout_s=10.0)
        log.info("placement: %s", "; ".join(f"{name} on {node_label(node)}" for name, node in placement.items()))
        if self.channel is not None:     # `gigpo status` shows the placement before the first update
            self._publish_status({"update": self.update, "policy_version": state["policy_version"]},
                                 state="started")

    def role_needs(self) -> dict[str, dict]:
        """What one inference and one rollout actor (also the eval actor's node) need of a node."""
        from common.placement import job_needs
        needs = job_needs(self.cfg)
        return {"an inference actor": needs["inference actor"][0], "a rollout actor": needs["rollout actor"][0]}

    def refresh_placement(self, timeout_s: float = 0.0) -> dict[str, dict | None]:
        """{actor name: its node, None while it has not started} for every actor of the run, in role order.
        Asks the inference and rollout actors again (one call in flight per actor: a restarted actor may
        come back on another node) and waits up to timeout_s for the answers; the learner's ranks reported
        theirs at start."""
        serving = self.inference + [actor for actor, _ in self.inference_starting]
        actors = {f"inference-{i}": actor for i, actor in enumerate(serving)}
        actors.update(self.rollouts)
        for name in list(self._node_asks):
            if name not in actors:
                del self._node_asks[name]
        for name, actor in actors.items():
            if name not in self._node_asks:
                self._node_asks[name] = actor.node.remote()
        refs = list(self._node_asks.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        ready = set(ready)
        for name, ref in list(self._node_asks.items()):
            if ref in ready:
                del self._node_asks[name]
                try:
                    self.placement[name] = ray.get(ref)
                except ray.exceptions.RayError:
                    self.placement[name] = None      # died (Ray may restart it; asked again next time)
        nodes = getattr(self.learners, "nodes", None) or [None] * len(self.learners)
        out = {f"learner-{rank}": node for rank, node in enumerate(nodes)}
        out.update({name: self.placement.get(name) for name in actors})
        return out

    def _ship_model(self, path: str):
        """The model as every actor receives it (common.model_files.ModelSource). It was built or found here,
        in this node's output directory, which other nodes do not see: on a cluster (an address given, or
        more than one node) a local model of up to model.ship_max_mb travels with the actors through Ray's
        object store. A local Ray is one node that sees the path itself: nothing is copied (its object store
        is small)."""
        from common.model_files import ModelSource
        from common.placement import alive_nodes
        if Path(path).is_dir():
            path = str(Path(path).resolve())       # the actors' working directory may differ from this one
        cluster = bool(self.cfg.run.ray_address or os.environ.get("RAY_ADDRESS")) or len(alive_nodes()) > 1
        return ModelSource.ship(path, self.cfg.model.ship_max_mb if cluster else 0)

    def _initial_model(self) -> str:
        """The policy a training run starts from: model.path ("tiny": built under run.output_dir), then the
        supervised warm start on training walkthroughs (cached under run.output_dir)."""
        from deploy.models import prepare_model_path
        path = prepare_model_path(self.cfg.model.path, self.cfg.run.output_dir)
        if self.cfg.model.warm_start_steps > 0:
            from deploy.warm_start import warm_start
            path = warm_start(self.cfg, path, progress=self.terminal.err if self.terminal else None)
        return path

    def _eval_model(self, scratch_dir: str) -> str:
        """The model `gigpo eval` starts its learner and actors from, without writing into the run: the run's
        own warm model or tiny model as they are (the settings they were made with are the run's, whatever
        this evaluation's config says); with a checkpoint to load, that model only supplies the architecture
        and tokenizer. What the run lacks is built in `scratch_dir`."""
        from deploy.models import prepare_model_path
        from deploy.warm_start import existing_warm_model, warm_start
        cfg = self.cfg
        if cfg.model.warm_start_steps > 0:
            warm = existing_warm_model(cfg.run.output_dir)
            if warm:
                return warm
        path = prepare_model_path(cfg.model.path, cfg.run.output_dir, build_dir=scratch_dir or None)
        from learner.trainer import LATEST, checkpoint_dir_of
        has_checkpoint = bool(cfg.run.resume_tag) or (checkpoint_dir_of(cfg) / LATEST).exists()
        if cfg.model.warm_start_steps > 0 and not has_checkpoint:
            if not scratch_dir:
                raise ValueError(f"{cfg.run.output_dir} has neither a checkpoint nor a warm model to evaluate")
            log.warning("%s has no checkpoint and no warm model: evaluating a warm start built for this "
                        "evaluation only", cfg.run.output_dir)
            path = warm_start(cfg, path, out_dir=str(Path(scratch_dir) / "warm_model"))
        return path

    def close(self) -> None:
        """Stop every part and leave nothing behind, whatever state the run is in (also after Ctrl-C or
        SIGTERM, and half-way through start()): rollout actors, learners (they checkpoint uncommitted
        updates), the vLLM engines (their own shutdown, which removes their shared memory, then ray.kill),
        the embedded Redis with its temporary directory, the weights directory made for this run, Ray, and
        last the /dev/shm files that processes of this run mapped and nobody maps any more. Each step has a
        deadline; a step that fails is logged and the next one still runs. While it runs, another Ctrl-C
        or SIGTERM is noted and ignored."""
        from actors.inference import remove_made_weights_dirs, stop_inference_actors
        from common import shm_cleanup

        self._closing = True

        # After a lost part, actors on a lost node wait for a restart that may never come: a short deadline.
        stop_s = LOST_STOP_S if self._lost else ROLLOUT_STOP_S
        inference_stop_s = LOST_STOP_S if self._lost else INFERENCE_STOP_S

        def stop_rollouts() -> None:
            self.scale_rollout(0, drain=False)
            # One deadline for all (an actor still waiting for CPUs never answers), then the rest is killed.
            refs = [stop_ref for _, stop_ref in self.retiring.values()]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=stop_s)
            self.reap_retired(timeout_s=0)
            for actor_id, (actor, _) in list(self.retiring.items()):
                self._say_closing("rollout actor %s did not stop within %d s: killed", actor_id, stop_s)
                ray.kill(actor)
                del self.retiring[actor_id]

        def stop_redis() -> None:
            if self.redis is not None:
                self.redis.stop(cleanup=True)      # removes its data directory if it is a temporary one

        def stop_ray() -> None:
            if ray.is_initialized():
                ray.shutdown()

        steps = [("rollout actors", stop_rollouts), ("learners", self._close_learners),
                 ("inference actors", lambda: stop_inference_actors(
                     self.inference + [a for a, _ in self.inference_starting]
                     + [entry[0] for entry in self.inference_retiring], timeout_s=inference_stop_s,
                     say=self._say_closing)),
                 # What killed engines noted in a weights directory of the config's; one made for this run
                 # goes with its notes.
                 ("engine shared memory", lambda: shm_cleanup.remove_noted_in(self.cfg.inference.weights_dir)),
                 ("weights directory", remove_made_weights_dirs),
                 ("tracker", lambda: self.tracker and self.tracker.close()), ("redis", stop_redis)]
        try:
            for name, step in steps:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - the next parts must still be stopped
                    self._say_closing("closing %s failed: %s", name, exc)
            # What this run's processes still map (a local Ray's are all below this process), before Ray
            # ends them: what is left of it afterwards, nobody else could remove.
            held = shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
            try:
                stop_ray()
            finally:
                removed = shm_cleanup.remove_unused(held, wait_s=30)
                if removed:
                    log.info("removed shared memory left by ended processes: %s", removed)
        finally:
            self.inference, self.learners, self.redis, self.tracker = [], [], None, None
            self.inference_starting, self.inference_retiring = [], []
            self._restore_signals()

    def _say_closing(self, msg: str, *args) -> None:
        """A part that failed to stop: a warning, but only a line in the log file after a lost part
        (lost_parts), when the parts that needed it are expected to fail."""
        (log.info if self._lost else log.warning)(msg, *args)

    def _close_learners(self) -> None:
        if self._learner_lost:
            # The other ranks would wait for the lost one in the close's collectives (a checkpoint): the
            # resumed run starts from the last checkpoint written, as it would have after the close.
            for worker in self.learners:
                ray.kill(worker)
            return
        refs = [worker.close.remote() for worker in self.learners]
        done, late = ray.wait(refs, num_returns=len(refs), timeout=LEARNER_CLOSE_S) if refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a dead learner has nothing left to save
                # (After a lost Redis: expected, its checkpoint is written before the acks that fail.)
                self._say_closing("learner close failed: %s", exc)
        if late:
            log.warning("%d learner(s) did not close within %d s", len(late), LEARNER_CLOSE_S)
        for worker in self.learners:
            ray.kill(worker)

    # -- signals: SIGTERM ends a run like Ctrl-C, through close() ---------------------------------------------

    def _trap_signals(self) -> None:
        """SIGTERM (`kill`, a scheduler stopping the job) raises KeyboardInterrupt in the main thread, as Ctrl-C
        does, so that the `with System(...)` block runs close(); __exit__ then turns it into SystemExit(143).
        (KeyboardInterrupt because it is the one exception a blocked ray.get passes on unchanged: Ray turns a
        SystemExit raised there into SystemExit(1).) Called again after ray.init, which installs a SIGTERM
        handler of its own that kills Ray's processes before anything could be closed."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self._saved_handlers is None:
            self._saved_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self._closing:
            log.warning("%s while shutting down: ignored, the run is being closed (every step has a deadline)",
                        signal.Signals(signum).name)
            return
        self._stopped_by = signum
        log.warning("%s: stopping the run", signal.Signals(signum).name)
        raise KeyboardInterrupt

    def _restore_signals(self) -> None:
        if self._saved_handlers is not None and threading.current_thread() is threading.main_thread():
            for sig, handler in self._saved_handlers.items():
                signal.signal(sig, handler)
            self._saved_handlers = None

    def __enter__(self) -> "System":
        self._trap_signals()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        learner_node = None
        if self._training and isinstance(exc, Exception) and not isinstance(exc, RunLost):
            # Before close() stops everything: was the failure a part the run cannot go on without?
            try:
                self._lost = self.lost_parts()
                nodes = getattr(self.learners, "nodes", None)
                if nodes and nodes[0]["node_id"] != ray.get_runtime_context().get_node_id():
                    learner_node = nodes[0]
            except Exception as check:  # noqa: BLE001 - the failure itself is what the user then gets
                log.info("could not check which parts of the run are lost: %s", check)
        self.close()
        if self._stopped_by == signal.SIGTERM:
            raise SystemExit(128 + signal.SIGTERM) from None     # the usual exit status of a terminated job
        if self._lost:
            raise RunLost(self._lost, str(self.out), learner_node) from exc

    def lost_parts(self, timeout_s: float = LOST_CHECK_S, decide_s: float = LOST_DECIDE_S) -> list[str]:
        """What the run cannot go on without and has lost, one line each ([]: nothing): a learner rank whose
        actor Ray reports dead (its process died, or its node left the cluster: said which, with the node),
        the embedded Redis (its process ended) or the configured one (it does not answer). A rank that does
        not answer within timeout_s (busy in a collective with a dead one, or hung) is not counted; one that
        Ray calls unavailable (its node stopped answering and Ray's health checks have not yet declared it
        dead) is asked again until Ray decides, for up to decide_s."""
        from common.placement import alive_nodes
        lost = []
        if self.learners and ray.is_initialized():
            nodes = getattr(self.learners, "nodes", None) or [None] * len(self.learners)
            start = time.monotonic()
            pings = {rank: (worker.node.remote(), start) for rank, worker in enumerate(self.learners)}

            def say_lost(rank: int, gone: bool) -> None:
                lost.append(f"learner rank {rank} on node {node_label(nodes[rank])}: "
                            + ("the node is gone (it left the Ray cluster)" if gone else "its process died"))
                self._learner_lost = True

            def node_gone(rank: int, alive: set) -> bool:
                return nodes[rank] is not None and nodes[rank]["node_id"] not in alive

            while pings:
                refs = [ping for ping, _ in pings.values()]
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=LOST_ASK_AGAIN_S)
                alive, now = {node["node_id"] for node in alive_nodes()}, time.monotonic()
                for rank, (ping, asked) in list(pings.items()):
                    if ping not in ready:
                        if now - asked >= timeout_s or now - start >= decide_s:
                            del pings[rank]     # no answer: busy, or on a node Ray has not yet declared dead
                            if node_gone(rank, alive):
                                say_lost(rank, gone=True)
                        continue
                    del pings[rank]
                    try:
                        ray.get(ping)
                    except ray.exceptions.RayActorError as exc:
                        if node_gone(rank, alive) or isinstance(exc, ray.exceptions.ActorDiedError):
                            say_lost(rank, gone=node_gone(rank, alive))
                        elif now - start < decide_s:        # unavailable: Ray has not decided yet
                            time.sleep(LOST_ASK_AGAIN_S)
                            pings[rank] = (self.learners[rank].node.remote(), time.monotonic())
        if self.redis is not None:
            if not self.redis.running:
                lost.append(f"its embedded Redis (the trajectory stream and the control channel; redis-server pid "
                            f"{self.redis.pid} on this node): the process ended")
        elif self.redis_url:
            import redis

            from common.redis_server import connect, redact
            try:
                connect(self.redis_url, retries=0, socket_timeout_s=5).ping()
            except redis.RedisError as exc:
                lost.append(f"its Redis at {redact(self.redis_url)} (stream.redis_url): it does not answer "
                            f"({' '.join(str(exc).split())[:200]}); start it again (with AOF its stream is kept)")
        return lost

    # -- rollout actors --------------------------------------------------------------------------------

    def scale_rollout(self, num_actors: int, drain: bool = True) -> None:
        """Add or remove rollout actors. A removed actor finishes (drain) or discards its in-flight groups;
        a group is never half-published either way. Draining runs in the background (its last groups may
        wait for room in the stream, which the learner keeps making); `reap_retired` collects it."""
        from actors.rollout import create_rollout_actor
        while len(self.rollouts) < num_actors:
            actor_id = f"rollout-{self._next_rollout}"
            self._next_rollout += 1
            actor = create_rollout_actor(to_dict(self.cfg), actor_id, self.inference, self.redis_url,
                                         log_dir=self.log_dir, model=self.model)
            self.rollouts[actor_id] = actor
            if not self.cfg.run.sync:
                self.rollout_runs[actor_id] = actor.run.remote()
        while len(self.rollouts) > num_actors:
            actor_id = list(self.rollouts)[-1]
            actor = self.rollouts.pop(actor_id)
            self.rollout_runs.pop(actor_id, None)
            self.restarting.pop(actor_id, None)
            self.retiring[actor_id] = (actor, actor.stop.remote(drain=drain))

    def reap_retired(self, timeout_s: float = 0.0) -> None:
        """Collect the retiring actors whose stop() has returned (waiting up to timeout_s for them)."""
        for actor_id, (actor, stop_ref) in list(self.retiring.items()):
            done, _ = ray.wait([stop_ref], timeout=timeout_s)
            if not done:
                continue
            del self.retiring[actor_id]
            self._last_stats.pop(actor_id, None)
            try:
                self._rollout_totals[actor_id] = ray.get(stop_ref)
                ray.get(actor.close.remote(), timeout=60)
            except Exception as exc:
                self._say_closing("rollout actor %s did not stop cleanly: %s", actor_id, exc)
            ray.kill(actor)

    # -- inference actors: `gigpo scale --inference` ---------------------------------------------------

    def scale_inference(self, num_actors: int) -> None:
        """Run `num_actors` (>= 1) inference actors. Added ones start in the background (a vLLM engine takes
        a while), created as the first ones were (resources, CPUs/GPUs, weights directory) but waiting for
        the learner's weights; each joins once its engine is up (`join_started_inference`). Removed ones (the
        newest first; one still starting is just stopped) leave at once: the learner stops pushing to them
        and the rollout actors stop sending them requests; each is stopped once the requests it holds have
        finished (`reap_retired_inference`)."""
        from actors.inference import create_inference_actors, stop_inference_actors
        if num_actors < 1:
            raise ValueError(f"a run needs at least one inference actor, not {num_actors}")
        have = len(self.inference) + len(self.inference_starting)
        if num_actors > have:
            added = create_inference_actors(self._actor_cfg, self.model, num_actors=num_actors - have,
                                            log_dir=self.log_dir, first=have, wait_for_weights=True)
            self.inference_starting += [(actor, actor.node.remote()) for actor in added]
        cancelled = []
        while len(self.inference) + len(self.inference_starting) > num_actors and self.inference_starting:
            cancelled.append(self.inference_starting.pop()[0])
        if cancelled:         # never used by anyone
            stop_inference_actors(cancelled, timeout_s=10)
        if len(self.inference) > num_actors:
            deadline = time.monotonic() + self.cfg.inference.generate_timeout_s
            self.inference_retiring += [[actor, deadline, None] for actor in self.inference[num_actors:]]
            self._use_inference(self.inference[:num_actors])

    def join_started_inference(self) -> None:
        """Added inference actors whose engine is up join the run, in the order they were added: the learner
        pushes its current weights to them, then the rollout actors send them requests too. One that died
        while starting (Ray gave up restarting it) is dropped, with a warning."""
        ready = 0
        for actor, ping in self.inference_starting:
            if not ray.wait([ping], timeout=0)[0]:
                break
            try:
                ray.get(ping)
            except ray.exceptions.RayError as exc:
                log.warning("an added inference actor did not start (%s); it is dropped: see its log, then scale "
                            "again", str(exc).splitlines()[0][:300])
                self.inference_starting.remove((actor, ping))
                ray.kill(actor)
                return
            ready += 1
        if ready:
            joining = [actor for actor, _ in self.inference_starting[:ready]]
            del self.inference_starting[:ready]
            info = self._use_inference(self.inference + joining)
            log.info("%d inference actor(s) joined; the learner's policy version %d was pushed to them (%s)",
                     len(joining), info.get("policy_version", -1),
                     f"{info['total_s']:.2f} s" if "total_s" in info else "they had it already")

    def _use_inference(self, actors: list) -> dict:
        """Make `actors` the run's inference actors: first the learner (it pushes to them from now on, and its
        current version to one that lacks it), then every rollout actor (its later requests go to them; one
        that does not answer in time, still starting or restarting, is told when it is back, and until then
        a request of its to a removed actor is retried on another). Returns learner rank 0's answer."""
        from learner.actor import set_learner_inference
        info = set_learner_inference(self.learners, actors, timeout_s=2 * self.cfg.inference.transfer_timeout_s + 60,
                                     on_wait=self._while_updating)
        handles = [a for actor_id, a in self.rollouts.items() if actor_id not in self.restarting]
        handles += [a for a, _ in self.retiring.values()]
        told = [a.set_inference_actors.remote(actors) for a in handles]
        ready, late = ray.wait(told, num_returns=len(told), timeout=ROLLOUT_TELL_S) if told else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass        # died: Ray restarts it, and _check_rollouts_alive tells it when it is back
        if late:
            log.info("%d rollout actor(s) did not take the new inference actors within %d s (still starting?): "
                     "they do when they answer", len(late), ROLLOUT_TELL_S)
        self.inference = list(actors)
        return info

    def reap_retired_inference(self) -> None:
        """Stop each removed inference actor once it holds no request (one without weights serves none: at
        once); after inference.generate_timeout_s, also with requests, which then fail over to the other
        actors (the rollout actors retry them there)."""
        from actors.inference import stop_inference_actors
        for entry in list(self.inference_retiring):
            actor, deadline, ref = entry
            if ref is None:
                ref = entry[2] = actor.stats.remote()
            idle = False
            if ray.wait([ref], timeout=5)[0]:
                entry[2] = None
                try:
                    stats = ray.get(ref)
                    idle = not stats["inflight"] and (not stats["held"] or not stats["has_weights"])
                except ray.exceptions.RayError:
                    idle = True         # gone already
            if idle or time.monotonic() > deadline:
                if not idle:
                    log.warning("a removed inference actor still held requests after inference.generate_timeout_s: "
                                "stopped; the rollout actors retry them on the others")
                stop_inference_actors([actor], timeout_s=INFERENCE_STOP_S)
                self.inference_retiring.remove(entry)

    def rollout_stats(self) -> dict:
        """Totals over live, retiring and removed rollout actors."""
        handles = dict(self.rollouts) | {actor_id: a for actor_id, (a, _) in self.retiring.items()}
        refs = {a.stats.remote(): actor_id for actor_id, a in handles.items()}
        # An actor still waiting for its node's resources (or starting, or restarting) cannot answer yet: its
        # last answer counts. (Resources that no node has were refused at start: see role_needs.)
        ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=10.0)
        if waiting:
            from common.placement import format_need
            log.warning("%d rollout actor(s) not started yet (each needs %s on one node; a busy cluster? see "
                        "`ray status`)", len(waiting), format_need(self.role_needs()["a rollout actor"]))
        for ref in ready:
            try:
                self._last_stats[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError:     # died since: _check_rollouts_alive restarts it
                pass
        total: dict = defaultdict(float)
        for stats in list(self._last_stats.values()) + list(self._rollout_totals.values()):
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
        # The bar's env steps/s: over the last RATE_WINDOW updates, not the last one alone. The rollout side
        # plays in bursts (it waits whenever the stream is full), so one update's delta swings between 0
        # and twice the mean; the window always spans some playing.
        samples = deque([(prev_t, prev.get("env_steps", 0.0))], maxlen=RATE_WINDOW + 1)
        terminal = self.terminal or Terminal(sys.stdout, sys.stderr)
        bar = terminal.bar = tqdm(initial=self.update, total=cfg.run.iterations, desc="training",
                                  unit="update", dynamic_ncols=True, file=terminal.err)
        while self.update < cfg.run.iterations:
            self._between_updates()
            if cfg.run.sync:
                self._collect_sync_batch()
            metrics = None
            while metrics is None:
                self._check_rollouts_alive()
                metrics = step_learner(self.learners, timeout_s=WAIT_FOR_DATA_S, on_wait=self._while_updating)
                if metrics is None:        # no full batch yet: stay responsive (scale commands, status)
                    self._between_updates()
                    self._publish_waiting_status()
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
            samples.append((now, stats.get("env_steps", 0.0)))
            (t_first, steps_first), (t_last, steps_last) = samples[0], samples[-1]
            steps_per_s = (steps_last - steps_first) / max(t_last - t_first, 1e-9)
            update = self.update = int(metrics["update"])
            if cfg.run.eval_every and update % cfg.run.eval_every == 0 and update < cfg.run.iterations:
                self.last_eval = self.evaluate(record=f"after update {update}")
                metrics.update({f"eval/{k}": v for k, v in self.last_eval.items() if isinstance(v, float)})
                terminal.print(eval_line(f"after update {update}", self.last_eval))
            metrics["rollout/actor_restarts"] = float(self.rollout_restarts)
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

    def _check_rollouts_alive(self) -> None:
        """A rollout actor that died (its process or its node) is restarted by Ray (max_restarts): its
        in-flight groups are abandoned (a group is published whole or not at all), the run goes on with the
        others, and it plays again once it is back. An exception inside its loop is a bug: the run stops."""
        for actor_id, ping in list(self.restarting.items()):
            done, _ = ray.wait([ping], timeout=0)
            if not done:
                continue
            try:                # it answers: back, play again (with the inference actors of now: its
                ray.get(ping)   # constructor's arguments may name others, from before a `scale --inference`)
                ray.get(self.rollouts[actor_id].set_inference_actors.remote(self.inference), timeout=60)
                del self.restarting[actor_id]
                self.rollout_runs[actor_id] = self.rollouts[actor_id].run.remote()
                log.info("rollout actor %s is back", actor_id)
            except ray.exceptions.RayError:     # still restarting (or waiting for a node): ask again later
                self.restarting[actor_id] = self.rollouts[actor_id].node.remote()
        for actor_id, ref in list(self.rollout_runs.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            try:
                ray.get(done[0])
                raise RuntimeError(f"rollout actor {actor_id} stopped unexpectedly")
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                del self.rollout_runs[actor_id]
                self.rollout_restarts += 1
                if actor_id in self._last_stats:    # its counters start again from 0 in its new life
                    self._rollout_totals[f"{actor_id}#{self.rollout_restarts}"] = self._last_stats.pop(actor_id)
                log.warning("rollout actor %s died (%s); Ray restarts it, its in-flight groups (at most %d) are "
                            "abandoned, training goes on with the other actors", actor_id,
                            str(exc).splitlines()[0][:200], self.cfg.rollout.groups_per_actor)
                self.restarting[actor_id] = self.rollouts[actor_id].node.remote()
            except ray.exceptions.RayError as exc:
                raise RuntimeError(f"rollout actor {actor_id} failed: {exc}") from exc

    def _while_updating(self) -> None:
        """Every ON_WAIT_EVERY_S of a long update (e.g. a weight push waiting for an inference actor whose
        node is gone): notice lost rollout actors and say so in the status."""
        self._check_rollouts_alive()
        self._publish_waiting_status(updating=True)

    def _publish_waiting_status(self, updating: bool = False) -> None:
        """While the driver waits on the learner: say why (paused by `scale --rollout 0`, rollout actors
        coming back after a loss, an update in progress, or waiting for data)."""
        if self.channel is None:
            return
        if not self.rollouts:
            state = "paused: no rollout actors (resume with `gigpo scale --rollout N`)"
        elif self.restarting:
            state = (f"waiting: {len(self.restarting)} rollout actor(s) coming back (their process or node was "
                     f"lost; Ray restarts them when a node with their resources is there)")
        else:
            state = "training" if updating else "waiting for data"
        self._publish_status(self._last_metrics, state=state)

    def _between_updates(self) -> None:
        """What the driver does while the learner is not in an update: apply `gigpo scale` commands, collect
        retired rollout actors, let started inference actors join, stop retired ones once idle."""
        self._apply_commands()
        self.reap_retired()
        self.join_started_inference()
        self.reap_retired_inference()

    def _apply_commands(self) -> None:
        for command in self.channel.pop_commands():
            op, n = command.get("op"), command.get("num_actors")
            if op == "scale_rollout" and isinstance(n, int):
                log.info("scaling rollout actors %d -> %d", len(self.rollouts), n)
                self.scale_rollout(max(0, n), drain=bool(command.get("drain", True)))
            elif op == "scale_inference" and isinstance(n, int) and n >= 1:
                log.info("scaling inference actors %d -> %d", len(self.inference) + len(self.inference_starting), n)
                self.scale_inference(n)
            else:
                log.warning("ignoring unknown command %r", command)

    def _publish_status(self, metrics: dict, state: str) -> None:
        last_eval = {f"eval/{k}": v for k, v in (self.last_eval or {}).items() if isinstance(v, float)}
        self.channel.publish_status({
            "run": self.cfg.run.name, "state": state, "iteration": int(metrics.get("update", 0)),
            "iterations": self.cfg.run.iterations, "policy_version": int(metrics.get("policy_version", 0)),
            "rollout_actors": len(self.rollouts), "inference_actors": len(self.inference),
            "inference_starting": len(self.inference_starting),
            "rollout_restarts": self.rollout_restarts, "rollout_restarting": len(self.restarting),
            "env_instances": len(self.rollouts) * self.cfg.rollout.groups_per_actor * self.cfg.rollout.group_size,
            "metrics": update_figures({**metrics, **last_eval}),
            "outputs": str(self.out.resolve()),
            "placement": self.placement_record(),
        })

    def placement_record(self) -> dict[str, dict]:
        """Each actor's node for the status record, {name: {"ip", "hostname"}} ("ip" None: not started yet);
        `gigpo status` groups the actors by node."""
        return {name: {"ip": node and node["ip"], "hostname": node and node["hostname"]}
                for name, node in self.refresh_placement().items()}

    # -- evaluation ------------------------------------------------------------------------------------

    def evaluate(self, split: str = "", record: str = "") -> dict:
        """Play the eval split (or `split`) once per task (group size 1, eval temperature) with the current
        weights. record: when the evaluation is ("before training", "after update 8", ...): the result,
        per-episode records included, is appended to <run.output_dir>/evals.jsonl under that label with the
        update and the policy version that played it (`gigpo eval` saves its own, in eval/)."""
        from actors.evaluation import evaluate_tasks
        from common.metrics import ActorMetrics
        cfg = self.cfg
        if split and split != cfg.env.eval_split:
            cfg = copy.deepcopy(cfg)
            cfg.env.eval_split = split
        result = evaluate_tasks(cfg, self.inference, log_dir=self.log_dir, model=self.model)
        if result.get("episodes"):
            ActorMetrics("driver", self.cfg.run.name).set("success_rate", float(result["success"]), split="eval")
        if record:
            line = {"when": record, "update": self.update, "split": cfg.env.eval_split,
                    "policy_version": ray.get(self.inference[0].policy_version.remote()), **result}
            # Appended by a resumed run, started anew otherwise (as metrics.jsonl).
            mode = "a" if self._evals_started or self.cfg.run.resume else "w"
            with open(self.out / EVALS_FILE, mode) as f:
                f.write(json.dumps(line) + "\n")
            self._evals_started = True
        return result


def train(cfg: ExperimentConfig) -> dict:
    """`gigpo train`: start, evaluate, train, evaluate, print a summary. The terminal shows a progress bar,
    one line per evaluation, warnings and the summary; every component's logs (the driver's included) go
    to <run.output_dir>/logs/."""
    log_dir = run_log_dir(cfg.run.output_dir)
    with run_output(log_dir) as terminal, System(cfg) as system:
        system.terminal = terminal
        terminal.print(f"run {cfg.run.name}: starting (logs in {log_dir})")
        system.start()
        before = system.evaluate(record="before training") if cfg.run.eval_every else None
        if before:
            terminal.print(eval_line("before training", before))
        t0 = time.perf_counter()
        history = system.train()
        train_s = time.perf_counter() - t0
        ray.get([w.save_checkpoint.remote() for w in system.learners])
        after = system.evaluate(record="after training") if cfg.run.eval_every else None
        if after:
            terminal.print(eval_line("after training", after))
        system._publish_status(history[-1] if history else {}, state="finished")
        stats = system.rollout_stats()
        summary = {"ok": True, "updates": len(history), "train_s": train_s,
                   "env_steps": stats.get("env_steps", 0.0), "before": before, "after": after,
                   "eval_split": cfg.env.eval_split, "outputs": str(system.out.resolve())}
        terminal.print(format_summary(summary))
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


def evaluate_only(cfg: ExperimentConfig, checkpoint: str = "", splits: list[str] | None = None) -> dict:
    """`gigpo eval`: the weights of `checkpoint` (a checkpoint directory), else of the latest checkpoint
    in run.output_dir, else the initial model, on each of `splits` (default: env.eval_split). The result,
    {"update", "policy_version", "splits": {split: summary}} (a summary per split as `summarize` makes it,
    per-episode records included), is printed in the paper's table layout and saved as
    <output_dir>/eval/update_<N>.json; its logs go to <output_dir>/eval/logs/. Nothing else in the run is
    touched (it may still be training). The run's own tiny / warm model is used as it is, whatever this
    config's settings for them; one the run lacks is built in a temporary directory, removed afterwards."""
    splits = list(splits or [cfg.env.eval_split])
    cfg.run.resume = True
    if checkpoint:
        cfg.run.output_dir, cfg.run.resume_tag = checkpoint_location(checkpoint)
    if not Path(cfg.run.output_dir).is_dir():
        from deploy.preflight import PreflightError
        raise PreflightError(f"no run to evaluate in {cfg.run.output_dir!r}: train one there first, or set "
                             f"run.output_dir (or --checkpoint) to a run's directory")
    eval_dir = Path(cfg.run.output_dir).resolve() / "eval"
    shared_dir = cfg.inference.weights_dir
    if shared_dir:      # the run's actors may be reading this directory: publish to a private one inside it
        cfg.inference.weights_dir = os.path.join(shared_dir, f"eval-{os.getpid()}-{int(time.time())}")
    scratch = tempfile.mkdtemp(prefix="gigpo-eval-")
    try:
        with run_output(eval_dir / "logs") as terminal, System(cfg) as system:
            system.log_dir, system.terminal = str(eval_dir / "logs"), terminal
            system.start(eval_only=True, scratch_dir=scratch)
            served = ray.get(system.inference[0].policy_version.remote())
            result = {"update": system.update, "policy_version": served, "splits": {}}
            for split in splits:
                result["splits"][split] = system.evaluate(split)
                terminal.print(eval_line(f"({split})", result["splits"][split]))
            path = eval_dir / f"update_{result['update']:07d}.json"
            path.write_text(json.dumps(result, indent=2))
            terminal.print(format_eval(f"update {result['update']} (policy version {served})", result["splits"]))
            terminal.print(f"saved to {path}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if shared_dir:
            shutil.rmtree(cfg.inference.weights_dir, ignore_errors=True)
    return result


def eval_line(when: str, result: dict) -> str:
    """One evaluation in one line: overall success, then per task type (full names), WebShop's score."""
    parts = [f"eval {when}: success {100 * result.get('success', 0.0):.1f}% over {result.get('episodes', 0)} "
             f"episodes"]
    per_type = result.get("per_task_type", {})
    if per_type and set(per_type) != {"all"}:
        parts.append(", ".join(f"{name} {100 * value:.1f}%" for name, value in sorted(per_type.items())))
    if "score" in result:
        parts.append(f"score {100 * result['score']:.1f}")
    if result.get("valid_action_share", 1.0) < 1.0:
        parts.append(f"valid responses {100 * result['valid_action_share']:.1f}%")
    return " | ".join(parts)


# The paper's ALFWorld table: its column per task type, in its order (Table 1: Pick, Look, Clean, Heat,
# Cool, Pick2, All). Other task names (none in the standard game set) keep their own name, after these.
PAPER_COLUMNS = {
    "pick_and_place_simple": "Pick", "look_at_obj_in_light": "Look", "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat", "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}


def format_eval(title: str, results: dict[str, dict]) -> str:
    """The paper's table layout, one row per split (`results`: split -> summary): success in % per task
    type and All for ALFWorld; score and success (Succ.) for WebShop; then the episodes played. A task type
    a split did not play shows "-"."""
    types = {t for r in results.values() for t in r.get("per_task_type", {}) if t not in ("all", "webshop")}
    order = list(PAPER_COLUMNS)
    types = sorted(types, key=lambda t: (order.index(t) if t in order else len(order), t))
    webshop = any("score" in r for r in results.values())
    columns = ([("Score", lambda r: 100 * r["score"] if "score" in r else None)] if webshop else []) + [
        (PAPER_COLUMNS.get(t, t), lambda r, t=t: 100 * r["per_task_type"][t] if t in r.get("per_task_type", {})
         else None) for t in types] + [("Succ." if webshop else "All", lambda r: 100 * r.get("success", 0.0))]
    first = max([len("split")] + [len(s) for s in results])
    widths = [max(6, len(name)) for name, _ in columns]
    lines = [f"== {title}: %", f"{'split':<{first}} | " + " | ".join(
        f"{name:>{w}}" for (name, _), w in zip(columns, widths)) + " | episodes"]
    for split, r in results.items():
        cells = ["-" if v is None else f"{v:.1f}" for v in (value(r) for _, value in columns)]
        lines.append(f"{split:<{first}} | " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
                     + f" | {r.get('episodes', 0):8d}")
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = ["", "=" * 72, f"trained {summary['updates']} updates in {summary['train_s'] / 60:.1f} min, "
             f"{summary['env_steps']:.0f} env steps"]
    if summary.get("before") and summary.get("after"):
        b, a = summary["before"]["success"], summary["after"]["success"]
        lines.append(f"success before {100 * b:.1f}%  ->  after {100 * a:.1f}%   ({100 * (a - b):+.1f} points)")
        if "score" in summary["before"] and "score" in summary["after"]:      # WebShop: the paper's other figure
            b, a = summary["before"]["score"], summary["after"]["score"]
            lines.append(f"score   before {100 * b:.1f}    ->  after {100 * a:.1f}    ({100 * (a - b):+.1f} points)")
        lines.append(format_eval("after training", {summary.get("eval_split", "eval"): summary["after"]}))
    lines.append(f"outputs: {summary['outputs']} (tensorboard --logdir {summary['outputs']}/tensorboard; "
                 f"each step's credit: gigpo view {summary['outputs']})")
    lines.append("=" * 72)
    return "\n".join(lines)

