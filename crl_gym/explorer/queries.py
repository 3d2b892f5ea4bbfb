"""The explorer's SQL: one page of the bank view, one entry with its history, the bank
over training.

A page is ``ORDER BY <column> LIMIT n OFFSET k`` over the page's ids alone, then one lookup of
those rows: the sort walks an index (``crl_gym/experience/store.py`` keeps one per sortable
column) instead of the wide rows, which is what keeps a page of a 100,000-entry bank fast
(``bench/explorer.py``). Sort keys and directions come from fixed tables here, never from the
request's text; filter values are bound parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from crl_gym.experience.pinning import UNPINNED_TAG
from crl_gym.explorer.source import BankSource

SORTS: dict[str, str] = {
    "id": "e.id",
    "rbar": "c.rbar",
    "episodes": "c.episodes",
    "retrievals": "e.retrieval_count",
    "train_count": "e.train_count",
    "last_trained": "e.last_trained_step",
    "version": "e.version",
    "created_step": "e.created_step",
    "utility": "e.utility",
}
"""Sort key of the bank view → its column."""
PREVIEW_CHARS = 400
"""Characters of an entry's text the bank view shows (the entry page shows all of it)."""
MAX_PER_PAGE = 200
_NO_CREDIT = (
    "(SELECT 0 AS entry_id, 0.0 AS rbar, 0 AS episodes, 0 AS steps, 0 AS last_step, 0.0 AS "
    "reward_sum WHERE 0)"
)
_NO_EVENTS = (
    "(SELECT 0 AS seq, 0 AS entry_id, 0 AS step, '' AS kind, 0 AS version, 0.0 AS value, 0 AS n, "
    "'' AS detail WHERE 0)"
)
REMOVED = ("merged_away", "discard", "delete", "evict")


@dataclass(frozen=True)
class PageQuery:
    """One bank-view request: sort, direction, page, and the filters."""

    sort: str = "id"
    order: str = "asc"
    page: int = 1
    per_page: int = 50
    q: str = ""
    """Substring of the text (case-insensitive for ASCII, as SQLite's LIKE)."""
    min_retrievals: int = 0
    step_min: int | None = None
    step_max: int | None = None
    credited: bool = False
    """Only entries that guided a credited episode."""

    def __post_init__(self) -> None:
        if self.sort not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(SORTS)}, got {self.sort!r}")
        if self.order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {self.order!r}")
        if self.page < 1 or not 1 <= self.per_page <= MAX_PER_PAGE:
            raise ValueError(f"page must be >= 1 and per_page in [1, {MAX_PER_PAGE}]")


def _credit_table(src: BankSource) -> str:
    return "entry_credit" if src.has_table("entry_credit") else _NO_CREDIT


def _events_table(src: BankSource) -> str:
    return "entry_events" if src.has_table("entry_events") else _NO_EVENTS


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def entries_page(src: BankSource, pq: PageQuery) -> dict[str, Any]:
    """One page of the bank view: ``{total, page, pages, per_page, sort, order,
    entries, has_utility}``."""
    where: list[str] = []
    params: list[Any] = []
    if pq.q:
        where.append("e.text LIKE ? ESCAPE '\\'")
        params.append(_like(pq.q))
    if pq.min_retrievals > 0:
        where.append("e.retrieval_count >= ?")
        params.append(pq.min_retrievals)
    if pq.step_min is not None:
        where.append("e.created_step >= ?")
        params.append(pq.step_min)
    if pq.step_max is not None:
        where.append("e.created_step <= ?")
        params.append(pq.step_max)
    on_entries = bool(where)  # filters on the entries' own columns
    credit = _credit_table(src)
    if pq.credited:
        where.append(f"EXISTS (SELECT 1 FROM {credit} c WHERE c.entry_id = e.id)")
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    direction = "DESC" if pq.order == "desc" else "ASC"
    offset = (pq.page - 1) * pq.per_page
    if pq.sort in ("rbar", "episodes") and not on_entries:
        total, ids = _credit_order(src, pq, credit, direction, offset)
    else:
        join = (
            f" LEFT JOIN {credit} c ON c.entry_id = e.id" if pq.sort in ("rbar", "episodes") else ""
        )
        total = int(src.query(f"SELECT count(*) FROM entries e{clause}", params)[0][0])
        ids = [
            int(r[0])
            for r in src.query(
                f"SELECT e.id FROM entries e{join}{clause} ORDER BY {SORTS[pq.sort]} {direction}, "
                f"e.id {direction} LIMIT ? OFFSET ?",
                [*params, pq.per_page, offset],
            )
        ]
    rows = {}
    if ids:
        marks = ",".join("?" * len(ids))
        for r in src.query(
            f"SELECT e.id, substr(e.text, 1, {PREVIEW_CHARS}), length(e.text), e.version, "
            "e.created_step, e.retrieval_count, e.last_retrieved, e.train_count, "
            "e.last_trained_step, e.utility, e.tags, c.rbar, c.episodes, e.provenance IS NULL "
            f"FROM entries e LEFT JOIN {_credit_table(src)} c ON c.entry_id = e.id WHERE e.id "
            f"IN ({marks})",
            ids,
        ):
            rows[int(r[0])] = {
                "id": int(r[0]),
                "text": r[1],
                "text_length": int(r[2]),
                "version": int(r[3]),
                "created_step": int(r[4]),
                "retrievals": int(r[5]),
                "last_retrieved": float(r[6]),
                "train_count": int(r[7]),
                "last_trained": int(r[8]),
                "utility": float(r[9]),
                "tags": json.loads(r[10]),
                "rbar": None if r[11] is None else float(r[11]),
                "episodes": 0 if r[12] is None else int(r[12]),
                "pinned": _pinned(bool(r[13]), json.loads(r[10])),
            }
    has_utility = bool(src.query("SELECT 1 FROM entries WHERE utility != 0 LIMIT 1"))
    return {
        "total": total,
        "page": pq.page,
        "pages": max(1, -(-total // pq.per_page)),
        "per_page": pq.per_page,
        "sort": pq.sort,
        "order": pq.order,
        "entries": [rows[i] for i in ids if i in rows],
        "has_utility": has_utility,
    }


def _credit_order(
    src: BankSource, pq: PageQuery, credit: str, direction: str, offset: int
) -> tuple[int, list[int]]:
    """A page in r̄(m) / episodes order without a join: the credited entries walk ``entry_credit``'s
    index, the others (no value: first ascending, last descending, as SQLite orders NULLs) the id
    index; ``entry_credit`` holds only entries in the bank."""
    col = "rbar" if pq.sort == "rbar" else "episodes"
    credited = int(src.query(f"SELECT count(*) FROM {credit}")[0][0])
    others = 0 if pq.credited else int(src.query("SELECT count(*) FROM entries")[0][0]) - credited

    def part_credited(skip: int, take: int) -> list[int]:
        return (
            [
                int(r[0])
                for r in src.query(
                    f"SELECT entry_id FROM {credit} ORDER BY {col} {direction}, entry_id "
                    f"{direction} LIMIT ? OFFSET ?",
                    [take, skip],
                )
            ]
            if take > 0
            else []
        )

    def part_others(skip: int, take: int) -> list[int]:
        return (
            [
                int(r[0])
                for r in src.query(
                    f"SELECT e.id FROM entries e WHERE NOT EXISTS (SELECT 1 FROM {credit} c WHERE "
                    f"c.entry_id = e.id) ORDER BY e.id {direction} LIMIT ? OFFSET ?",
                    [take, skip],
                )
            ]
            if take > 0 and others > 0
            else []
        )

    parts = [(credited, part_credited), (others, part_others)]
    if direction == "ASC":
        parts.reverse()
    ids: list[int] = []
    skip, take = offset, pq.per_page
    for size, part in parts:
        if skip >= size:
            skip -= size
            continue
        got = part(skip, take)
        ids += got
        skip, take = 0, take - len(got)
    return credited + others, ids


def _pinned(users: bool, tags: list[str]) -> bool:
    """:func:`crl_gym.experience.pinning.is_pinned` of a stored row: a user's entry (no
    provenance), not unpinned by its tag."""
    return users and UNPINNED_TAG not in tags


def entry_detail(src: BankSource, entry_id: int) -> dict[str, Any] | None:
    """An entry with its history, credits and provenance (``None`` if the bank never logged it).

    A deleted entry (merged away, discarded, pruned) comes back with ``entry: None`` and its events,
    whose last one holds its final text."""
    columns = {r[1] for r in src.query("PRAGMA table_info(entries)")}
    keyed = (
        "source, key" if {"source", "key"} <= columns else "'', NULL"
    )  # a bank older than retrieval keys
    rows = src.query(
        "SELECT id, text, version, created_step, retrieval_count, last_retrieved, train_count, "
        f"last_trained_step, utility, tags, provenance, history, {keyed} FROM entries WHERE id = ?",
        [entry_id],
    )
    events = [
        {
            "seq": int(r[0]),
            "step": int(r[1]),
            "kind": r[2],
            "version": r[3],
            "value": r[4],
            "n": r[5],
            "detail": json.loads(r[6]) if r[6] else None,
        }
        for r in src.query(
            f"SELECT seq, step, kind, version, value, n, detail FROM {_events_table(src)} "
            f"WHERE entry_id = ? ORDER BY seq",
            [entry_id],
        )
    ]
    if not rows and not events:
        return None
    entry: dict[str, Any] | None = None
    provenance = None
    if rows:
        r = rows[0]
        history = list(json.loads(r[11]))
        entry = {
            "id": int(r[0]),
            "text": r[1],
            "version": int(r[2]),
            "created_step": int(r[3]),
            "retrievals": int(r[4]),
            "last_retrieved": float(r[5]),
            "train_count": int(r[6]),
            "last_trained": int(r[7]),
            "utility": float(r[8]),
            "tags": json.loads(r[9]),
            "history": history,
            "source": r[12] or "",
            "retrieved_by": r[1] if r[13] is None else r[13],
            "pinned": _pinned(not r[10], json.loads(r[9])),
        }
        if r[10]:
            p = json.loads(r[10])
            provenance = {
                "prompt": p.get("prompt", ""),
                "response": p.get("response", ""),
                "extractor_version": p.get("extractor_version"),
                "tokens": len(p.get("token_ids") or []),
            }
        texts = [*history, r[1]]  # the text at version v
        for ev in events:
            v = ev["version"]
            if (
                ev["kind"] in ("add", "update", "merge")
                and isinstance(v, int)
                and 0 <= v < len(texts)
            ):
                ev["text"] = texts[v]
        if not any(ev["kind"] == "add" for ev in events):  # written before the event log
            events.insert(
                0,
                {
                    "seq": 0,
                    "step": entry["created_step"],
                    "kind": "add",
                    "version": 0,
                    "value": None,
                    "n": None,
                    "detail": {"derived": "created_step"},
                    "text": texts[0],
                },
            )
    credits = [
        e for e in events if e["kind"] == "credit" and e["n"]
    ]  # the fold of entry_credit, deleted entries too
    episodes = sum(int(e["n"]) for e in credits)
    rbar = (
        {
            "rbar": sum(float(e["value"]) * int(e["n"]) for e in credits) / episodes,
            "episodes": episodes,
            "steps": len({e["step"] for e in credits}),
            "last_step": max(e["step"] for e in credits),
        }
        if episodes
        else None
    )
    origin = None
    if entry is not None and src.has_table(
        "entry_origin"
    ):  # who wrote it (crl_gym.experience.origin)
        found = src.query(
            "SELECT written_by, model_step, step, written_at, quarantined FROM entry_origin "
            "WHERE entry_id = ?",
            [entry_id],
        )
        if found:
            o = found[0]
            origin = {
                "written_by": o[0],
                "model_step": o[1],
                "step": int(o[2]),
                "written_at": float(o[3]),
                "quarantined": bool(o[4]),
            }
    return {
        "entry": entry,
        "origin": origin,
        "events": [e for e in events if e["kind"] != "credit"],
        "credits": [
            {"step": e["step"], "rbar": e["value"], "episodes": e["n"]}
            for e in events
            if e["kind"] == "credit"
        ],
        "rbar": rbar,
        "provenance": provenance,
    }


MAX_TIMELINE_SPAN = 100_000
"""Most steps the timeline fills in between its first and last logged step."""


def timeline(src: BankSource) -> dict[str, Any]:
    """The bank over training, one value per step from the first to the last logged:
    ``steps``, ``bank_size`` (at the end of the step), ``adds``, ``updates``, ``merges`` (entries a
    Merge produced), ``removed``, ``mean_rbar`` (mean r̄(m) of the entries credited that step; None
    when none was) and ``credited_episodes``."""
    counts: dict[int, dict[str, float]] = {}
    for step, kind, n, mean, episodes in src.query(
        f"SELECT step, kind, count(*), avg(value), sum(n) FROM {_events_table(src)} GROUP BY "
        "step, kind"
    ):
        row = counts.setdefault(int(step), {})
        row[kind] = float(n)
        if kind == "credit":
            row["mean_rbar"], row["credited_episodes"] = float(mean), float(episodes or 0)
    # entries written before the event log: their Add is known from created_step only
    unlogged = (
        "SELECT entry_id FROM entry_events WHERE kind = 'add'"
        if src.has_table("entry_events")
        else "SELECT 0 WHERE 0"
    )
    for step, n in src.query(
        f"SELECT created_step, count(*) FROM entries WHERE id NOT IN ({unlogged}) GROUP BY "
        "created_step"
    ):
        row = counts.setdefault(int(step), {})
        row["add"] = row.get("add", 0.0) + float(n)
    out: dict[str, list[Any]] = {
        k: []
        for k in (
            "steps",
            "bank_size",
            "adds",
            "updates",
            "merges",
            "removed",
            "mean_rbar",
            "credited_episodes",
        )
    }
    if counts:
        size = 0
        lo, hi = min(counts), max(counts)
        # every step in between, unless the span is absurd (a step of 10**18 written once): then the
        # logged ones
        for step in range(lo, hi + 1) if hi - lo <= MAX_TIMELINE_SPAN else sorted(counts):
            row = counts.get(step, {})
            adds, removed = int(row.get("add", 0)), int(sum(row.get(k, 0) for k in REMOVED))
            size += adds - removed
            out["steps"].append(step)
            out["bank_size"].append(size)
            out["adds"].append(adds)
            out["updates"].append(int(row.get("update", 0)))
            out["merges"].append(int(row.get("merge", 0)))
            out["removed"].append(removed)
            out["mean_rbar"].append(row.get("mean_rbar"))
            out["credited_episodes"].append(int(row.get("credited_episodes", 0)))
    return out
