"""The text WebShop env: page flow, actions, goals, data loading (env_servers/webshop/)."""
from __future__ import annotations

import json
import os
import random

import pytest

from env_servers.base import TextEnv
from env_servers.webshop import WebShopEnv, bench_steps_per_second, prepare
from env_servers.webshop.catalog import load_products, parse_pricing
from env_servers.webshop.data import SAMPLE_DIR, resolve_data_dir
from env_servers.webshop.engine import CHOSEN
from env_servers.webshop.env import scripted_purchase
from env_servers.webshop.goals import PRICE_RANGE, build_goals
from env_servers.webshop.sample_catalog import generate
from tests.support.webshop_catalog import real_catalog



@pytest.fixture(scope="module")
def env():
    e = WebShopEnv(data_dir=SAMPLE_DIR)
    yield e
    e.close()


def play(env, task_id, actions):
    report = env.reset(task_id)
    for a in actions:
        report = env.step(a)
    return report


def test_is_a_text_env(env):
    assert isinstance(env, TextEnv)


def test_scripted_purchase_of_every_sample_goal_wins(env):
    for task_id in env.task_ids("all"):
        report = play(env, task_id, scripted_purchase(env, task_id))
        assert report.done and report.won and report.score == 1.0 and report.reward == 1.0, task_id
        assert report.task_type == "webshop" and report.admissible_actions == []


def test_episode_ends_only_at_buy_and_wrong_choice_scores_less(env):
    task_id = next(t for t in env.task_ids("all") if len(env.shop.goals[int(t)].goal_options) == 2)
    plan = scripted_purchase(env, task_id)
    report = env.reset(task_id)
    for action in plan[:-3]:                     # up to the item page, no options chosen
        report = env.step(action)
        assert not report.done
    report = env.step("click[description]")
    report = env.step("click[< prev]")
    report = env.step("click[buy now]")          # bought without the wanted options
    assert report.done and not report.won and 0 < report.score < 1.0
    after = env.step("click[buy now]")           # nothing happens after the end
    assert after.done and not after.action_admissible and after.reward == 0.0


def test_search_page_and_first_report(env):
    report = env.reset("0")
    assert report.observation == report.anchor == "'Search'"
    assert report.admissible_actions == ["search[<your query>]"]
    assert report.info["page_text"] == f"WebShop [SEP] Instruction: [SEP] {report.task} [SEP] Search"
    assert report.reward == 0 and not report.done and report.action_admissible


def test_results_paging_and_navigation(env):
    env.reset("0")
    r = env.step("search[pack]")                 # every sample title has "(N Pack)"
    total = len(env._session.state.results)
    assert total == 50
    assert "'Page 1 (Total results: 50)'" in r.observation and "click[< prev]" not in r.admissible_actions
    assert r.admissible_actions[:2] == ["click[back to search]", "click[next >]"]
    asins = [a for a in r.admissible_actions if a.startswith("click[b0")]
    assert len(asins) == 10
    r = env.step("click[next >]")
    assert "'Page 2 (Total results: 50)'" in r.observation and "click[< prev]" in r.admissible_actions
    page2 = [a for a in r.admissible_actions if a.startswith("click[b0")]
    assert not set(page2) & set(asins)
    r = env.step(page2[0])
    assert r.info["page"] == "item" and "'Buy Now'" in r.observation
    for sub, marker in [("description", "Made for everyday use"), ("features", "Sold by")]:
        r = env.step(f"click[{sub}]")
        assert marker in r.observation and r.admissible_actions == ["click[back to search]", "click[< prev]"]
        r = env.step("click[< prev]")
        assert r.info["page"] == "item"
    r = env.step("click[reviews]")
    assert r.observation == "'Back to Search' [SEP] '< Prev'"       # the sample has no reviews
    env.step("click[< prev]")
    r = env.step("click[< prev]")                # item -> the results page it came from
    assert "'Page 2 (Total results: 50)'" in r.observation
    for _ in range(4):
        r = env.step("click[next >]")            # the original always offers "Next >": page 6 is empty
    assert "'Page 6 (Total results: 50)'" in r.observation and not any(
        a.startswith("click[b0") for a in r.admissible_actions)
    r = env.step("click[back to search]")
    assert r.observation == "'Search'"


def test_options_are_remembered_and_search_works_from_any_page(env):
    task_id = next(t for t in env.task_ids("all") if env.shop.goals[int(t)].goal_options)
    plan = scripted_purchase(env, task_id)
    play(env, task_id, plan[:-1])
    assert env._session.state.options == env.shop.goals[int(task_id)].goal_options
    r = env.step("search[shampoo]")              # the original runs searches from any page
    assert r.action_admissible and r.info["page"] == "results" and env._session.state.options == {}


def test_the_item_page_shows_the_options_chosen(env):
    """Choosing an option changes the item page (the page alone, as the prompt shows it, tells a state before
    a choice from the state after, and GiGPO's anchors keep them apart): each chosen value reads
    "<value> (chosen)", the others as before, and the clickable actions stay the same."""
    task_id = next(t for t in env.task_ids("all") if len(env.shop.goals[int(t)].goal_options) >= 2)
    goal = env.shop.goals[int(task_id)]
    plan = scripted_purchase(env, task_id)
    item = play(env, task_id, plan[:-1 - len(goal.goal_options)])
    assert item.info["page"] == "item" and CHOSEN not in item.observation
    seen = {item.anchor}
    for k, (name, value) in enumerate(goal.goal_options.items(), start=1):
        r = env.step(f"click[{value}]")
        assert r.action_admissible and r.admissible_actions == item.admissible_actions
        assert r.observation.count(CHOSEN) == k and f"'{value} {CHOSEN}'" in r.observation
        assert r.anchor not in seen
        seen.add(r.anchor)
    assert env.step("click[buy now]").won


@pytest.mark.parametrize("action", ["click[nothing here]", "jump", "", "click[]", "search[]", "click[search]",
                                    "click[buy now]", "click[next >]", "search", "<action>x</action>", None])
def test_unknown_or_malformed_action_leaves_page_unchanged(env, action):
    first = env.reset("1")
    r = env.step(action)
    assert not r.action_admissible and r.observation == first.observation and not r.done
    assert r.admissible_actions == first.admissible_actions and r.reward == 0
    env.step("search[shampoo]")
    before = env.step("click[next >]")
    r = env.step(action)
    assert not r.action_admissible or action == "click[next >]"
    if action != "click[next >]":
        assert r.observation == before.observation


def test_two_instances_same_goal_same_first_observation():
    a, b = WebShopEnv(data_dir=SAMPLE_DIR, seed=1), WebShopEnv(data_dir=SAMPLE_DIR, seed=2)
    assert a.shop is b.shop                      # catalog, goals and index built once per process
    ra, rb = a.reset("5", seed=3), b.reset("5", seed=3)
    assert (ra.observation, ra.task, ra.admissible_actions) == (rb.observation, rb.task, rb.admissible_actions)
    ra, rb = a.step("search[green tea]"), b.step("search[green tea]")
    assert ra.observation == rb.observation and ra.anchor == rb.anchor
    assert ra.task not in ra.anchor and "Instruction:" not in ra.anchor


def test_task_ids_and_bad_ids(env):
    n = len(env.shop.goals)
    assert env.task_ids("eval") == [str(i) for i in range(n // 5)]
    assert env.task_ids("train") == [str(i) for i in range(n // 5, n)]
    with pytest.raises(KeyError, match="ids are"):
        env.reset(str(n))
    with pytest.raises(KeyError, match="ids are"):
        env.reset("abc")
    with pytest.raises(KeyError, match="splits"):
        env.task_ids("valid_unseen")
    with pytest.raises(TypeError):
        WebShopEnv(data_dir=SAMPLE_DIR, no_such_option=1)


def test_search_is_bm25_with_lucene_constants(env):
    bm25 = env.shop.index._bm25
    assert (bm25.k1, bm25.b, bm25.method) == (0.9, 0.4, "lucene")
    hits = env.shop.search("green tea")
    assert hits == env.shop.search("GREEN the tea")          # lower-cased, stop words dropped
    for pos in (0, 7, 31):                       # a product's own title finds it first
        assert env.shop.search(env.shop.products[pos].title)[0] == pos
    assert env.shop.search("zzzz qqqq") == [] and len(env.shop.search("pack")) == 50


def test_price_parsing_the_original_way():
    assert parse_pricing("$19.99 - $27.99") == ([19.99, 27.99], "$19.99 to $27.99")
    assert parse_pricing("$1,299.00") == ([1299.0], "$1299.0")
    assert parse_pricing("") == ([100.0], "$100.0") and parse_pricing(None) == ([100.0], "$100.0")
    with pytest.raises(ValueError, match="unparseable"):
        parse_pricing("$abc")


def test_loader_handles_original_fields(tmp_path):
    products = [
        {"asin": "B00000000A", "name": "Thing", "category": "c", "query": " Things ", "product_category": "a › b",
         "full_description": "d", "small_description": "one bullet", "pricing": "$5",
         "customization_options": {"Color": [{"value": " Black/White "}], "Size": None}},
        {"asin": "B00000000A", "name": "duplicate"},
        {"asin": "nan", "name": "bad"},
        {"asin": "B00000000AXX", "name": "too long"},
    ]
    (tmp_path / "items_shuffle_1000.json").write_text(json.dumps(products))
    (tmp_path / "items_ins_v2_1000.json").write_text(json.dumps({}))
    [p] = load_products(str(tmp_path))
    assert p.options == {"color": ["black | white"]} and p.bullet_points == ["one bullet"]
    assert p.query == "things" and p.attributes == ["DUMMY_ATTR"] and p.price_tag == "$5.0"
    with pytest.raises(FileNotFoundError, match="human_goals"):
        load_products(str(tmp_path), human_goals=True)


def test_human_goal_mode(tmp_path):
    generate(str(tmp_path), num_products=10)
    human = {"B0SAMPLE00": [{"instruction": "i want it.", "instruction_attributes": ["x"],
                             "instruction_options": ["black"]},
                            {"instruction": "skipped", "instruction_attributes": [], "instruction_options": []}]}
    (tmp_path / "items_human_ins.json").write_text(json.dumps(human))
    env = WebShopEnv(data_dir=str(tmp_path), human_goals=True, eval_goals=0)
    assert len(env.shop.goals) == 1 and env.shop.goals[0].goal_options == ["black"]
    assert env.reset("0").task.startswith("i want it, and price lower than")


def test_synthetic_goals_counts_weights_prices():
    products = load_products(SAMPLE_DIR)
    goals, prices = build_goals(products)
    expected = 0
    for p in products:
        if p.instruction_text is not None:
            n = 1
            for values in p.options.values():
                n *= len(values)
            expected += n
    assert len(goals) == expected == 80
    again, prices_again = build_goals(products)
    assert [g.instruction_text for g in again] == [g.instruction_text for g in goals] and prices == prices_again
    for g in goals:
        price = prices[g.asin]
        allowed = [x for x in PRICE_RANGE if x > price][1:4]
        assert g.price_upper in allowed and f"price lower than {g.price_upper:.2f} dollars" in g.instruction_text
        assert 0 < g.weight <= 1
    # Goal order is the original's: random.seed(233); random.shuffle(goals).
    from env_servers.webshop.goals import synthetic_goals, product_prices
    rng = random.Random(233)
    plain = synthetic_goals(products, product_prices(products, rng), rng)
    random.seed(233)
    random.shuffle(plain)
    assert [g.instruction_text for g in plain] == [g.instruction_text for g in goals]


def test_prepare_copies_idempotently_and_resolution(tmp_path, monkeypatch):
    dest = tmp_path / "webshop"
    prepare(str(dest), source=SAMPLE_DIR)
    copied = dest / "items_shuffle_sample.json"
    assert copied.read_bytes() == open(os.path.join(SAMPLE_DIR, "items_shuffle_sample.json"), "rb").read()
    mtime = copied.stat().st_mtime_ns
    prepare(str(dest), source=SAMPLE_DIR)
    assert copied.stat().st_mtime_ns == mtime
    with pytest.raises(FileNotFoundError, match="no WebShop catalog"):
        prepare(str(tmp_path / "x"), source=str(tmp_path / "empty"))
    monkeypatch.setenv("WEBSHOP_DATA", str(dest))
    assert resolve_data_dir(None) == str(dest)
    monkeypatch.setenv("WEBSHOP_DATA", str(tmp_path / "nothing"))
    assert resolve_data_dir(None) == SAMPLE_DIR
    with pytest.raises(FileNotFoundError):
        resolve_data_dir(str(tmp_path / "nothing"))


def test_shipped_sample_is_what_the_generator_makes(tmp_path):
    generate(str(tmp_path))
    for name in ("items_shuffle_sample.json", "items_ins_v2_sample.json"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(SAMPLE_DIR, name), "rb").read()


def test_bench_steps_per_second_runs():
    """bench/bench_env.py's WebShop figure runs (its speed is the benchmark's to print, not a test's)."""
    assert bench_steps_per_second(200, data_dir=SAMPLE_DIR) > 0


def test_real_small_catalog_goal_counts_and_episodes():
    env = WebShopEnv(data_dir=real_catalog())
    assert len(env.shop.products) == 1000
    assert sum(1 for p in env.shop.products if p.instruction_text is not None) == 415
    # The README counts 477 with customization_options; 54 of those hold only null option lists.
    assert sum(1 for p in env.shop.products if p.options) == 423
    assert len(env.shop.goals) == 6910
    assert len(env.task_ids("eval")) == 500 and len(env.task_ids("train")) == 6410
    assert env.task_ids("train")[0] == "500"
    won = sum(play(env, t, scripted_purchase(env, t)).won for t in env.task_ids("eval")[:100])
    assert won >= 90             # a few goals cannot reach 1.0 even with the right item (original quirks)


def test_lucene_like_analysis_porter_stemmer():
    from env_servers.webshop.porter import stem
    from env_servers.webshop.search import tokenize
    cases = {"caresses": "caress", "ponies": "poni", "agreed": "agre", "motoring": "motor", "hopping": "hop",
             "filing": "file", "happy": "happi", "relational": "relat", "conformabli": "conform",
             "archaeology": "archaeolog", "generalizations": "gener", "oscillators": "oscil",
             "adoption": "adopt", "electrical": "electr", "controll": "control", "be": "be"}
    assert {w: stem(w) for w in cases} == cases
    assert tokenize("L'eau D'Issey 6.7 fl oz, Women's running SHOES -- the best") == [
        "l'eau", "d'issei", "6.7", "fl", "oz", "women", "run", "shoe", "best"]


def test_page_text_in_the_original_simple_mode_format(env):
    report = env.reset("2")
    r = env.step("search[pack]")
    first = env.shop.products[env._session.state.results[0]]
    assert r.info["page_text"].startswith(
        f"Instruction: [SEP] {report.task} [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] "
        f"Next > [SEP] {first.asin} [SEP] {first.title} [SEP] {first.price_tag} [SEP] ")
    assert r.observation.startswith("'Back to Search' [SEP] 'Page 1 (Total results: 50)' [SEP] 'Next >'")
    r = env.step(f"click[{first.asin.lower()}]")
    options = " [SEP] ".join(f"{name} [SEP] " + " [SEP] ".join(values) for name, values in first.options.items())
    middle = f" [SEP] {options}" if options else ""
    assert r.info["page_text"] == (
        f"Instruction: [SEP] {report.task} [SEP] Back to Search [SEP] < Prev{middle} [SEP] {first.title} [SEP] "
        f"Price: {first.price_tag} [SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now")
    r = env.step("click[buy now]")
    assert r.info["page_text"].startswith("Thank you for shopping with us! [SEP] Your code: [SEP] ")
    assert r.info["page_text"].endswith(f"Your score (min 0.0, max 1.0) [SEP] {r.score}")
