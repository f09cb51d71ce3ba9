"""Serving the LoRA adapters in vLLM (learner.lora_push=adapter) against serving merged weights
(learner.lora_push=merged), in the same run: what a push carries and takes, and what the adapter costs the
generation.

    .venv/bin/python bench/bench_lora_serving.py                      # the tiny policy and SmolLM2-135M
    .venv/bin/python bench/bench_lora_serving.py --models tiny --rank 16

- two vLLM inference actors at once (a local Ray of 2 CPUs, one CPU each), the same model: one plain, pushed
  the merged weights (`WeightTransfer.push`, the shm way), one started for LoRA (enable_lora, max_loras 1),
  pushed the adapters alone (`WeightTransfer.push_adapter`); adapters of --rank on all seven projections
  (learner.lora_target_modules' default), B random so that they change the outputs;
- push: seconds from the call to the actor serving the new version, best and median of --repeats after one
  warm-up push; bytes as sent;
- generation: --prompts prompts of --prompt-tokens random tokens sent at once, --new-tokens each (temperature
  1), generated tokens per second of wall time; the two actors take turns (plain, LoRA, LoRA, plain, ...
  for --rounds), so drift and other load hit both alike; medians;
- models: the tiny policy (float32) and SmolLM2-135M-Instruct (`make model`; bfloat16 as
  configs/alfworld-smollm2.yaml).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

DTYPES = {"tiny": "float32", "smollm2": "bfloat16"}


def model_dir(model: str) -> str:
    if model == "tiny":
        from tests.support.tiny_policy import tiny_policy
        return tiny_policy()
    from deploy.models import prepare_pinned
    return str(prepare_pinned())         # SmolLM2-135M-Instruct as `make model` prepares it


def adapted(path: str, rank: int, dtype: str):
    """The model with adapters of `rank` whose B is random (as after some training: they change the outputs), in
    the dtype the learner pushes (its compute dtype: the module's under DeepSpeed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.config import LearnerConfig
    from learner.lora import with_lora

    torch.manual_seed(0)
    model = with_lora(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)),
                      LearnerConfig(lora_rank=rank))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def generation_tokens_per_s(actor, prompts: list[list[int]], new_tokens: int) -> float:
    import ray

    t0 = time.perf_counter()
    outs = ray.get([actor.generate.remote(p, {"temperature": 1.0, "max_tokens": new_tokens}) for p in prompts])
    return sum(len(o["response_ids"]) for o in outs) / (time.perf_counter() - t0)


def bench_model(name: str, path: str, args) -> list[str]:
    import random

    from actors.inference import create_inference_actors, stop_inference_actors
    from common.config import ExperimentConfig, InferenceConfig, LearnerConfig, ModelConfig
    from common.weights.sender import WeightTransfer
    from learner.lora import adapter_weights, merged_weights

    weights_dir = tempfile.mkdtemp(prefix="bench-lora-serving-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    model_cfg = ModelConfig(dtype=DTYPES[name], max_prompt_tokens=args.prompt_tokens + 8,
                            max_response_tokens=args.new_tokens)
    infer = InferenceConfig(gpu_memory_utilization=0.05, max_num_seqs=args.prompts, weight_bucket_mb=512,
                            weights_dir=weights_dir, transfer_timeout_s=900.0)
    arms = {"merged": LearnerConfig(lora_rank=args.rank, lora_push="merged"),
            "adapter": LearnerConfig(lora_rank=args.rank, lora_push="adapter")}
    actors = {arm: create_inference_actors(ExperimentConfig(model=model_cfg, inference=infer, learner=learner),
                                           path, num_actors=1, max_restarts=0)[0]
              for arm, learner in arms.items()}
    try:
        model = adapted(path, args.rank, DTYPES[name])
        merged = list(merged_weights(model))
        adapter = adapter_weights(model)
        # peft makes the adapters float32; under DeepSpeed's bf16 the learner's module, adapters too, is bf16
        adapter["tensors"] = {n: t.to(model.dtype) for n, t in adapter["tensors"].items()}
        pushes: dict[str, list[dict]] = {}
        for arm, actor in actors.items():
            transfer = WeightTransfer([actor], mode="shm", bucket_mb=512, timeout_s=900.0)
            infos = []
            for version in range(1, args.repeats + 2):        # the first is the warm-up
                infos.append(transfer.push(merged, version) if arm == "merged"
                             else transfer.push_adapter(adapter, version))
            pushes[arm] = infos[1:]
        rng = random.Random(0)
        vocab = model.get_base_model().config.vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
        order = [arm for i in range(args.rounds) for arm in (("merged", "adapter") if i % 2 == 0
                                                               else ("adapter", "merged"))]
        generation_tokens_per_s(actors["merged"], prompts[:2], 4)        # warm-up of both
        generation_tokens_per_s(actors["adapter"], prompts[:2], 4)
        speed: dict[str, list[float]] = {arm: [] for arm in actors}
        for arm in order:
            speed[arm].append(generation_tokens_per_s(actors[arm], prompts, args.new_tokens))
    finally:
        stop_inference_actors(list(actors.values()))
        shutil.rmtree(weights_dir, ignore_errors=True)
    base_push = min(i["total_s"] for i in pushes["merged"])
    base_speed = statistics.median(speed["merged"])
    lines = [f"{name} ({DTYPES[name]}), adapters of rank {args.rank} on all seven projections; push: best / median "
             f"of {args.repeats}; generation: {args.prompts} prompts x {args.prompt_tokens} tokens, "
             f"{args.new_tokens} new, median of {args.rounds}",
             f"  {'push':8s} {'MB sent':>9s} {'best s':>8s} {'median s':>9s} {'vs merged':>10s} "
             f"{'gen tok/s':>10s} {'vs merged':>10s}"]
    for arm in ("merged", "adapter"):
        best = min(i["total_s"] for i in pushes[arm])
        median = statistics.median(i["total_s"] for i in pushes[arm])
        tok_s = statistics.median(speed[arm])
        lines.append(f"  {arm:8s} {pushes[arm][0]['bytes'] / 1e6:9.2f} {best:8.3f} {median:9.3f} "
                     f"{best / base_push:9.2f}x {tok_s:10.1f} {tok_s / base_speed:9.2f}x")
    lines.append(f"  generation rounds (tok/s): merged {', '.join(f'{v:.0f}' for v in speed['merged'])}; "
                 f"adapter {', '.join(f'{v:.0f}' for v in speed['adapter'])}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated, of tiny and smollm2")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    import ray

    from common.processes.process_env import apply_project_env
    apply_project_env()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    print(f"bench_lora_serving {datetime.date.today()} at {commit}", flush=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name in args.models.split(","):
            for line in bench_model(name, model_dir(name), args):
                print(line, flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
