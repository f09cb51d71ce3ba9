"""Supervised warm start: a short fine-tune of the initial policy on the solutions of training games.

    path = warm_start(cfg, "runs/embedded/tiny_model")    # -> "runs/embedded/warm_model" (or the input)

Why: the embedded default's tiny random model is a near-uniform random policy (~3% success on the tiny
generated games); a few dozen supervised steps on walkthroughs lift it off the floor while leaving room for RL.

Each training game's walkthrough (`info["walkthrough"]` at reset; WebShop builds one from the goal) is replayed
through the real env, so every supervised row is exactly a rollout row: the rollout's prompt, and as response
what constrained generation can produce, `<think></think> <action>go to desk 1</action>` then end-of-turn;
the loss is the response tokens' cross-entropy. The model is saved atomically as `<run.output_dir>/warm_model`
with a record of its settings, and reused by a run with the same settings (`gigpo eval` uses the run's as is).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from actors.prompts.shared import build_user_message, is_admissible, prompt_token_ids, response_text
from common.config import ExperimentConfig
from common.run_dir import WARM_DIR
from deploy.tiny_model import save_model_atomically
from env_servers.webshop.engine import split_shop_action
from learner.supervised import Example, finetune

log = logging.getLogger("gigpo.warm_start")

_INFO = "warm_start.json"

# The code that turns a game into rows: its env's pages and the prompt built from them. Another version of it
# (a page's text, the prompt's layout) makes other rows, so a warm model cached before the change is rebuilt.
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_ROW_CODE = ("actors/prompts/*.py",)
_ENV_CODE = {"alfworld": ("env_servers/alfworld_*.py",), "webshop": ("env_servers/webshop/*.py",)}


def clicks_named_value(action: str, task: str) -> bool:
    """Whether `action` clicks a value the task's text names (WebShop: `click[large]` for a goal "... and
    size: large, ..."): a step that copies the goal's words, as a search query does."""
    name, value = split_shop_action(action)
    return name == "click" and value is not None and value.lower() in task.lower()


def collect_examples(cfg: ExperimentConfig, tokenizer) -> tuple[list[Example], dict]:
    """Replay the walkthroughs of the first `model.warm_start_games` training games through the env: the
    examples and counts (games used or skipped, rows over `model.max_prompt_tokens`). The env runs in an
    EnvPool worker process, as in a rollout, so a crashed engine is an error result, not a crashed driver."""
    from env_servers.server import EnvPool

    examples: list[Example] = []
    counts = {"games": 0, "games_skipped": 0, "rows_too_long": 0, "free_text_rows": 0, "option_rows": 0}

    def report_of(results):
        res = results[0]
        if res.error is not None or res.report is None:
            raise RuntimeError(f"warm start: env call failed: {res.error}")
        return res.report

    with EnvPool(cfg.env, 1, seed=cfg.run.seed) as env:
        task_ids = env.task_ids(cfg.env.train_split)[: cfg.model.warm_start_games]
        held_out = set(task_ids) & set(env.task_ids(cfg.env.eval_split))
        if held_out:     # the evaluation would then measure memory of the answer, not the policy
            raise ValueError(f"warm start: {len(held_out)} of its games are in the held-out split "
                             f"(env.train_split={cfg.env.train_split!r}, env.eval_split={cfg.env.eval_split!r}, "
                             f"e.g. task {sorted(held_out)[0]!r}); warm-start on games the evaluation does not play")
        eos = tokenizer.eos_token_id
        for task_id in task_ids:
            report = report_of(env.reset_batch([(0, task_id, cfg.run.seed)]))
            walkthrough = list(report.info.get("walkthrough") or [])
            if not walkthrough:
                raise ValueError(f"model.warm_start_steps > 0 needs games with solutions: task {task_id!r} of "
                                 f"env {cfg.env.name!r} has no walkthrough (its env reports none at reset; "
                                 f"set model.warm_start_steps=0)")
            rows: list[Example] = []
            free_text = option_rows = 0
            history: list[tuple[str, str]] = []
            ok = True
            for step, action in enumerate(walkthrough[: cfg.env.max_steps]):
                listed = action in report.admissible_actions
                if not listed and not is_admissible(action, report.admissible_actions):
                    ok = False
                    break
                message = build_user_message(cfg.env.name, report.task, report.observation,
                                             report.admissible_actions, history, step, cfg.rollout.history_length)
                ids = prompt_token_ids(tokenizer, message)
                if len(ids) <= cfg.model.max_prompt_tokens:
                    response = tokenizer.encode(response_text(action), add_special_tokens=False) + [eos]
                    option = listed and clicks_named_value(action, report.task)
                    repeat = (cfg.model.warm_start_free_text_repeat if not listed
                              else cfg.model.warm_start_option_repeat if option else 1)
                    rows.append(Example(ids, response[: cfg.model.max_response_tokens], repeat=repeat))
                    free_text += not listed
                    option_rows += option
                else:
                    counts["rows_too_long"] += 1
                history.append((report.observation, action))
                report = report_of(env.step_batch([(0, action)]))
            if ok and report.won:
                examples.extend(rows)
                counts["games"] += 1
                counts["free_text_rows"] += free_text
                counts["option_rows"] += option_rows
            else:
                counts["games_skipped"] += 1
    return examples, counts


def _settings(cfg: ExperimentConfig, model_path: str) -> dict:
    """Everything that changes the warmed model: a cached one is reused only when all of it matches."""
    m = cfg.model
    source = Path(model_path)
    build = source / "tiny_build.json"
    fingerprint = build.read_text() if build.exists() else str(source.resolve())
    settings = {"steps": m.warm_start_steps, "games": m.warm_start_games, "lr": m.warm_start_lr,
                "batch": m.warm_start_batch, "trainable_layers": m.warm_start_trainable_layers,
                "seed": cfg.run.seed, "env": cfg.env.name, "source": cfg.env.source,
                "generator": cfg.env.generator, "train_split": cfg.env.train_split,
                "max_steps": cfg.env.max_steps, "history_length": cfg.rollout.history_length,
                "max_prompt_tokens": m.max_prompt_tokens, "row_code": row_code_fingerprint(cfg.env.name),
                "initial_model": hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}
    if m.warm_start_lr_decay:         # (absent at 0, the constant rate: warm models cached before it stay valid)
        settings["lr_decay"] = m.warm_start_lr_decay
    if cfg.env.name == "webshop":     # settings only WebShop's rows have
        settings.update(webshop_catalog=_webshop_catalog(cfg.env.source), free_text_repeat=m.warm_start_free_text_repeat,
                        option_repeat=m.warm_start_option_repeat)
    return settings


def row_code_fingerprint(env_name: str, root: Path = _PACKAGE_ROOT) -> str:
    """A digest of the source files that render env `env_name`'s rows (under `root`): it changes when they do."""
    files = sorted({f for pattern in (*_ROW_CODE, *_ENV_CODE.get(env_name, ())) for f in root.glob(pattern)})
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _webshop_catalog(source: str) -> str:
    """A fingerprint of the catalog WebShop loads (another catalog gives other goals, so another warm model)."""
    from env_servers.webshop.data import catalog_dir
    folder = Path(catalog_dir(source))
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.glob("*.json"))
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def existing_warm_model(output_dir: str) -> str | None:
    """The warm model a run made (`<output_dir>/warm_model`, complete), whatever its settings; or None."""
    out = Path(output_dir) / WARM_DIR
    return str(out) if (out / _INFO).is_file() else None


def warm_start(cfg: ExperimentConfig, model_path: str, out_dir: str | None = None, progress=None) -> str:
    """The run's initial model: `model_path` when `model.warm_start_steps` is 0, else the warmed copy in
    `out_dir` (default `<run.output_dir>/warm_model`; reused while the settings match). progress: a text
    stream for the fine-tuning's progress bar."""
    m = cfg.model
    if m.warm_start_steps <= 0:
        return model_path
    if m.warm_start_games < 1 or m.warm_start_batch < 1 or m.warm_start_lr <= 0:
        raise ValueError(f"warm start needs model.warm_start_games >= 1 (got {m.warm_start_games}), "
                         f"model.warm_start_batch >= 1 (got {m.warm_start_batch}) and model.warm_start_lr > 0 "
                         f"(got {m.warm_start_lr})")
    out = Path(out_dir) if out_dir else Path(cfg.run.output_dir) / WARM_DIR
    settings = _settings(cfg, model_path)
    try:
        if json.loads((out / _INFO).read_text())["settings"] == settings:
            log.info("warm start: reusing %s", out)
            return str(out)
    except (OSError, ValueError, KeyError):
        pass   # none yet, or made with other settings: build it below

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.trainer import train_only_last_layers

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples, counts = collect_examples(cfg, tokenizer)
    if not examples:
        raise ValueError(f"warm start: none of the first {m.warm_start_games} games of split "
                         f"{cfg.env.train_split!r} gave a usable walkthrough ({counts})")
    t_collect = time.perf_counter() - t0
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    bar = tqdm(total=m.warm_start_steps, desc="warm start", unit="step", dynamic_ncols=True, file=progress,
               disable=progress is None)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        train_only_last_layers(model, m.warm_start_trainable_layers, "model.warm_start_trainable_layers")
        losses = finetune(model, examples, m.warm_start_steps, m.warm_start_lr, m.warm_start_batch, cfg.run.seed,
                          m.warm_start_micro_batch_tokens, on_step=bar.update, packed=cfg.learner.packed,
                          lr_decay=m.warm_start_lr_decay)
    finally:
        torch.set_num_threads(threads)
        bar.close()
    record = {"settings": settings, **counts, "rows": len(examples), "collect_s": round(t_collect, 1),
              "train_s": round(time.perf_counter() - t0 - t_collect, 1),
              "loss_first": losses[0], "loss_last": sum(losses[-5:]) / len(losses[-5:])}

    save_model_atomically(model, tokenizer, out, _INFO, record)
    log.info("warm start: %d steps on %d rows of %d games (%d skipped) in %.0fs, loss %.3f -> %.3f; saved %s",
             m.warm_start_steps, len(examples), counts["games"], counts["games_skipped"],
             time.perf_counter() - t0, record["loss_first"], record["loss_last"], out)
    del model
    _give_back_freed_memory()
    return str(out)


def _give_back_freed_memory() -> None:
    """The driver lives as long as the run, and freed tensors stay in glibc's heap unless trimmed: SmolLM2's
    warm start left it at 12.2 GB resident, and Ray's memory monitor then killed actors on a 24 GB machine."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):    # not glibc: nothing to trim
        pass
