"""A small BM25 index over the catalog, standing in for WebShop's pyserini (Lucene) index.

Documents are a product's title, description, bullet points and option values, as WebShop
indexes them; scoring is Okapi BM25 with Lucene's defaults in pyserini (``k1=0.9, b=0.4``).
Ties break by catalog order, so a query always returns the same list.

>>> idx = BM25Index(["red apple", "green apple pie", "blue car"])
>>> idx.search("apple", k=5)
[0, 1]
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crl_gym.envs.webshop.catalog import Product

_TOKEN = re.compile(r"[0-9a-z]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def product_document(p: Product) -> str:
    options = " ".join(v for values in p.get("options", {}).values() for v in values)
    return " ".join(
        [p.get("Title", ""), p.get("Description", ""), " ".join(p.get("BulletPoints", [])), options]
    )


class BM25Index:
    """Okapi BM25 over a list of documents; ``search`` returns document indices, best first."""

    def __init__(self, documents: list[str], k1: float = 0.9, b: float = 0.4) -> None:
        self.k1, self.b = k1, b
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.lengths: list[int] = []
        for i, doc in enumerate(documents):
            counts = Counter(tokenize(doc))
            self.lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings[term].append((i, tf))
        self.n = len(documents)
        self.avgdl = (sum(self.lengths) / self.n) if self.n else 0.0

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1 + (self.n - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        for term in set(tokenize(query)):
            idf = self.idf(term)
            for doc, tf in self.postings.get(term, ()):
                norm = self.k1 * (1 - self.b + self.b * self.lengths[doc] / self.avgdl)
                out[doc] += idf * tf * (self.k1 + 1) / (tf + norm)
        return out

    def search(self, query: str, k: int = 50) -> list[int]:
        scored = self.scores(query)
        return sorted(scored, key=lambda d: (-scored[d], d))[:k]
