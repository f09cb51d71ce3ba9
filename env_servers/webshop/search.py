"""BM25 product search, built once per catalog, as the original WebShop's Lucene index searched.

Documents: lower-cased `title + description + first bullet + "name: v1, v2, and name: ..."`. Scoring: BM25,
Lucene idf, k1 = 0.9, b = 0.4 (bm25s "lucene"). Analyzer (approximating Lucene's English one): word tokens
(kept together across "." and "'", as in "6.7" or "l'eau"), trailing "'s" removed, lower-cased, Lucene's
stop words dropped, Porter-stemmed. Only documents sharing a term with the query are returned; ties go by
catalog order. Not reproduced: Lucene's lossy one-byte document lengths, which can reorder near-ties.
"""
from __future__ import annotations

import re

import numpy as np

from env_servers.webshop.catalog import Product
from env_servers.webshop.porter import stem

SEARCH_RETURN_N = 50
K1, B = 0.9, 0.4
# Lucene's EnglishAnalyzer default stop set.
LUCENE_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there "
    "these they this to was will with".split())
_TOKEN = re.compile(r"\w+(?:[.'’]\w+)*")
_POSSESSIVE = re.compile(r"['’]s$")


def tokenize(text: str) -> list[str]:
    tokens = (_POSSESSIVE.sub("", t) for t in _TOKEN.findall(text.lower()))
    return [stem(t) for t in tokens if t and t not in LUCENE_STOP_WORDS]


def document_text(p: Product) -> str:
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in p.options.items())
    first_bullet = p.bullet_points[0] if p.bullet_points else ""
    return " ".join([p.title, p.description, first_bullet, option_text]).lower()


class SearchIndex:
    """BM25 over a product list; `search` returns product positions, best first."""

    def __init__(self, products: list[Product]):
        import bm25s

        corpus = [tokenize(document_text(p)) for p in products]
        self._bm25 = bm25s.BM25(k1=K1, b=B, method="lucene")
        self._bm25.index(corpus, show_progress=False)
        self._vocab = self._bm25.vocab_dict
        self.num_docs = len(products)

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[int]:
        tokens = [t for t in tokenize(query) if t in self._vocab]
        if not tokens or self.num_docs == 0:
            return []
        scores = np.asarray(self._bm25.get_scores(tokens), dtype=np.float64)
        matching = np.flatnonzero(scores > 0)
        if matching.size > k:
            # The k-th best score; keep everything at least that good, then sort exactly.
            kth = np.partition(scores[matching], matching.size - k)[matching.size - k]
            matching = matching[scores[matching] >= kth]
        order = np.lexsort((matching, -scores[matching]))
        return [int(i) for i in matching[order][:k]]
