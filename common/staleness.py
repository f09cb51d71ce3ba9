"""Staleness, in one place: how far behind the learner's weights a group's sampling policy may be.

A group is stale when the learner stands more than `stream.max_policy_lag` policy versions past the version
that sampled it: the learner's read policy drops it untrained (`learner.read_policy`). So that this stays
rare, producers obey one admission rule (after SkyRL's staleness manager): they start a group only while
fewer than `policy_lag_bound(cfg)` groups are admitted and not yet trained (common/stream/redis_stream.py's `admit`).
Across a resume the learner's version numbers jump (a resumed learner pushes under a new number above every
number used before), so lags are counted in versions of the learner's own history (`policy_lag`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config import ExperimentConfig


def policy_lag_bound(cfg: ExperimentConfig) -> int:
    """The admission rule's bound: a producer starts a group only while fewer than this many groups are
    admitted and not yet trained (in the stream unread or read, or being played; groups trained and awaiting
    their ack are not counted). A group admitted when the learner stands at version v has at most
    (max_policy_lag + 1) * groups_per_batch - 1 groups ahead of it, all trained (groups_per_batch per update)
    by the time the learner stands at v + max_policy_lag, so none is played only to be dropped as stale.
    stream.max_stream_groups bounds all the groups Redis holds, trained-unacked ones included."""
    return (cfg.stream.max_policy_lag + 1) * cfg.learner.groups_per_batch


def policy_lag(version: int, current: int, resumed: tuple[int, int] | None = None) -> int:
    """Versions of the learner's own history between the weights that sampled `version` and the current ones
    (`current`): current - version without a resume; after a resume from a checkpoint at version c whose weights
    were pushed again as r (`resumed` = (c, r)), version r + k stands at c + k, and a version v < r at v."""
    if resumed is None:
        return current - version
    checkpoint, pushed_as = resumed
    here = checkpoint + (current - pushed_as)
    return here - version if version < pushed_as else current - version


def is_stale(lag: int, max_policy_lag: int) -> bool:
    """Whether a group sampled `lag` versions ago is too old to train on (stream.max_policy_lag)."""
    return lag > max_policy_lag
