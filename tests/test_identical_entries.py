"""Identical entries stay retrievable: a bank where one advice was written a hundred times.

10,000 entries holding 2,000 copies of 20 texts: before, the copies cost the HNSW index queries for
*other* entries (60 of 64 found here; the recall suite lost 18 of 64 at 6,600 entries), because
hundreds of points at distance 0 fill each other's neighbour lists. Now the bank stores the copies
of a text with one vector and the index keys each distinct vector once.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from crl_gym.experience.bank import ExperienceBank, PendingAdd
from crl_gym.experience.embedders import HashingEmbedder, SentenceTransformerEmbedder

ENTRIES, COPIED_TEXTS, COPIES = 10_000, 20, 100
WORDS = ("key door lava east west north south box wall fountain potion scroll ladder stairs altar chest "
         "coin gem torch rope").split()
Corpus = tuple[list[str], np.ndarray, list[str], np.ndarray]


def advice(i: int) -> str:
    r = random.Random(i)
    return f"Task {i}: " + " ".join(r.choice(WORDS) for _ in range(8)) + f", then step {r.randint(1, 9)} times."


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """(texts of the 10,000 entries in insertion order, their vectors, the 64 queries, theirs)."""
    emb = HashingEmbedder(384)
    distinct = [advice(i) for i in range(ENTRIES - COPIED_TEXTS * COPIES)]
    copied = [advice(100_000 + j) for j in range(COPIED_TEXTS)]
    texts = distinct + [t for t in copied for _ in range(COPIES)]
    rng = random.Random(0)
    rng.shuffle(texts)
    queries = copied + rng.sample(distinct, 64 - COPIED_TEXTS)
    return texts, emb.encode(texts), queries, emb.encode(queries)


def last_bits_apart(texts: list[str], vectors: np.ndarray) -> np.ndarray:
    """The copies' vectors nudged by one ulp in a few components, a different nudge per copy: what
    an embedder gives one text in different batches (MiniLM: up to ~1e-7, see the test below)."""
    out = vectors.copy()
    seen: dict[str, int] = {}
    for row, t in enumerate(texts):
        k = seen[t] = seen.get(t, -1) + 1
        if k:
            cols = [(k * 7 + j) % out.shape[1] for j in range(3)]
            out[row, cols] = np.nextafter(out[row, cols], np.float32(2.0))
    return out


def fill(bank: ExperienceBank, texts: list[str], vectors: np.ndarray) -> None:
    for s in range(0, len(texts), 500):  # 20 batches, as the track's applies come
        bank.apply_batch([PendingAdd(t, v, 0) for t, v in zip(texts[s:s + 500], vectors[s:s + 500], strict=True)])


def found(bank: ExperienceBank, queries: list[str], qvecs: np.ndarray) -> int:
    hits = bank.search(qvecs, 1)
    return sum(bool(h) and bank.get(h[0][0]).text == q for q, h in zip(queries, hits, strict=True))  # type: ignore[union-attr]


@pytest.mark.parametrize("copies_as", ["equal", "last_bits_apart"])
def test_ten_thousand_entries_with_two_thousand_copies_find_all_64_queries(
        corpus: Corpus, copies_as: str, tmp_path: Path) -> None:
    texts, vectors, queries, qvecs = corpus
    if copies_as == "last_bits_apart":
        vectors = last_bits_apart(texts, vectors)
        assert len({vectors[i].tobytes() for i, t in enumerate(texts) if t == queries[0]}) == COPIES
    bank = ExperienceBank(tmp_path / "bank", dim=vectors.shape[1])
    fill(bank, texts, vectors)
    assert len(bank) == ENTRIES
    assert found(bank, queries, qvecs) == 64
    # every copy is found, not one of them: a search as wide as the copies returns all of them
    hits = bank.search(qvecs[:1], COPIES)[0]
    assert sorted(i for i, _ in hits) == sorted(e.id for e in bank if e.text == queries[0])
    assert len({bank.get(i).embedding.tobytes() for i, _ in hits}) == 1  # type: ignore[union-attr]
    # the same after a reopen: the saved index is the one for these rows, no rebuild
    bank.close()
    again = ExperienceBank(tmp_path / "bank", dim=vectors.shape[1])
    try:
        assert again.index_recoveries == [] and found(again, queries, qvecs) == 64
    finally:
        again.close()


def test_minilm_gives_one_text_other_bits_in_another_batch_and_the_bank_one_vector() -> None:
    """The premise of ``last_bits_apart``, with the real embedder, and the bank's answer to it."""
    emb = SentenceTransformerEmbedder()
    text = "Pick up the key before walking to the door."
    longer = "A much longer text that pads the batch to a longer length than the first one, so the shapes differ."
    alone, padded = emb.encode([text])[0], emb.encode([text, longer])[0]
    assert not np.array_equal(alone, padded) and float(alone @ padded) > 0.9999
    bank = ExperienceBank(None, dim=emb.dim)
    a = bank.add(text, alone)
    b = bank.add(text, padded)
    bank.add(longer, emb.encode([longer])[0])
    assert np.array_equal(bank.get(b).embedding, bank.get(a).embedding)  # type: ignore[union-attr]
    assert bank._index.keys == 2 and sorted(i for i, _ in bank.search(padded, 2)[0]) == [a, b]
