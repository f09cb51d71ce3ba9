"""The one interface every text environment implements: reset to a task, step with action strings. Each
report carries what the rollout plane needs for prompts and GiGPO's anchor groups (observation, anchor key,
admissible actions, reward, done/won, whether the action was admissible)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass
class EnvReport:
    """What an environment says after a reset or a step."""

    observation: str                    # text shown to the agent for this state
    anchor: str                         # anchor-state key: the raw observation (GiGPO Eq. 6)
    admissible_actions: list[str] = field(default_factory=list)
    reward: float = 0.0                 # reward of the step that led here (0 after reset)
    done: bool = False
    won: bool = False                   # task solved (ALFWorld: won; WebShop: bought with score 1.0)
    task: str = ""                      # the task instruction text
    task_type: str = ""                 # e.g. "pick_and_place_simple", "webshop"
    action_admissible: bool = True      # whether the action just taken was in the admissible list
    score: float = 0.0                  # native score (WebShop purchase reward in [0, 1]; else = won)
    info: dict = field(default_factory=dict)   # anything env-specific, JSON-serializable


@runtime_checkable
class TextEnv(Protocol):
    """A single-instance text environment. Implementations are synchronous and may block; the env
    server runs them off the actor's event loop."""

    def reset(self, task_id: str, seed: int = 0) -> EnvReport:
        """Start `task_id` from its initial state. Every member of an episode group passes the same
        task id and seed and must get an identical first report. Unknown task ids raise KeyError with a
        message saying what exists."""
        ...

    def step(self, action: str) -> EnvReport:
        """Apply one action. Unknown or malformed actions give the environment's normal feedback
        ("Nothing happens." / an unchanged page) with action_admissible=False, never an exception."""
        ...

    def task_ids(self, split: str) -> list[str]:
        """The task ids of a split ("train", "eval", or env-specific names such as "valid_unseen")."""
        ...

    def close(self) -> None:
        ...
