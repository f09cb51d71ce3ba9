"""The run's rollout actors: added and removed (`gigpo scale --rollout`), restarted ones played again, and
their stats summed over the whole run (removed actors and lives before a restart included)."""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import ray

from common.config import ExperimentConfig
from common.processes.actor_calls import answered, call_all, wait_all
from common.processes.placement import format_need, job_needs

log = logging.getLogger("gigpo")

ROLLOUT_TELL_S = 30      # rollout actors told of added or removed inference actors
ROLLOUT_STOP_S = 30      # rollout actors told to stop without draining (they discard what is in flight)
UNSTARTED_PING_S = 1.0   # a removed actor that has never answered gets this long to say it has started
STATS_WAIT_S = 10.0      # a placed actor's stats() answer is waited for this long (it answers in ms)
UNSTARTED_SAY_S = 30.0   # an actor not placed and constructed after this long is reported, once


@dataclass
class RolloutRecord:
    """One rollout actor of the run and the driver's calls in flight on it."""
    id: str
    handle: object
    run: object = None              # ObjectRef of its run() while it plays (async mode)
    stop: object = None             # ObjectRef of its stop() once removed: it is retiring
    stats: dict = field(default_factory=dict)   # its last stats, of this life (a restart counts from 0)
    restart_ping: object = None     # ObjectRef of a node() call while Ray restarts it (it is coming back)
    started: bool = False           # it has answered a stats() call: it was placed and constructed
    stats_call: object = None       # ObjectRef of its stats() call not answered yet
    created: float = field(default_factory=time.monotonic)
    said_unstarted: bool = False    # reported as not started after UNSTARTED_SAY_S


class RolloutPool:
    """The rollout actors, live and retiring. `create(actor_id)` starts one."""

    def __init__(self, cfg: ExperimentConfig, create: Callable[[str], object]):
        self.cfg = cfg
        self._create = create
        self.actors: dict[str, RolloutRecord] = {}   # live and retiring, by id, oldest first
        self.ended: list[dict] = []     # the last stats of removed actors and of lives ended by a restart
        self.restarts = 0               # rollout actors that died and were restarted by Ray
        self._next_id = 0

    @property
    def live(self) -> list[RolloutRecord]:
        return [actor for actor in self.actors.values() if actor.stop is None]

    @property
    def retiring(self) -> list[RolloutRecord]:
        return [actor for actor in self.actors.values() if actor.stop is not None]

    @property
    def restarting(self) -> list[RolloutRecord]:
        return [actor for actor in self.live if actor.restart_ping is not None]

    def handles(self) -> dict[str, object]:
        """{id: handle} of the live actors, oldest first."""
        return {actor.id: actor.handle for actor in self.live}

    def start(self, num_actors: int) -> None:
        """The run's first rollout actors."""
        self.scale(num_actors)

    def scale(self, num_actors: int, drain: bool = True) -> None:
        """Add or remove rollout actors (the newest first). A removed actor finishes (drain) or discards its
        in-flight groups, in the background (they may wait for room in the stream); `reap_retired` collects it."""
        while len(self.live) < num_actors:
            actor_id = f"rollout-{self._next_id}"
            self._next_id += 1
            actor = self.actors[actor_id] = RolloutRecord(actor_id, self._create(actor_id))
            if not self.cfg.run.sync:
                actor.run = actor.handle.run.remote()
        removed = []
        while len(self.live) > num_actors:
            actor = self.live[-1]
            actor.run = actor.restart_ping = None
            actor.stop = actor.handle.stop.remote(drain=drain)
            removed.append(actor)
        self._forget_unstarted(removed)

    def _forget_unstarted(self, removed: list[RolloutRecord]) -> None:
        """Removed actors that are not placed or still constructing hold no group: they are killed at once, not
        left retiring until a node has room for them (their stop() would wait for that)."""
        unsure = [actor for actor in removed if not actor.started]
        pings = wait_all([actor.handle.node.remote() for actor in unsure], UNSTARTED_PING_S)
        for i in pings.late:
            actor = unsure[i]
            ray.kill(actor.handle)
            del self.actors[actor.id]
            log.info("rollout actor %s was removed before it started: killed", actor.id)

    def reap_retired(self, timeout_s: float = 0.0, say=log.warning) -> None:
        """Collect the retiring actors whose stop() has returned (waiting up to timeout_s for them)."""
        for actor in self.retiring:
            if not answered(actor.stop, timeout_s):
                continue
            del self.actors[actor.id]
            try:
                self.ended.append(ray.get(actor.stop))
                ray.get(actor.handle.close.remote(), timeout=60)
            except Exception as exc:
                say("rollout actor %s did not stop cleanly: %s", actor.id, exc)
            ray.kill(actor.handle)

    def stop_all(self, timeout_s: float, say=log.warning) -> None:
        """Remove every actor without draining; one deadline for all, then the rest is killed."""
        self.scale(0, drain=False)
        wait_all([actor.stop for actor in self.retiring], timeout_s)
        self.reap_retired(timeout_s=0, say=say)
        for actor in self.retiring:
            say("rollout actor %s did not stop within %d s: killed", actor.id, timeout_s)
            ray.kill(actor.handle)
            del self.actors[actor.id]

    def check_alive(self, inference: list) -> None:
        """A rollout actor that died (its process or its node) is restarted by Ray: its in-flight groups are
        abandoned, the run goes on, and it plays again once back, with `inference`. An exception inside its
        loop is a bug: the run stops."""
        for actor in self.restarting:
            if not answered(actor.restart_ping):
                continue
            try:                # it answers: back, play again (with the inference actors of now: its
                ray.get(actor.restart_ping)   # constructor's arguments may name others, from before a scale)
                ray.get(actor.handle.set_inference_actors.remote(inference), timeout=60)
                actor.restart_ping, actor.run = None, actor.handle.run.remote()
                log.info("rollout actor %s is back", actor.id)
            except ray.exceptions.RayError:     # still restarting (or waiting for a node): ask again later
                actor.restart_ping = actor.handle.node.remote()
        for actor in self.live:
            if actor.run is None or not answered(actor.run):
                continue
            try:
                ray.get(actor.run)
                raise RuntimeError(f"rollout actor {actor.id} stopped unexpectedly")
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                actor.run = None
                self.restarts += 1
                if actor.stats:    # its counters start again from 0 in its new life
                    self.ended.append(actor.stats)
                    actor.stats = {}
                actor.stats_call = None     # (an answer of the old life must not count in the new one)
                log.warning("rollout actor %s died (%s); Ray restarts it, its in-flight groups (at most %d) are "
                            "abandoned, training goes on with the other actors", actor.id,
                            str(exc).splitlines()[0][:200], self.cfg.rollout.groups_per_actor)
                actor.restart_ping = actor.handle.node.remote()
            except ray.exceptions.RayError as exc:
                raise RuntimeError(f"rollout actor {actor.id} failed: {exc}") from exc

    def tell_inference(self, inference: list) -> None:
        """Every live and retiring actor's later requests go to `inference`. One that does not answer in time
        is told when it is back (`check_alive`)."""
        # (One that died meanwhile is restarted by Ray, and check_alive tells it when it is back.)
        told = call_all([actor.handle for actor in self.actors.values() if actor.restart_ping is None],
                        "set_inference_actors", inference, timeout_s=ROLLOUT_TELL_S)
        if told.late:
            log.info("%d rollout actor(s) did not take the new inference actors within %d s (still starting?): "
                     "they do when they answer", len(told.late), ROLLOUT_TELL_S)

    def play_one_batch(self, groups: int) -> None:
        """Sync mode: the live actors play exactly `groups` groups between them, with the current weights."""
        actors = self.live
        n = len(actors)
        shares = [groups // n + (1 if i < groups % n else 0) for i in range(n)]
        ray.get([actor.handle.run.remote(max_groups=k) for actor, k in zip(actors, shares) if k > 0])

    def stats(self) -> dict:
        """Totals over live, retiring and removed actors. An actor still waiting for its node's resources (or
        constructing, or restarting) cannot answer yet: its call stays pending, its last answer counts, and the
        driver does not wait for it (it may wait for a node for the rest of the run). (Resources that no node
        has were refused at start: System.start.)"""
        actors = list(self.actors.values())
        for actor in actors:
            if actor.stats_call is None:
                actor.stats_call = actor.handle.stats.remote()
        ready = [a for a in actors if a.started and a.restart_ping is None]
        waiting = [a for a in actors if not (a.started and a.restart_ping is None)]
        for group, timeout_s in ((ready, STATS_WAIT_S), (waiting, 0.0)):
            answers = wait_all([actor.stats_call for actor in group], timeout_s)
            for i in [*answers.done, *answers.lost, *answers.failed]:
                group[i].stats_call = None        # (one that died since: check_alive restarts it)
            for i, stats in answers.done.items():
                group[i].stats, group[i].started = stats, True
        unsaid = [a for a in actors if not a.started and not a.said_unstarted
                  and time.monotonic() - a.created > UNSTARTED_SAY_S]
        if unsaid:
            log.warning("rollout actor(s) %s not started after %.0f s (each needs %s on one node; a busy cluster? "
                        "see `ray status`)", ", ".join(a.id for a in unsaid), UNSTARTED_SAY_S,
                        format_need(job_needs(self.cfg)["rollout actor"][0]))
            for actor in unsaid:
                actor.said_unstarted = True
        total: dict = defaultdict(float)
        for stats in [actor.stats for actor in actors] + self.ended:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] += value
        return dict(total)
