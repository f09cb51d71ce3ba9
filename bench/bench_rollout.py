"""Rollout throughput vs env instances per rollout actor, and the time of one weight update.

One vLLM inference actor (tiny model) and one rollout actor with its env instances (generated ALFWorld games)
in worker processes. For 1, 4, 16 and 64 instances per actor: env steps/s and generated tokens/s over a fixed
window after a warm-up, as ratios against 1 instance (with env steps and generation overlapped, throughput
should grow with the instances until the 2 CPUs saturate). Weight update: WeightPublisher.push of the tiny
model in few large buckets (bucket_mb=512) against one file per tensor, same run, same actor.

    python bench/bench_rollout.py [--window 15] [--instances 1,4,16,64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=12.0, help="seconds measured per setting")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after every instance has stepped")
    ap.add_argument("--instances", default="1,4,16,64")
    ap.add_argument("--response-tokens", type=int, default=32)
    args = ap.parse_args()

    import ray
    import torch

    from actors.inference import create_inference_actors, stop_inference_actors
    from actors.rollout import create_rollout_actor
    from common.config import EnvConfig, ExperimentConfig, InferenceConfig, ModelConfig, RolloutConfig
    from common.weights.sender import ShmTransfer as WeightPublisher
    from tests.support.tiny_policy import tiny_policy

    t_start = time.perf_counter()
    path = tiny_policy()
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False)
    cfg = ExperimentConfig(
        model=ModelConfig(path=path, max_prompt_tokens=1024, max_response_tokens=args.response_tokens),
        inference=InferenceConfig(gpu_memory_utilization=0.05, max_num_seqs=256, cpus_per_actor=1.0),
        env=EnvConfig(max_steps=20, num_generated_games=16, instances_per_process=8),
        rollout=RolloutConfig(cpus_per_actor=0.5))
    inference = create_inference_actors(cfg, path, num_actors=1)
    ray.get(inference[0].policy_version.remote(), timeout=300)
    print(f"engine ready in {time.perf_counter() - t_start:.0f} s")

    rows = []
    for n in [int(x) for x in args.instances.split(",")]:
        size = min(n, 8)               # n instances: groups of up to 8
        groups = max(1, n // size)
        cfg.rollout.groups_per_actor, cfg.rollout.group_size = groups, size
        actor = create_rollout_actor(cfg, f"bench-{n}", inference, None)
        run = actor.run.remote()
        # Warm-up: until every instance has been reset and stepped (64 instances start 8 env worker
        # processes and reset 8 games: seconds on a busy machine), then a little more.
        deadline = time.monotonic() + 120
        while ray.get(actor.stats.remote())["env_steps"] < n and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(args.warmup)
        s0 = ray.get(actor.stats.remote())
        t0 = time.perf_counter()
        time.sleep(args.window)
        s1 = ray.get(actor.stats.remote())
        dt = time.perf_counter() - t0
        ray.get(actor.stop.remote(drain=False))
        ray.get(run)
        ray.get(actor.close.remote())
        ray.kill(actor)
        steps = (s1["env_steps"] - s0["env_steps"]) / dt
        toks = (s1["generated_tokens"] - s0["generated_tokens"]) / dt
        env_wait = (s1["env_wait_s"] - s0["env_wait_s"]) / max(1, s1["env_calls"] - s0["env_calls"])
        rows.append((n, steps, toks, env_wait))
        print(f"instances {n:3d} ({groups} x {size}): {steps:7.1f} env steps/s  {toks:8.0f} tokens/s  "
              f"mean env call {env_wait * 1000:.0f} ms", flush=True)

    base_steps, base_toks = rows[0][1], rows[0][2]
    print("\nthroughput vs 1 instance per actor (same run):")
    for n, steps, toks, _ in rows:
        print(f"  {n:3d} instances: env steps/s x{steps / max(base_steps, 1e-9):.2f}   "
              f"tokens/s x{toks / max(base_toks, 1e-9):.2f}")

    # Weight update: few large buckets vs one file per tensor.
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    timings = {}
    for j, (label, bucket_mb) in enumerate((("buckets (512 MB)", 512), ("per tensor", 1e-6))):
        pub = WeightPublisher(inference, bucket_mb=bucket_mb)
        pushes = (pub.push(model.state_dict().items(), 3 * j + k) for k in (1, 2, 3))     # versions 1 to 6
        best = timings[label] = min(pushes, key=lambda t: t["total_s"])
        print(f"weight update, {label}: {best['buckets']} files, {best['bytes'] / 1e6:.1f} MB, "
              f"write {best['write_s'] * 1000:.0f} ms + load {best['load_s'] * 1000:.0f} ms = "
              f"{best['total_s'] * 1000:.0f} ms (best of 3)")
    ratio = timings["per tensor"]["total_s"] / timings["buckets (512 MB)"]["total_s"]
    print(f"weight update speed-up of bucketing vs per-tensor files: x{ratio:.2f}")
    pub.close(remove_files=True)
    print(f"total bench time {time.perf_counter() - t_start:.0f} s")
    stop_inference_actors(inference)      # the engine's own shutdown: ray.shutdown alone leaves ~400 MB in /dev/shm
    ray.shutdown()


if __name__ == "__main__":
    main()
