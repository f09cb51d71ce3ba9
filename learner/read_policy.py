"""The learner's read policy: which of the groups a trajectory source hands out it trains on.

A source (`common.stream.interface.TrajectorySource`: the Redis stream, or in memory) delivers each complete group
at least once and knows nothing of policy versions. Whatever the source, the learner judges every group:

* one claiming a policy version above the newest the learner published is dead-lettered (no weights of this
  learner sampled it);
* a duplicate (id already trained on, held from an earlier read, or twice in this read: a retried publish,
  a redelivery after a crash between commit and ack) is acked untrained as "duplicates_skipped";
* a stale one (sampled more than stream.max_policy_lag versions behind the learner: common.staleness) is acked
  untrained as
  "dropped_stale"; a redelivered group passed that check when first read and is not judged again
  (`learner.loop.Learner._resume`), nor is one without a version (-1).
"""
from __future__ import annotations

from typing import Callable, Container, Iterable

from common.staleness import is_stale
from common.stream.interface import Received, TrajectorySource


def groups_to_train(source: TrajectorySource, received: list[Received], *, trained_ids: Container[str],
                    newest_version: int, max_policy_lag: int, held_ids: Iterable[str] = (),
                    policy_lag: Callable[[int], int] | None = None) -> list[Received]:
    """The groups of `received` to train on, in order; the others are dead-lettered or acked untrained
    (counted in source.stats). `held_ids`: groups read and not yet trained. `policy_lag(v)`: versions the
    learner stands past v (default newest_version - v; `learner.loop.Learner.policy_lag` after a resume)."""
    policy_lag = policy_lag or (lambda version: newest_version - version)
    taken = set(held_ids)
    keep, duplicates, stale = [], [], []
    for r in received:
        oldest, newest = r.group.policy_versions
        if newest > newest_version:
            source.dead_letter([r], f"sampled by policy version {newest}, which this learner has not published "
                                    f"(newest: {newest_version})")
        elif r.group.group_id in trained_ids or r.group.group_id in taken:
            duplicates.append(r)
        elif not r.redelivered and oldest >= 0 and is_stale(policy_lag(oldest), max_policy_lag):
            stale.append(r)
        else:
            taken.add(r.group.group_id)
            keep.append(r)
    source.ack(duplicates, counted_as="duplicates_skipped")
    source.ack(stale, counted_as="dropped_stale")
    return keep
