"""The purchase reward of WebShop, as the GiGPO reference (verl-agent's copy of WebShop) computes it.

    total = (n_attribute_matches + n_option_matches + [price <= price_upper])
            / (len(goal.attributes) + len(goal.goal_options) + 1) * r_type

- attribute g matches if some product attribute has fuzzy token-set ratio > 85 with g, or g occurs in the
  lower-cased title, bullet points or description;
- option g matches if some chosen option value has token-set ratio > 85 with g (both color-normalized).
  For synthetic goals the reference passes `goal_options.items()`, so g is a (name, value) pair: it is
  color-normalized only when the value is exactly a base color, else compared as the text "name value".
  Kept: e.g. a chosen "large" matches the goal ("size", "x-large") ({large} is a token subset of it).
- r_type = 1.0; 0.5 unless (same query, or >= 2 shared category levels, or title noun overlap > 0.2);
  0.1 if the overlap < 0.1; 0.0 if it is 0.

Fuzzy scores reproduce `thefuzz.fuzz.token_set_ratio` on rapidfuzz (see `token_set_score`). Title nouns:
the reference keeps spaCy en_core_web_sm's NOUN/PROPN tokens; that model is not on PyPI, so it is used
when installed, else `approximate_nouns`. As in the reference, the shared-noun count is divided by the
goal title's noun count *with repeats* (a title repeating a noun scores below 1.0 even against itself).
"""
from __future__ import annotations

import functools
import importlib.util
import re
import threading
from dataclasses import dataclass

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from env_servers.webshop.catalog import Product
from env_servers.webshop.goals import Goal

COLOR_SET = [
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream",
    "crystal", "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape",
    "graphite", "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender",
    "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint",
    "mocha", "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach",
    "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire",
    "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe",
    "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
]
MATCH_THRESHOLD = 85
_DROP_LATIN1 = {i: None for i in range(128, 256)}


def token_set_score(a, b) -> int:
    """thefuzz's token_set_ratio (full_process, force_ascii) on top of rapidfuzz: str() of both, characters
    128-255 dropped, rapidfuzz's default processing, rounded to an int."""
    pa = default_process(str(a).translate(_DROP_LATIN1))
    pb = default_process(str(b).translate(_DROP_LATIN1))
    return int(round(fuzz.token_set_ratio(pa, pb)))


def normalize_color(value):
    """The first base color that occurs in `value` (substring for strings, membership for tuples),
    else `value` unchanged."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


# ---------------------------------------------------------------------------------------------- nouns
# English function words (articles, pronouns, prepositions, conjunctions, auxiliaries, quantifiers and
# common adverbs): the words a POS tagger would never call NOUN/PROPN in a product title.
FUNCTION_WORDS = frozenset("""
a about above across after again against all almost alone along already also although always am among an
and another any anyone anything anyway anywhere are around as at be became because become becomes been
before behind being below beside besides between beyond both but by can cannot could did do does doing
done down due during each either else enough even ever every everyone everything except few for from
further had has have having he her here hers herself him himself his how however i if in inside into is
it its itself just least less many may me might mine more most mostly much must my myself neither never
nevertheless no nobody none nor not nothing now of off often on once one only onto or other others
otherwise our ours ourselves out over own per perhaps please quite rather really same several she should
since so some somehow someone something sometimes somewhere still such than that the their theirs them
themselves then there thereby therefore these they this those though through throughout thus to together
too toward towards under until up upon us very via was we well were what whatever when whenever where
whereas wherever whether which while who whoever whole whom whose why will with within without would yet
you your yours yourself yourselves
""".split())
_SPLIT = re.compile(r"[^\w'’]+|_")
_POSSESSIVE_END = re.compile(r"['’]s$")

_nlp_lock = threading.Lock()
_tag_lock = threading.Lock()     # an env pool steps instances from worker threads
_nlp = None                      # spaCy pipeline with a tagger, when en_core_web_sm is installed


def noun_method() -> str:
    """"spacy-model" when en_core_web_sm is installed (the reference's tagger), else "approximate"."""
    global _nlp
    with _nlp_lock:
        if _nlp is None:
            if importlib.util.find_spec("en_core_web_sm") is None:
                _nlp = "approximate"
            else:
                import spacy      # imports torch via thinc (~230 MB): only when the model is there

                _nlp = spacy.load("en_core_web_sm", disable=["parser", "ner", "lemmatizer"])
        return "approximate" if _nlp == "approximate" else "spacy-model"


def approximate_nouns(title: str) -> list[str]:
    """Approximation of en_core_web_sm's NOUN/PROPN tokens of a title, without a tagger (and without
    importing spaCy): split at whitespace and punctuation other than apostrophes, drop a possessive
    "'s", keep purely alphabetic pieces longer than one letter that are not English function words.
    Numbers, sizes glued to digits ("16x20", "B07X"), articles, prepositions, pronouns and conjunctions
    drop out; adjectives and verbs, which the tagger would drop, stay (product titles are mostly
    capitalized noun phrases tagged PROPN/NOUN, so the difference is small)."""
    nouns = []
    for piece in _SPLIT.split(title):
        piece = _POSSESSIVE_END.sub("", piece).strip("'’")
        if len(piece) > 1 and piece.isalpha() and piece.lower() not in FUNCTION_WORDS:
            nouns.append(piece.lower())
    return nouns


@functools.lru_cache(maxsize=200_000)
def title_nouns(title: str) -> tuple[str, ...]:
    """Lower-cased nouns of a product title, in order, repeats kept (cached: titles repeat)."""
    if noun_method() == "spacy-model":
        with _tag_lock:
            doc = _nlp(title)
        return tuple(t.text.lower() for t in doc if t.pos_ in ("PNOUN", "NOUN", "PROPN"))
    return tuple(approximate_nouns(title))


# ---------------------------------------------------------------------------------------------- terms
@dataclass
class TypeReward:
    r_type: float
    query_match: bool
    category_match: bool
    title_score: float


def type_reward(product: Product, goal: Goal) -> TypeReward:
    query_match = product.query == goal.query
    bought_levels = {x.strip() for x in product.product_category.split("›")}
    goal_levels = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(bought_levels & goal_levels) >= 2
    bought_nouns = title_nouns(product.title)
    wanted_nouns = title_nouns(goal.name)
    title_score = len(set(bought_nouns) & set(wanted_nouns)) / len(wanted_nouns) if wanted_nouns else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return TypeReward(r_type, query_match, category_match, title_score)


def attribute_matches(product: Product, goal: Goal) -> int:
    title = product.title.lower()
    bullets = " ".join(product.bullet_points).lower()
    description = product.description.lower()
    return sum(1 for wanted in goal.attributes
               if any(token_set_score(have, wanted) > MATCH_THRESHOLD for have in product.attributes)
               or wanted in title or wanted in bullets or wanted in description)


def option_matches(chosen_values: list[str], goal_options) -> int:
    """`goal_options`: the goal's {name: value} (compared as (name, value) pairs, see module doc) or a
    list of values (human goals)."""
    wanted = list(goal_options.items()) if isinstance(goal_options, dict) else list(goal_options)
    chosen = [normalize_color(v) for v in chosen_values]
    return sum(1 for g in map(normalize_color, wanted) if any(token_set_score(c, g) > MATCH_THRESHOLD for c in chosen))


def purchase_reward(product: Product, goal: Goal, price: float, chosen_options: dict[str, str]) -> tuple[float, dict]:
    """(reward in [0, 1], its parts)."""
    t = type_reward(product, goal)
    price_ok = price <= goal.price_upper
    n_attr = attribute_matches(product, goal)
    n_opt = option_matches(list(chosen_options.values()), goal.goal_options)
    denominator = len(goal.attributes) + len(goal.goal_options) + 1
    total = (n_attr + n_opt + int(price_ok)) / denominator * t.r_type
    info = {"r_type": t.r_type, "query_match": t.query_match, "category_match": t.category_match,
            "title_score": t.title_score, "attribute_matches": n_attr, "option_matches": n_opt,
            "price_ok": price_ok, "num_attributes": len(goal.attributes),
            "num_options": len(goal.goal_options), "noun_method": noun_method()}
    return total, info
