"""Episode groups for the stream tests (small by default; sizes as arguments)."""
from __future__ import annotations

import time

import numpy as np

from common.stream.records import EpisodeGroup, StepRow, Termination, Trajectory
from tests.support.synthetic import row_step


def make_group(group_id: str, *, num_traj: int = 2, num_steps: int = 3, prompt_len: int = 20,
               response_len: int = 5, version: int = 0, seed: int = 0, task_id: str = "task-1") -> EpisodeGroup:
    rng = np.random.default_rng(seed)
    terminations = list(Termination)
    played = []
    for i in range(num_traj):
        steps = [
            StepRow(
                prompt_ids=rng.integers(0, 50_000, prompt_len),
                response_ids=rng.integers(0, 50_000, response_len),
                response_logprobs=-rng.random(response_len).astype(np.float32) * 5,
                reward=10.0 if s == num_steps - 1 and i == 0 else 0.0,
                anchor=f"You are in room {s}. Ünïcode ok ✓",
                valid=bool(s % 2 == 0),
                step=s,
                policy_version=version + (s % 2),
                action=f"go to desk {s}",
            )
            for s in range(num_steps)
        ]
        played.append((Trajectory(traj_id=f"{group_id}/{i}", success=i == 0, episode_return=10.0 if i == 0 else 0.0,
                                  termination=terminations[i % len(terminations)], task_type="pick_and_place",
                                  score=1.0 if i == 0 else 0.25), steps))
    return EpisodeGroup.pack(group_id, task_id, "alfworld", played, created_at=time.time(), producer="rollout-0")


def assert_groups_equal(a: EpisodeGroup, b: EpisodeGroup) -> None:
    assert (a.group_id, a.task_id, a.env_name, a.created_at, a.producer) == \
           (b.group_id, b.task_id, b.env_name, b.created_at, b.producer)
    assert a.policy_versions == b.policy_versions
    assert a.trajectories == b.trajectories
    assert all(isinstance(t.termination, Termination) for t in b.trajectories)
    assert len(a.rows) == len(b.rows)
    for i in range(len(a.rows)):
        sa, sb = row_step(a.rows, i), row_step(b.rows, i)
        assert sb.prompt_ids.dtype == np.int32 and sb.response_ids.dtype == np.int32
        assert sb.response_logprobs.dtype == np.float32
        np.testing.assert_array_equal(sa.prompt_ids, sb.prompt_ids)
        np.testing.assert_array_equal(sa.response_ids, sb.response_ids)
        np.testing.assert_array_equal(sa.response_logprobs, sb.response_logprobs)
        assert (sa.reward, sa.anchor, sa.valid, sa.step, sa.policy_version, sa.action) == \
               (sb.reward, sb.anchor, sb.valid, sb.step, sb.policy_version, sb.action)
        assert type(sb.reward) is float and type(sb.valid) is bool and type(sb.step) is int
