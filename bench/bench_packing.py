"""Packed micro-batches against padded ones (learner.pack_rows) on the same rows in the same run: forward +
backward tokens/s, and the share of the computed tokens that is padding, on the tiny policy and on
SmolLM2-135M's shape (random weights), in float32 and bfloat16.

- rows: synthetic ALFWorld-shaped groups (tests/support/synthetic.py); prompt and response lengths "alfworld"
  (600-1200 and 32-256 tokens, as bench_gpu.py: the reference's prompt with its history) or "short"
  (synthetic_groups' own 16-64 and 4-24), per model (`--tiny-lengths`, `--smollm2-lengths`; SmolLM2's shape
  defaults to short rows on a CPU, where one ALFWorld-sized mini-batch takes minutes);
- each layout plans its micro-batches by the same token budget (learner.micro_batch_tokens; padded: rows x
  longest row, packed: the rows' sum) and runs the trainer's log-probs (learner.trainer.response_logprobs,
  entropy included) and a backward pass through every weight, micro-batch after micro-batch;
- the machine may be shared (an experiment running beside): the two arms alternate, A B then B A, for
  `--rounds` rounds after a warm-up of each, and the figures are medians; the ratio packed / padded is taken
  per round (both arms of a round ran under about the same load), then its median;
- `--threads`: torch's intra-op threads, each count in turn (default: torch's, all this process may use, as
  the learner's compute_threads). On cores that other processes keep busy, every parallel region waits for
  its threads to be scheduled (milliseconds each, where an idle machine takes microseconds): with more than
  one thread the figures are then much noisier than with one.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.config import ExperimentConfig  # noqa: E402
from learner.batching import TrainBatch, build_batch, collate, collate_packed, plan_micro_batches  # noqa: E402
from learner.packing import use_packed_attention  # noqa: E402
from learner.trainer import response_logprobs  # noqa: E402
from tests.support.model_shapes import SMOLLM2_135M, random_causal_lm  # noqa: E402
from tests.support.synthetic import synthetic_groups  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULTS = ExperimentConfig()
LENGTHS = {"alfworld": ((600, 1200), (32, 256)), "short": ((16, 64), (4, 24))}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(name: str, dtype: torch.dtype):
    """The tiny policy (built once under .cache, as the tests' fixture) or SmolLM2-135M's shape."""
    if name == "tiny":
        from transformers import AutoModelForCausalLM

        from tests.support.tiny_policy import tiny_policy
        path = tiny_policy()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = random_causal_lm(SMOLLM2_135M, seed=0, dtype=dtype)
    model.config.use_cache = False
    use_packed_attention(model)          # plain sdpa for the padded layout, row by row for the packed one
    return model.train()


def rows_of(vocab: int, groups: int, group_size: int, lengths: str, seed: int) -> TrainBatch:
    prompt, response = LENGTHS[lengths]
    return build_batch(synthetic_groups(groups, group_size, vocab_size=vocab, seed=seed, prompt_tokens=prompt,
                                        response_tokens=response),
                       DEFAULTS.learner, invalid_action_penalty=DEFAULTS.rollout.invalid_action_penalty)


def one_pass(model, batch: TrainBatch, packed: bool, budget: int) -> tuple[float, int, int, int]:
    """Forward + backward over every row, micro-batch after micro-batch: (seconds, real tokens, computed
    tokens, positions the attention computes: the packed layout's rows right-padded, learner/packing.py)."""
    plan = plan_micro_batches(batch, np.arange(batch.num_rows), budget, packed=packed)
    real = computed = attended = 0
    t0 = time.perf_counter()
    for rows in plan.per_rank[0]:
        mb = collate_packed(batch, rows) if packed else collate(batch, rows)
        logp, entropy = response_logprobs(model, mb, DEFAULTS.rollout.temperature, with_entropy=True)
        (-(logp.sum()) - DEFAULTS.learner.entropy_coef * entropy.sum()).backward()
        real += int(mb.attention_mask.sum())
        computed += mb.input_ids.numel()
        attended += len(mb.rows) * mb.longest_row if packed else mb.input_ids.numel()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, real, computed, attended


def compare(model_name: str, dtype: str, batch: TrainBatch, budget: int, rounds: int) -> dict:
    model = load_model(model_name, DTYPES[dtype])
    arms = {"padded": False, "packed": True}
    first = replace(batch, prompt_ids=batch.prompt_ids[:1], response_ids=batch.response_ids[:1],
                    old_logprobs=batch.old_logprobs[:1], advantages=batch.advantages[:1],
                    token_masks=batch.token_masks[:1])
    for packed in arms.values():           # warm-up: the kernels' first calls, on the first row alone
        one_pass(model, first, packed, budget)
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    sizes = {}
    for k in range(rounds):
        order = list(arms) if k % 2 == 0 else list(reversed(arms))
        for arm in order:
            s, *sizes[arm] = one_pass(model, batch, arms[arm], budget)
            seconds[arm].append(s)
    ratio = [p / q for p, q in zip(seconds["padded"], seconds["packed"])]     # = packed tok/s / padded tok/s
    return {"seconds": seconds, "sizes": sizes, "ratio": ratio}


def report(model_name: str, dtype: str, lengths: str, batch: TrainBatch, budget: int, result: dict) -> None:
    real = result["sizes"]["padded"][0]
    parts = []
    for arm in ("padded", "packed"):
        _, computed, attended = result["sizes"][arm]
        rate = real / float(np.median(result["seconds"][arm]))
        parts.append(f"{arm} {rate:,.0f} tok/s, padding {1 - real / computed:.1%} of {computed:,} computed "
                     f"(attention: {1 - real / attended:.1%})")
    r = result["ratio"]
    print(f"  {model_name:8s} {dtype:9s} {lengths:8s} {batch.num_rows:4d} rows {real:7,d} tokens: " + "; ".join(parts)
          + f"; packed/padded tok/s {np.median(r):.2f}x (rounds {min(r):.2f}..{max(r):.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--tiny-lengths", default="alfworld", choices=list(LENGTHS))
    ap.add_argument("--smollm2-lengths", default="short", choices=list(LENGTHS))
    ap.add_argument("--tiny-groups", type=int, default=2, help="episode groups of the tiny model's rows")
    ap.add_argument("--smollm2-groups", type=int, default=1, help="episode groups of SmolLM2's rows")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--budget", type=int, default=DEFAULTS.learner.micro_batch_tokens,
                    help="micro-batch token budget (learner.micro_batch_tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    print(f"bench_packing {datetime.date.today()} at {head.strip() or '?'} (+ working tree), {os.cpu_count()} CPUs, "
          f"budget {args.budget} tokens, {args.rounds} rounds A B / B A (medians)", flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"{threads} torch threads:", flush=True)
        for model_name in args.models:
            lengths = args.tiny_lengths if model_name == "tiny" else args.smollm2_lengths
            groups = args.tiny_groups if model_name == "tiny" else args.smollm2_groups
            vocab = 1000 if model_name == "tiny" else SMOLLM2_135M["vocab_size"]
            batch = rows_of(vocab, groups, args.group_size, lengths, seed=0)
            for dtype in args.dtypes:
                report(model_name, dtype, lengths, batch, args.budget,
                       compare(model_name, dtype, batch, args.budget, args.rounds))


if __name__ == "__main__":
    main()
