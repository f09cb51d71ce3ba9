"""Generates the small catalog shipped in sample/ (the original WebShop schema), so the env and its tests run
without external data; `python -m env_servers.webshop.sample_catalog` rewrites byte-identical files.
Products come from fixed word lists: brand, product type, two to four attributes (in title, description
and bullets), a price or range, no/color/color+size options; three in five get a synthetic instruction.
"""
from __future__ import annotations

import json
import os
import random

from env_servers.webshop.data import SAMPLE_DIR

CATEGORIES = {
    "beauty": ("Beauty & Personal Care", {
        "Hair Care": ["shampoo", "conditioner", "hair oil"],
        "Skin Care": ["face cream", "body lotion", "lip balm"],
        "Fragrance": ["perfume", "body mist"],
    }, ["paraben free", "long lasting", "natural ingredients", "cruelty free", "sensitive skin",
        "travel size"]),
    "electronics": ("Electronics", {
        "Headphones": ["headphones", "earbuds"],
        "Accessories": ["phone case", "charging cable", "power bank"],
        "Television & Video": ["hdmi cable", "tv mount"],
    }, ["fast charging", "noise cancelling", "high definition", "easy install", "wireless bluetooth",
        "heavy duty"]),
    "garden": ("Home & Kitchen", {
        "Furniture": ["console table", "bar stool", "bookshelf"],
        "Bedding": ["throw pillow", "duvet cover"],
        "Decor": ["wall clock", "table lamp"],
    }, ["easy assemble", "solid wood", "machine washable", "living room", "space saving",
        "mid century"]),
    "fashion": ("Clothing, Shoes & Jewelry", {
        "Women": ["sneakers", "yoga pants", "sun hat"],
        "Men": ["polo shirt", "rain jacket", "leather belt"],
    }, ["machine wash", "quick drying", "non slip", "relaxed fit", "button closure", "water resistant"]),
    "grocery": ("Grocery & Gourmet Food", {
        "Snacks": ["potato chips", "protein bar", "trail mix"],
        "Beverages": ["green tea", "cold brew coffee"],
        "Pantry": ["olive oil", "pasta sauce"],
    }, ["gluten free", "non gmo", "low sugar", "keto friendly", "dairy free", "plant based"]),
}
BRANDS = ["Aurora", "Bellwood", "Cobalt", "Driftline", "Evergreen", "Fablehouse", "Granite Peak",
          "Harbor", "Ironleaf", "Juniper"]
COLORS = ["black", "white", "navy blue", "green", "gray", "red"]
SIZES = ["small", "medium", "large"]


def _product(rng: random.Random, i: int) -> tuple[dict, dict]:
    category = sorted(CATEGORIES)[i % len(CATEGORIES)]
    top, subs, attribute_pool = CATEGORIES[category]
    sub = sorted(subs)[rng.randrange(len(subs))]
    ptype = rng.choice(subs[sub])
    brand = rng.choice(BRANDS)
    attrs = rng.sample(attribute_pool, rng.randint(2, 4))
    asin = f"B0SAMPLE{i:02d}"
    title = f"{brand} {ptype.title()} - {', '.join(a.title() for a in attrs[:2])} ({i + 1} Pack)"
    description = (f"The {brand} {ptype} is {attrs[0]} and {attrs[-1]}. "
                   f"Made for everyday use by people who want a {ptype} that lasts.")
    bullets = [f"{a.upper()}: this {ptype} is {a}." for a in attrs] + [f"Sold by {brand}."]
    if rng.random() < 0.5:
        pricing = f"${rng.randint(3, 90)}.{rng.randint(0, 99):02d}"
    else:
        low = rng.randint(5, 60)
        pricing = f"${low}.99 - ${low + rng.randint(5, 40)}.99"
    kind = i % 3
    options = None
    if kind == 1:
        options = {"Color": [{"value": c.title(), "image": None} for c in rng.sample(COLORS, 3)]}
    elif kind == 2:
        options = {"Color": [{"value": c.title(), "image": None} for c in rng.sample(COLORS, 2)],
                   "Size": [{"value": s.title(), "image": None} for s in rng.sample(SIZES, 2)]}
    product = {
        "asin": asin, "category": category, "query": f"{ptype}s", "name": title,
        "product_category": f"{top} › {sub} › {ptype.title()}",
        "full_description": description, "small_description": bullets, "pricing": pricing,
        "images": [f"https://example.invalid/{asin}.jpg"], "customization_options": options,
        "average_rating": "", "page": 1,
    }
    entry: dict = {"attributes": attrs}
    if i % 5 < 3:
        wanted = attrs[:2]
        entry["instruction"] = f"i am looking for {ptype} that is {wanted[0]} and {wanted[1]}"
        entry["instruction_attributes"] = wanted
    return product, entry


def generate(out_dir: str = SAMPLE_DIR, num_products: int = 50, seed: int = 0) -> None:
    """Write items_shuffle_sample.json and items_ins_v2_sample.json into out_dir."""
    rng = random.Random(seed)
    products, attributes = [], {}
    for i in range(num_products):
        product, entry = _product(rng, i)
        products.append(product)
        attributes[product["asin"]] = entry
    os.makedirs(out_dir, exist_ok=True)
    for name, data in (("items_shuffle_sample.json", products), ("items_ins_v2_sample.json", attributes)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
            f.write("\n")


if __name__ == "__main__":
    generate()
