"""The records every plane shares: a step row, a trajectory, an episode group.

Data flows one way: env instances produce observations, rollout actors turn each environment step into a
`StepRow`, collect the rows of one rollout into a `Trajectory`, and publish the N trajectories of one task
as an `EpisodeGroup`. The learner trains on the rows. These classes are plain data: encoding for the wire
lives in `common.codec`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Termination(str, Enum):
    """Why a trajectory ended. Only `DONE` and `MAX_STEPS` are ordinary endings; the others are marked so
    that nobody mistakes a cut-off trajectory for a finished one."""

    DONE = "done"                # the environment reported done (won, or lost for good)
    MAX_STEPS = "max_steps"      # the step budget (e.g. 50 for ALFWorld) ran out
    TRUNCATED = "truncated"      # the prompt no longer fitted the model's context
    ENV_ERROR = "env_error"      # the env instance crashed or hung and was restarted


@dataclass
class StepRow:
    """One environment step of one trajectory: one training row (one prompt, one response).

    Token ids are int32 arrays and log-probs float32 arrays so that they go on the wire as packed bytes.
    """

    prompt_ids: np.ndarray          # int32 [P]: the full prompt the policy saw (chat template applied)
    response_ids: np.ndarray        # int32 [T]: the sampled response tokens
    response_logprobs: np.ndarray   # float32 [T]: log-prob of each response token under the behaviour policy
    reward: float                   # environment reward r_t of this step (10 on the winning step, else 0);
                                    # the invalid-action penalty is NOT folded in: it follows from `valid`
    anchor: str                     # anchor-state key: the raw observation the action was taken from
    valid: bool                     # whether the response parsed as a well-formed admissible-format action
    step: int                       # index of this step inside its trajectory, from 0
    policy_version: int             # version of the weights that generated the response
    action: str = ""                # the action text sent to the environment (for logs and evaluation)

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int32)
        self.response_logprobs = np.asarray(self.response_logprobs, dtype=np.float32)
        if self.response_logprobs.shape != self.response_ids.shape:
            raise ValueError(
                f"step {self.step}: {self.response_ids.shape[0]} response tokens but "
                f"{self.response_logprobs.shape[0]} log-probs"
            )


@dataclass
class Trajectory:
    """One rollout of one task: its steps in order, and how it ended."""

    task_id: str                    # the task (e.g. ALFWorld game path, WebShop goal index) all members share
    group_id: str                   # the episode group this trajectory belongs to
    traj_id: str                    # unique id of this trajectory (unique across the whole run)
    steps: list[StepRow] = field(default_factory=list)
    success: bool = False           # ALFWorld: won; WebShop: bought with native reward exactly 1.0
    episode_return: float = 0.0     # R(tau): sum of the environment rewards of the steps
    termination: Termination = Termination.DONE
    task_type: str = ""             # e.g. "pick_and_place_simple"; "" when the env has none
    score: float = 0.0              # the env's native score (WebShop reward in [0, 1]; ALFWorld: = success)

    def __post_init__(self) -> None:
        self.termination = Termination(self.termination)

    @property
    def num_steps(self) -> int:
        return len(self.steps)


@dataclass
class EpisodeGroup:
    """The N trajectories of one task, started from the same initial state: GiGPO's unit of grouping,
    and the unit the trajectory stream publishes, admits and ages."""

    group_id: str                   # unique id; the learner trains on each id at most once
    task_id: str
    env_name: str                   # "alfworld" | "webshop" | ...
    trajectories: list[Trajectory] = field(default_factory=list)
    created_at: float = 0.0         # unix time when the group was completed (for stream lag metrics)
    producer: str = ""              # id of the rollout actor that produced it

    @property
    def policy_versions(self) -> tuple[int, int]:
        """(oldest, newest) policy version among all steps; (-1, -1) for a group without steps."""
        versions = [s.policy_version for t in self.trajectories for s in t.steps]
        if not versions:
            return (-1, -1)
        return (min(versions), max(versions))

    @property
    def num_rows(self) -> int:
        return sum(t.num_steps for t in self.trajectories)

    def returns(self) -> np.ndarray:
        return np.array([t.episode_return for t in self.trajectories], dtype=np.float64)
