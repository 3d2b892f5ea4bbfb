"""Bank-view benchmark of the explorer (issue 26): one page of a 100,000-entry bank in ≤ 200 ms.

Builds (once, cached in ``--dir``) a persistent bank of ``--entries`` entries shaped like a real
run's: MiniLM-sized vectors (384 floats), a provenance sample per entry (a 2,000-character prompt,
its answer, 120 token ids and log-probs), 5,000 of them updated, 60 % credited, retrieval
counts spread over 0-49. Then it asks the explorer's ``/ui/api/entries`` route for pages in process
(Starlette's test client: the server's whole handling, no network) with each sort key, first,
middle and last page, and with the filters, and reports per case the median and p95 of
``--repeats`` requests.

The target covers every bank-view page (any sort, any page, the numeric filters); a text
substring filter reads every row's text and is reported beside it (``text_filter``).

    python bench/explorer.py --json           # last line: one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from crl_gym.experience.bank import DB_FILE, ExperienceBank, PendingAdd, PendingUpdate
from crl_gym.experience.bank_counters import RETRIEVAL_SQL
from crl_gym.experience.store import SQLiteStore, open_readonly
from crl_gym.explorer import BankSource, explorer_app
from crl_gym.protocol import ExtractorSample

TARGET_MS = 200.0
DIM = 384
WORDS = ("open", "the", "door", "key", "north", "south", "lava", "avoid", "pick", "up", "stairs", "walk",
         "east", "west", "monster", "river", "cross", "boulder", "push", "wand")


def build(d: Path, n: int, seed: int = 0) -> None:
    """The bank in ``d`` with ``n`` entries, built once: Adds through the bank (vectors, index, event
    log), then the counters through its store (the same SQL the bank runs), so no later phase reopens
    the bank and pays for its vector index, which the bank view never reads. Each phase runs once,
    so an interrupted build resumes where it stopped."""
    rng = np.random.default_rng(seed)
    if not _entries_done(d, n):
        _add_entries(d, n, rng)
    _counters(d, rng)


def _entries_done(d: Path, n: int) -> bool:
    if not (d / DB_FILE).is_file():
        return False
    conn = open_readonly(d / DB_FILE)
    try:
        count = conn.execute("SELECT count(*) FROM entries").fetchone()[0]
        updated = conn.execute("SELECT 1 FROM entry_events WHERE kind = 'update' LIMIT 1").fetchone()
        return bool(count >= n and updated)
    finally:
        conn.close()


def _add_entries(d: Path, n: int, rng: np.random.Generator) -> None:
    bank = ExperienceBank(d, dim=DIM, embedder_name="bench-random-384")
    try:
        todo = n - len(bank)
        while todo > 0:
            m = min(5000, todo)
            vecs = rng.standard_normal((m, DIM)).astype(np.float32)
            vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
            adds = []
            for v in vecs:
                text = " ".join(rng.choice(WORDS, size=int(rng.integers(10, 60))))
                sample = ExtractorSample(prompt="p" * 2000, response=text, logprobs=[-0.5] * 120,
                                         token_ids=list(range(120)), prompt_token_ids=[], extractor_version=1)
                adds.append(PendingAdd(text, v, int(rng.integers(0, 200)), ("crl/MiniHack-Room-5x5-v0",), sample))
            bank.apply_batch(adds)
            todo -= m
        if not bank.read_sql("SELECT 1 FROM entry_events WHERE kind = 'update' LIMIT 1"):
            upd = rng.choice(bank.ids(), size=min(5000, n // 3), replace=False)
            bank.apply_batch(updates=[PendingUpdate(int(i), e.text + " again", e.embedding)  # type: ignore[arg-type]
                                      for i in upd if (e := bank.get(int(i))) is not None], step=150)
    finally:
        bank.close()


def _counters(d: Path, rng: np.random.Generator) -> None:
    store = SQLiteStore(d / DB_FILE, create=False)
    try:
        ids = [int(r[0]) for r in store.conn.execute("SELECT id FROM entries ORDER BY id")]
        if store.conn.execute("SELECT 1 FROM entry_credit LIMIT 1").fetchone() is None:
            credited = rng.choice(ids, size=int(len(ids) * 0.6), replace=False)
            for step, chunk in enumerate(np.array_split(credited, 100)):
                store.record_credits(step, [(int(i), float(rng.choice([-1.0, 1.0])), int(rng.integers(1, 9))) for i in chunk])
        if store.conn.execute("SELECT 1 FROM entries WHERE retrieval_count > 0 LIMIT 1").fetchone() is None:
            store.update_stats(RETRIEVAL_SQL, [(int(rng.integers(0, 50)), 1.0, i) for i in ids])
    finally:
        store.close()


CASES: dict[str, str] = {
    "default": "",
    "middle_page": "page=1000",
    "last_page": "page=2000",
    "sort_rbar": "sort=rbar&order=desc",
    "sort_rbar_middle": "sort=rbar&order=desc&page=1000",
    "sort_episodes": "sort=episodes&order=desc",
    "sort_retrievals": "sort=retrievals&order=desc",
    "sort_retrievals_middle": "sort=retrievals&order=desc&page=1000",
    "sort_train_count": "sort=train_count&order=desc",
    "sort_version": "sort=version&order=desc",
    "sort_created_step": "sort=created_step&order=asc&page=500",
    "filter_retrievals": "min_retrievals=40&sort=rbar&order=desc",
    "filter_steps": "step_min=50&step_max=60",
    "filter_credited": "credited=true&sort=retrievals&order=desc",
}
TEXT_CASES: dict[str, str] = {"text_filter": "q=lava%20avoid", "text_filter_sorted": "q=monster%20river&sort=rbar&order=desc"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/crl-explorer-bench"))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--per-page", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from fastapi.testclient import TestClient

    d = args.dir / f"bank-{args.entries}"
    t0 = time.perf_counter()
    build(d, args.entries)
    build_s = time.perf_counter() - t0
    source = BankSource.open(d, search=False)
    out: dict[str, Any] = {"entries": 0, "per_page": args.per_page, "repeats": args.repeats, "target_ms": TARGET_MS,
                           "build_or_reuse_s": round(build_s, 1), "pages": {}, "text_filter": {}}
    try:
        with TestClient(explorer_app(source)) as client:
            out["entries"] = client.get("/ui/api/summary").json()["entries"]
            for group, cases in (("pages", CASES), ("text_filter", TEXT_CASES)):
                for name, qs in cases.items():
                    url = f"/ui/api/entries?per_page={args.per_page}&{qs}"
                    client.get(url).raise_for_status()  # warm: SQLite's page cache
                    times = []
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        r = client.get(url)
                        times.append((time.perf_counter() - t) * 1000)
                        r.raise_for_status()
                    times.sort()
                    out[group][name] = {"median_ms": round(statistics.median(times), 1),
                                        "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))], 1),
                                        "rows": len(r.json()["entries"]), "total": r.json()["total"]}
    finally:
        source.close()
    worst = max(v["p95_ms"] for v in out["pages"].values())
    out["worst_page_p95_ms"] = worst
    out["meets_targets"] = bool(worst <= TARGET_MS and out["entries"] >= args.entries)
    if args.json:
        for name, v in {**out["pages"], **out["text_filter"]}.items():
            print(f"{name:24s} median {v['median_ms']:7.1f} ms  p95 {v['p95_ms']:7.1f} ms", file=sys.stderr)
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
