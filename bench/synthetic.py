"""Synthetic episode groups shaped like ALFWorld rollouts (random tokens, sparse success reward, repeated
anchor observations, some invalid actions), for the learner's benchmarks and tests. Seeded: the same
arguments give the same groups. Needs numpy and common.records only (bench_gpu runs without Ray or vLLM)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from common.records import EpisodeGroup, StepRow, Trajectory


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
