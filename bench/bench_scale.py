"""The rollout's control plane at cluster scale, simulated on this one machine: Ray nodes made by
`ray.cluster_utils.Cluster` (a raylet and an object store each, all sharing this machine's cores), stand-in
rollout actors spread over them (tests/support/scale_standins.py: the real stream admission and publish, a
group's play a set sleep), the real Redis stream (an embedded Redis), the real RolloutPool driven as the run's
driver drives it (check_alive, stats() and reap_retired once per update), and a stand-in learner in its own
actor on the head node that reads batches and acks them at once (a learner that is never the bottleneck).

    python bench/bench_scale.py [--nodes 8] [--actors 4,16,64] [--seconds 30] [--group-kb 1000]
                                [--push-actors 1,2,4,8] [--push-shapes tiny-policy,qwen2.5-1.5b] [--bucket-mb 256]

Per actor count: groups/s through the stream against the stand-ins' ideal (actors x slots / play time), the
driver's CPU per update, the admission wait p50/p99 (every admit() of every slot), and the CPU seconds per
group of Redis and of the learner's reads (where one core of each runs out: 1 / that). Then, at the largest
count: the time to remove 32 actors (drained: until each is collected) and to add 32 back (until each has
published a group), and a node lost with its actors: the time until they play again elsewhere and until
groups/s is back to 90% of before. Every group published is checked to have been trained exactly once.

First, the weight push against the number of inference actors (--push-actors, --push-shapes): the real sender
(common.weights.sender.WeightTransfer, as learner rank 0 calls it, from this driver on the head node) and the
real receiver in stand-in inference actors (StandInInference: no vLLM model; each tensor copied once, as vLLM
copies it into its parameter), by shm with every actor on the head node (one node: N readers of one write) and
by the collective way with one actor per simulated node (gloo's broadcast: a binomial tree, log2(N+1) rounds of
every byte; the sender sends each buffer ceil(log2(N+1)) times). Shapes: the project's tiny policy (float32)
and Qwen2.5-1.5B's (bfloat16, what a GPU learner pushes; 3.6 GB with the tied embedding sent twice). The first
push (the collective's group is built then, as after every restart or `gigpo scale --inference`) apart from the
best of --push-repeats after it. A count whose buffers would not fit the memory available is skipped, saying so.

On two cores the simulated nodes, Redis, the learner and the driver share the CPUs: the curve bends where this
machine does. The CPU figures per group and per update are what carry over to a real cluster; the push's bytes
all cross this machine's memory and loopback, so its growth with N is this machine's (one node's memory
bandwidth for shm; for the collective, a real cluster's nodes each receive on their own link).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402 - (the type of simulated_nodes' cluster)

from common.config import load_config  # noqa: E402
from common.processes.actor_calls import call_all  # noqa: E402
from common.stream.codec import encode_group, encoded_size  # noqa: E402
from common.stream.redis_client import connect  # noqa: E402
from common.stream.redis_server import EmbeddedRedis  # noqa: E402
from deploy.rollout_pool import RolloutPool  # noqa: E402
from tests.support.accounting import stream_counts  # noqa: E402
from tests.support.model_shapes import SHAPES, shaped_weights  # noqa: E402
from tests.support.scale_standins import (SCRATCH_BYTES, StandInInference, StandInLearner,  # noqa: E402
                                          StandInRollout, simulated_nodes)
from tests.support.synthetic import synthetic_groups  # noqa: E402

SLOTS = 2               # groups each stand-in actor plays at once
PLAY_S = 2.0            # seconds a stand-in group takes to play: SLOTS / PLAY_S groups/s per actor
BATCH = 16              # groups per learner update
STEP_WAIT_S = 2.0       # the learner's wait for a batch per call (the driver's loop turns at least this often)


def group_shape(kb: int) -> dict:
    """synthetic_groups' arguments for groups of about `kb` kB encoded on average: 8 trajectories of 1-30 steps
    (15.5 on average: one group may be half or 1.5 times the mean), whose prompts carry the size (4 bytes a token;
    responses of ~100 tokens with their log-probs, 8 bytes a token)."""
    prompt = max(int((kb * 1000 / (8 * 15.5) - 100 * 8) / 4), 16)
    return {"group_size": 8, "max_steps": 30, "prompt_tokens": (prompt, prompt + 1), "response_tokens": (90, 110)}


class Bench:
    def __init__(self, args):
        self.args = args
        self.redis = EmbeddedRedis()
        self.redis.start()
        self.admin = connect(self.redis.admin_url)
        # The stream's bound: room for every slot of the most actors and two batches, so that admission waits
        # only when the learner's reads fall behind.
        most = max(args.actors)
        self.cfg = load_config(None, [f"rollout.groups_per_actor={SLOTS}", f"learner.groups_per_batch={BATCH}",
                                      f"stream.max_stream_groups={most * SLOTS + 2 * BATCH}",
                                      "stream.run_id=bench-scale", "run.name=bench-scale"])
        url, stream_cfg, shape = self.redis.url, self.cfg.stream, group_shape(args.group_kb)
        actor = StandInRollout.options(resources={"sim_node": 1}, scheduling_strategy="SPREAD", max_restarts=-1,
                                       max_task_retries=0)
        self.rollouts = RolloutPool(self.cfg, lambda actor_id: actor.remote(actor_id, url, stream_cfg, SLOTS, PLAY_S,
                                                                            group_shape=shape))
        self.learner = ray.remote(num_cpus=0, resources={"head_node": 1})(StandInLearner).remote(
            url, stream_cfg, BATCH, 0.0)
        self.inference = ["stand-in"]           # what restarted rollout actors are told (they generate nothing)

    def redis_cpu_s(self) -> float:
        info = self.admin.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def trained(self) -> int:
        return ray.get(self.learner.count.remote())

    def turn(self) -> bool:
        """One turn of the driver's loop, as System.train makes it: lost actors noticed, a learner step, the
        pool's stats, retired actors collected. True when the step trained a batch."""
        self.rollouts.check_alive(self.inference)
        waited = ray.get(self.learner.step.remote(STEP_WAIT_S))
        self.rollouts.stats()
        self.rollouts.reap_retired()
        return waited is not None

    def run_for(self, seconds: float) -> dict:
        """Turns for `seconds`: groups/s, the driver's CPU per update, admission waits, Redis and learner CPU."""
        self.admission_samples()          # (from now on)
        cpu0, redis0, learner0 = time.process_time(), self.redis_cpu_s(), ray.get(self.learner.cpu_s.remote())
        n0, t0 = self.trained(), time.monotonic()
        updates = 0
        while time.monotonic() - t0 < seconds:
            updates += self.turn()
        dt, groups = time.monotonic() - t0, self.trained() - n0
        samples = sorted(self.admission_samples())
        return {"groups_per_s": groups / dt, "updates": updates,
                "driver_cpu_ms": 1000 * (time.process_time() - cpu0) / max(updates, 1),
                "admit_p50_ms": 1000 * samples[len(samples) // 2] if samples else float("nan"),
                "admit_p99_ms": 1000 * samples[int(len(samples) * 0.99)] if samples else float("nan"),
                "redis_cpu_ms_per_group": 1000 * (self.redis_cpu_s() - redis0) / max(groups, 1),
                "learner_cpu_ms_per_group": 1000 * (ray.get(self.learner.cpu_s.remote()) - learner0) / max(groups, 1)}

    def admission_samples(self) -> list[float]:
        """Every admit() wait of the playing actors since the last call (seconds)."""
        playing = [a.handle for a in self.rollouts.live if a.restart_ping is None]
        return [s for got in call_all(playing, "take_admission_samples", timeout_s=10).done.values() for s in got]

    def scale_to(self, n: int) -> float:
        """Seconds until `n` actors play: removed ones collected (drained), added ones published a group."""
        before = set(self.rollouts.handles())
        t0 = time.monotonic()
        self.rollouts.scale(n, drain=True)
        added = [h for actor_id, h in self.rollouts.handles().items() if actor_id not in before]
        while self.rollouts.retiring or (added and min(s["groups_published"] for s in ray.get(
                [h.stats.remote() for h in added])) == 0):
            self.turn()
        return time.monotonic() - t0

    def lose_a_node(self, cluster: Cluster, before_per_s: float) -> tuple[int, float, float]:
        """Remove the worker node hosting the most actors: (its actors, seconds until each plays again,
        seconds until groups/s over 5 s is back to 90% of `before_per_s`)."""
        where = dict(zip(self.rollouts.handles(), ray.get([h.node.remote() for h in self.rollouts.handles().values()])))
        counts: dict[str, int] = {}
        for node in where.values():
            counts[node["node_id"]] = counts.get(node["node_id"], 0) + 1
        victim = next(n for n in cluster.worker_nodes if n.node_id == max(counts, key=counts.get))
        lost = counts[victim.node_id]
        t0 = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)
        deadline = t0 + 300
        while len(self.rollouts.restarting) < lost and time.monotonic() < deadline:
            self.turn()           # until the pool has noticed every lost actor (check_alive)
        while self.rollouts.restarting and time.monotonic() < deadline:
            self.turn()           # until Ray has restarted each elsewhere and the pool has it playing again
        back_s = time.monotonic() - t0
        while self.run_for(5.0)["groups_per_s"] < 0.9 * before_per_s and time.monotonic() < deadline:
            pass
        return lost, back_s, time.monotonic() - t0

    def close(self) -> tuple[int, int]:
        """Stop every actor (drained), train what is left: (groups appended to the stream, distinct groups
        trained; -1 when one was trained twice)."""
        self.rollouts.scale(0, drain=True)
        deadline = time.monotonic() + 120
        while self.rollouts.retiring and time.monotonic() < deadline:
            self.turn()
        ray.get(self.learner.drain.remote())
        counts = stream_counts(self.redis.admin_url, self.cfg.stream)     # (what Redis appended: lost lives too)
        published = counts["xadd_calls"] - counts["xadd_failed"] - counts["dead_length"]
        trained = ray.get(self.learner.trained_ids.remote())
        self.rollouts.stop_all(10)
        self.redis.stop(cleanup=True)
        return published, len(set(trained)) if len(set(trained)) == len(trained) else -1


def push_weights(shape: str):
    """The (name, tensor) pairs learner rank 0 pushes for `shape`, and whether its embedding is tied."""
    import torch

    if shape == "tiny-policy":  # the project's tiny policy (deploy/tiny_model.py), float32 as trained
        from transformers import AutoModelForCausalLM

        from tests.support.tiny_policy import tiny_policy
        net = AutoModelForCausalLM.from_pretrained(tiny_policy(), dtype=torch.float32)
        return [(n, p.detach()) for n, p in net.named_parameters()], bool(net.config.tie_word_embeddings)
    return shaped_weights(SHAPES[shape], torch.bfloat16), bool(SHAPES[shape].get("tie_word_embeddings"))


def push_curve(cluster: Cluster, args) -> list[dict]:
    """Per shape, way and inference-actor count: the first push and the best of args.push_repeats after it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from common.weights.sender import WeightTransfer

    head = ray.get_runtime_context().get_node_id()
    workers = [n.node_id for n in cluster.worker_nodes]
    weights_dir = os.path.join("/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp",
                               f"gigpo-bench-scale-{os.getpid()}")
    rows, version = [], 0
    for shape in args.push_shapes:
        weights, tied = push_weights(shape)
        for way in ("shm", "collective"):
            for n in args.push_actors:
                if way == "collective" and n > len(workers):
                    continue
                # The stand-ins' memory: a gloo receiver holds up to 3 buffers (2 arriving, 1 loading), a bucket
                # reader 1 bucket; the sender 2 buffers (the weights are held already).
                need = (n * (3 if way == "collective" else 1) + 2) * args.bucket_mb * 2**20 + n * SCRATCH_BYTES
                have = psutil.virtual_memory().available
                if 1.25 * need > have:
                    print(f"push {shape} {way} x{n}: skipped, it needs about {need / 2**30:.1f} GiB of memory and "
                          f"{have / 2**30:.1f} GiB is available", flush=True)
                    continue
                nodes = [head] * n if way == "shm" else workers[:n]
                actors = [StandInInference.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id, soft=False)).remote(weights_dir, tied) for node_id in nodes]
                transfer = WeightTransfer(actors, mode=way, bucket_mb=args.bucket_mb, timeout_s=600.0)
                try:
                    times = []
                    for _ in range(args.push_repeats + 1):
                        version += 1
                        info = transfer.push(weights, version)
                        times.append(info["total_s"])
                        got = ray.get([a.take_received.remote() for a in actors], timeout=60)
                        # (shm's bytes are its files' sizes: the tensors' plus each file's small header)
                        if any(g["version"] != version or sum(g["bytes"].values()) < 0.99 * info["bytes"]
                               for g in got):
                            raise RuntimeError(f"{shape} {way} x{n}: an actor did not get version {version} whole")
                finally:
                    transfer.close(remove_files=True)
                    for a in actors:
                        ray.kill(a)
                row = {"shape": shape, "way": way, "actors": n, "bytes": info["bytes"], "first_s": times[0],
                       "best_s": min(times[1:])}
                rows.append(row)
                print(f"push {shape} {way} x{n}: first {row['first_s']:.2f} s, best {row['best_s']:.2f} s",
                      flush=True)
        del weights
    return rows


def print_push_table(rows: list[dict]) -> None:
    print("\nweight push against the number of inference actors (stand-in engines, the real sender and receiver; "
          "shm: all on the learner's node; collective: one a node):")
    print(f"{'shape':>13s} {'way':>10s} {'actors':>6s} {'MB':>7s} {'first ms':>9s} {'best ms':>8s} {'vs 1':>5s} "
          f"{'GB/s per actor':>14s}")
    one = {(r["shape"], r["way"]): r["best_s"] for r in rows if r["actors"] == 1}
    for r in rows:
        ratio = r["best_s"] / one[(r["shape"], r["way"])] if (r["shape"], r["way"]) in one else float("nan")
        print(f"{r['shape']:>13s} {r['way']:>10s} {r['actors']:6d} {r['bytes'] / 1e6:7.1f} {r['first_s'] * 1e3:9.1f} "
              f"{r['best_s'] * 1e3:8.1f} {ratio:5.2f} {r['bytes'] / r['best_s'] / 1e9:14.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8, help="simulated worker nodes (Ray raylets on this machine)")
    ap.add_argument("--actors", default="4,16,64", help="rollout actor counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured time per actor count")
    ap.add_argument("--group-kb", type=int, default=1000, help="encoded size of a group")
    ap.add_argument("--push-actors", default="1,2,4,8", help="inference actor counts of the weight push (\"\": skip)")
    ap.add_argument("--push-shapes", default="tiny-policy,qwen2.5-1.5b",
                    help=f"tiny-policy (the project's tiny model) or of {sorted(SHAPES)}")
    ap.add_argument("--push-repeats", type=int, default=2, help="timed pushes after the first, per count")
    # 256, not the config's 512: a gloo receiver holds 3 buffers, so 8 of them at 512 MB beside the 1.5B shape's
    # weights need more than 24 GiB (measured 2026-12-07: at 1-4 actors the two sizes' times agree within 7%)
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="inference.weight_bucket_mb of the push")
    args = ap.parse_args()
    args.actors = sorted(int(n) for n in args.actors.split(","))
    args.push_actors = sorted(int(n) for n in args.push_actors.split(",") if n.strip())
    args.push_shapes = [s.strip() for s in args.push_shapes.split(",") if s.strip()]
    unknown = set(args.push_shapes) - set(SHAPES) - {"tiny-policy"}
    if unknown:
        ap.error(f"unknown shape(s) {sorted(unknown)}")
    t_start = time.perf_counter()
    with simulated_nodes(args.nodes) as cluster:
        push_rows = push_curve(cluster, args) if args.push_actors else []
        bench = Bench(args)
        size = sum(encoded_size(encode_group(g)) for g in synthetic_groups(32, **group_shape(args.group_kb))) / 32
        print(f"{args.nodes} simulated nodes; groups of {size / 1e6:.2f} MB on average; each actor plays {SLOTS} "
              f"groups at once, {PLAY_S:g} s each", flush=True)
        rows = []
        try:
            for n in args.actors:
                up_s = bench.scale_to(n)
                row = {"actors": n, "start_s": up_s, **bench.run_for(args.seconds)}
                row["ideal"] = n * SLOTS / PLAY_S
                rows.append(row)
                print(f"{n} actors: started in {up_s:.0f} s; {row['groups_per_s']:.1f} groups/s of {row['ideal']:.1f} "
                      f"ideal", flush=True)
            most = args.actors[-1]
            down_s = up_s = lost = back_s = rate_s = None
            if most > 32:
                down_s = bench.scale_to(most - 32)
                up_s = bench.scale_to(most)
                print(f"-32 actors in {down_s:.1f} s, +32 in {up_s:.1f} s", flush=True)
            if args.nodes > 1:
                lost, back_s, rate_s = bench.lose_a_node(cluster, rows[-1]["groups_per_s"])
                print(f"node lost with {lost} actors: playing again after {back_s:.1f} s, groups/s at 90% after "
                      f"{rate_s:.1f} s", flush=True)
        finally:
            published, trained = bench.close()
    if push_rows:
        print_push_table(push_rows)
    print(f"\nrollout control plane over {args.nodes} simulated nodes ({SLOTS} slots x {PLAY_S:g} s per actor, "
          f"groups of {size / 1e6:.2f} MB on average, learner never the bottleneck):")
    print(f"{'actors':>6s} {'groups/s':>8s} {'ideal':>6s} {'share':>5s} {'driver ms/upd':>13s} {'admit p50 ms':>12s} "
          f"{'p99 ms':>7s} {'redis ms/grp':>12s} {'learner ms/grp':>14s}")
    for r in rows:
        print(f"{r['actors']:6d} {r['groups_per_s']:8.1f} {r['ideal']:6.1f} {r['groups_per_s'] / r['ideal']:5.2f} "
              f"{r['driver_cpu_ms']:13.1f} {r['admit_p50_ms']:12.1f} {r['admit_p99_ms']:7.1f} "
              f"{r['redis_cpu_ms_per_group']:12.2f} {r['learner_cpu_ms_per_group']:14.2f}")
    if down_s is not None:
        print(f"scale {most} -> {most - 32} (drained) {down_s:.1f} s, {most - 32} -> {most} (each publishing) "
              f"{up_s:.1f} s")
    if lost is not None:
        print(f"a node lost with {lost} actors: they play again after {back_s:.1f} s; groups/s back to 90% after "
              f"{rate_s:.1f} s")
    print(f"every group trained once: {'yes' if trained == published else 'NO'} ({published} published, "
          f"{trained} trained)")
    print(f"total bench time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
