"""Each term of WebShop's purchase reward (env_servers/webshop/reward.py)."""
from __future__ import annotations

import pytest

from env_servers.webshop.catalog import Product
from env_servers.webshop.goals import Goal
from env_servers.webshop.reward import (attribute_matches, normalize_color, option_matches, purchase_reward,
                                        title_nouns, token_set_score, type_reward)


def make_product(**kw) -> Product:
    base = dict(asin="B000000001", title="plain shampoo bottle", description="a description",
                bullet_points=["first bullet", "second bullet"], pricing=[20.0], price_tag="$20.0",
                options={}, attributes=["long lasting"], category="beauty", query="shampoo",
                product_category="Beauty & Personal Care › Hair Care › Shampoo")
    base.update(kw)
    return Product(**base)


def make_goal(**kw) -> Goal:
    base = dict(asin="B000000001", category="beauty", query="shampoo", name="plain shampoo bottle",
                product_category="Beauty & Personal Care › Hair Care › Shampoo",
                instruction_text="i want shampoo", attributes=["long lasting"], price_upper=40.0,
                goal_options={})
    base.update(kw)
    return Goal(**base)


def test_token_set_score_matches_thefuzz_semantics():
    assert token_set_score("natural ingredient", "natural ingredients") > 85
    assert token_set_score("large", ("size", "x-large")) == 100      # tuple is str()-ed, token subset
    assert token_set_score("Ünïcode", "ncode") == token_set_score("ncode", "ncode")  # latin-1 chars dropped
    assert isinstance(token_set_score("a b", "a c"), int)


def test_attribute_fuzzy_match_against_product_attributes():
    product = make_product(attributes=["natural ingredient", "paraben free"])
    assert attribute_matches(product, make_goal(attributes=["natural ingredients"])) == 1
    assert attribute_matches(product, make_goal(attributes=["sugar free snack"])) == 0


@pytest.mark.parametrize("where", ["title", "bullet_points", "description"])
def test_attribute_substring_in_title_bullets_description(where):
    text = "Great MACHINE WASHABLE cover"
    value = [text] if where == "bullet_points" else text
    product = make_product(attributes=["DUMMY_ATTR"], **{where: value})
    assert attribute_matches(product, make_goal(attributes=["machine washable"])) == 1
    assert attribute_matches(product, make_goal(attributes=["machine washable", "gluten free"])) == 1


def test_normalize_color():
    assert normalize_color("navy blue") == "blue"           # first base color in list order
    assert normalize_color("rectangular") == "tan"          # substring rule of the original, kept
    assert normalize_color(("color", "black")) == "black"   # tuples: exact member only
    assert normalize_color(("color", "navy blue")) == ("color", "navy blue")
    assert normalize_color("xyz") == "xyz"


def test_option_matches_synthetic_goal_pairs():
    assert option_matches(["navy blue"], {"color": "blue"}) == 1
    assert option_matches(["black", "large"], {"color": "black", "size": "large"}) == 2
    assert option_matches(["large"], {"size": "x-large"}) == 1       # token subset of "size x large"
    assert option_matches(["small"], {"size": "large"}) == 0
    assert option_matches(["white"], {"color": "black"}) == 0
    assert option_matches([], {"color": "black"}) == 0


def test_option_matches_human_goal_values():
    assert option_matches(["navy blue"], ["blue"]) == 1
    assert option_matches(["12 ounce"], ["24 ounce"]) == 1      # "ounce 12" vs "ounce 24" scores 88
    assert option_matches(["12 ounce"], ["large"]) == 0


def test_price_term_and_total():
    product = make_product(attributes=["long lasting", "paraben free"])
    goal = make_goal(attributes=["long lasting", "paraben free"], goal_options={"color": "black"},
                     price_upper=40.0)
    total, info = purchase_reward(product, goal, price=30.0, chosen_options={"color": "black"})
    assert total == 1.0 and info["price_ok"]
    total, info = purchase_reward(product, goal, price=40.01, chosen_options={"color": "black"})
    assert total == pytest.approx(3 / 4) and not info["price_ok"]
    total, _ = purchase_reward(product, goal, price=40.0, chosen_options={"color": "white"})
    assert total == pytest.approx(3 / 4)
    total, _ = purchase_reward(product, goal, price=10.0, chosen_options={})
    assert total == pytest.approx(3 / 4)


GOAL_TITLE = "shampoo bottle brush comb towel soap mirror razor sponge tray"   # ten nouns


@pytest.mark.parametrize("bought_title, query, category, expected", [
    ("shampoo bottle", "shampoo", "X › Y", 1.0),                      # same query (overlap 0.2 >= 0.1)
    ("shampoo bottle", "other", "Beauty & Personal Care › Hair Care", 1.0),  # two category levels
    ("shampoo bottle brush", "other", "Other › Thing", 1.0),          # title overlap 0.3 > 0.2
    ("shampoo bottle", "other", "Other › Thing", 0.5),                # overlap 0.2: no match -> 0.5
    ("shampoo", "shampoo", "Beauty & Personal Care › Hair Care", 1.0),  # overlap exactly 0.1 stays
    ("lamp", "shampoo", "Beauty & Personal Care › Hair Care", 0.0),   # overlap 0 -> 0 even if query matches
])
def test_type_reward_rules(bought_title, query, category, expected):
    goal = make_goal(name=GOAL_TITLE)
    product = make_product(title=bought_title, query=query, product_category=category)
    assert len(title_nouns(GOAL_TITLE)) == 10
    assert type_reward(product, goal).r_type == expected


def test_type_reward_low_overlap_is_point_one():
    goal = make_goal(name=GOAL_TITLE + " candle")                     # eleven nouns
    product = make_product(title="shampoo", query="shampoo")          # overlap 1/11 < 0.1
    assert type_reward(product, goal).r_type == 0.1


def test_type_reward_scales_total():
    goal = make_goal(name=GOAL_TITLE, query="other")
    product = make_product(title="shampoo bottle", product_category="Other › Thing")
    total, info = purchase_reward(product, goal, price=1.0, chosen_options={})
    assert info["r_type"] == 0.5 and total == pytest.approx(0.5)
