"""WebShop goals (tasks) and the prices they are checked against.

Synthetic goals (human_goals=False, as in the public GiGPO runs): one per option combination (names sorted)
of every product with an `instruction`, which gets " with name: value, and name: value" and ", and price
lower than X.00 dollars" appended; weight = mean over its attributes of 1 / (goals carrying the attribute).
Human goals: one per entry of items_human_ins.json with at least one attribute; weight 1.

Price cap: the larger of two draws from the first four of 10, 20, ..., 990 above the product's price (none,
1,000,000, when fewer than two exist); a range-priced product costs a uniform draw from its range. The
original draws unseeded; here one `random.Random(price_seed)` draws in the original's order (all prices,
then the caps), so every process agrees. Goals are then shuffled like the original's `random.seed(233);
random.shuffle(goals)`, so goal indices match the original's.
"""
from __future__ import annotations

import itertools
import random
from collections import defaultdict
from dataclasses import dataclass

from env_servers.webshop.catalog import Product

PRICE_RANGE = [10.0 * i for i in range(1, 100)]
NO_PRICE_CAP = 1000000
GOAL_SHUFFLE_SEED = 233


@dataclass(slots=True)
class Goal:
    """What one task asks for."""

    asin: str                       # the product the goal was made from
    category: str
    query: str
    name: str                       # that product's title (used by the type reward)
    product_category: str
    instruction_text: str
    attributes: list[str]
    price_upper: float
    goal_options: dict[str, str] | list[str]   # synthetic: {name: value}; human: [value, ...]
    weight: float = 1.0


def product_prices(products: list[Product], rng: random.Random) -> dict[str, float]:
    """The price each product is sold at (range-priced products: a uniform draw from the range)."""
    prices = {}
    for p in products:
        if not p.pricing:
            prices[p.asin] = 100.0
        elif len(p.pricing) == 1:
            prices[p.asin] = p.pricing[0]
        else:
            prices[p.asin] = rng.uniform(*p.pricing[:2])
    return prices


def _price_cap(price: float, rng: random.Random) -> tuple[float, str]:
    above = [p for p in PRICE_RANGE if p > price][:4]
    if len(above) >= 2:
        _, upper = sorted(rng.sample(above, 2))
        return upper, f", and price lower than {upper:.2f} dollars"
    return NO_PRICE_CAP, ""


def synthetic_goals(products: list[Product], prices: dict[str, float], rng: random.Random) -> list[Goal]:
    """One goal per option combination of each product with a synthetic instruction (unshuffled)."""
    goals: list[Goal] = []
    attribute_counts: dict[str, int] = defaultdict(int)
    for p in products:
        if p.instruction_text is None:
            continue
        attributes = p.instruction_attributes or []
        if not attributes:
            raise ValueError(f"product {p.asin} has an instruction but no instruction_attributes")
        price_upper, price_text = _price_cap(prices[p.asin], rng)
        names = sorted(p.options)
        for combination in itertools.product(*(p.options[n] for n in names)):
            options = dict(zip(names, combination))
            option_text = ", and ".join(f"{k}: {v}" for k, v in options.items())
            option_text = f" with {option_text}" if option_text else ""
            goals.append(Goal(asin=p.asin, category=p.category, query=p.query, name=p.title,
                              product_category=p.product_category,
                              instruction_text=f"{p.instruction_text}{option_text}{price_text}",
                              attributes=list(attributes), price_upper=price_upper, goal_options=options))
            for a in attributes:
                attribute_counts[a] += 1
    for g in goals:
        g.weight = sum(1.0 / attribute_counts[a] for a in g.attributes) / len(g.attributes)
    return goals


def human_goals(products: list[Product], prices: dict[str, float], rng: random.Random) -> list[Goal]:
    """One goal per human instruction with at least one attribute (unshuffled)."""
    goals: list[Goal] = []
    for p in products:
        for entry in p.human_instructions or []:
            attributes = entry.get("instruction_attributes") or []
            if not attributes:
                continue
            price_upper, price_text = _price_cap(prices[p.asin], rng)
            goals.append(Goal(asin=p.asin, category=p.category, query=p.query, name=p.title,
                              product_category=p.product_category,
                              instruction_text=entry["instruction"].strip(".") + price_text,
                              attributes=list(attributes), price_upper=price_upper,
                              goal_options=list(entry.get("instruction_options") or [])))
    return goals


def build_goals(products: list[Product], use_human_goals: bool = False,
                price_seed: int = GOAL_SHUFFLE_SEED) -> tuple[list[Goal], dict[str, float]]:
    """All goals in the original's shuffled order, plus the price of every product."""
    rng = random.Random(price_seed)
    prices = product_prices(products, rng)
    goals = (human_goals if use_human_goals else synthetic_goals)(products, prices, rng)
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    return goals, prices
