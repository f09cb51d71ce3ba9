"""WebShop as a TextEnv. Instances in a process share one read-only `Shop` per (catalog, options):
products, prices, goals and the BM25 index are built once; an instance holds only its session.

Reports: `observation` = `anchor` = the page without the instruction (each part in single quotes, joined by
" [SEP] ", as the GiGPO reference feeds the model and groups anchor states); `task` is the instruction;
`info["page_text"]` is the full page. `reward` = `score` = the purchase reward in [0, 1] (0 before buying);
`won` = bought with reward exactly 1.0. After a reset `info["walkthrough"]` is the goal's `solution_path`
(what the supervised warm start imitates, as ALFWorld's walkthrough).
"""
from __future__ import annotations

import itertools
import os
import re
import threading
import time
from dataclasses import dataclass, field

from env_servers.base import EnvReport
from env_servers.webshop.catalog import Product, load_products
from env_servers.webshop.data import resolve_data_dir
from env_servers.webshop.engine import PRODUCTS_PER_PAGE, ShopSession
from env_servers.webshop.goals import GOAL_SHUFFLE_SEED, Goal, build_goals
from env_servers.webshop.reward import noun_method
from env_servers.webshop.search import SearchIndex

TASK_TYPE = "webshop"
SPLITS = ("train", "eval", "all")      # eval: the first DEFAULT_EVAL_GOALS goals, never trained on
DEFAULT_EVAL_GOALS = 500


@dataclass
class Shop:
    """Everything instances share: catalog, prices, goals, search index."""

    data_dir: str
    products: list[Product]
    prices: dict[str, float]
    goals: list[Goal]
    index: SearchIndex
    num_eval_goals: int
    solutions: dict[int, list[str]] = field(default_factory=dict)   # goal index -> solution_path, cached

    def search(self, query: str) -> list[int]:
        return self.index.search(query)


_shops: dict[tuple, Shop] = {}
_shops_lock = threading.Lock()


def get_shop(data_dir: str, human_goals: bool = False, num_products: int | None = None,
             price_seed: int = GOAL_SHUFFLE_SEED, eval_goals: int | None = None) -> Shop:
    """The process-wide shared Shop for these settings (built on first use)."""
    key = (os.path.realpath(data_dir), human_goals, num_products, price_seed, eval_goals)
    with _shops_lock:
        shop = _shops.get(key)
        if shop is None:
            products = load_products(data_dir, human_goals=human_goals, num_products=num_products)
            goals, prices = build_goals(products, use_human_goals=human_goals, price_seed=price_seed)
            if not goals:
                raise ValueError(f"the catalog in {data_dir!r} yields no goals "
                                 f"({'human' if human_goals else 'synthetic'} goal mode)")
            # The real catalogs evaluate on goals 0..499; a small catalog keeps a fifth for evaluation.
            n_eval = eval_goals if eval_goals is not None else min(DEFAULT_EVAL_GOALS, len(goals) // 5)
            shop = Shop(data_dir, products, prices, goals, SearchIndex(products), n_eval)
            noun_method()        # load the tagger (if installed) now, not inside a purchase step
            _shops[key] = shop
        return shop


class WebShopEnv:
    """TextEnv over the text WebShop. num_products None: all; eval_goals None: 500, or a fifth of the goals
    for small catalogs."""

    def __init__(self, data_dir: str | None = None, seed: int = 0, human_goals: bool = False,
                 num_products: int | None = None, price_seed: int = GOAL_SHUFFLE_SEED, eval_goals: int | None = None):
        self.seed = seed
        self.shop = get_shop(resolve_data_dir(data_dir), human_goals, num_products, price_seed, eval_goals)
        self._session: ShopSession | None = None
        self._task_id = ""

    def task_ids(self, split: str) -> list[str]:
        n, n_eval = len(self.shop.goals), self.shop.num_eval_goals
        ranges = {"train": range(n_eval, n), "eval": range(n_eval), "all": range(n)}
        if split not in ranges:
            raise KeyError(f"unknown WebShop split {split!r}; splits: {', '.join(SPLITS)}")
        return [str(i) for i in ranges[split]]

    def reset(self, task_id: str, seed: int = 0) -> EnvReport:
        try:
            index = int(task_id)
            if not 0 <= index < len(self.shop.goals):
                raise ValueError
        except (TypeError, ValueError):
            raise KeyError(f"unknown WebShop task id {task_id!r}: ids are '0'..'{len(self.shop.goals) - 1}' "
                           f"(eval: < {self.shop.num_eval_goals})") from None
        # The shop is deterministic: the seed changes nothing, every group member sees the same pages.
        self._session = ShopSession(self.shop, self.shop.goals[index])
        self._task_id = str(index)
        report = self._report(0.0, True)
        report.info["walkthrough"] = solution_path(self.shop, index)
        return report

    def step(self, action: str) -> EnvReport:
        if self._session is None:
            raise RuntimeError("step() before reset()")
        accepted, reward = self._session.step(action)
        return self._report(reward, accepted)

    def close(self) -> None:
        self._session = None

    def _report(self, reward: float, accepted: bool) -> EnvReport:
        s = self._session
        obs, done = s.observation(), s.done
        score = s.state.reward if done else 0.0
        info = {"page": s.state.page, "page_text": s.page_text(), "task_id": self._task_id}
        if done:
            info["reward_info"] = s.state.reward_info
            info["purchased_asin"] = s.shop.products[s.state.product].asin
        return EnvReport(observation=obs, anchor=obs, admissible_actions=s.admissible_actions(),
                         reward=reward, done=done, won=done and score == 1.0, task=s.goal.instruction_text,
                         task_type=TASK_TYPE, action_admissible=accepted, score=score, info=info)


# The query a solution path searches with: the goal's words, in the shape constrained generation allows a query
# (actors/prompts/webshop.py FREE_TEXT_*: lower-case letters, digits, spaces, ",.:'&-", at most 160 characters).
QUERY_MAX_CHARS = 160
_PRICE_CLAUSE = re.compile(r",? and price lower than .*$")
_GOAL_OPENING = re.compile(r"^(find me|i am looking for|i'm looking for|i need|i want)\s+")
_NOT_IN_QUERY = re.compile(r"[^a-z0-9 ,.:'&-]+")


def solution_query(goal: Goal, max_chars: int = QUERY_MAX_CHARS) -> str:
    """The goal's own words as a search query: the instruction, lower-cased, without its opening ("find
    me") and its price clause (prices are not in the search index), characters outside the query shape
    replaced by spaces, cut at a word boundary to `max_chars`. On the 1,000-product catalog the goal's
    product is the first result for 55% of the eval goals and on the first page for 91% (docs/webshop.md)."""
    text = _PRICE_CLAUSE.sub("", goal.instruction_text.lower().strip())
    text = _GOAL_OPENING.sub("", text)
    text = " ".join(_NOT_IN_QUERY.sub(" ", text).split())
    if len(text) > max_chars:
        text = text[: max_chars + 1].rsplit(" ", 1)[0][:max_chars]
    text = text.strip(" ,.:'&-")
    return text or goal.query or "product"


def solution_path(shop: Shop, index: int) -> list[str]:
    """A path that solves goal `index` as a shopper would: search the goal's words (`solution_query`), then
    `_buy_from_results`. When the search misses the goal's product (a few goals in a thousand), the path is
    just the search: it cannot win, and the warm start skips it."""
    cached = shop.solutions.get(index)
    if cached is not None:
        return list(cached)
    goal = shop.goals[index]
    query = solution_query(goal)
    actions = [f"search[{query}]"] + (_buy_from_results(shop, goal, query) or [])
    shop.solutions[index] = actions     # (a race between threads only computes the same list twice)
    return list(actions)


def _buy_from_results(shop: Shop, goal: Goal, query: str) -> list[str] | None:
    """After searching `query`: page to the goal's product (the one it was made from), click it, choose each
    of the goal's options, buy. None when the search does not return the product."""
    asins = [shop.products[i].asin for i in shop.search(query)]
    if goal.asin not in asins:
        return None
    actions = ["click[next >]"] * (asins.index(goal.asin) // PRODUCTS_PER_PAGE)
    actions.append(f"click[{goal.asin.lower()}]")
    if isinstance(goal.goal_options, dict):
        actions += [f"click[{v}]" for v in goal.goal_options.values()]
    return actions + ["click[buy now]"]


def scripted_purchase(env: WebShopEnv, task_id: str) -> list[str]:
    """Search the goal's whole instruction, then `_buy_from_results` (tests and the bench)."""
    goal = env.shop.goals[int(task_id)]
    query = goal.instruction_text.lower()
    return [f"search[{query}]"] + (_buy_from_results(env.shop, goal, query) or ["click[back to search]"])


def bench_steps_per_second(n_steps: int = 2000, data_dir: str | None = None) -> float:
    """Env steps per second of one instance running scripted purchases (search, paging, item,
    options, sub pages, buy) over successive goals, excluding the one-time Shop build."""
    env = WebShopEnv(data_dir=data_dir)
    ids = env.task_ids("all")
    steps, start = 0, time.perf_counter()
    for task_id in itertools.cycle(ids):
        if steps >= n_steps:
            break
        env.reset(task_id)
        plan = scripted_purchase(env, task_id)
        plan = plan[:-1] + ["click[description]", "click[< prev]", "click[features]", "click[< prev]"] + plan[-1:]
        for action in plan:
            env.step(action)
            steps += 1
            if steps >= n_steps:
                break
    return steps / (time.perf_counter() - start)
