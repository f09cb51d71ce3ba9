"""LoRA adapters (learner.lora_rank) against full fine-tuning and against training the last layers only
(learner.trainable_layers), on the same batches of the same model: learner tokens/s, peak memory, checkpoint
size, and what a weight push carries.

- each arm runs in a process of its own (a fresh process: its peak RSS is its own), one DeepSpeed ZeRO-2
  engine on CPU, the same synthetic ALFWorld-shaped batches (tests/support/synthetic.py, seeded), one warm-up
  update then `--updates` timed ones; arms alternate full, last-layers, LoRA, then again in reverse order
  (`--rounds` 2: drift and another run's load hit all alike); figures are medians;
- models: the tiny policy (float32, ALFWorld-length rows) and SmolLM2-135M's shape (random weights, bfloat16
  as configs/alfworld-smollm2.yaml, short rows: on a CPU one ALFWorld-sized SmolLM2 update takes minutes);
- memory: the process's peak RSS (`ru_maxrss`), which includes the model's load; the arms differ by what
  training adds (gradients, the optimizer's moments, the reference copy: learner.kl_coef > 0 here, as the
  default);
- push: the bytes `named_weights()` yields (the merged weights, what the push sends today) and the bytes of
  the adapters alone (what an adapter-only push would send); checkpoint: the bytes one checkpoint writes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.config import ExperimentConfig, LearnerConfig  # noqa: E402

DEFAULTS = ExperimentConfig()
LENGTHS = {"tiny": ((600, 1200), (32, 256)), "smollm2": ((16, 64), (4, 24))}
DTYPES = {"tiny": "float32", "smollm2": "bfloat16"}


def arm_config(arm: str, model: str, rank: int) -> LearnerConfig:
    layers = {"tiny": 1, "smollm2": 6}[model]         # SmolLM2's config trains its last 6 of 30 blocks
    fields = {"full": {}, "last_layers": {"trainable_layers": layers}, "lora": {"lora_rank": rank}}[arm]
    return LearnerConfig(zero_stage=2, mini_batch_rows=1024, lr=1e-5, kl_coef=DEFAULTS.learner.kl_coef, **fields)


def model_dir(model: str, root: str) -> str:
    if model == "tiny":
        from tests.support.tiny_policy import tiny_policy
        return tiny_policy()
    from tests.support.model_shapes import SMOLLM2_135M, random_causal_lm
    path = os.path.join(root, "smollm2-shape")
    if not os.path.isdir(path):
        random_causal_lm(SMOLLM2_135M, seed=0).save_pretrained(path)
    return path


def run_arm(arm: str, model: str, rank: int, updates: int, threads: int, root: str) -> dict:
    """One arm in this process: what the module says, as a dict."""
    from learner.batching import build_batch
    from learner.trainer import PolicyTrainer
    from tests.support.synthetic import synthetic_groups

    torch.set_num_threads(threads)
    cfg = arm_config(arm, model, rank)
    path = model_dir(model, root)
    trainer = PolicyTrainer(path, cfg, dtype=DTYPES[model], head_dtype=DEFAULTS.model.head_dtype,
                            temperature=DEFAULTS.rollout.temperature, seed=0)
    vocab = trainer.vocab_size
    prompt, response = LENGTHS[model]
    groups = 2 if model == "tiny" else 1
    batches = [build_batch(synthetic_groups(groups, 4, vocab_size=vocab, seed=s, prompt_tokens=prompt,
                                            response_tokens=response),
                           cfg, invalid_action_penalty=DEFAULTS.rollout.invalid_action_penalty)
               for s in range(updates + 1)]
    seconds, tokens = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        trainer.train_step(batch, update=i)
        if i:                                   # the first is the warm-up
            seconds.append(time.perf_counter() - t0)
            tokens.append(int(sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))))
    t0 = time.perf_counter()
    pushed = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    gather_s = time.perf_counter() - t0
    adapters = sum(p.numel() * p.element_size() for n, p in trainer.engine.module.named_parameters()
                   if ".lora_" in n)
    ckpt = tempfile.mkdtemp(dir=root)
    trainer.save_checkpoint(ckpt, {})
    checkpoint = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
    trainer.close()
    return {"seconds": float(np.median(seconds)), "tokens_per_s": float(np.sum(tokens) / np.sum(seconds)),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "pushed_mb": pushed / 2**20, "adapter_mb": adapters / 2**20, "gather_s": gather_s,
            "checkpoint_mb": checkpoint / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=list(LENGTHS))
    ap.add_argument("--rank", type=int, default=8, help="learner.lora_rank of the LoRA arm")
    ap.add_argument("--updates", type=int, default=3, help="timed updates per arm and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--arm", help=argparse.SUPPRESS)       # internal: run one arm, print its JSON
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.model, args.rank, args.updates, args.threads, args.root)))
        return
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    print(f"bench_lora {datetime.date.today()} at {head.strip() or '?'} (+ working tree), {os.cpu_count()} CPUs, "
          f"{args.threads} torch threads, LoRA rank {args.rank}, {args.updates} updates x {args.rounds} rounds "
          "per arm (medians)", flush=True)
    arms = ["full", "last_layers", "lora"]
    with tempfile.TemporaryDirectory() as root:
        for model in args.models:
            got: dict[str, list[dict]] = {arm: [] for arm in arms}
            for k in range(args.rounds):
                for arm in (arms if k % 2 == 0 else arms[::-1]):
                    out = subprocess.run([sys.executable, __file__, "--arm", arm, "--model", model, "--root", root,
                                          "--rank", str(args.rank), "--updates", str(args.updates),
                                          "--threads", str(args.threads)],
                                         capture_output=True, text=True, cwd=REPO)
                    if out.returncode:
                        raise SystemExit(f"{model} {arm} failed:\n{out.stderr[-3000:]}")
                    got[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            full = np.median([r["tokens_per_s"] for r in got["full"]])
            print(f"  {model} ({DTYPES[model]}):", flush=True)
            for arm in arms:
                med = {key: float(np.median([r[key] for r in got[arm]])) for key in got[arm][0]}
                print(f"    {arm:11s} {med['tokens_per_s']:8,.0f} tok/s ({med['tokens_per_s'] / full:.2f}x full), "
                      f"peak RSS {med['peak_rss_mb']:7,.0f} MB, checkpoint {med['checkpoint_mb']:7,.1f} MB, "
                      f"push {med['pushed_mb']:6,.1f} MB in {med['gather_s']:.2f} s"
                      + (f" (adapters alone {med['adapter_mb']:.2f} MB)" if arm == "lora" else ""), flush=True)


if __name__ == "__main__":
    main()
