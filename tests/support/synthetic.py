"""Synthetic episode groups shaped like ALFWorld rollouts (random tokens, sparse success reward, repeated
anchor observations, some invalid actions), and looking into episode groups row by row (steps as StepRows,
trajectories kept or dropped, last rows). Seeded: the same arguments give the same groups. The benchmarks
use the same groups; needs numpy and common.stream.records only (bench_gpu runs without Ray or vLLM)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from common.stream.records import COLUMNS, RAGGED, TEXT, EpisodeGroup, Rows, StepRow, Trajectory


def synthetic_groups(num_groups: int, group_size: int = 4, *, vocab_size: int = 1000, seed: int = 0,
                     max_steps: int = 4, prompt_tokens: tuple[int, int] = (16, 64),
                     response_tokens: tuple[int, int] = (4, 24), num_anchors: int = 3,
                     policy_version: int = 0, prefix: str = "g",
                     respond: Callable[[np.random.Generator], tuple[np.ndarray, str]] | None = None
                     ) -> list[EpisodeGroup]:
    """`num_groups` groups of `group_size` trajectories of 1..max_steps steps each.

    Token ids are drawn from [1, vocab_size) (0 stays free for padding); behaviour log-probs are negative
    random numbers (tests that need on-policy log-probs recompute them). `respond(rng)`, when given, writes
    each response instead: (token ids, the grammar it was sampled under)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        gid = f"{prefix}{seed}-{g}"
        played = []
        for k in range(group_size):
            n = int(rng.integers(1, max_steps + 1))
            won = bool(rng.random() < 0.4)
            steps = []
            for t in range(n):
                r = 10.0 if (won and t == n - 1) else 0.0
                nr = int(rng.integers(*response_tokens))
                prompt = rng.integers(1, vocab_size, int(rng.integers(*prompt_tokens)))
                response, grammar = (rng.integers(1, vocab_size, nr), "") if respond is None else respond(rng)
                steps.append(StepRow(
                    prompt_ids=prompt, response_ids=response,
                    response_logprobs=(-0.5 - 3.0 * rng.random(len(response))).astype(np.float32),
                    reward=r, anchor=f"observation {int(rng.integers(num_anchors))}",
                    valid=bool(rng.random() < 0.8), step=t, policy_version=policy_version,
                    action=f"go to place {t}", grammar=grammar))
            played.append((Trajectory(traj_id=f"{gid}-{k}", success=won, episode_return=10.0 if won else 0.0,
                                      score=float(won)), steps))
        groups.append(EpisodeGroup.pack(gid, f"task{g}", "alfworld", played, producer="synthetic"))
    return groups


def step_rows(groups: list[EpisodeGroup]) -> list[tuple[str, str, StepRow]]:
    """(group id, trajectory id, step) of every row of `groups`, in build_batch's order; the steps' arrays
    are views of the groups' columns."""
    return [(g.group_id, t.traj_id, s) for g in groups for k, t in enumerate(g.trajectories) for s in steps_of(g, k)]


def keep_trajectories(group: EpisodeGroup, keep: list[int]) -> EpisodeGroup:
    """A copy of `group` with only the trajectories at indices `keep` (and their rows)."""
    played = [(dataclasses.replace(group.trajectories[k]), steps_of(group, k)) for k in keep]
    return EpisodeGroup.pack(group.group_id, group.task_id, group.env_name, played, group.created_at, group.producer)


def last_rows(group: EpisodeGroup) -> np.ndarray:
    """The row index of each trajectory's last step (trajectories with steps only)."""
    ends = np.cumsum([t.num_steps for t in group.trajectories]) - 1
    return ends[[t.num_steps > 0 for t in group.trajectories]]


def row_step(rows: Rows, i: int) -> StepRow:
    """Row i as a StepRow (its arrays are views of the columns)."""
    values = {}
    for name in COLUMNS:
        if name in RAGGED:
            start = int(rows.offsets(RAGGED[name])[i])
            value = rows[name][start:start + int(rows[RAGGED[name]][i])]
            values[name] = value.tobytes().decode() if name in TEXT else value
        else:
            values[name] = rows[name][i].item()
    return StepRow(**values)


def steps_of(group: EpisodeGroup, k: int) -> list[StepRow]:
    """Trajectory k's steps as StepRows (views of the group's columns)."""
    start = sum(t.num_steps for t in group.trajectories[:k])
    return [row_step(group.rows, i) for i in range(start, start + group.trajectories[k].num_steps)]
