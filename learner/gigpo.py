"""The algorithm in one file: group-based advantages for multi-step agents (GiGPO; GRPO and RLOO as
baselines) and the policy loss they train with. Config names map to functions in ADVANTAGE_ESTIMATORS
(learner.algorithm) and CORRECTIONS (learner.logprob_correction).

Advantages: pure NumPy, one value per training row (one environment step), rows in any order. Equation
numbers are those of the GiGPO paper (Feng et al., arXiv 2505.10978):

    R(tau)   = sum_t r_t                                   episode return
    R_t      = sum_{k>=t} gamma^(k-t) r_k                  discounted return-to-go          (Eq. 5)
    A^E      = (R(tau) - mean_G) / F                       episode advantage                (Eq. 3)
    G^S(s)   = rows of one episode group with anchor s     anchor-state group               (Eq. 6)
    A^S      = (R_t - mean_{G^S}) / F                      step advantage                   (Eq. 7)
    A        = A^E + omega * A^S                                                            (Eq. 8)
    F        = std + eps (unbiased std)  if normalize_std  else 1

Conventions (those of the reference implementation, verl-agent, unless noted):
- An episode-statistics group of one member has mean 0 and std 1; an anchor group of one row has A^S = 0.
- A group whose values are all equal has advantage exactly 0: computed in float64 and detected explicitly
  (the reference's float32 path leaves noise of up to ~0.5 there).
- `penalties` (e.g. 0.1 per invalid action) are subtracted from that row's episode score and step return
  only; they are not discounted into earlier steps.
- `episode_stats="rows"`: mean/std over all step rows of the episode group (the reference's default since
  June 2025: longer trajectories weigh more); `"trajectories"`: over the N trajectory scores (Eq. 3), a
  trajectory's score being the mean of its rows' scores (= R(tau) without penalties). "All equal" refers
  to the members the statistics are taken over.

The loss (reference §2): token-level PPO with dual clip, k3 KL to a frozen reference and an entropy bonus
(Eq. 8's objective); pure torch. A micro-batch's loss is the *sum* of its token terms divided by the token
count of the whole mini-batch (`token_normalizer`), so the summed micro-batch gradients are exactly those of
the mini-batch token mean, however the rows were split across micro-batches and processes.

Both sides of PPO's ratio exp(logp - old_logp) must be the distribution the tokens were drawn from:
softmax(logits / T), T = rollout.temperature, as vLLM reports it and the learner computes it
(learner.trainer.PolicyTrainer's `temperature`). Under rollout.constrain_actions it is the softmax over the
tokens the action grammar allows (`token_logprobs_and_entropy`'s `allowed`, learner/grammar_mask.py).
Forced tokens: where the grammar leaves a single token (the rest of "</action>", the tail of a unique
prefix), p = 1 whatever the weights, log-prob 0 on both sides, gradient 0. They get mask 0
(learner.batching.forced_token_mask, from the rollout's log-probs) and do not count in the token
normalizer, where they would only dilute the token means and the clip and KL metrics. (An unconstrained
sampler reaches log-prob 0 in float32 only for p > 1 - 6e-8, whose gradient is that small too.)
"""
from __future__ import annotations

import difflib
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from common.config import LearnerConfig


# ----------------------------------------------------------------------------------------------------------
# The definition: GiGPO one episode group at a time, with loops (Eqs. 3-8). The tests' oracle: the vectorized
# `gigpo_advantages` below, which is what runs, equals it to 1e-9 (tests/learner/test_advantages.py).

def gigpo_readable(group_ids, traj_ids, steps, rewards, anchors, *, gamma=LearnerConfig.gamma,
                   omega=LearnerConfig.omega, normalize_std=LearnerConfig.normalize_std,
                   episode_stats=LearnerConfig.episode_stats, similarity=LearnerConfig.similarity, eps=1e-6,
                   penalties=None) -> list[float]:
    """GiGPO advantage per row, written as the paper defines it; arguments as `gigpo_advantages`."""
    penalties = [0.0] * len(group_ids) if penalties is None else [float(p) for p in penalties]
    rows_of_group = defaultdict(list)
    for i, g in enumerate(group_ids):
        rows_of_group[g].append(i)
    advantage = [0.0] * len(group_ids)
    for rows in rows_of_group.values():
        trajectories = defaultdict(list)          # trajectory id -> its rows in step order
        for i in sorted(rows, key=lambda i: steps[i]):
            trajectories[traj_ids[i]].append(i)
        return_to_go = {}                         # R_t (Eq. 5)
        for traj_rows in trajectories.values():
            running = 0.0
            for i in reversed(traj_rows):
                running = float(rewards[i]) + gamma * running
                return_to_go[i] = running
        # A^E (Eq. 3): each row's episode score R(tau) - its penalty, normalized over the group's rows
        # (episode_stats="rows") or over its trajectories' mean scores ("trajectories").
        traj_return = {t: sum(float(rewards[i]) for i in traj_rows) for t, traj_rows in trajectories.items()}
        score = {i: traj_return[traj_ids[i]] - penalties[i] for i in rows}
        if episode_stats == "rows":
            members = [score[i] for i in rows]
        else:
            members = [sum(score[i] for i in t) / len(t) for t in trajectories.values()]
        mean, divisor, zero = _group_norm(members, normalize_std, eps, alone="mean0_std1")
        episode = {i: 0.0 if zero else (score[i] - mean) / divisor for i in rows}
        # A^S (Eqs. 6-7): the step's return R_t - its penalty, normalized within its anchor-state group.
        for anchor_rows in _anchor_groups(rows, anchors, similarity):
            values = [return_to_go[i] - penalties[i] for i in anchor_rows]
            mean, divisor, zero = _group_norm(values, normalize_std, eps, alone="zero")
            for i, value in zip(anchor_rows, values):
                step = 0.0 if zero else (value - mean) / divisor
                advantage[i] = episode[i] + omega * step          # Eq. 8
    return advantage


def _group_norm(members: list[float], normalize_std: bool, eps: float, alone: str) -> tuple[float, float, bool]:
    """(mean, divisor, zero) of a group: a member's normalized value is 0 if zero, else (value - mean) /
    divisor, with divisor = unbiased std + eps (normalize_std) or 1. All members equal: zero. A group of one:
    mean 0, std 1 (alone="mean0_std1") or zero (alone="zero")."""
    if len(members) == 1:
        return 0.0, (1.0 + eps if normalize_std else 1.0), alone == "zero"
    if all(m == members[0] for m in members):
        return 0.0, 1.0, True
    mean = sum(members) / len(members)
    std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
    return mean, (std + eps if normalize_std else 1.0), False


def _anchor_groups(rows: list[int], anchors, similarity: float | None) -> list[list[int]]:
    """The anchor-state groups of one episode group's rows (Eq. 6): identical anchors; with a `similarity`
    (not 0 or None), each anchor joins the first earlier group whose first anchor is at least that similar."""
    groups: dict[Any, list[int]] = {}
    for i in rows:
        key = anchors[i]
        if similarity:
            text = str(key)
            key = next((rep for rep in groups if rep == text or
                        difflib.SequenceMatcher(None, rep, text).ratio() >= similarity), text)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


# ----------------------------------------------------------------------------------------------------------
# Small vectorized building blocks

def factorize(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """Dense int64 codes 0..K-1 for any hashable values, numbered by first appearance."""
    arr = values if isinstance(values, np.ndarray) else None
    if arr is not None and arr.dtype.kind in "biuU":
        _, first, inverse = np.unique(arr, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        return rank[inverse.reshape(-1)]
    # Hashables of any kind (str, bytes, tuples): hash them in C via map(dict.setdefault); each value is
    # coded by the row of its first appearance, then made dense.
    first_row: dict[Any, int] = {}
    sparse = np.fromiter(map(first_row.setdefault, values, itertools.count()), dtype=np.int64,
                         count=len(values))
    _, dense = np.unique(sparse, return_inverse=True)
    return dense.reshape(-1).astype(np.int64)


def scoped_codes(outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """Dense codes of the pairs (outer, inner): an id scoped by its episode group."""
    if len(outer) == 0:
        return outer
    return factorize(outer * (int(inner.max()) + 1) + inner)


def group_stats(codes: np.ndarray, values: np.ndarray, num_groups: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per dense group code: (mean, unbiased std, size, whether all members are equal)."""
    size = np.bincount(codes, minlength=num_groups)
    mean = np.bincount(codes, weights=values, minlength=num_groups) / np.maximum(size, 1)
    sq = np.bincount(codes, weights=(values - mean[codes]) ** 2, minlength=num_groups)
    std = np.sqrt(sq / np.maximum(size - 1, 1))
    vmax = np.full(num_groups, -np.inf)
    vmin = np.full(num_groups, np.inf)
    np.maximum.at(vmax, codes, values)
    np.minimum.at(vmin, codes, values)
    return mean, std, size, vmax == vmin


def normalize_in_groups(codes: np.ndarray, values: np.ndarray, *, normalize_std: bool, eps: float,
                        singleton: str, members: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """(value - group mean) / F per row. `singleton` says what a one-member group gets: "zero" (A^S = 0) or
    "mean0_std1" (the reference's episode convention: mean 0, std 1). `members`: (group code, value) of
    what the statistics are taken over, when not the rows themselves (an episode group's trajectories)."""
    num_groups = int(codes.max()) + 1 if len(codes) else 0
    mean, std, size, all_equal = group_stats(*(members or (codes, values)), num_groups)
    single = size == 1
    if singleton == "mean0_std1":
        mean[single], std[single] = 0.0, 1.0
    out = values - mean[codes]
    if normalize_std:
        out = out / (std[codes] + eps)
    # Exact zeros: all-equal groups (float mean of equal values need not equal them), and singleton
    # anchor groups. An episode singleton keeps its score (mean 0), as in the reference.
    zero = all_equal & ~single if singleton == "mean0_std1" else all_equal | single
    out[zero[codes]] = 0.0
    return out


def discounted_returns(traj_codes: np.ndarray, steps: np.ndarray, rewards: np.ndarray,
                       gamma: float) -> np.ndarray:
    """R_t = sum_{k>=t} gamma^(k-t) r_k inside each trajectory (Eq. 5), in the order of `steps`. The recursion
    R_t = r_t + gamma R_{t+1} runs over the columns of a [trajectories x max_len] grid: the Python loop is
    over time steps (<= 50 in ALFWorld), not rows."""
    n = len(rewards)
    if n == 0:
        return np.zeros(0)
    order = np.lexsort((steps, traj_codes))
    sorted_traj = traj_codes[order]
    sorted_steps = steps[order]
    dup = (sorted_traj[1:] == sorted_traj[:-1]) & (sorted_steps[1:] == sorted_steps[:-1])
    if dup.any():
        i = order[1:][dup][0]
        raise ValueError(f"duplicate step index {steps[i]} within one trajectory (row {i})")
    starts = np.flatnonzero(np.r_[True, sorted_traj[1:] != sorted_traj[:-1]])
    lengths = np.diff(np.r_[starts, n])
    position = np.arange(n) - np.repeat(starts, lengths)
    row_of_traj = np.repeat(np.arange(len(starts)), lengths)
    grid = np.zeros((len(starts), int(lengths.max()) + 1))
    grid[row_of_traj, position] = rewards[order]
    for t in range(grid.shape[1] - 2, -1, -1):
        grid[:, t] += gamma * grid[:, t + 1]
    out = np.empty(n)
    out[order] = grid[row_of_traj, position]
    return out


def similarity_codes(group_codes: np.ndarray, anchors: Sequence[Any], threshold: float) -> np.ndarray:
    """Anchor groups by text similarity (Eq. 6 relaxed): inside each episode group, in order of first
    appearance, an anchor joins the first earlier cluster whose representative is >= threshold similar, else
    starts one. The ratio is difflib's 2*LCS/(len_a+len_b), scored in C++ by rapidfuzz over distinct texts
    only: O(distinct^2) per group, not O(rows^2) in Python."""
    from rapidfuzz import fuzz, process

    exact = scoped_codes(group_codes, factorize(anchors))
    num_exact = int(exact.max()) + 1 if len(exact) else 0
    first_row = np.full(num_exact, len(exact))
    np.minimum.at(first_row, exact, np.arange(len(exact)))
    cluster_of_exact = np.empty(num_exact, dtype=np.int64)
    next_cluster = 0
    for g in np.unique(group_codes):
        members = np.flatnonzero(group_codes[first_row] == g)       # exact-anchor codes in this group
        members = members[np.argsort(first_row[members])]
        texts = [str(anchors[first_row[m]]) for m in members]
        sim = process.cdist(texts, texts, scorer=fuzz.ratio, score_cutoff=threshold * 100.0,
                            dtype=np.uint8, workers=1) > 0
        reps: list[int] = []
        for i in range(len(members)):
            hit = [r for r in reps if sim[i, r]]
            if hit:
                cluster_of_exact[members[i]] = cluster_of_exact[members[hit[0]]]
            else:
                reps.append(i)
                cluster_of_exact[members[i]] = next_cluster
                next_cluster += 1
    return cluster_of_exact[exact]


# ----------------------------------------------------------------------------------------------------------
# Input checking

@dataclass(frozen=True)
class _Rows:
    group: np.ndarray        # dense episode-group codes
    traj: np.ndarray         # dense trajectory codes (a trajectory id is scoped by its group)
    steps: np.ndarray
    rewards: np.ndarray
    penalties: np.ndarray
    scores: np.ndarray       # episode score: the trajectory's return R(tau) minus the row's own penalty


def _check_rows(group_ids, traj_ids, steps, rewards, penalties, extra=(), eps: float = 0.0) -> _Rows:
    """The rows, coded, once their lengths and values (and eps) are checked. (The settings' ranges, gamma,
    omega, similarity, episode_stats, are the rules of the learner.* fields, checked when the config loads.)"""
    n = len(group_ids)
    named = [("traj_ids", traj_ids), ("steps", steps), ("rewards", rewards)] + list(extra)
    if penalties is not None:
        named.append(("penalties", penalties))
    for name, arr in named:
        if len(arr) != n:
            raise ValueError(f"length mismatch: group_ids has {n} rows but {name} has {len(arr)}")
    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    pen = np.zeros(n) if penalties is None else np.asarray(penalties, dtype=np.float64).reshape(-1)
    for name, arr in (("rewards", rewards), ("penalties", pen)):
        if not np.all(np.isfinite(arr)):
            bad = int(np.flatnonzero(~np.isfinite(arr))[0])
            raise ValueError(f"{name} must be finite; row {bad} is {arr[bad]}")
    steps = np.asarray(steps).reshape(-1)
    if n and steps.dtype.kind not in "iu":
        raise ValueError(f"steps must be integers, got dtype {steps.dtype}")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    group = factorize(group_ids)
    traj = scoped_codes(group, factorize(traj_ids))
    return _Rows(group, traj, steps.astype(np.int64), rewards, pen, np.bincount(traj, weights=rewards)[traj] - pen)


# ----------------------------------------------------------------------------------------------------------
# Estimators

def _trajectory_scores(rows: _Rows) -> tuple[np.ndarray, np.ndarray]:
    """(episode group, mean score of its rows) of each trajectory."""
    traj_group = np.zeros(int(rows.traj.max()) + 1, dtype=np.int64)
    traj_group[rows.traj] = rows.group
    return traj_group, np.bincount(rows.traj, weights=rows.scores) / np.bincount(rows.traj)


def _episode_advantages(rows: _Rows, *, normalize_std: bool, episode_stats: str, eps: float) -> np.ndarray:
    """A^E (Eq. 3), statistics over the rows or the trajectories of each episode group."""
    members = None if episode_stats == "rows" else _trajectory_scores(rows)
    return normalize_in_groups(rows.group, rows.scores, normalize_std=normalize_std, eps=eps, singleton="mean0_std1",
                               members=members)


@dataclass(frozen=True)
class GiGPOParts:
    """The pieces of a GiGPO advantage, for monitoring: A = episode + omega * step."""

    episode: np.ndarray          # A^E per row
    step: np.ndarray             # A^S per row
    anchor_group: np.ndarray     # dense anchor-group code per row
    returns: np.ndarray          # R_t - penalty per row (the value normalized inside anchor groups)


def gigpo_parts(group_ids, traj_ids, steps, rewards, anchors, *, gamma: float = LearnerConfig.gamma,
                normalize_std: bool = LearnerConfig.normalize_std,
                episode_stats: str = LearnerConfig.episode_stats,
                similarity: float | None = LearnerConfig.similarity, eps: float = 1e-6,
                penalties=None) -> GiGPOParts:
    """Episode and step advantages of GiGPO, separately. See `gigpo_advantages`."""
    rows = _check_rows(group_ids, traj_ids, steps, rewards, penalties, extra=[("anchors", anchors)], eps=eps)
    if len(rows.rewards) == 0:
        empty = np.zeros(0)
        return GiGPOParts(empty, empty, np.zeros(0, dtype=np.int64), empty)
    episode = _episode_advantages(rows, normalize_std=normalize_std, episode_stats=episode_stats, eps=eps)
    returns = discounted_returns(rows.traj, rows.steps, rows.rewards, gamma) - rows.penalties
    if not similarity:
        anchor_group = scoped_codes(rows.group, factorize(anchors))
    else:
        anchor_group = similarity_codes(rows.group, list(anchors), similarity)
    step = normalize_in_groups(anchor_group, returns, normalize_std=normalize_std, eps=eps, singleton="zero")
    return GiGPOParts(episode=episode, step=step, anchor_group=anchor_group, returns=returns)


def gigpo_advantages(group_ids, traj_ids, steps, rewards, anchors, *, gamma: float = LearnerConfig.gamma,
                     omega: float = LearnerConfig.omega, normalize_std: bool = LearnerConfig.normalize_std,
                     episode_stats: str = LearnerConfig.episode_stats,
                     similarity: float | None = LearnerConfig.similarity, eps: float = 1e-6,
                     penalties=None) -> np.ndarray:
    """GiGPO advantage per row, float64 in the input order: A = A^E + omega * A^S (Eq. 8). Vectorized; equals
    `gigpo_readable`.

    Per row: group_ids (episode group, any hashable), traj_ids (scoped by the group), steps (integer order
    inside the trajectory), rewards (r_t), anchors (anchor-state key: observation text, bytes, tuples) and
    optional penalties (see the module). gamma: Eq. 5's discount; omega: Eq. 8's weight; normalize_std:
    divide by std + eps, else subtract the mean only; episode_stats: "rows" (reference) or "trajectories"
    (Eq. 3); similarity: 0 (or None) groups identical anchors, a ratio in (0, 1) anchor texts at least this
    similar. The defaults are the learner.* fields' of the same names.
    """
    parts = gigpo_parts(group_ids, traj_ids, steps, rewards, anchors, gamma=gamma,
                        normalize_std=normalize_std, episode_stats=episode_stats, similarity=similarity,
                        eps=eps, penalties=penalties)
    return parts.episode + omega * parts.step


def grpo_advantages(group_ids, traj_ids, steps, rewards, *, normalize_std: bool = LearnerConfig.normalize_std,
                    episode_stats: str = LearnerConfig.episode_stats, eps: float = 1e-6,
                    penalties=None) -> np.ndarray:
    """GRPO: the episode advantage A^E alone (Eq. 3); equals GiGPO with omega = 0."""
    rows = _check_rows(group_ids, traj_ids, steps, rewards, penalties, eps=eps)
    if len(rows.rewards) == 0:
        return np.zeros(0)
    return _episode_advantages(rows, normalize_std=normalize_std, episode_stats=episode_stats, eps=eps)


def rloo_advantages(group_ids, traj_ids, steps, rewards, *, episode_stats: str, penalties=None) -> np.ndarray:
    """RLOO: score minus the mean score of the group's *other* members (leave-one-out baseline), members being
    the trajectories (each row: R(tau) - penalty minus the others' mean) or the rows. Alone: baseline 0."""
    rows = _check_rows(group_ids, traj_ids, steps, rewards, penalties)
    if len(rows.rewards) == 0:
        return np.zeros(0)
    scores = rows.scores
    members = (rows.group, scores) if episode_stats == "rows" else _trajectory_scores(rows)
    mean, _, size, all_equal = group_stats(*members, int(rows.group.max()) + 1)
    own = scores if episode_stats == "rows" else members[1][rows.traj]
    n = size[rows.group].astype(np.float64)
    baseline = np.where(n > 1, (mean[rows.group] * n - own) / np.maximum(n - 1, 1), 0.0)
    out = scores - baseline
    out[(all_equal & (size > 1))[rows.group]] = 0.0
    return out


# ----------------------------------------------------------------------------------------------------------
# Monitoring

def anchor_group_summary(parts: GiGPOParts) -> dict[str, float]:
    """Per-batch summary of the anchor-state groups (paper Sec. 5 reports < 35% singletons): num_groups,
    singleton_share and size_ge_10_share (of anchor groups), mean_group_size (rows), nonzero_step_adv_share
    (of rows) and hist_<bucket> (anchor groups per size bucket: 1, 2, 3-4, 5-9, >=10)."""
    if len(parts.anchor_group) == 0:
        return {"num_groups": 0.0, "singleton_share": 0.0, "size_ge_10_share": 0.0, "mean_group_size": 0.0,
                "nonzero_step_adv_share": 0.0}
    sizes = np.bincount(parts.anchor_group)
    sizes = sizes[sizes > 0]
    buckets = {"hist_1": (1, 1), "hist_2": (2, 2), "hist_3_4": (3, 4), "hist_5_9": (5, 9), "hist_ge_10": (10, np.inf)}
    return {"num_groups": float(len(sizes)), "singleton_share": float(np.mean(sizes == 1)),
            "size_ge_10_share": float(np.mean(sizes >= 10)), "mean_group_size": float(sizes.mean()),
            "nonzero_step_adv_share": float(np.mean(parts.step != 0.0)),
            **{k: float(((sizes >= lo) & (sizes <= hi)).sum()) for k, (lo, hi) in buckets.items()}}


# ----------------------------------------------------------------------------------------------------------
# The estimators by learner.algorithm: (rows, config) -> (advantage per row, metrics of its own). A new one
# is a function and its entry in ADVANTAGE_ESTIMATORS, its name in the config's Literal (tests/common/test_registries.py)

@dataclass(frozen=True)
class AdvantageRows:
    """What an estimator reads: one entry per training row (one environment step), rows in any order."""

    group_ids: list             # episode-group id
    traj_ids: list              # trajectory id, scoped by its group
    steps: np.ndarray           # int64 step index in its trajectory
    rewards: np.ndarray         # float64 r_t
    anchors: list               # anchor-state key (the observation text)
    penalties: np.ndarray       # float64, subtracted from the row's scores (invalid action)


def gigpo_parts_of(rows: AdvantageRows, cfg: LearnerConfig) -> GiGPOParts:
    """`gigpo_parts` of `rows` with the settings of `cfg`."""
    return gigpo_parts(rows.group_ids, rows.traj_ids, rows.steps, rows.rewards, rows.anchors, gamma=cfg.gamma,
                       normalize_std=cfg.normalize_std, episode_stats=cfg.episode_stats,
                       similarity=cfg.similarity, penalties=rows.penalties)


def estimate_gigpo(rows: AdvantageRows, cfg: LearnerConfig) -> tuple[np.ndarray, dict[str, float]]:
    """GiGPO (Eq. 8), with its anchor groups (anchor/*) and the size of its two parts (adv/*_abs_mean)."""
    parts = gigpo_parts_of(rows, cfg)
    metrics = {f"anchor/{k}": v for k, v in anchor_group_summary(parts).items()}
    if len(parts.episode):
        metrics["adv/episode_abs_mean"] = float(np.abs(parts.episode).mean())
        metrics["adv/step_abs_mean"] = float(np.abs(parts.step).mean())
    return parts.episode + cfg.omega * parts.step, metrics


def estimate_grpo(rows: AdvantageRows, cfg: LearnerConfig) -> tuple[np.ndarray, dict[str, float]]:
    """GRPO: the episode advantage alone."""
    return grpo_advantages(rows.group_ids, rows.traj_ids, rows.steps, rows.rewards,
                           normalize_std=cfg.normalize_std, episode_stats=cfg.episode_stats,
                           penalties=rows.penalties), {}


def estimate_rloo(rows: AdvantageRows, cfg: LearnerConfig) -> tuple[np.ndarray, dict[str, float]]:
    """RLOO over the trajectories (learner.episode_stats and normalize_std do not apply to it)."""
    return rloo_advantages(rows.group_ids, rows.traj_ids, rows.steps, rows.rewards, episode_stats="trajectories",
                           penalties=rows.penalties), {}


ADVANTAGE_ESTIMATORS = {"gigpo": estimate_gigpo, "grpo": estimate_grpo, "rloo": estimate_rloo}


# ----------------------------------------------------------------------------------------------------------
# The policy loss: token-level PPO with dual clip, k3 KL, entropy bonus (torch; see the module's docstring)

@dataclass(frozen=True)
class LossSettings:
    """The loss's coefficients; defaults and ranges: the learner.* fields of the same names (the paper's values)."""

    clip_ratio: float = LearnerConfig.clip_ratio         # PPO ratio clip epsilon
    dual_clip: float = LearnerConfig.dual_clip           # c of the dual clip for negative advantages (> 1); 0: off
    kl_coef: float = LearnerConfig.kl_coef               # weight of the low_var_kl term; 0 disables it
    entropy_coef: float = LearnerConfig.entropy_coef     # weight of the entropy bonus (subtracted from the loss)


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || reference) per token: exp(ref - logp) - (ref - logp) - 1, clamped to
    [-10, 10] as the reference does, so that one far-off token cannot blow up the loss."""
    log_ratio = ref_logp - logp
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


# ----------------------------------------------------------------------------------------------------------
# The sampler is not the learner: the gap between their log-probs, and corrections for it (NumPy)
#
# The tokens were sampled by vLLM (mu: another kernel, often another precision), not by the learner's old
# policy pi_old of PPO's ratio. With the learner's own old log-probs (learner.recompute_old_logprobs) the
# ratio starts at 1, and a per-token importance weight w = pi_old / mu, bounded by a cap C > 1 because a
# few tokens can be off by nats, corrects for the samples coming from mu:
#   tis            w = min(pi_old / mu, C)                truncated importance sampling (bounded variance;
#                                                          biased on tokens above C only)
#   mask_token     w = 1 if 1/C <= pi_old / mu <= C else 0 tokens the two policies disagree on are dropped
#   mask_sequence  w = 1 for a whole row if 1/C <= geometric mean of its ratios <= C, else 0 for the row
# w multiplies the policy-gradient term only (not KL or entropy); the normalizer still counts dropped tokens,
# so a correction never inflates the other tokens' weight.

GAP_THRESHOLD = 0.1     # nat: tokens whose |log pi_old - log mu| exceeds it count in logprob_gap_share


def logprob_gap(learner_logp: np.ndarray, sampler_logp: np.ndarray) -> dict[str, float]:
    """How far the learner's log-probs of the sampled tokens are from the sampler's (flat, over the tokens of
    the loss): mean and max of |d|, the share of tokens with |d| > GAP_THRESHOLD, and the k3 estimate of
    KL(mu || pi_old), mean of exp(d) - 1 - d with d = log pi_old - log mu (each term >= 0; its mean under
    samples of mu is unbiased)."""
    d = np.asarray(learner_logp, dtype=np.float64) - np.asarray(sampler_logp, dtype=np.float64)
    if d.size == 0:
        return {"mean": 0.0, "max": 0.0, "share": 0.0, "kl": 0.0}
    a = np.abs(d)
    return {"mean": float(a.mean()), "max": float(a.max()), "share": float((a > GAP_THRESHOLD).mean()),
            "kl": float(np.mean(np.expm1(d) - d))}


# One function per learner.logprob_correction: (log pi_old - log mu of one row's tokens, the same of its loss
# tokens, C) -> (float32 weight per token, bool where the correction binds: ratio truncated at C, token dropped).

def no_correction(log_ratio, loss_log_ratio, cap):
    return np.ones(log_ratio.shape, dtype=np.float32), np.zeros(log_ratio.shape, dtype=bool)


def truncated_importance_weights(log_ratio, loss_log_ratio, cap):
    w = np.minimum(np.exp(log_ratio), cap).astype(np.float32)
    return w, w == np.float32(cap)


def mask_tokens(log_ratio, loss_log_ratio, cap):
    w = (np.abs(log_ratio) <= math.log(cap)).astype(np.float32)
    return w, w == 0.0


def mask_sequence(log_ratio, loss_log_ratio, cap):
    inside = loss_log_ratio.size == 0 or abs(loss_log_ratio.mean()) <= math.log(cap)
    w = np.full(log_ratio.shape, float(inside), dtype=np.float32)
    return w, w == 0.0


CORRECTIONS = {"none": no_correction, "tis": truncated_importance_weights, "mask_token": mask_tokens,
               "mask_sequence": mask_sequence}


def correction_weights(learner_logp: list[np.ndarray], sampler_logp: list[np.ndarray], kind: str, cap: float,
                       masks: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], float]:
    """Per row, the weight of each response token under correction `kind` (see above), and the share of
    the loss tokens where it binds (0 when there are none). `masks`: the tokens of the loss per row (a row's
    geometric mean is over those; None: all)."""
    weights, bound = [], [np.zeros(0, dtype=bool)]
    for r, (mine, theirs) in enumerate(zip(learner_logp, sampler_logp)):
        log_ratio = np.asarray(mine, dtype=np.float64) - np.asarray(theirs, dtype=np.float64)
        in_loss = np.ones(log_ratio.shape, dtype=bool) if masks is None else masks[r]
        w, binds = CORRECTIONS[kind](log_ratio, log_ratio[in_loss], cap)
        weights.append(w)
        bound.append(binds[in_loss])
    bound = np.concatenate(bound)
    return weights, float(bound.mean()) if bound.size else 0.0


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                settings: LossSettings, *, token_normalizer: float | torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, and its metrics: detached *sums over tokens* (keys ending in `_sum`) and
    `tokens`, for callers to add over micro-batches and divide once.

    logp (with grad), old_logp (behaviour policy: the rollout's or recomputed), mask (1: a token of the loss,
    0: padding or forced), ref_logp (frozen reference; needed when kl_coef > 0), entropy (with grad; needed
    when entropy_coef > 0) and weights (`correction_weights`; None: all 1) are per token, of one shape [R, T]
    or [N]; advantages too, or one per row ([R] for [R, T] inputs). token_normalizer: the token count of the
    whole mini-batch (None: this micro-batch's own, a plain token mean).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    mask = mask.to(logp.dtype)
    if advantages.dim() == 1 and logp.dim() == 2:      # one advantage per row
        advantages = advantages[:, None]
    advantages = advantages.to(logp.dtype).expand_as(logp)
    old_logp = old_logp.to(logp.dtype)
    tokens = mask.sum()
    norm = tokens if token_normalizer is None else token_normalizer
    norm = torch.clamp(torch.as_tensor(norm, dtype=logp.dtype, device=logp.device), min=1.0)

    # Per token: PPO's clipped loss; `clipped` and `dual` mark where the ratio clip and the dual clip bind.
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped_term = -advantages * torch.clamp(ratio, 1.0 - settings.clip_ratio, 1.0 + settings.clip_ratio)
    pg = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    dual = torch.zeros_like(clipped)
    if settings.dual_clip:
        # For A < 0 the ordinary clipped loss is unbounded as the ratio grows; dual clip caps it at -c*A.
        cap = -advantages * settings.dual_clip
        dual = (advantages < 0) & (pg > cap)
        pg = torch.where(advantages < 0, torch.minimum(pg, cap), pg)
    if weights is not None:
        pg = pg * weights.to(logp.dtype)
    loss_sum = (pg * mask).sum()
    with torch.no_grad():
        log_ratio = (logp - old_logp).detach()
        metrics = {
            "tokens": tokens.detach(),
            "pg_loss_sum": loss_sum.detach(),
            "clip_frac_sum": (clipped.to(mask.dtype) * mask).sum(),
            "dual_clip_frac_sum": (dual.to(mask.dtype) * mask).sum(),
            # k3 estimate of KL(old || new): mean of exp(r) - 1 - r, r = logp - old_logp
            "approx_kl_sum": ((torch.exp(log_ratio) - 1.0 - log_ratio) * mask).sum(),
            "ratio_sum": (torch.exp(log_ratio) * mask).sum(),
        }
    if settings.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl_sum = (low_var_kl(logp, ref_logp.to(logp.dtype)) * mask).sum()
        loss_sum = loss_sum + settings.kl_coef * kl_sum
        metrics["kl_sum"] = kl_sum.detach()
    if entropy is not None:
        ent_sum = (entropy * mask).sum()
        metrics["entropy_sum"] = ent_sum.detach()
        if settings.entropy_coef > 0:
            loss_sum = loss_sum - settings.entropy_coef * ent_sum
    elif settings.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs entropy")
    metrics["loss_sum"] = loss_sum.detach()
    return loss_sum / norm, metrics


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True,
                               allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of each position's distribution, in float32 (callers pass the response
    positions only, to keep the float32 copy small). logits: [..., V]; targets: [...] token ids. allowed:
    bool [..., V], the tokens a constrained sampler could pick (learner/grammar_mask.py): the distribution is
    then softmax over those alone, as that sampler's. None: every token."""
    logits = logits.float()
    scored = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    logz = torch.logsumexp(scored, dim=-1)
    logp = torch.gather(scored, -1, targets.long().unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        probs = torch.softmax(scored, dim=-1)
        entropy = logz - (probs * logits).sum(-1)   # (unmasked logits: a left-out token adds 0, not 0 * -inf)
    return logp, entropy
