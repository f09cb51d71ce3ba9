"""The shop's pages and how actions move between them (the original text WebShop, simple text mode).

Pages and their text (parts joined by " [SEP] ", as the original's simple mode renders the HTML):
  search   WebShop | Instruction: | <instruction> | Search
  results  Instruction: | <instr> | Back to Search | Page N (Total results: T) | [< Prev] | Next > |
           then per product: ASIN | title | price tag          (10 per page of the top 50)
  item     Instruction: | <instr> | Back to Search | < Prev | <option name> | <values>... | title |
           Price: <tag> | Rating: <r> | Description | Features | Reviews | Buy Now
           (a value chosen reads "<value> (chosen)": see CHOSEN)
  sub page Instruction: | <instr> | Back to Search | < Prev | description / bullet points / reviews
  done     Thank you for shopping with us! | ... | Your score (min 0.0, max 1.0) | <score>

Clickables: the lower-cased button texts, product asins and option values of the page, in page order
(option values override same-named earlier entries, as the original's dict did). As in the original,
results pages always show "Next >" and `search[...]` runs from any page; "click[search]" never runs, so it
is not admissible.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from env_servers.webshop.catalog import Product
from env_servers.webshop.goals import Goal
from env_servers.webshop.reward import purchase_reward

PRODUCTS_PER_PAGE = 10
SEP = " [SEP] "
_ACTION = re.compile(r"(.+)\[(.+)\]")
SUB_PAGES = {"description": "Description", "features": "Features", "reviews": "Reviews"}
# After an option value the item page shows as chosen. The original's simple text mode shows none (its rich
# mode marks a clicked option); with the page alone as the prompt (rollout.history_length 0) an item page
# before and after a choice would then read the same, so the policy could not tell whether to choose or to
# buy, and GiGPO would group the two states as one anchor.
CHOSEN = "(chosen)"


@dataclass
class ShopState:
    """Where one shopper is."""

    page: str = "search"                     # search | results | item | sub | done
    keywords: str = ""
    results: list[int] = field(default_factory=list)   # product positions, best first
    page_num: int = 1
    product: int | None = None               # product position on item/sub pages
    options: dict[str, str] = field(default_factory=dict)
    sub_page: str = ""                       # Description | Features | Reviews
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)


def split_shop_action(action: str) -> tuple[str, str | None]:
    """"click[x]" -> ("click", "x"); anything else -> (action, None). Same greedy pattern as the original."""
    m = _ACTION.match(action)
    return (action, None) if m is None else (m.group(1), m.group(2))


class ShopSession:
    """One shopper working on one goal. `shop` provides products, prices and search (shared, read-only)."""

    def __init__(self, shop, goal: Goal):
        self.shop = shop
        self.goal = goal
        self.state = ShopState()
        self._parts: list[str] = []
        self._clickables: dict[str, tuple[str, object]] = {}
        self._render()

    # ------------------------------------------------------------------ rendering
    def _product(self) -> Product:
        return self.shop.products[self.state.product]

    def _render(self) -> None:
        s, instr = self.state, self.goal.instruction_text
        parts: list[str] = []
        clickables: dict[str, tuple[str, object]] = {}

        def button(text: str, kind: str, arg=None):
            parts.append(text)
            clickables[text.lower()] = (kind, arg)

        if s.page == "search":
            parts += ["WebShop", "Instruction:", instr]
            button("Search", "search_button")
        elif s.page == "done":
            parts += ["Thank you for shopping with us!", "Your code:", "(Paste it in your MTurk interface.)",
                      "Purchased", "asin", self._product().asin, "options", json.dumps(s.options, sort_keys=True),
                      "Your score (min 0.0, max 1.0)", str(s.reward)]
        elif s.page == "results":
            parts += ["Instruction:", instr]
            button("Back to Search", "back")
            parts.append(f"Page {s.page_num} (Total results: {len(s.results)})")
            if s.page_num > 1:
                button("< Prev", "prev")
            button("Next >", "next")
            start = (s.page_num - 1) * PRODUCTS_PER_PAGE
            for pos in s.results[start:start + PRODUCTS_PER_PAGE]:
                p = self.shop.products[pos]
                button(p.asin, "product", pos)
                parts += [p.title, p.price_tag]
        else:   # item or sub page
            p = self._product()
            parts += ["Instruction:", instr]
            button("Back to Search", "back")
            button("< Prev", "prev")
            if s.page == "item":
                option_values: dict[str, tuple[str, object]] = {}
                for name, values in p.options.items():
                    chosen = s.options.get(name)
                    parts += [name, *(f"{v} {CHOSEN}" if v == chosen else v for v in values)]
                    option_values.update((v, ("option", name)) for v in values)
                parts += [p.title, f"Price: {p.price_tag}", f"Rating: {p.rating}"]
                for label in SUB_PAGES.values():
                    button(label, "sub", label)
                button("Buy Now", "buy")
                clickables.update(option_values)       # radio inputs come after the buttons
            elif s.sub_page == "Description":
                parts.append(p.description)
            elif s.sub_page == "Features":
                parts += p.bullet_points
            else:
                for r in p.reviews:
                    parts += [f'"{r["title"]}"', str(r["score"]), str(r["body"])]
        self._parts = [x.strip() for x in parts if x is not None and x.strip()]
        self._clickables = clickables

    # ------------------------------------------------------------------ views
    @property
    def done(self) -> bool:
        return self.state.page == "done"

    def page_text(self) -> str:
        """The page as the original's simple text mode shows it (instruction included)."""
        return SEP.join(self._parts)

    def observation(self) -> str:
        """The page without the instruction: the parts after it, each in single quotes, as the GiGPO
        reference formats WebShop observations (and uses them as anchor states)."""
        instr = self.goal.instruction_text.strip()
        if instr in self._parts:
            i = self._parts.index(instr)
            return SEP.join(f"'{x}'" for x in self._parts[i + 1:])
        return self.page_text()

    def admissible_actions(self) -> list[str]:
        if self.done:
            return []
        actions = ["search[<your query>]"] if self.state.page == "search" else []
        return actions + [f"click[{c}]" for c in self._clickables if c != "search"]

    # ------------------------------------------------------------------ actions
    def step(self, action: str) -> tuple[bool, float]:
        """Apply `action`; returns (accepted, reward). A rejected action leaves the page as it was."""
        if self.done or not isinstance(action, str):
            return False, 0.0
        name, arg = split_shop_action(action.strip())
        arg = arg.lower() if arg is not None else None
        s = self.state
        if name == "search" and arg:
            s.keywords = arg
            s.results = self.shop.search(arg)
            self._to_results(1)
            self._render()
            return True, 0.0
        if name != "click" or arg is None or arg == "search" or arg not in self._clickables:
            return False, 0.0
        kind, value = self._clickables[arg]
        reward = 0.0
        # Button names take precedence over option values that happen to equal them (original order).
        if arg == "buy now" and s.page == "item":
            reward, s.reward_info = purchase_reward(self._product(), self.goal,
                                                    self.shop.prices[self._product().asin], s.options)
            s.reward, s.page = reward, "done"
        elif arg == "back to search":
            self.state = ShopState()
        elif arg == "next >" and s.page == "results":
            self._to_results(s.page_num + 1)
        elif arg == "< prev" and s.page in ("results", "item"):
            self._to_results(s.page_num - 1 if s.page == "results" else s.page_num)
        elif arg == "< prev" and s.page == "sub":
            s.page = "item"
        elif arg in SUB_PAGES and s.page == "item":
            s.page, s.sub_page = "sub", SUB_PAGES[arg]
        elif kind == "product":
            s.product, s.page = value, "item"
        elif kind == "option":
            s.options[value] = arg
            s.page = "item"
        else:
            return False, 0.0
        self._render()
        return True, reward

    def _to_results(self, page_num: int) -> None:
        s = self.state
        s.page, s.page_num, s.product, s.options, s.sub_page = "results", page_num, None, {}, ""
