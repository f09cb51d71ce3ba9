"""The trajectory boundary, as an interface, with a tiny in-memory implementation.

    rollout actors --TrajectorySink.publish--> [stream] --TrajectorySource.read/ack--> learner

The real one is `common.stream.redis_stream.TrajectoryStream` (Redis); `InMemoryTrajectories` only works inside
one process (unit tests). Which groups to train on (stale ones, duplicates) is the learner's read policy
(`learner.read_policy`), the same for every source.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from common.stream.records import EpisodeGroup


@dataclass
class Received:
    """One group handed to the learner; pass it back to `ack()` or `dead_letter()`. `redelivered`: handed
    out before and never acked (a learner stopped while holding it), so a learner has judged it once."""

    entry_id: str
    group: EpisodeGroup
    redelivered: bool = False


class TrajectorySink(Protocol):
    def admit(self, timeout_s: float | None = None, group_id: str = "") -> str:
        """A slot for a group about to be played; waits up to timeout_s while groups admitted and not yet
        trained are at the bound (stream.max_stream_groups, `common.staleness.policy_lag_bound`), then raises
        TimeoutError."""

    def renew(self, slots: list[str]) -> None:
        """Keep admitted slots alive while their groups are played (a dead producer's lapse)."""

    def release(self, slot: str) -> None:
        """Give back a slot whose group will not be published."""

    def publish(self, group: EpisodeGroup, timeout_s: float | None = None, admitted: str = "") -> str:
        """Append a finished group in its admitted slot (at once), or admit it first (waits as `admit`).
        Returns the entry id."""

    def close(self) -> None: ...


class TrajectorySource(Protocol):
    # counters since start, among them how the learner's groups ended (see ack): acked, dropped_stale,
    # duplicates_skipped, dead_lettered
    stats: dict[str, int]

    def read(self, max_groups: int, block_ms: int = 0) -> list[Received]:
        """Up to max_groups complete groups that no live reader holds, waiting up to block_ms for the first."""

    def ack(self, received: list[Received], counted_as: str = "acked") -> None:
        """Done with these groups: the update that used them is committed (counted as "acked"), or the
        learner dropped them untrained (counted as its reason: "dropped_stale", "duplicates_skipped")."""

    def trained(self, received: list[Received]) -> None:
        """These groups are trained on, their ack awaits a checkpoint (learner.ack_on_checkpoint): no longer
        counted as untrained by the producers' admission (`common.staleness.policy_lag_bound`)."""

    def dead_letter(self, received: list[Received], reason: str) -> None:
        """Set aside groups that cannot be trained on, with the reason; never handed out again."""

    def untrained(self) -> int:
        """Groups published and not yet trained on (unread, or read and not yet marked `trained()`)."""

    def forget_trained(self) -> None:
        """A learner starts with nothing trained and unacked: marks left by one that died before the
        checkpoint that would have acked them are dropped (those groups are handed out again, untrained)."""

    def depth(self) -> int:
        """Groups published and not yet acked."""

    def close(self) -> None: ...


class InMemoryTrajectories:
    """Both ends of the trajectory boundary in one process: each group is handed out once, until acked or
    dead-lettered (nothing is redelivered: no reader can die apart from it); no bound, nothing persisted,
    no blocking (`block_ms` is ignored: nothing else could publish while it waits)."""

    def __init__(self):
        self._entries: OrderedDict[str, EpisodeGroup] = OrderedDict()    # published, not acked
        self._inflight: set[str] = set()
        self._trained: set[str] = set()         # marked trained, not yet acked
        self._ids = itertools.count(1)
        self.dead: list[tuple[EpisodeGroup, str]] = []
        self.stats = {"published": 0, "read": 0, "acked": 0, "dropped_stale": 0, "duplicates_skipped": 0,
                      "dead_lettered": 0}

    def admit(self, timeout_s: float | None = None, group_id: str = "") -> str:
        return f"slot-{next(self._ids)}"

    def renew(self, slots: list[str]) -> None:
        pass

    def release(self, slot: str) -> None:
        pass

    def publish(self, group: EpisodeGroup, timeout_s: float | None = None, admitted: str = "") -> str:
        entry_id = f"{next(self._ids)}-0"
        self._entries[entry_id] = group
        self.stats["published"] += 1
        return entry_id

    def read(self, max_groups: int, block_ms: int = 0) -> list[Received]:
        unread = ((e, g) for e, g in self._entries.items() if e not in self._inflight)
        out = [Received(e, g) for e, g in itertools.islice(unread, max(max_groups, 0))]
        self._inflight.update(r.entry_id for r in out)
        self.stats["read"] += len(out)
        return out

    def ack(self, received: list[Received], counted_as: str = "acked") -> None:
        for r in received:
            self._inflight.discard(r.entry_id)
            self._trained.discard(r.entry_id)
            self.stats[counted_as] += self._entries.pop(r.entry_id, None) is not None

    def trained(self, received: list[Received]) -> None:
        self._trained.update(r.entry_id for r in received if r.entry_id in self._entries)

    def untrained(self) -> int:
        return len(self._entries) - len(self._trained)

    def forget_trained(self) -> None:
        self._trained.clear()

    def dead_letter(self, received: list[Received], reason: str) -> None:
        for r in received:
            self._inflight.discard(r.entry_id)
            self._trained.discard(r.entry_id)
            if self._entries.pop(r.entry_id, None) is not None:
                self.dead.append((r.group, reason))
                self.stats["dead_lettered"] += 1

    def depth(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        pass
