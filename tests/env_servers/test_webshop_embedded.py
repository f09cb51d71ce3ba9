"""The pieces of the embedded WebShop run: the free-text search action under constrained generation, the
goals' solution paths, and the warm start on them (configs/webshop-embedded.yaml, docs/webshop.md)."""
from __future__ import annotations

import os
import re

import pytest

from actors.prompts.shared import action_regex, is_admissible, parse_action
from actors.prompts.webshop import FREE_TEXT, FREE_TEXT_MAX_CHARS
from env_servers.webshop.data import SAMPLE_DIR
from env_servers.webshop.env import QUERY_MAX_CHARS, WebShopEnv, solution_path, solution_query
from tests.support.webshop_catalog import real_catalog

SEARCH = "search[<your query>]"


def response(action: str, think: str = "") -> str:
    return f"<think>{think}</think> <action>{action}</action>"


def test_search_query_is_free_text_of_a_fixed_shape():
    pattern = re.compile(action_regex([SEARCH, "click[back to search]"]))
    for query in ["double sided, machine washable decorative pillows with size: 28 x 28", "a", "3x-large",
                  "women's shorts & tops", "x" * FREE_TEXT_MAX_CHARS]:
        assert pattern.fullmatch(response(f"search[{query}]")), query
    assert pattern.fullmatch(response("click[back to search]"))
    for bad in ["search[]", "search[ leading space]", "search[Upper case]", "search[a]b]", "search[<tag>]",
                "search[" + "x" * (FREE_TEXT_MAX_CHARS + 1) + "]", "search[<your query>]",
                "click[search]"]:
        assert not pattern.fullmatch(response(bad)), bad
    # Listed actions stay literal: a search action the env lists itself is that action only.
    literal = re.compile(action_regex(["search[red shirt]"]))
    assert literal.fullmatch(response("search[red shirt]")) and not literal.fullmatch(response("search[red]"))


def test_think_section_gives_up_what_the_query_may_add():
    """The rollout sizes the think budget from the longest listed action (the placeholder, 20 characters); a
    query can make the action 148 characters longer, so the think section shrinks by that much and the
    whole response still fits the character budget the rollout computed."""
    budget = 200
    regex = action_regex([SEARCH], budget)
    think = int(re.search(r"\{0,(\d+)\}</think>", regex).group(1))
    longest_action = len("search[]") + FREE_TEXT_MAX_CHARS
    assert think == budget - (longest_action - len(SEARCH))
    assert re.fullmatch(regex, response("search[" + "q" * FREE_TEXT_MAX_CHARS + "]", "t" * think))
    assert not re.fullmatch(regex, response("search[q]", "t" * (think + 1)))
    assert action_regex([SEARCH], 10).startswith("<think>[ -;=?-~]{0,0}</think>")   # never negative
    # Without a free-text slot nothing changes.
    assert "{0,200}" in action_regex(["click[buy now]"], 200)


def test_grammar_backend_compiles_the_free_text_regex_without_warnings(capfd):
    import xgrammar

    capfd.readouterr()
    xgrammar.Grammar.from_regex(action_regex([SEARCH, "click[back to search]", "click[< prev]"]))
    err = capfd.readouterr().err
    assert "arning" not in err, err


def test_is_admissible():
    listed = [SEARCH, "click[b07x2v4nm3]", "help"]
    assert is_admissible("click[b07x2v4nm3]", listed)
    assert is_admissible("search[red t-shirt, size: xl]", listed)
    for action in ["click[b07x2v4nm4]", "search[]", "search[Red]", "help", "search[a] click[b]"]:
        assert not is_admissible(action, listed), action
    assert is_admissible("go to desk 1", ["go to desk 1"])     # ALFWorld: membership


@pytest.fixture(scope="module")
def sample_env():
    env = WebShopEnv(data_dir=SAMPLE_DIR)
    yield env
    env.close()


def test_solution_paths_of_the_sample_catalog_win(sample_env):
    for task_id in sample_env.task_ids("all"):
        report = sample_env.reset(task_id)
        path = report.info["walkthrough"]
        assert path == solution_path(sample_env.shop, int(task_id))
        assert path[0].startswith("search[") and path[-1] == "click[buy now]"
        assert is_admissible(path[0], report.admissible_actions)
        for action in path:
            report = sample_env.step(action)
            assert report.action_admissible, (task_id, action)
        assert report.won, task_id


def test_solution_query_is_the_goals_words():
    class Goal:
        query = "pillows"
        instruction_text = ('Find me double sided, machine washable decorative pillows with size: 28" x 28", '
                            "and price lower than 50.00 dollars")

    assert solution_query(Goal()) == "double sided, machine washable decorative pillows with size: 28 x 28"
    Goal.instruction_text = "i am looking for " + "very long words " * 20
    query = solution_query(Goal())
    assert len(query) <= QUERY_MAX_CHARS and query.startswith("very long") and query.endswith("words")


def test_solution_paths_on_the_1000_product_catalog():
    """Every goal's query has the shape the action grammar allows, and the solution paths of the held-out
    goals win at the measured rate (95.2% of 500: the search finds the goal's product for all but 2, and
    23 products' goals do not score 1 even when bought as asked); 90% leaves room for nothing else."""
    env = WebShopEnv(data_dir=real_catalog())
    shape = re.compile(r"search\[" + FREE_TEXT + r"\]")
    assert all(shape.fullmatch(f"search[{solution_query(g)}]") for g in env.shop.goals)
    won = 0
    for task_id in env.task_ids("eval"):
        report = env.reset(task_id)
        for action in report.info["walkthrough"]:
            report = env.step(action)
        won += report.won
    assert won / len(env.task_ids("eval")) >= 0.9


def test_warm_start_rows_of_webshop_goals(tmp_path, tiny_model_path, monkeypatch):
    from transformers import AutoTokenizer

    from common.config import load_config
    from deploy.warm_start import collect_examples

    monkeypatch.setenv("WEBSHOP_DATA", SAMPLE_DIR)
    cfg = load_config("configs/webshop-embedded.yaml", [f"run.output_dir={tmp_path}", "model.warm_start_games=5",
                                                          "model.warm_start_option_repeat=3"])
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    examples, counts = collect_examples(cfg, tok)
    assert counts["games"] == 5 and counts["games_skipped"] == 0 and counts["free_text_rows"] == 5
    searches = [e for e in examples if e.repeat == cfg.model.warm_start_free_text_repeat]
    assert len(searches) == 5
    # Every option a goal asks for is one row, in the pool 3 times (the sample goals each ask for some).
    env = WebShopEnv(data_dir=SAMPLE_DIR)
    goals = [env.shop.goals[int(t)] for t in env.task_ids(cfg.env.train_split)[:5]]
    asked = [v for g in goals for v in (g.goal_options.values() if isinstance(g.goal_options, dict) else [])]
    options = [e for e in examples if e.repeat == 3]
    assert counts["option_rows"] == len(options) == len(asked) > 0
    for e in examples:
        text = tok.decode(e.response_ids[:-1])
        parsed = parse_action(text)
        shown = re.search(r"admissible actions of the current situation are: \[(.*)\]\.",
                          tok.decode(e.prompt_ids)).group(1)
        admissible = re.findall(r"'([^']*)'", shown)
        assert parsed.valid and is_admissible(parsed.action, admissible)
        assert (e.repeat == cfg.model.warm_start_free_text_repeat) == parsed.action.startswith("search[")
        if e.repeat == 3:
            assert parsed.action.startswith("click[") and parsed.action[6:-1] in asked
        assert re.fullmatch(action_regex(admissible, 200), text)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_long_uneven_batches_are_cut_into_micro_batches_with_the_same_gradient(tiny_model_path, warm_start_with_sgd,
                                                                               packed):
    """A warm-start step over model.warm_start_micro_batch_tokens is cut by length (the learner's packing, in
    either layout); its loss and gradient equal those of one padded pass up to float32 summation order, and the
    model's attention is left as it was. The gradient is read as the weight change of one plain SGD step of lr
    1 (AdamW's first step is about sign(gradient), which would amplify rounding noise of gradients near 0).
    Tolerance: sums of ~1e4 float32 terms (eps 1.2e-7) agree to ~1e-4 relative."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from learner.supervised import Example, finetune, supervised_batch
    from learner.batching import pack_by_tokens

    rng = torch.Generator().manual_seed(0)

    def row(length: int) -> Example:
        ids = torch.randint(0, 1000, (length,), generator=rng).tolist()
        return Example(ids[:-8], ids[-8:])

    batch = [row(n) for n in (300, 310, 2900, 1500, 320, 2000, 2500, 330, 2800, 1800, 2600, 340)]
    budget = 8192
    lengths = supervised_batch(batch).row_lengths()
    parts = pack_by_tokens(np.arange(len(batch)), lengths, budget, packed=packed)
    assert len(parts) > 1 and sorted(np.concatenate(parts)) == list(range(len(batch)))

    def one_step(micro_batch_tokens: int, packed: bool):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        attention = model.config._attn_implementation
        before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        loss = finetune(model, batch, 1, 1.0, len(batch), seed=0, micro_batch_tokens=micro_batch_tokens,
                        packed=packed)[0]
        assert model.config._attn_implementation == attention
        return loss, torch.cat([p.detach().flatten() for p in model.parameters()]) - before

    split_loss, split_step = one_step(budget, packed)
    whole_loss, whole_step = one_step(10**9, packed=False)
    assert split_loss == pytest.approx(whole_loss, rel=1e-4)
    assert split_step.abs().max() > 0
    assert torch.allclose(split_step, whole_step, rtol=1e-3, atol=1e-4 * float(whole_step.abs().max()))


def test_step_reward_is_the_win_or_the_scaled_native_score():
    from actors.rollout import step_reward
    from common.config import RolloutConfig
    from env_servers.base import EnvReport

    partial = EnvReport(observation="", anchor="", done=True, won=False, score=0.5)
    won = EnvReport(observation="", anchor="", done=True, won=True, score=1.0)
    midway = EnvReport(observation="", anchor="", done=False, score=0.0)
    paper = RolloutConfig()              # the paper's reward: 10 on a win, else 0
    assert [step_reward(paper, r) for r in (partial, won, midway)] == [0.0, 10.0, 0.0]
    dense = RolloutConfig(reward="score")
    assert [step_reward(dense, r) for r in (partial, won, midway)] == [5.0, 10.0, 0.0]


def test_make_run_env_webshop_is_the_documented_command():
    """`make run ENV=webshop` (README, docs/webshop.md) copies the catalog if needed, then trains the WebShop
    config (the shortened end-to-end run of that config: tests/system/test_webshop_e2e.py). `make -n` prints the
    recipe without running it."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    # As a user types it: not as a sub-make of `make test` (which would add "Entering directory" lines).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "--no-print-directory", "-n", "run", "ENV=webshop"], cwd=repo, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-2].endswith("-m env_servers.data prepare --only webshop"), out
    assert out[-1].endswith("bin/gigpo train configs/webshop-embedded.yaml"), out
