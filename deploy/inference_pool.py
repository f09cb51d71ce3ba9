"""The run's inference actors (vLLM engines): serving, starting (added by `gigpo scale --inference`), and
retiring (removed, still holding requests)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import ray

from actors.inference import stop_inference_actors
from common.processes.actor_calls import answered

log = logging.getLogger("gigpo")

INFERENCE_STOP_S = 60    # inference actors told to shut down their engines, before they are killed


@dataclass(eq=False)     # (list.remove finds this very entry)
class Retiring:
    """A removed inference actor, stopped once it holds no request or at `deadline` (time.monotonic)."""
    handle: object
    deadline: float
    stats_ref: object = None        # ObjectRef of its stats() in flight


class InferencePool:
    """`create(num_actors=None, first=0, wait_for_weights=False)` starts inference actors as the run's first
    ones were; `use(actors)` makes them the ones the learner pushes to and the rollout actors use."""

    def __init__(self, create: Callable[..., list], use: Callable[[list], dict], generate_timeout_s: float):
        self._create, self._use, self._generate_timeout_s = create, use, generate_timeout_s
        self.serving: list = []                  # the learner pushes to them, rollout actors use them
        self.starting: list[tuple] = []          # (handle, ObjectRef of its node()) added, engine starting
        self.retiring: list[Retiring] = []       # removed ones, stopped once idle (reap_retired)

    def start(self) -> None:
        """The run's first inference actors (inference.num_actors)."""
        self.serving = self._create()

    def scale(self, num_actors: int) -> None:
        """Run `num_actors` (>= 1) inference actors. Added ones start in the background and join once their
        engine is up (`join_started`). Removed ones (the newest first) leave at once, and are stopped once
        their requests have finished (`reap_retired`)."""
        if num_actors < 1:
            raise ValueError(f"a run needs at least one inference actor, not {num_actors}")
        have = len(self.serving) + len(self.starting)
        if num_actors > have:
            added = self._create(num_actors=num_actors - have, first=have, wait_for_weights=True)
            self.starting += [(actor, actor.node.remote()) for actor in added]
        cancelled = []
        while len(self.serving) + len(self.starting) > num_actors and self.starting:
            cancelled.append(self.starting.pop()[0])
        if cancelled:         # never used by anyone
            stop_inference_actors(cancelled, timeout_s=10)
        if len(self.serving) > num_actors:
            deadline = time.monotonic() + self._generate_timeout_s
            self.retiring += [Retiring(actor, deadline) for actor in self.serving[num_actors:]]
            self.use(self.serving[:num_actors])

    def use(self, actors: list) -> dict:
        """Make `actors` the serving ones; learner rank 0's answer."""
        info = self._use(actors)
        self.serving = list(actors)
        return info

    def join_started(self) -> None:
        """Added inference actors whose engine is up join the run, in the order they were added (the learner
        pushes its weights to them first). One that died while starting is dropped, with a warning."""
        ready = 0
        for actor, ping in self.starting:
            if not answered(ping):
                break
            try:
                ray.get(ping)
            except ray.exceptions.RayError as exc:
                log.warning("an added inference actor did not start (%s); it is dropped: see its log, then scale "
                            "again", str(exc).splitlines()[0][:300])
                self.starting.remove((actor, ping))
                ray.kill(actor)
                return
            ready += 1
        if ready:
            joining = [actor for actor, _ in self.starting[:ready]]
            del self.starting[:ready]
            info = self.use(self.serving + joining)
            log.info("%d inference actor(s) joined; the learner's policy version %d was pushed to them (%s)",
                     len(joining), info.get("policy_version", -1),
                     f"{info['total_s']:.2f} s" if "total_s" in info else "they had it already")

    def reap_retired(self) -> None:
        """Stop each removed inference actor once it holds no request; after inference.generate_timeout_s,
        also with requests (the rollout actors retry them on the others)."""
        for entry in list(self.retiring):
            if entry.stats_ref is None:
                entry.stats_ref = entry.handle.stats.remote()
            idle = False
            if answered(entry.stats_ref, timeout_s=5):
                ref, entry.stats_ref = entry.stats_ref, None
                try:
                    stats = ray.get(ref)
                    idle = not stats["inflight"] and (not stats["held"] or not stats["has_weights"])
                except ray.exceptions.RayError:
                    idle = True         # gone already
            if idle or time.monotonic() > entry.deadline:
                if not idle:
                    log.warning("a removed inference actor still held requests after inference.generate_timeout_s: "
                                "stopped; the rollout actors retry them on the others")
                stop_inference_actors([entry.handle], timeout_s=INFERENCE_STOP_S)
                self.retiring.remove(entry)

    def stop_all(self, timeout_s: float, say=log.warning) -> None:
        """Shut every engine down (their own shutdown, which removes their shared memory), then ray.kill."""
        try:
            every_actor = self.serving + [actor for actor, _ in self.starting] + [r.handle for r in self.retiring]
            stop_inference_actors(every_actor, timeout_s=timeout_s, say=say)
        finally:
            self.serving, self.starting, self.retiring = [], [], []
