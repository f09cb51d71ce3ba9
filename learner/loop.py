"""The learner loop: stream -> batch -> train -> push weights -> (checkpoint) -> ack.

    learner = Learner(cfg, model_path, TrajectoryStream(url, cfg.stream), publisher=create_weight_transfer(cfg, actors))
    while learner.updates < cfg.run.iterations:
        metrics = learner.step()          # one update; None if no full batch arrived in time
    learner.close()

`Learner` is a plain object with a single-step API: it runs in a script, a test, or a Ray actor (one per
learner process, `learner.actor`, which sets the torchrun-style RANK/WORLD_SIZE/MASTER_* variables first).
With several processes rank 0 reads the stream, pushes weights and acks; the batch is broadcast to the
other ranks, which train on their share and join the collectives.

Exactly-once training across restarts. A group id enters `trained_group_ids` when its update is done; the
checkpoint stores that set and the policy version with the DeepSpeed state. With checkpointing on, groups
are acked only once a checkpoint containing their update is written: a learner killed between checkpoints
loses those updates, but their groups are still pending in the stream and the resumed learner trains on
them again (no gap), while groups inside the checkpoint are acked untrained by the read policy (no
duplicate). Unacked groups occupy the stream's bound (stream.max_stream_groups), so a checkpoint is forced
whenever they would leave the producers no room for the next batch. Without a checkpoint directory, or with
learner.ack_on_checkpoint=false, groups are acked right after their update (a crash then loses them with
the updates since the last checkpoint). Versions and policy lag after a crash: `Learner._resume`.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.atomic_write import write_atomically
from common.config import ExperimentConfig
from common.run_dir import PUSHED_VERSION, checkpoints_dir, prepare_checkpoint_dir
from common.staleness import policy_lag
from common.stream.records import EpisodeGroup
from learner.batching import GroupLimits, build_batch, check_group
from learner.collectives import broadcast, broadcast_groups
from learner.group_record import GroupRecorder
from learner.learner_metrics import LearnerMetrics
from learner.read_policy import groups_to_train
from learner.trainer import PolicyTrainer, TrainStepResult, setup_distributed

if TYPE_CHECKING:
    from common.stream.interface import TrajectorySource
    from common.weights.interface import WeightPublisher

log = logging.getLogger(__name__)


class Learner:
    """One learner process: owns the trainer, and on rank 0 the stream reader and weight publisher."""

    def __init__(self, cfg: ExperimentConfig, model_path: str, trajectories: TrajectorySource | None = None,
                 *, publisher: WeightPublisher | None = None, checkpoint_dir: str | None = None,
                 resume: bool | None = None, read_block_ms: int = 1000, read_only: bool = False):
        """
        model_path: the initial policy (local, Hugging Face format). trajectories: where rank 0 reads groups (a
        common.stream.interface.TrajectorySource; None: groups come through `step(groups)`). publisher: where
        rank 0 pushes weights (a common.weights.interface.WeightPublisher; None: nowhere). Both are built by
        the caller (learner.actor: from the run's Redis URL and inference actors), who owns them; rank 0 alone
        uses them. checkpoint_dir: default <run.output_dir>/checkpoints, "" none. resume: load the
        latest checkpoint there, or cfg.run.resume_tag (default cfg.run.resume); without it, existing
        checkpoints are refused unless cfg.run.overwrite (`common.run_dir.prepare_checkpoint_dir`). read_only:
        serve a checkpoint without touching the run (`gigpo eval`): nothing written, `step` refused, weights
        pushed under the checkpoint's own policy version.
        """
        self.cfg = cfg
        self.read_only = read_only
        self.group_limits = GroupLimits.of(cfg)       # what a group this run made can hold (_valid)
        resume = cfg.run.resume if resume is None else resume
        self.checkpoint_dir = (str(checkpoints_dir(cfg.run.output_dir)) if checkpoint_dir is None
                               else checkpoint_dir) or None
        if self.checkpoint_dir and not read_only:     # before the (slow) engine start: a clear error at once
            prepare_checkpoint_dir(self.checkpoint_dir, resume=resume, overwrite=cfg.run.overwrite,
                                   rank=setup_distributed()[0])
        self.trainer = PolicyTrainer(model_path, cfg.learner, dtype=cfg.model.dtype,
                                     head_dtype=cfg.model.head_dtype, seed=cfg.run.seed,
                                     temperature=cfg.rollout.temperature)
        self.rank, self.world_size = self.trainer.rank, self.trainer.world_size
        self.read_block_ms = read_block_ms
        self.stream: TrajectorySource | None = trajectories if self.rank == 0 else None
        self.publisher: WeightPublisher | None = publisher if self.rank == 0 else None
        # Every rank must know whether rank 0 pushes (ZeRO-3 gathers need all ranks).
        self._pushes = bool(self._broadcast(self.publisher is not None))

        self.policy_version = 0                    # version of the weights the actors have (0 = initial)
        # (checkpoint version, version of the resumed weights) of the last resume: see policy_lag
        self._resumed_versions: tuple[int, int] | None = None
        self.trained_group_ids: set[str] = set()   # groups whose update is done (committed or not)
        self.committed_group_ids: set[str] = set() # ... of those, the ones inside the last checkpoint
        self._unacked: list = []                   # stream entries trained on, not yet acked
        self._pending: list = []                   # stream entries read, waiting for a full batch
        self.updates = 0
        self.last_group_ids: list[str] = []         # groups of the latest update (for logs and tests)
        self._update_record: dict = {}              # the latest update's record, for its checkpoint
        self.resumed_record: dict | None = None     # ... of the checkpoint this learner resumed from
        self.stats = {"bad_groups": 0, "groups_trained": 0, "groups_skipped_equal_returns": 0}
        # Prometheus metrics (through Ray; no-ops outside it), rank 0's alone
        self.metrics = LearnerMetrics(self.rank, self.stream) if self.rank == 0 else None
        if resume:
            self._resume()
        if self.stream is not None and not read_only:
            self.stream.forget_trained()        # (a dead learner's marks: its unacked groups come back untrained)
        self.repush_if_needed()     # inference actors that started without the model's weights wait for them
        if self.metrics is not None:
            self.metrics.set("policy_version", self.policy_version)
        # groups.jsonl's line of each update, for `gigpo view` (the driver writes it: learner.actor)
        self.recorder = GroupRecorder(cfg, resume=resume) if self.rank == 0 and not read_only else None
        self.last_groups_record: dict | None = None

    def _resume(self) -> None:
        """Continue the run in checkpoint_dir from its latest checkpoint (or run.resume_tag): weights,
        optimizer, update count, trained group ids and policy version.

        The updates after the checkpoint (at version c) were lost, but their weights may have reached the
        actors as versions c+1..P (P: PUSHED_VERSION, written before each push). A version never names two
        weights, so the checkpoint's weights go out at once as P+1 (the resume's only push). The lost updates'
        groups, never acked, come back first in the order first read and are trained again, not judged stale
        anew (against P+1, with checkpoints rarer than max_policy_lag, most would be deleted untrained). Lag is
        counted in the learner's own history (`policy_lag`): the resumed weights stand where c stood, each
        later version one step further, a lost version v at v (the redo retraces the lost updates on the same
        groups in order), so groups sampled just before the crash are as fresh when the redo reaches them as
        without it.
        """
        if not self.checkpoint_dir:
            return
        state = self.trainer.load_checkpoint(self.checkpoint_dir, tag=self.cfg.run.resume_tag or None)
        if state is not None:
            self.trained_group_ids = set(state.get("trained_group_ids", []))
            self.committed_group_ids = set(self.trained_group_ids)
            self.policy_version = int(state.get("policy_version", 0))
            self.updates = int(state.get("updates", 0))
            self.resumed_record = state.get("update_record")
        if self.read_only:
            log.info("loaded update %d, policy version %d (read-only)", self.updates, self.policy_version)
            return
        pushed = None
        if self.rank == 0:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pushed = int((Path(self.checkpoint_dir) / PUSHED_VERSION).read_text().strip())
        pushed = self._broadcast(pushed)
        if state is None and pushed is None:
            log.info("no checkpoint under %s: starting fresh", self.checkpoint_dir)
            return
        # Also without a checkpoint (a crash before the first one): the initial weights, above P.
        checkpoint_version = self.policy_version
        self.policy_version = max(self.policy_version, pushed or 0)
        if self._pushes:
            self.publish_weights()
        self._resumed_versions = (checkpoint_version, self.policy_version)
        log.info("resumed at update %d (checkpoint %s), policy version %d, %d trained groups", self.updates,
                 "none" if state is None else f"at version {state.get('policy_version', 0)}",
                 self.policy_version, len(self.trained_group_ids))

    def policy_lag(self, version: int) -> int:
        """Versions of this learner's own history between the weights that sampled `version` and the current
        ones (common.staleness.policy_lag, with this learner's resume, `_resume`)."""
        return policy_lag(version, self.policy_version, self._resumed_versions)

    def _read_groups(self, timeout_s: float | None) -> list | None:
        """Rank 0: stream entries until groups_per_batch are in hand (None on timeout; what was read
        stays pending for the next call)."""
        need = self.cfg.learner.groups_per_batch
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self._pending) < need:
            got = self.stream.read(need - len(self._pending), self.read_block_ms)
            # The newest version pushed is policy_version: the push is done before the next read.
            got = groups_to_train(self.stream, got, trained_ids=self.trained_group_ids,
                        held_ids=(r.group.group_id for r in self._pending), newest_version=self.policy_version,
                        policy_lag=self.policy_lag, max_policy_lag=self.cfg.stream.max_policy_lag)
            self._pending.extend(self._valid(got))
            if deadline is not None and time.monotonic() > deadline and len(self._pending) < need:
                return None
        batch, self._pending = self._pending[:need], self._pending[need:]
        return batch

    def _valid(self, received: list) -> list:
        """The groups that pass `learner.batching.check_group`; the others go to the dead-letter stream with
        the reason, so that one bad group neither crashes the learner nor comes back."""
        good = []
        for r in received:
            try:
                check_group(r.group, self.trainer.vocab_size, self.group_limits)
                good.append(r)
            except ValueError as exc:
                log.error("dead-lettering group %s: %s", r.group.group_id, exc)
                self.stats["bad_groups"] += 1
                self.stream.dead_letter([r], f"learner: {exc}")
        return good

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every process (msgpack's types; no pickle: learner.collectives)."""
        return value if self.world_size == 1 else broadcast(value)

    def step(self, groups: list[EpisodeGroup] | None = None, timeout_s: float | None = None
             ) -> dict[str, float] | None:
        """One update. Groups come from the stream (rank 0 reads, waiting up to timeout_s; None: forever)
        unless given. Returns the update's metrics, or None when no full batch arrived in time."""
        if self.read_only:
            raise RuntimeError("this learner is read-only (it serves a checkpoint for evaluation): no training")
        t_start = time.perf_counter()
        groups, received = self._next_groups(groups, timeout_s)          # read (stale groups: not returned)
        if groups is None:
            self.repush_if_needed()      # an inference actor back from a restart without weights
            if self.metrics is not None:
                self.metrics.record_no_batch(time.perf_counter() - t_start)
            return None
        times = {"time/wait_data_s": time.perf_counter() - t_start}
        with _timed(times, "time/build_batch_s"):
            batch, groups, received = self._build_batch(groups, received)     # advantages (bad groups out)
        lags = [self.policy_lag(g.policy_versions[0]) for g in groups if g.policy_versions[0] >= 0]
        trained = self._train(batch, groups)
        if self.recorder is not None:
            self.last_groups_record = self.recorder.build(groups, batch, self.updates,
                                                          learner_logprobs=trained.learner_logprobs)
        with _timed(times, "time/push_weights_s"):
            # Nothing trained (every group skipped): the actors' weights stand.
            push_info = self.publish_weights() if batch.num_rows else {}
        # What the driver writes of this update, kept in a checkpoint of it: a driver killed between the
        # checkpoint and its own write leaves the resumed run the means to fill that line (System.start).
        self._update_record = {"update": self.updates, "groups": self.last_groups_record,
                               "metrics": {**batch.metrics, **trained.metrics, "update": float(self.updates),
                                           "policy_version": float(self.policy_version)}}
        with _timed(times, "time/checkpoint_s"):
            checkpointed = self._commit(received)                        # checkpoint, then ack
        times["time/step_s"] = time.perf_counter() - t_start
        metrics = self._step_metrics(batch, trained.metrics, push_info, groups, lags, times, checkpointed)
        if self.metrics is not None:
            self.metrics.record_update(metrics, groups, received, batch.skipped_group_ids)
        return metrics

    def _next_groups(self, groups: list[EpisodeGroup] | None, timeout_s: float | None
                     ) -> tuple[list[EpisodeGroup] | None, list | None]:
        """The batch's groups on every process (rank 0 reads them from the stream unless given) and, when
        read, the stream entries they came in (to ack once trained)."""
        received = None
        if self.rank == 0 and groups is None:
            if self.stream is None:
                raise ValueError("Learner.step() without groups needs a trajectory source")
            received = self._read_groups(timeout_s)
            groups = None if received is None else [r.group for r in received]
        return (groups if self.world_size == 1 else broadcast_groups(groups)), received

    def _build_batch(self, groups: list[EpisodeGroup], received: list | None):
        """(batch, groups, received) with advantages. Groups that passed the checks on read but cannot be batched
        go to the dead-letter stream with the reason (a retry would fail the same way); the others train."""
        penalty = self.cfg.rollout.invalid_action_penalty
        try:
            return build_batch(groups, self.cfg.learner, invalid_action_penalty=penalty), groups, received
        except ValueError as e:
            log.error("dropping groups of a bad batch: %s", e)
        good = []
        for g in groups:
            try:
                build_batch([g], self.cfg.learner, invalid_action_penalty=penalty)
                good.append(g)
            except ValueError as exc:
                self.stats["bad_groups"] += 1
                if received is not None:
                    self.stream.dead_letter([r for r in received if r.group.group_id == g.group_id],
                                            f"learner: {exc}")
                    received = [r for r in received if r.group.group_id != g.group_id]
        return build_batch(good, self.cfg.learner, invalid_action_penalty=penalty), good, received

    def _train(self, batch, groups: list[EpisodeGroup]) -> TrainStepResult:
        """One optimizer pass over the batch; the update and its groups are counted as trained."""
        trained = self.trainer.train_step(batch, update=self.updates)
        self.updates += 1
        self.trained_group_ids.update(batch.group_ids)
        self.last_group_ids = list(batch.group_ids)
        self.stats["groups_trained"] += len(groups) - len(batch.skipped_group_ids) - len(batch.env_error_group_ids)
        self.stats["groups_skipped_equal_returns"] += len(batch.skipped_group_ids)
        return trained

    def _commit(self, received: list | None) -> bool:
        """Ack the update's stream entries at once, or (learner.ack_on_checkpoint) with the checkpoint covering
        them, taken every learner.checkpoint_every updates or when unacked groups crowd the stream. Returns
        whether a checkpoint was taken."""
        deferred = bool(self.checkpoint_dir) and self.cfg.learner.ack_on_checkpoint
        if received is not None:
            self._unacked.extend(received)
            if deferred and self.stream is not None:
                self.stream.trained(received)     # no longer untrained: the producers' lag bound leaves them out
        checkpointed = False
        if self.checkpoint_dir:
            every = self.cfg.learner.checkpoint_every
            due = every > 0 and self.updates % every == 0
            # Unacked groups still count against the stream's bound; checkpoint (and ack) early rather than
            # leave the producers no room for the next batch.
            room = self.cfg.stream.max_stream_groups - self.cfg.learner.groups_per_batch
            crowded = deferred and self._broadcast(
                len(self._unacked) + len(self._pending) > room if self.rank == 0 else None)
            checkpointed = due or crowded
            if checkpointed:
                self.save_checkpoint()
        if not deferred:
            self._ack()
        return checkpointed

    def _step_metrics(self, batch, train: dict, push_info: dict, groups: list[EpisodeGroup], lags: list[int],
                      times: dict[str, float], checkpointed: bool) -> dict[str, float]:
        """The update's metrics (metrics.jsonl, TensorBoard): batch, training, push, lags, phase times, the
        stream's and the learner's counters."""
        now = time.time()
        ages = [now - g.created_at for g in groups if g.created_at > 0]
        metrics: dict[str, float] = {
            **batch.metrics, **train,
            **{f"push/{k}": float(v) for k, v in push_info.items() if isinstance(v, (int, float))},
            "update": float(self.updates),
            "policy_version": float(self.policy_version),
            "lag/group_age_s_mean": float(np.mean(ages)) if ages else 0.0,
            **times,
            "time/groups_per_s": len(groups) / max(times["time/step_s"], 1e-9),
            "checkpointed": float(checkpointed),
        }
        if lags:     # (groups of a warm start or a test carry no version)
            metrics.update({"lag/policy_versions_min": float(min(lags)), "lag/policy_versions_max": float(max(lags)),
                            "lag/policy_versions_mean": float(np.mean(lags))})
        if self.stream is not None:
            metrics.update({f"stream/{k}": float(v) for k, v in self.stream.stats.items()})
            metrics["stream/depth"] = float(self.stream.depth())
        metrics.update({f"learner/{k}": float(v) for k, v in self.stats.items()})
        return metrics

    def publish_weights(self) -> dict:
        """Push the current weights as the next policy version (all processes call it). The version is recorded
        beside the checkpoints first (a crash in between skips a number), so that a resumed learner never
        reuses a number for different weights. Read-only: the checkpoint's own version, nothing recorded."""
        version = self.policy_version + (0 if self.read_only else 1)
        info: dict = {}
        if self._pushes:
            if self.rank == 0 and self.checkpoint_dir and not self.read_only:
                write_atomically(Path(self.checkpoint_dir) / PUSHED_VERSION, str(version), durable=True)
            info = self._push(version)
        self.policy_version = version
        if self.metrics is not None:
            self.metrics.set("policy_version", version)
        return info

    def repush_if_needed(self) -> dict:
        """Push the current weights again, as the current version, when an inference actor lacks them (started
        with dummy weights, or restarted): at start and when a step finds no batch, so that an actor is served
        even while no update happens. All processes call it; rank 0 asks the publisher (`needs_push`), and a
        failed check is logged and asked again next time."""
        if not self._pushes:
            return {}
        need = False
        if self.rank == 0 and self.publisher is not None:
            try:
                need = bool(self.publisher.needs_push(self.policy_version))
            except Exception as exc:  # noqa: BLE001 - an actor restarting right now: ask again next time
                log.warning("could not ask the inference actors for their weights: %s", exc)
        if not self._broadcast(need):
            return {}
        info = self._push(self.policy_version)
        if self.rank == 0:
            log.info("pushed version %d again to inference actors without it (%.2f s, %s)", self.policy_version,
                     info.get("total_s", 0.0), info.get("transfer", "?"))
        return info

    def _push(self, version: int) -> dict:
        """Rank 0 pushes the weights as `version` (returns the publisher's timings); at ZeRO-3 the other ranks
        join its collective gathers. LoRA with learner.lora_push=adapter: the adapters, after the base model's
        weights where an inference actor lacks them (every rank learns whether, for the gathers)."""
        if self.trainer.pushes_adapter:
            need_base = bool(self._broadcast(self.rank == 0 and self.publisher.needs_base()))
            adapter = self.trainer.adapter_weights()
            base = self.trainer.named_weights(base=True) if need_base else None
            if self.rank == 0:
                return self.publisher.push_adapter(adapter, version, base) or {}
            if base is not None and self.cfg.learner.zero_stage == 3:
                for _ in base:
                    pass
            return {}
        if self.rank == 0:
            return self.publisher.push(self.trainer.named_weights(), version) or {}
        if self.cfg.learner.zero_stage == 3:
            for _ in self.trainer.named_weights():
                pass
        return {}

    def set_inference_actors(self, inference_actors: list) -> dict:
        """Push to these inference actors from now on (`gigpo scale --inference`, between two updates); an added
        one that lacks the current version gets it now (a repush). All processes call it. Returns the repush's
        timings (none when not needed) and the current policy version."""
        if self._pushes and self.rank == 0:
            self.publisher.set_actors(inference_actors)
        return {**self.repush_if_needed(), "policy_version": self.policy_version}

    def _ack(self) -> None:
        if self.stream is not None and self._unacked:
            self.stream.ack(self._unacked)
        self._unacked = []

    def save_checkpoint(self) -> str | None:
        """Checkpoint now (all processes), then ack every group it covers."""
        if not self.checkpoint_dir or self.read_only:
            return None
        record = self._update_record if self._update_record.get("update") == self.updates else None
        path = self.trainer.save_checkpoint(self.checkpoint_dir, {
            "trained_group_ids": sorted(self.trained_group_ids),
            "policy_version": self.policy_version,
            "updates": self.updates,
            "update_record": record if self.rank == 0 else None,
        }, keep=self.cfg.learner.keep_checkpoints)
        self.committed_group_ids = set(self.trained_group_ids)
        self._ack()
        return path

    def close(self, checkpoint: bool = True) -> None:
        """Checkpoint uncommitted updates (so their groups get acked), then free the engine."""
        if checkpoint and self.checkpoint_dir and self.trained_group_ids != self.committed_group_ids:
            self.save_checkpoint()
        self.trainer.close()


@contextlib.contextmanager
def _timed(times: dict[str, float], key: str):
    """times[key] = the seconds the with-block took."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[key] = time.perf_counter() - t0
