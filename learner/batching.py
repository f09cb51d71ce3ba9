"""From episode groups to training tensors: rows, advantages, mini-batches, token-budget micro-batches.

    batch = build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
    for rows in mini_batches(batch.num_rows, learner_cfg.mini_batch_rows, seed=update):
        plan = plan_micro_batches(batch, rows, micro_batch_tokens, world_size)
        for idx in plan.per_rank[rank]:
            mb = collate(batch, idx, pad_id)

Every step row is one training row (one prompt, one response). Advantages are computed over the kept
groups only (nothing padded or duplicated before the statistics). Micro-batches are filled by a token budget,
rows sorted by length, in one of two layouts (learner.pack_rows): padded (`collate`: the budget bounds rows x
longest row, so that little of it is padding; left-padded so that only the response window's logits are
computed) or packed (`collate_packed`: the rows one after the other in one sequence, nothing padded; the budget
bounds their sum; learner/packing.py keeps the attention inside each row).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import ExperimentConfig, LearnerConfig
from common.stream.records import TABLE, EpisodeGroup, Termination, check_values
from learner.gigpo import ADVANTAGE_ESTIMATORS, AdvantageRows, estimate_grpo


@dataclass
class TrainBatch:
    """The rows of one update, flattened from its groups, with one advantage per row. The trainer never writes
    into a batch it is given: its grammar masks, recomputed log-probs and weights go on a copy."""

    prompt_ids: list[np.ndarray]          # per row, int32
    response_ids: list[np.ndarray]        # per row, int32
    old_logprobs: list[np.ndarray]        # per row, float32: the sampler's (behaviour policy)
    advantages: np.ndarray                # float64 [rows]
    row_group: list[str]                  # episode-group id of each row
    group_ids: list[str]                  # every group consumed by this batch, kept or skipped
    skipped_group_ids: list[str]          # groups dropped by dynamic sampling (all returns equal)
    metrics: dict[str, float] = field(default_factory=dict)
    env_error_group_ids: list[str] = field(default_factory=list)  # too few trajectories without env error
    # The rest per row; None: all tokens in the loss / no grammar / unconstrained / weight 1.
    token_masks: list[np.ndarray] | None = None    # bool per token: in the loss (False: forced, learner/gigpo.py)
    grammars: list[str] | None = None              # the regex the response was sampled under ("": none)
    allowed_bits: list[np.ndarray] | None = None   # int32 [tokens, words] (grammar_mask.py; the trainer's copy)
    weights: list[np.ndarray] | None = None        # float32 policy-gradient weight per token (correction_weights)

    @property
    def num_rows(self) -> int:
        return len(self.prompt_ids)

    def row_lengths(self) -> np.ndarray:
        """prompt + response tokens per row (what a forward pass costs)."""
        return np.array([len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)], dtype=np.int64)

    def response_lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.response_ids], dtype=np.int64)

    def token_mask(self, row: int) -> np.ndarray:
        """The loss mask of one row's response tokens (all True without token_masks)."""
        return np.ones(len(self.response_ids[row]), dtype=bool) if self.token_masks is None else self.token_masks[row]

    def trained_token_counts(self) -> np.ndarray:
        """Response tokens per row that take part in the loss (the loss normalizer counts these)."""
        return np.array([int(self.token_mask(r).sum()) for r in range(self.num_rows)], dtype=np.int64)


# Text bytes a row's anchor and action may hold per token of the longest prompt and response: that text was
# printed in them, and env text averages far under 16 bytes a token (4 for English under a BPE).
TEXT_BYTES_PER_TOKEN = 16


@dataclass(frozen=True)
class GroupLimits:
    """The most a group of this run can hold: a group past one of them was not made by this run's rollout
    (another config, or someone else's writer), and is refused before it costs the learner memory or time."""

    trajectories: int           # rollout.group_size
    steps: int                  # env.max_steps, per trajectory
    prompt_tokens: int          # model.max_prompt_tokens (a longer prompt ends the trajectory, unplayed)
    response_tokens: int        # model.max_response_tokens (vLLM's max_tokens)
    grammar_bytes: int          # stream.max_grammar_bytes
    group_bytes: int            # stream.max_group_mb, or the sum of the above's bytes

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> GroupLimits:
        prompt, response = cfg.model.max_prompt_tokens, cfg.model.max_response_tokens
        # The grammar's alternatives are actions printed in the prompt; escaping at most doubles them.
        grammar = cfg.stream.max_grammar_bytes or 2 * TEXT_BYTES_PER_TOKEN * prompt + 256
        # A row: its table entry, prompt ids (4 bytes), response ids and log-probs (4 + 4), anchor and action
        # text, the grammar; the header (a few fields per trajectory) is far under 64 KiB.
        row = TABLE.itemsize + 4 * prompt + 8 * response + TEXT_BYTES_PER_TOKEN * (prompt + response) + grammar
        derived = cfg.rollout.group_size * cfg.env.max_steps * row + 65536
        return cls(cfg.rollout.group_size, cfg.env.max_steps, prompt, response, grammar,
                   int(cfg.stream.max_group_mb * 2**20) or derived)

    def problem(self, group: EpisodeGroup) -> str:
        """What of `group` is past a limit ("" when nothing is)."""
        trajs, rows = group.trajectories, group.rows
        if len(trajs) > self.trajectories:
            return f"{len(trajs)} trajectories, more than rollout.group_size ({self.trajectories})"
        longest = max((t.num_steps for t in trajs), default=0)
        if longest > self.steps:
            return f"a trajectory of {longest} steps, more than env.max_steps ({self.steps})"
        for name, limit, setting in (("prompt_len", self.prompt_tokens, "model.max_prompt_tokens"),
                                     ("response_len", self.response_tokens, "model.max_response_tokens")):
            if len(rows) and rows[name].max() > limit:
                return f"a row of {int(rows[name].max())} {name[:-4]} tokens, more than {setting} ({limit})"
        if len(rows) and rows["grammar_len"].max() > self.grammar_bytes:
            return (f"a grammar of {int(rows['grammar_len'].max())} bytes, more than stream.max_grammar_bytes' "
                    f"bound ({self.grammar_bytes})")
        return ""


def check_group(group: EpisodeGroup, vocab_size: int | None = None, limits: GroupLimits | None = None) -> None:
    """Raise a ValueError naming the group when its rows cannot be trained on: values the row schema refuses
    (`common.stream.records.check_values`), positive log-probs, an empty prompt, token ids outside [0, vocab_size)
    (one past the embedding table would crash the forward pass), anything past `limits`."""
    rows = group.rows
    problem = limits.problem(group) if limits is not None else ""
    problem = problem or check_values(rows)
    if not problem and len(rows["response_logprobs"]) and rows["response_logprobs"].max() > 1e-4:
        problem = "response_logprobs: log-probs must be <= 0"
    if not problem and len(rows) and rows["prompt_len"].min() == 0:
        problem = f"empty prompt in row {int(np.argmin(rows['prompt_len']))}"
    if not problem and vocab_size is not None:
        for name in ("prompt_ids", "response_ids"):
            if len(rows[name]) and rows[name].max() >= vocab_size:
                problem = f"{name}: token id {int(rows[name].max())} outside the vocabulary [0, {vocab_size})"
                break
    if problem:
        raise ValueError(f"group {group.group_id}: {problem}")


MIN_TRAJECTORIES = 2   # a group needs two trajectories to compare: with one, every advantage is its own score


def forced_token_mask(logprobs: np.ndarray) -> np.ndarray:
    """True where the sampler had a single choice: behaviour log-prob exactly 0 (p = 1). Such tokens are
    left out of the loss (see learner/gigpo.py: "Forced tokens")."""
    return np.asarray(logprobs) == 0.0


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two advantage vectors: 1 for two zero vectors, 0 for a zero vector against a non-zero one."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.clip(np.dot(a, b) / (na * nb), -1.0, 1.0))


def build_batch(groups: list[EpisodeGroup], cfg: LearnerConfig, *, invalid_action_penalty: float) -> TrainBatch:
    """Flatten groups into rows, each with its advantage by cfg.algorithm's estimator
    (learner.gigpo.ADVANTAGE_ESTIMATORS), and the batch's metrics.

    Trajectories ended by an environment error (unknown outcome, not the policy's failure) are left out
    before any statistic, and a group left with fewer than MIN_TRAJECTORIES whole (counted in
    batch/trajectories_env_error, batch/groups_dropped_env_error). With cfg.dynamic_sampling, groups whose
    returns are all equal are skipped (counted). Rows with an empty response count in the statistics (steps
    the agent took) but are not trained. Forced tokens (behaviour log-prob exactly 0) get mask False in
    `token_masks` (batch/forced_tokens).

    diag/* (docs/metrics.md) compare with GRPO (same normalization and penalties) over the trained rows,
    and over the groups before dynamic sampling: the all-success share and the mean length of the
    successful trajectories (NaN: none; shorter is what GiGPO's step signal rewards).
    """
    estimate = _estimator(groups, cfg)
    usable, env_error_groups = _without_env_errors(groups)
    kept, skipped = [], []
    for g, r, trajs in usable:
        returns = np.array([t.episode_return for t in trajs], dtype=np.float64)
        if cfg.dynamic_sampling and len(returns) and np.all(returns == returns[0]):
            skipped.append(g.group_id)
        else:
            kept.append((g, r, trajs))
    rows = advantage_rows([(g, r) for g, r, _ in kept], invalid_action_penalty)
    advantages, metrics = estimate(rows, cfg)
    # The baseline of the diagnostics: GRPO's advantages of the same rows (already computed when it trains).
    grpo = advantages if estimate is estimate_grpo else estimate_grpo(rows, cfg)[0]
    batch, trained = _train_batch(groups, kept, rows, advantages, skipped, env_error_groups)
    metrics.update(_batch_metrics(groups, usable, kept, rows, batch, len(rows.steps) - len(trained),
                                  np.asarray(grpo, dtype=np.float64)[trained]))
    batch.metrics = metrics
    return batch


def _estimator(groups: list[EpisodeGroup], cfg: LearnerConfig):
    """The advantage estimator of cfg.algorithm, once the groups are checked: distinct ids, rows that can
    be trained on (`check_group`)."""
    estimate = ADVANTAGE_ESTIMATORS.get(cfg.algorithm)
    if estimate is None:
        raise ValueError(f"learner.algorithm must be one of {tuple(ADVANTAGE_ESTIMATORS)}, got {cfg.algorithm!r}")
    seen: set[str] = set()
    for g in groups:
        if g.group_id in seen:
            raise ValueError(f"group {g.group_id} appears twice in one batch")
        seen.add(g.group_id)
        check_group(g)
    return estimate


def known_outcomes(group: EpisodeGroup) -> np.ndarray:
    """bool per trajectory: not ended by an environment error (whose outcome is unknown)."""
    return np.array([t.termination != Termination.ENV_ERROR for t in group.trajectories], dtype=bool)


def usable_rows(group: EpisodeGroup) -> np.ndarray:
    """The rows of the group's trajectories with a known outcome: those build_batch computes advantages over."""
    return np.flatnonzero(known_outcomes(group)[group.row_trajectory()])


def _without_env_errors(groups: list[EpisodeGroup]) -> tuple[list[tuple[EpisodeGroup, np.ndarray, list]], list[str]]:
    """(group, `usable_rows`, its trajectories with a known outcome) of every group but those left with
    fewer than MIN_TRAJECTORIES such trajectories, whose ids come second."""
    usable, dropped = [], []
    for g in groups:
        good = known_outcomes(g)
        if not good.all() and good.sum() < MIN_TRAJECTORIES:
            dropped.append(g.group_id)
        else:
            usable.append((g, usable_rows(g), [t for t, ok in zip(g.trajectories, good) if ok]))
    return usable, dropped


def advantage_rows(chosen: list[tuple[EpisodeGroup, np.ndarray]], invalid_action_penalty: float
                   ) -> AdvantageRows:
    """The given rows of each group, flattened group after group, for the advantage estimators."""
    gid, tid, anchors, steps, rewards, valid = [], [], [], [], [], []
    for g, rows in chosen:
        gid += [g.group_id] * len(rows)
        tid += [g.trajectories[k].traj_id for k in g.row_trajectory()[rows].tolist()]
        texts = g.rows.text("anchor")
        anchors += [texts[i] for i in rows.tolist()]
        steps.append(g.rows["step"][rows])
        rewards.append(g.rows["reward"][rows])
        valid.append(g.rows["valid"][rows])
    return AdvantageRows(group_ids=gid, traj_ids=tid, steps=_concat(steps, np.int64),
                         rewards=_concat(rewards, np.float64), anchors=anchors,
                         penalties=np.where(_concat(valid, bool), 0.0, invalid_action_penalty))


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if len(parts) else np.zeros(0, dtype=dtype)


def _train_batch(groups: list[EpisodeGroup], kept: list, rows: AdvantageRows, advantages: np.ndarray,
                 skipped: list[str], env_error_groups: list[str]) -> tuple[TrainBatch, np.ndarray]:
    """The TrainBatch of the kept rows that have a response, and which of `rows` those are."""
    columns = {"prompt_ids": [], "response_ids": [], "response_logprobs": [], "grammar": []}
    for g, r, _ in kept:
        for name, out in columns.items():
            values = g.rows.text(name) if name == "grammar" else g.rows.per_row(name)
            out += [values[i] for i in r.tolist()]
    trained = np.flatnonzero([len(r) > 0 for r in columns["response_ids"]])
    prompts, responses, logps, grammars = ([column[i] for i in trained] for column in columns.values())
    return TrainBatch(
        prompt_ids=prompts, response_ids=responses, old_logprobs=logps,
        advantages=np.asarray(advantages, dtype=np.float64)[trained],
        row_group=[rows.group_ids[i] for i in trained], group_ids=[g.group_id for g in groups],
        skipped_group_ids=skipped, env_error_group_ids=env_error_groups,
        token_masks=[~forced_token_mask(lp) for lp in logps],
        grammars=grammars if any(columns["grammar"]) else None), trained


def _batch_metrics(groups: list[EpisodeGroup], usable: list, kept: list, rows: AdvantageRows,
                   batch: TrainBatch, empty_responses: int, baseline: np.ndarray) -> dict[str, float]:
    """The batch/*, adv/* and diag/* metrics (see `build_batch`); `baseline`: GRPO's advantages of the
    trained rows."""
    trajs = [t for _, _, ts in kept for t in ts]
    success_lengths = [t.num_steps for _, _, ts in usable for t in ts if t.success]
    a, pens = batch.advantages, rows.penalties
    mean_or_0 = lambda values: float(np.mean(values)) if len(values) else 0.0  # noqa: E731
    return {
        "batch/groups": float(len(groups)),
        "batch/groups_skipped_equal_returns": float(len(batch.skipped_group_ids)),
        "batch/groups_dropped_env_error": float(len(batch.env_error_group_ids)),
        "batch/trajectories_env_error": float(sum(int((~known_outcomes(g)).sum()) for g in groups)),
        "batch/rows": float(batch.num_rows),
        "batch/rows_empty_response": float(empty_responses),
        "batch/invalid_action_share": mean_or_0(pens > 0),
        "batch/response_tokens": float(batch.response_lengths().sum()),
        "batch/forced_tokens": float(sum(int((~m).sum()) for m in batch.token_masks)),
        "batch/episode_return_mean": mean_or_0([t.episode_return for t in trajs]),
        "batch/success_rate": mean_or_0([float(t.success) for t in trajs]),
        "batch/episode_steps_mean": mean_or_0([t.num_steps for t in trajs]),
        "adv/mean": mean_or_0(a),
        "adv/std": float(a.std()) if len(a) else 0.0,
        "adv/min": float(a.min()) if len(a) else 0.0,
        "adv/max": float(a.max()) if len(a) else 0.0,
        "adv/zero_share": mean_or_0(a == 0.0),
        "diag/adv_cosine_vs_grpo": _cosine(a, baseline),
        "diag/adv_sign_differs_share": mean_or_0(np.sign(a) != np.sign(baseline)),
        "diag/groups_all_success_share": mean_or_0([all(t.success for t in ts) for _, _, ts in usable]),
        "diag/success_episode_length_mean": float(np.mean(success_lengths)) if success_lengths else float("nan"),
        "diag/successful_trajectories": float(len(success_lengths)),
        "diag/successful_trajectory_steps": float(sum(success_lengths)),
    }


def mini_batches(num_rows: int, mini_batch_rows: int, seed: int) -> list[np.ndarray]:
    """Row indices of each mini-batch (one optimizer step each): a seeded shuffle cut into chunks of
    mini_batch_rows; the last one may be smaller (rows are never duplicated to fill it)."""
    if mini_batch_rows < 1:
        raise ValueError(f"mini_batch_rows must be >= 1, got {mini_batch_rows}")
    order = np.random.default_rng(seed).permutation(num_rows)
    return [order[i:i + mini_batch_rows] for i in range(0, num_rows, mini_batch_rows)]


@dataclass
class MicroBatchPlan:
    """The micro-batches of one mini-batch per learner process, as many on each (an empty one does nothing but
    join the collectives); `response_tokens`: the whole mini-batch's loss tokens, every process's normalizer."""

    per_rank: list[list[np.ndarray]]
    response_tokens: int


def pack_by_tokens(rows: np.ndarray, lengths: np.ndarray, budget: int, *, packed: bool = False
                   ) -> list[np.ndarray]:
    """Pack rows, longest first (similar lengths together), into micro-batches whose computed size stays within
    `budget` tokens: rows x longest in the padded layout, the rows' sum in the packed one (`collate_packed`);
    a longer row gets one of its own (the budget is a target)."""
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    order = rows[np.argsort(-lengths[rows], kind="stable")]
    out: list[np.ndarray] = []
    current: list[int] = []
    longest = total = 0
    for r in order:
        n = int(lengths[r])
        size = total + n if packed else (len(current) + 1) * max(longest, n)
        if current and size > budget:
            out.append(np.array(current, dtype=np.int64))
            current, longest, total = [], 0, 0
        current.append(int(r))
        longest, total = max(longest, n), total + n
    if current:
        out.append(np.array(current, dtype=np.int64))
    return out


def plan_micro_batches(batch: TrainBatch, rows: np.ndarray, micro_batch_tokens: int, world_size: int = 1, *,
                       packed: bool = False) -> MicroBatchPlan:
    """Split a mini-batch across processes (longest rows first, each to the one with the fewest tokens so far)
    and pack each share by the token budget (`pack_by_tokens`, for the padded or the packed layout);
    deterministic, so every process computes the same plan."""
    lengths = batch.row_lengths()
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = np.zeros(world_size, dtype=np.int64)
    for r in rows[np.argsort(-lengths[rows], kind="stable")]:
        k = int(np.argmin(load))
        shares[k].append(int(r))
        load[k] += lengths[r]
    per_rank = [pack_by_tokens(np.array(s, dtype=np.int64), lengths, micro_batch_tokens, packed=packed)
                for s in shares]
    most = max(len(p) for p in per_rank)
    for p in per_rank:
        p.extend(np.zeros(0, dtype=np.int64) for _ in range(most - len(p)))
    resp = int(batch.trained_token_counts()[rows].sum())
    return MicroBatchPlan(per_rank=per_rank, response_tokens=resp)


@dataclass
class MicroBatch:
    """Model inputs of some rows, and flat per-response-token tensors in row-major order, in one of two layouts.

    Padded (`collate`): rows LEFT-padded to [R, L], so every response's logits lie in the last `window`
    positions, the only ones the model is asked for (`logits_to_keep`). `target_mask[r, j]`: logits position
    L - window + j of row r predicts a response token; logits[:, :-1] of the window, masked, line up with the
    flat tensors.
    Packed (`collate_packed`): the rows one after the other in one sequence [1, T], nothing padded; `row_bounds`
    where each row starts (and T at the end); `logit_positions` the N positions whose logits predict the
    response tokens, in the flat tensors' order (learner/packing.py's `packed_logits`)."""

    input_ids: torch.Tensor        # long [R, L] left-padded, or [1, T] packed
    attention_mask: torch.Tensor   # long, as input_ids: 1 on real tokens (all of a pack)
    position_ids: torch.Tensor     # long, as input_ids: counted from each row's first real token
    targets: torch.Tensor          # long [N] response token ids
    old_logprobs: torch.Tensor     # float32 [N]
    advantages: torch.Tensor       # float32 [N]
    rows: np.ndarray               # batch row indices, in order
    loss_mask: torch.Tensor        # float32 [N]: 1 for tokens in the loss, 0 for forced ones
    weights: torch.Tensor          # float32 [N]: each token's policy-gradient weight (1 without a correction)
    allowed_bits: torch.Tensor | None = None   # int32 [N, words]: tokens the sampler could pick; None: any
    # Padded layout only:
    window: int = 0                              # logits_to_keep: longest response + 1
    target_mask: torch.Tensor | None = None      # bool [R, window - 1]
    # Packed layout only (None: padded):
    row_bounds: torch.Tensor | None = None       # int32 [R + 1]: cu_seqlens
    logit_positions: torch.Tensor | None = None  # long [N]
    longest_row: int = 0                         # tokens of the longest row

    @property
    def packed(self) -> bool:
        return self.row_bounds is not None


def _per_token(batch: TrainBatch, rows: np.ndarray) -> dict:
    """The flat per-response-token fields of `MicroBatch` for `rows`, in row-major order (both layouts)."""
    as_tensor = lambda values, dtype: torch.from_numpy(_concat(values, dtype))  # noqa: E731
    sizes = [len(batch.response_ids[r]) for r in rows]
    return dict(
        targets=as_tensor([batch.response_ids[r] for r in rows], np.int64),
        old_logprobs=as_tensor([batch.old_logprobs[r] for r in rows], np.float32),
        advantages=as_tensor([np.full(n, batch.advantages[r]) for n, r in zip(sizes, rows)], np.float32),
        rows=np.asarray(rows, dtype=np.int64),
        loss_mask=as_tensor([batch.token_mask(r) for r in rows], np.float32),
        weights=as_tensor([np.ones(n) if batch.weights is None else batch.weights[r] for n, r in zip(sizes, rows)],
                          np.float32),
        allowed_bits=(torch.from_numpy(np.concatenate([batch.allowed_bits[r] for r in rows]))
                      if batch.allowed_bits is not None and len(rows) else None),
    )


def collate(batch: TrainBatch, rows: np.ndarray, pad_id: int = 0) -> MicroBatch:
    """Left-pad prompt+response of the given rows into one micro-batch."""
    lens = [len(batch.prompt_ids[r]) + len(batch.response_ids[r]) for r in rows]
    width = max([2] + lens)
    longest = max([1] + [len(batch.response_ids[r]) for r in rows])
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    att = np.zeros((len(rows), width), dtype=np.int64)
    pos = np.zeros((len(rows), width), dtype=np.int64)
    tmask = np.zeros((len(rows), longest), dtype=bool)
    for i, r in enumerate(rows):
        p, a = batch.prompt_ids[r], batch.response_ids[r]
        n = len(p) + len(a)
        ids[i, width - n:width - len(a)] = p
        ids[i, width - len(a):] = a
        att[i, width - n:] = 1
        pos[i, width - n:] = np.arange(n)
        tmask[i, longest - len(a):] = True
    return MicroBatch(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(att),
                      position_ids=torch.from_numpy(pos), window=longest + 1, target_mask=torch.from_numpy(tmask),
                      **_per_token(batch, rows))


def collate_packed(batch: TrainBatch, rows: np.ndarray) -> MicroBatch:
    """Prompt+response of the given rows (at least one) one after the other in one sequence: nothing padded,
    position ids restarting at 0 in each row. Position i predicts token i + 1, so a row starting at s with a
    prompt of p tokens and a response of a has its response predicted at s + p - 1 ... s + p + a - 2."""
    prompts = [batch.prompt_ids[r] for r in rows]
    responses = [batch.response_ids[r] for r in rows]
    lens = np.array([len(p) + len(a) for p, a in zip(prompts, responses)], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([np.concatenate([p, a]) for p, a in zip(prompts, responses)]).astype(np.int64)
    positions = np.concatenate([np.arange(s + len(p) - 1, s + n - 1) for s, p, n in zip(starts, prompts, lens)])
    return MicroBatch(input_ids=torch.from_numpy(ids)[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      position_ids=torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))[None],
                      row_bounds=torch.from_numpy(starts.astype(np.int32)),
                      logit_positions=torch.from_numpy(positions.astype(np.int64)), longest_row=int(lens.max()),
                      **_per_token(batch, rows))
