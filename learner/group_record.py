"""A bounded record of each update's training groups, step by step with the credit every step got, for
`gigpo view` (deploy/tools/viewer.py): one JSON line per update in <run.output_dir>/groups.jsonl.

    recorder = GroupRecorder(cfg, resume=resume)
    result = trainer.train_step(batch, update)                   # learner rank 0 (a TrainStepResult)
    line = recorder.build(groups, batch, update, learner_logprobs=result.learner_logprobs)
    recorder.write(line)                                         # the driver, where the run's files are
    recorder.record(groups, batch, update, learner_logprobs=...)  # both in one process (tests, a script)

Learner rank 0 builds the line and hands it to the driver with the update's metrics (learner.actor), which
writes it on its own node: without a filesystem the nodes share, `gigpo view` on the head finds every update.

`group_record` builds the line from what the update holds (no forward pass): the first run.record_groups
groups it trained on and every step row of their trajectories, with GiGPO's episode and step advantages and
GRPO's (learner.gigpo on the recorded groups alone: every statistic is within one episode group, so these
are the batch's values), the advantage trained with (from the TrainBatch) and, when the update recomputed
the old log-probs, the mean |learner - vLLM| log-prob gap of the row's tokens. Texts are cut at
MAX_TEXT_CHARS, each distinct observation (anchor text) stored once per group. One line:

    {"update": 3, "algorithm": "gigpo", "omega": 1.0, "groups_in_update": 4, "groups": [
      {"group_id": "...", "task_id": "...", "env": "alfworld", "task_type": "pick_and_place_simple",
       "env_error_trajectories": 0,
       "trajectories": [{"traj_id": "...", "success": true, "return": 10.0, "score": 1.0, "steps": 4,
                         "termination": "done"}, ...],
       "observations": [{"text": "You are in the middle of a room...", "chars": 312}, ...],
       "rows": [{"traj": 0, "step": 0, "obs": 0, "action": "go to desk 1", "valid": true, "reward": 0.0,
                 "anchor_group": 0, "adv": 0.53, "episode_adv": 0.2, "step_adv": 0.33, "grpo_adv": 0.2,
                 "policy_version": 2, "logprob_gap": 0.004}, ...]}]}

"traj" indexes the group's "trajectories" (env-error ones left out, as build_batch does, and counted), "obs"
its "observations"; "anchor_group" numbers its anchor groups by first appearance. "adv" is null for a row
not trained (an empty response), "logprob_gap" without a recompute.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from common.config import ExperimentConfig, LearnerConfig
from common.run_dir import GROUPS_FILE
from common.stream.records import EpisodeGroup
from learner.batching import TrainBatch, advantage_rows, known_outcomes, usable_rows
from learner.gigpo import estimate_grpo, factorize, gigpo_parts_of

log = logging.getLogger(__name__)

MAX_TEXT_CHARS = 2000       # an observation (a WebShop page can be ~10k characters) or action is cut here


def cut(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text`, cut to `limit` characters ("..." marks the cut)."""
    return text if len(text) <= limit else text[:limit] + "..."


def batch_rows(groups: list[EpisodeGroup], batch: TrainBatch) -> list[tuple[EpisodeGroup, np.ndarray, np.ndarray]]:
    """(group, its usable rows, the batch row of each or -1) of every group the batch trained on, in order, as
    build_batch lays them out (skipped and env-error groups and empty responses left out); ValueError else."""
    left_out = set(batch.skipped_group_ids) | set(batch.env_error_group_ids)
    out, start = [], 0
    for g in groups:
        if g.group_id in left_out:
            continue
        rows = usable_rows(g)
        trained = g.rows["response_len"][rows] > 0
        n = int(trained.sum())
        if batch.row_group[start:start + n] != [g.group_id] * n:
            raise ValueError(f"the batch's rows do not line up with group {g.group_id}")
        where = np.full(len(rows), -1, dtype=np.int64)
        where[trained] = start + np.arange(n)
        start += n
        out.append((g, rows, where))
    if start != batch.num_rows:
        raise ValueError(f"the batch has {batch.num_rows} rows, its groups' trained rows are {start}")
    return out


def group_record(groups: list[EpisodeGroup], batch: TrainBatch, cfg: LearnerConfig, *, keep: int, update: int,
                 invalid_action_penalty: float, learner_logprobs: list[np.ndarray] | None = None,
                 max_text_chars: int = MAX_TEXT_CHARS) -> dict:
    """The groups.jsonl line of one update: `groups`, the `batch` build_batch made of them with `cfg` and
    `invalid_action_penalty`; `keep`: how many trained groups; `learner_logprobs`: the recomputed old
    log-probs per batch row, or None."""
    chosen = batch_rows(groups, batch)[:keep]
    # The chosen groups' rows, flattened as build_batch flattens them, for learner.gigpo's estimators.
    flat = advantage_rows([(g, rows) for g, rows, _ in chosen], invalid_action_penalty)
    parts = gigpo_parts_of(flat, cfg)
    grpo, _ = estimate_grpo(flat, cfg)
    out_groups, first = [], 0
    for g, rows, where in chosen:
        span = slice(first, first + len(rows))
        first += len(rows)
        out_groups.append(_group_entry(g, rows, where, batch, flat.anchors[span], parts.anchor_group[span],
                                       {"episode_adv": parts.episode[span], "step_adv": parts.step[span],
                                        "grpo_adv": grpo[span]}, learner_logprobs, max_text_chars))
    return {"update": int(update), "algorithm": cfg.algorithm, "omega": float(cfg.omega),
            "groups_in_update": len(groups), "groups": out_groups}


def _group_entry(g: EpisodeGroup, rows: np.ndarray, where: np.ndarray, batch: TrainBatch, anchors: list[str],
                 anchor_codes: np.ndarray, advantages: dict[str, np.ndarray],
                 learner_logprobs: list[np.ndarray] | None, max_text_chars: int) -> dict:
    """One recorded group: its usable trajectories, distinct observations and step rows."""
    kept_trajs = np.flatnonzero(known_outcomes(g))
    position = np.zeros(len(g.trajectories), dtype=np.int64)
    position[kept_trajs] = np.arange(len(kept_trajs))
    obs_codes = factorize(anchors)
    first_of_obs = np.unique(obs_codes, return_index=True)[1]
    actions = g.rows.text("action")
    # Columns as lists first: indexing numpy scalars row by row would cost more than the rest together.
    columns = {"traj": position[g.row_trajectory()[rows]].tolist(), "step": g.rows["step"][rows].tolist(),
               "obs": obs_codes.tolist(), "action": [cut(actions[i], max_text_chars) for i in rows.tolist()],
               "valid": g.rows["valid"][rows].tolist(), "reward": g.rows["reward"][rows].tolist(),
               "anchor_group": factorize(anchor_codes).tolist(),     # numbered within the group
               "adv": [None if b < 0 else float(batch.advantages[b]) for b in where.tolist()],
               **{name: values.tolist() for name, values in advantages.items()},
               "policy_version": g.rows["policy_version"][rows].tolist(),
               "logprob_gap": (_logprob_gaps(g, rows, where, batch, learner_logprobs) if learner_logprobs is not None
                               else [None] * len(rows))}
    trajs = [g.trajectories[k] for k in kept_trajs]
    return {
        "group_id": g.group_id, "task_id": g.task_id, "env": g.env_name,
        "task_type": next((t.task_type for t in trajs if t.task_type), ""),
        "env_error_trajectories": len(g.trajectories) - len(trajs),
        "trajectories": [{"traj_id": t.traj_id, "success": bool(t.success), "return": float(t.episode_return),
                          "score": float(t.score), "steps": int(t.num_steps), "termination": t.termination.value}
                         for t in trajs],
        "observations": [{"text": cut(anchors[i], max_text_chars), "chars": len(anchors[i])}
                         for i in first_of_obs.tolist()],
        "rows": [dict(zip(columns, values)) for values in zip(*columns.values())],
    }


def _logprob_gaps(g: EpisodeGroup, rows: np.ndarray, where: np.ndarray, batch: TrainBatch,
                  learner_logprobs: list[np.ndarray]) -> list[float | None]:
    """Per row, the mean |learner - vLLM| log-prob over its tokens in the loss (forced tokens are not: see
    learner.batching.forced_token_mask); None for an untrained row or one without such tokens."""
    gaps: list[float | None] = [None] * len(rows)
    trained = np.flatnonzero(where >= 0)          # (each has a response: no empty segment below)
    if not len(trained):
        return gaps
    in_batch = where[trained].tolist()
    lengths = g.rows["response_len"][rows[trained]].astype(np.int64)
    first = np.concatenate(([0], np.cumsum(lengths)[:-1]))          # where each row starts, flattened
    tokens = np.repeat(g.rows.offsets("response_len")[rows[trained]] - first, lengths) + np.arange(lengths.sum())
    sampled = g.rows["response_logprobs"][tokens].astype(np.float64)
    learner = np.concatenate([learner_logprobs[b] for b in in_batch]).astype(np.float64)
    mask = np.concatenate([batch.token_mask(b) for b in in_batch])
    sums = np.add.reduceat(np.where(mask, np.abs(learner - sampled), 0.0), first)
    counts = np.add.reduceat(mask.astype(np.int64), first)
    for j, total, count in zip(trained.tolist(), sums.tolist(), counts.tolist()):
        gaps[j] = total / count if count else None
    return gaps


class GroupRecorder:
    """The writer of groups.jsonl (the driver's; a new run starts it anew, a resumed one appends). A record
    that cannot be built or written is logged and skipped: it never stops the training."""

    def __init__(self, cfg: ExperimentConfig, *, resume: bool):
        self.cfg = cfg
        self.path = Path(cfg.run.output_dir) / GROUPS_FILE
        self._mode = "a" if resume else "w"

    def build(self, groups: list[EpisodeGroup], batch: TrainBatch, update: int, *,
              learner_logprobs: list[np.ndarray] | None) -> dict | None:
        """The update's line (None: run.record_groups is 0, or it could not be built). learner_logprobs: the
        old log-probs the training step recomputed (`learner.trainer.TrainStepResult`), None without a
        recompute."""
        if not self.cfg.run.record_groups:
            return None
        try:
            line = group_record(groups, batch, self.cfg.learner, keep=self.cfg.run.record_groups, update=update,
                                invalid_action_penalty=self.cfg.rollout.invalid_action_penalty,
                                learner_logprobs=learner_logprobs)
            json.dumps(line, allow_nan=False)      # what write() needs: fail here, where the cause is
            return line
        except Exception as exc:  # noqa: BLE001 - a diagnostic record is never worth stopping a training run
            log.warning("update %d: no record for %s: %s: %s", update, self.path, type(exc).__name__, exc)
            return None

    def write(self, line: dict | None) -> bool:
        """Append `line` to groups.jsonl (nothing for None); False (logged) when it cannot be written."""
        if line is None:
            return False
        try:
            text = json.dumps(line, allow_nan=False, ensure_ascii=False) + "\n"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, self._mode, encoding="utf-8") as f:
                f.write(text)           # one write: a reader sees whole lines, or a partial last one
        except Exception as exc:  # noqa: BLE001 - a diagnostic record is never worth stopping a training run
            log.warning("update %s: no record in %s: %s: %s", line.get("update"), self.path, type(exc).__name__, exc)
            return False
        self._mode = "a"
        return True

    def record(self, groups: list[EpisodeGroup], batch: TrainBatch, update: int, *,
               learner_logprobs: list[np.ndarray] | None) -> dict | None:
        """build, then write; the line written (None: nothing was)."""
        line = self.build(groups, batch, update, learner_logprobs=learner_logprobs)
        return line if self.write(line) else None
