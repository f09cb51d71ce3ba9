"""Stand-ins for a run's costly parts, keeping its control plane real: for the autoscale tests (and a scale
bench). They live with the tests and are never a run's option.

    StandInRollout   a Ray actor with the rollout actor's interface (run, stop, stats, node, close,
                     set_inference_actors) whose slots each take the real stream's admission, "play" a group
                     for `play_s` seconds (a set share of it counted as waiting on generation, the rest on the
                     environment) and publish a synthetic group through the real Redis stream
    StandInLearner   reads batches of `batch` groups from the real stream and "trains" each for `step_s`
                     seconds (settable while running), then acks them; it counts how long it waited for groups
    StandInInference a Ray actor with the inference actor's weight-transfer interface: the real WeightReceiver
                     (common/weights/receiver.py) over an engine without a model, so a push travels as a run's
                     does (shm buckets read from /dev/shm; the real gloo group and broadcasts) and each tensor
                     received is copied once, as vLLM copies it into its parameter

What they leave out is what costs compute: a policy, environments, a learner's arithmetic, vLLM's model.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections import Counter
from types import SimpleNamespace

import ray

from common.config import StreamConfig
from common.processes.placement import this_node
from common.seeds import stable_seed
from common.stream.redis_stream import TrajectoryStream
from common.weights.receiver import WeightEndpoints
from tests.support.synthetic import synthetic_groups

ADMIT_POLL_S = 0.5      # a slot waiting for admission looks at stop() this often
STORE_BYTES = 80 * 1024**2      # each simulated node's object store (Ray's least)


@contextlib.contextmanager
def simulated_nodes(nodes: int):
    """Ray nodes simulated on this machine, this process connected as the driver: `ray.cluster_utils.Cluster`
    (a raylet and an object store each, every node at this machine's own address, as a local Ray is: nothing
    leaves the machine). The head has 1 CPU and the resource "head_node"; each of the `nodes` workers 1 CPU and
    "sim_node": 1000 (place stand-ins with resources={"sim_node": 1}). Yields the Cluster; all stopped after."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head_node": 1},
                                                            "object_store_memory": STORE_BYTES})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, resources={"sim_node": 1000}, object_store_memory=STORE_BYTES)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


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


# -- the inference actor's weight-transfer half, without vLLM's model ------------------------------------------

SCRATCH_BYTES = 64 * 1024**2       # a stand-in model's copy target: the copy's bytes without a model's memory


class _ModelStandIn:
    """What a push's loaders see of a vLLM worker and its model (`reload_weights` for shm buckets,
    `load_weights` for the gloo engine's chunks): each tensor's bytes are copied once, through a scratch
    buffer (the copy vLLM makes into its parameter; a model's memory is left out, so that many stand-ins fit
    one machine); names and bytes are kept, and each tensor's sum when `keep_sums`."""

    def __init__(self, keep_sums: bool):
        import torch

        self.keep_sums = keep_sums
        self.scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
        self.received: dict[str, int] = {}      # name: bytes, since the last take
        self.sums: dict[str, float] = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool = True) -> None:
        self.load_weights(weights_iterator)

    def load_weights(self, weights) -> None:
        import torch

        for name, tensor in weights:
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), SCRATCH_BYTES):
                piece = flat[start:start + SCRATCH_BYTES]
                self.scratch[:piece.numel()].copy_(piece)
            self.received[name] = flat.numel()
            if self.keep_sums:
                self.sums[name] = float(tensor.double().sum())


class _EngineStandIn:
    """The part of vLLM's AsyncLLM that WeightReceiver calls, for one worker without a model: bucket loads run
    on the stand-in model; the gloo engine is the project's own (common/weights/gloo.py), less vLLM's
    layer-wise reload at start and finish (there is no model to reload)."""

    def __init__(self, model: _ModelStandIn, tie_word_embeddings: bool):
        parallel = SimpleNamespace(world_size=1, data_parallel_size=1, rank=0, data_parallel_index=0)
        self.vllm_config = SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(
            hf_config=SimpleNamespace(tie_word_embeddings=tie_word_embeddings)))
        self.model = model
        self.transfer = None

    async def collective_rpc(self, fn, args=()):
        return [await asyncio.to_thread(fn, self.model, *args)]

    async def reset_prefix_cache(self) -> bool:
        return True

    async def init_weight_transfer_engine(self, request) -> None:
        import torch

        from common.weights.gloo import GlooWeightTransferEngine

        class GlooWithoutReload(GlooWeightTransferEngine):
            def start_weight_update(self) -> None:
                pass

            def finish_weight_update(self) -> None:
                pass

        self.transfer = GlooWithoutReload(None, self.vllm_config, torch.device("cpu"), self.model)
        await asyncio.to_thread(self.transfer.init_transfer_engine, self.transfer.parse_init_info(request.init_info))

    async def start_weight_update(self) -> None:
        pass

    async def update_weights(self, request) -> None:
        await asyncio.to_thread(self.transfer.update_weights, request.update_info)

    async def finish_weight_update(self) -> None:
        pass

    async def shutdown_weight_transfer_engine(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()


@ray.remote(num_cpus=0)
class StandInInference(WeightEndpoints):
    def __init__(self, weights_dir: str, tie_word_embeddings: bool, keep_sums: bool = False,
                 timeout_s: float = 600.0):
        """weights_dir: where shm pushes' manifests are written (inference.weights_dir); tie_word_embeddings:
        the served model's (the sender adds lm_head.weight for it); keep_sums: each tensor's sum is kept (a
        test's check that the values arrived)."""
        # What a real actor's process has imported by its first push (vLLM's, through its model loader): here
        # at start, so that the first push's time is the group's build, not these imports (~1 s a process).
        import vllm.distributed.weight_transfer.packed_tensor  # noqa: F401
        import vllm.model_executor.model_loader.mtp_validation  # noqa: F401

        from common.weights import gloo  # noqa: F401
        from common.weights.receiver import RequestGate, WeightReceiver

        self.model = _ModelStandIn(keep_sums)
        self.receiver = WeightReceiver(_EngineStandIn(self.model, tie_word_embeddings), RequestGate(),
                                       SimpleNamespace(set=lambda name, value: None), backend="gloo",
                                       timeout_s=timeout_s, weights_dir=weights_dir, has_weights=True)

    def node(self) -> dict:
        return this_node()

    def take_received(self) -> dict:
        """{"version", "bytes": {name: bytes}, "sums": {name: sum}} of what arrived since the last take."""
        model = self.model
        out = {"version": self.receiver.version, "bytes": model.received, "sums": model.sums}
        model.received, model.sums = {}, {}
        return out
