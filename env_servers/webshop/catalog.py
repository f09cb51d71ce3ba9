"""Loading WebShop's product catalog from the original file schema (`PRODUCT_FILES`, `ATTRIBUTE_FILES`):
items_shuffle*.json (products), items_ins_v2*.json ({asin: {attributes, [instruction,
instruction_attributes]}}), items_human_ins.json ({asin: [{instruction, instruction_attributes,
instruction_options}]}, optional) and reviews.json (optional; without it pages say "N.A.").

As the original loader does: duplicate asins and asins longer than 10 characters (or "nan") are skipped;
option values are stripped, lower-cased and "/" becomes " | "; options with a null value list are dropped;
products without attributes get ["DUMMY_ATTR"]. Prices: see `parse_pricing`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

# Looked up in this order: the full catalog, the 1,000-product one, the generated sample of this package.
PRODUCT_FILES = ("items_shuffle.json", "items_shuffle_1000.json", "items_shuffle_sample.json")
ATTRIBUTE_FILES = ("items_ins_v2.json", "items_ins_v2_1000.json", "items_ins_v2_sample.json")
HUMAN_GOALS_FILE = "items_human_ins.json"
REVIEWS_FILE = "reviews.json"


@dataclass(slots=True)
class Product:
    """One product as the shop pages and the reward see it."""

    asin: str
    title: str                          # the original's "Title" (= name)
    description: str                    # "Description" (= full_description)
    bullet_points: list[str]            # "BulletPoints" (= small_description)
    pricing: list[float]                # one price or a [low, high] range
    price_tag: str                      # "$12.5" or "$12.5 to $20.0", shown on pages
    options: dict[str, list[str]]       # option name -> values, lower-cased
    attributes: list[str]
    category: str
    query: str
    product_category: str
    rating: str | float = "N.A."
    reviews: list[dict] = field(default_factory=list)
    instruction_text: str | None = None          # synthetic instruction (items_ins_v2)
    instruction_attributes: list[str] | None = None
    human_instructions: list[dict] | None = None  # items_human_ins entries


def parse_pricing(pricing: str | None) -> tuple[list[float], str]:
    """Prices the original way: split on "$", strip every non-digit except ".", Decimal -> float.
    Returns (pricing, price_tag). Missing pricing means $100.0, as in the original."""
    if not pricing:
        return [100.0], "$100.0"
    values = []
    for piece in pricing.split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", piece)
        try:
            values.append(float(Decimal(digits)))
        except InvalidOperation as exc:
            raise ValueError(f"unparseable price {pricing!r} (piece {piece!r})") from exc
    if not values:
        raise ValueError(f"unparseable price {pricing!r}: no '$' amount in it")
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def find_file(data_dir: str, names: tuple[str, ...]) -> str | None:
    """The first of `names` present in data_dir, or None."""
    return next((path for path in (os.path.join(data_dir, n) for n in names) if os.path.isfile(path)), None)


def has_catalog(data_dir: str | None) -> bool:
    """Whether data_dir holds a products file and an attributes file."""
    return bool(data_dir) and os.path.isdir(data_dir) and \
        find_file(data_dir, PRODUCT_FILES) is not None and find_file(data_dir, ATTRIBUTE_FILES) is not None


def require_catalog(data_dir: str, hint: str = "") -> None:
    """FileNotFoundError unless data_dir holds a catalog."""
    if not has_catalog(data_dir):
        raise FileNotFoundError(
            f"no WebShop catalog in {data_dir!r}: need one of {PRODUCT_FILES} and one of {ATTRIBUTE_FILES}{hint}")


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def load_products(data_dir: str, human_goals: bool = False, num_products: int | None = None) -> list[Product]:
    """Load the catalog of `data_dir` (see module docstring). `human_goals` also reads the human
    instruction file, which must then exist. `num_products` keeps only the first N raw entries, as the
    original does."""
    require_catalog(data_dir)
    products_path, attrs_path = find_file(data_dir, PRODUCT_FILES), find_file(data_dir, ATTRIBUTE_FILES)
    raw = _read_json(products_path)
    if not isinstance(raw, list):
        raise ValueError(f"{products_path}: expected a list of products, got {type(raw).__name__}")
    attributes = _read_json(attrs_path)
    human = None
    if human_goals:
        human_path = os.path.join(data_dir, HUMAN_GOALS_FILE)
        if not os.path.isfile(human_path):
            raise FileNotFoundError(f"human_goals=True needs {human_path} (`make data` downloads it when "
                                    "$WEBSHOP_DATA holds no catalog yet; or put the original file there)")
        human = _read_json(human_path)
    reviews, ratings = {}, {}
    reviews_path = os.path.join(data_dir, REVIEWS_FILE)
    if os.path.isfile(reviews_path):
        for entry in _read_json(reviews_path):
            reviews[entry["asin"]] = entry.get("reviews", [])
            ratings[entry["asin"]] = entry.get("average_rating", "N.A.")

    if num_products is not None:
        raw = raw[:num_products]
    products: list[Product] = []
    seen: set[str] = set()
    for p in raw:
        asin = p.get("asin")
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        try:
            pricing, price_tag = parse_pricing(p.get("pricing"))
        except ValueError as exc:
            raise ValueError(f"{products_path}: product {asin}: {exc}") from exc
        options = {name.lower(): [c["value"].strip().replace("/", " | ").lower() for c in contents]
                   for name, contents in (p.get("customization_options") or {}).items() if contents is not None}
        bullets = p.get("small_description")
        bullets = bullets if isinstance(bullets, list) else [bullets if bullets is not None else ""]
        entry = attributes.get(asin, {})
        product_reviews = [{"title": r.get("title", ""), "score": r.get("score", r.get("stars", 0)),
                            "body": r.get("body", r.get("review", ""))} for r in reviews.get(asin, [])]
        products.append(Product(
            asin=asin,
            title=p.get("name") or "",
            description=p.get("full_description") or "",
            bullet_points=[b if isinstance(b, str) else str(b) for b in bullets],
            pricing=pricing,
            price_tag=price_tag,
            options=options,
            attributes=entry["attributes"] if "attributes" in entry else ["DUMMY_ATTR"],
            category=p.get("category", ""),
            query=(p.get("query") or "").lower().strip(),
            product_category=p.get("product_category") or "",
            rating=ratings.get(asin, "N.A."),
            reviews=product_reviews,
            instruction_text=None if human_goals else entry.get("instruction"),
            instruction_attributes=None if human_goals else entry.get("instruction_attributes"),
            human_instructions=human.get(asin) if human is not None else None,
        ))
    return products
