"""Stand-ins for a run's costly parts, keeping its control plane real: for the autoscale tests (and a scale
bench). They live with the tests and are never a run's option.

    StandInRollout   a Ray actor with the rollout actor's interface (run, stop, stats, node, close,
                     set_inference_actors) whose slots each take the real stream's admission, "play" a group
                     for `play_s` seconds (a set share of it counted as waiting on generation, the rest on the
                     environment) and publish a synthetic group through the real Redis stream
    StandInLearner   reads batches of `batch` groups from the real stream and "trains" each for `step_s`
                     seconds (settable while running), then acks them; it counts how long it waited for groups

What they leave out is what costs compute: a policy, environments, a learner's arithmetic.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import Counter

import ray

from common.config import StreamConfig
from common.processes.placement import this_node
from common.seeds import stable_seed
from common.stream.redis_stream import TrajectoryStream
from tests.support.synthetic import synthetic_groups

ADMIT_POLL_S = 0.5      # a slot waiting for admission looks at stop() this often


@ray.remote(num_cpus=0)
class StandInRollout:
    def __init__(self, actor_id: str, url: str, stream_cfg: StreamConfig, slots: int, play_s: float,
                 generation: float = 0.5, group_shape: dict | None = None):
        """group_shape: synthetic_groups' keyword arguments of the group every slot publishes (a new id each
        time; the default is a small one, ~10 kB)."""
        self.actor_id, self.slots, self.play_s, self.generation = actor_id, slots, play_s, generation
        self.stream = TrajectoryStream(url, stream_cfg, consumer_name=f"producer-{actor_id}")
        shape = {"group_size": 2, "max_steps": 2, **(group_shape or {})}
        self.template = synthetic_groups(1, seed=stable_seed(0, actor_id), prefix=f"{actor_id}-", **shape)[0]
        self.admission_samples: list[float] = []    # seconds each admit() took, since the last take
        self.life = uuid.uuid4().hex[:8]      # in its groups' ids: a restarted actor counts from 0 again
        self.counters: Counter = Counter()
        self.timers = {"admission_wait_s": 0.0, "gen_wait_s": 0.0, "env_wait_s": 0.0}
        self._wall, self._started, self._stopping, self._running = 0.0, 0.0, False, None

    def node(self) -> dict:
        return this_node()

    def set_inference_actors(self, actors: list) -> int:
        return len(actors)

    async def run(self, max_groups: int | None = None) -> dict:
        self._stopping, self._started = False, time.perf_counter()
        self._running = asyncio.get_running_loop().create_future()
        try:
            await asyncio.gather(*[self._slot() for _ in range(self.slots)])
        finally:
            self._wall += time.perf_counter() - self._started
            self._running.set_result(True)
            self._running = None
        return self.stats()

    async def _slot(self) -> None:
        while not self._stopping:
            t0 = mark = time.perf_counter()
            admitted = ""
            while not admitted and not self._stopping:     # (the wait counted after every try, as the real actor)
                try:
                    admitted = await asyncio.to_thread(self.stream.admit, ADMIT_POLL_S)
                except TimeoutError:
                    pass
                self.timers["admission_wait_s"] += time.perf_counter() - mark
                mark = time.perf_counter()
            self.admission_samples.append(time.perf_counter() - t0)
            if not admitted:
                return
            n = self.counters["groups_started"]      # (the group's id: this actor's n-th)
            self.counters["groups_started"] += 1
            await asyncio.sleep(self.play_s)
            self.timers["gen_wait_s"] += self.play_s * self.generation
            self.timers["env_wait_s"] += self.play_s * (1 - self.generation)
            group = dataclasses.replace(self.template, group_id=f"{self.actor_id}-{self.life}-{n}")
            await asyncio.to_thread(self.stream.publish, group, None, admitted)
            self.counters["groups_published"] += 1

    async def stop(self, drain: bool = True) -> dict:
        """Stop taking slots; the groups being played are published (drain=False is not needed here)."""
        self._stopping = True
        if self._running is not None:
            await asyncio.shield(self._running)
        return self.stats()

    def stats(self) -> dict:
        wall = self._wall + (time.perf_counter() - self._started if self._running is not None else 0.0)
        return {"groups_published": self.counters["groups_published"], **self.timers, "wall_s": wall}

    def take_admission_samples(self) -> list[float]:
        samples, self.admission_samples = self.admission_samples, []
        return samples

    def close(self) -> None:
        self.stream.close()


class StandInLearner:
    def __init__(self, url: str, stream_cfg: StreamConfig, batch: int, step_s: float):
        self.stream = TrajectoryStream(url, stream_cfg, consumer_name="learner-0")
        self.batch, self.step_s = batch, step_s
        self.trained: list[str] = []        # group ids, in the order trained
        self._held: list = []               # read, waiting for the rest of a batch

    def step(self, timeout_s: float) -> float | None:
        """One update: the seconds waited for its batch; None when no whole batch came within timeout_s (the
        groups read so far are kept for the next call)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while len(self._held) < self.batch and time.monotonic() < deadline:
            block_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            self._held += self.stream.read(self.batch - len(self._held), block_ms=block_ms)
        if len(self._held) < self.batch:
            return None
        waited = time.monotonic() - t0
        time.sleep(self.step_s)
        batch, self._held = self._held, []
        self.trained += [r.group.group_id for r in batch]
        self.stream.ack(batch)
        return waited

    def count(self) -> int:
        return len(self.trained)

    def trained_ids(self) -> list[str]:
        return self.trained

    def set_step_s(self, step_s: float) -> None:
        self.step_s = step_s

    def cpu_s(self) -> float:
        """This process' CPU seconds so far (run as a Ray actor: the learner's own process)."""
        return time.process_time()

    def drain(self) -> None:
        """Train what the stream still holds, however few (the run's end)."""
        while True:
            got = self.stream.read(self.batch, block_ms=200)
            if not got and not self._held:
                return
            batch, self._held = self._held + got, []
            self.trained += [r.group.group_id for r in batch]
            self.stream.ack(batch)

    def close(self) -> None:
        self.stream.close()
