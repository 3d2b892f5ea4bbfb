"""Periodic Merge: the extractor compacts the bank chunk by chunk, with a sliding window.

The bank is walked in chunks that fit ``token_budget``. Each window shows the items carried over
from the previous window (the merged output, paper §3.2.1) followed by the next bank entries; the
generator answers which entries to merge or discard as JSON (format in
:data:`prompts.MERGE_TEMPLATE`, schema :func:`crl_gym.experience.schemas.merge_schema`: each prompt
is a :class:`MergePrompt`, a ``str`` that also carries its window's labels, so a structured
generator can restrict the answer to them). Its
results are carried into the next window as far as ``carry_fraction`` of the budget allows; the
rest is final. Only at the end is the result swapped into the bank, in one ``apply_batch`` under
the writer lock. If the generator raises or answers garbage for any window, nothing is applied
and :class:`MergeReport` says why.

Provenance and counters (a documented choice): a merged group becomes an *update* of its anchor,
the source entry retrieved most often (ties: more training, then the smaller id); the other
sources are deleted. The anchor keeps its id (so in-flight episodes that reference it can still
be credited), its provenance and its training counters: those count CISPO updates of that very
provenance sample, so they stay exact. Its retrieval count is thereby the max over the sources.
Sources changed by a concurrent write since the walk started are left alone (counted under
``conflicts``). Deleted texts are listed in the report, so nothing is lost silently.

>>> import numpy as np
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> emb = HashingEmbedder(32); bank = ExperienceBank(None, dim=32)
>>> ids = [bank.add(t, emb.encode([t])[0]) for t in ("go east", "walk east", "eat")]
>>> answer = '{"E1": "merge", "E2": "merge", "E3": "keep", "merged": "Head east."}'
>>> gen = lambda ps: [answer for _ in ps]
>>> report = merge_bank(bank, emb, gen, order="id")
>>> report.ok, sorted(e.text for e in bank)
(True, ['Head east.', 'eat'])
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from crl_gym.experience.bank import ExperienceBank, PendingUpdate
from crl_gym.experience.embedders import Embedder
from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.keys import stored_key
from crl_gym.experience.ops import (
    DEFAULT_MAX_LEN,
    MAX_INPUT_CHARS,
    clean_text,
    find_json,
    strip_think,
)
from crl_gym.experience.prompts import MergeItem, build_merge_prompt, render_merge_item
from crl_gym.experience.schemas import MERGE_ACTIONS
from crl_gym.protocol import ExtractorSample

logger = logging.getLogger(__name__)
Generate = Callable[[list[str]], Sequence[Any]]


def approx_tokens(text: str) -> int:
    """Default token counter: about four characters per token (English prose, BPE).

    >>> approx_tokens(""), approx_tokens("abcd"), approx_tokens("abcde")
    (0, 1, 2)
    """
    return -(-len(text) // 4)


class MergeOutputError(ValueError):
    """A merge answer that cannot be applied; the message says what is wrong."""


class MergePrompt(str):
    """A merge window's prompt that also carries the window's labels, in window order (what the
    answer's schema allows). It is a ``str``: a generator that only reads text takes it as one.

    >>> p = MergePrompt("[E1] a [E2] b", ("E1", "E2"))
    >>> p.labels, p.startswith("[E1]")
    (('E1', 'E2'), True)
    """

    labels: tuple[str, ...]

    def __new__(cls, text: str, labels: Sequence[str]) -> MergePrompt:
        obj = super().__new__(cls, text)
        obj.labels = tuple(labels)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (MergePrompt, (str(self), self.labels))


@dataclass
class MergeDecision:
    """Parsed answer for one window: labels kept, merged groups (labels, text), labels dropped."""

    keep: list[str] = field(default_factory=list)
    merge: list[tuple[list[str], str]] = field(default_factory=list)
    discard: list[str] = field(default_factory=list)


def _labels(value: object, where: str) -> list[str]:
    if not isinstance(value, list):
        raise MergeOutputError(f"{where} must be a list of labels, got {type(value).__name__}")
    out = []
    for v in value:
        if not isinstance(v, str) or not v.strip():
            raise MergeOutputError(f"{where}: {v!r} is not a label like 'E3'")
        out.append(v.strip().strip("[]").strip().upper())
    return out


def _is_label_form(v: object, known: set[str]) -> bool:
    """The schema's form: ``{"E1": "keep", "E2": "merge", …, "merged": "text"}``."""
    return (
        isinstance(v, dict)
        and "merged" in v
        and all(k == "merged" or k.upper() in known for k in v)
    )


def _label_form(obj: dict[str, Any], labels: Sequence[str], max_len: int) -> MergeDecision:
    """The schema's form as a decision (``_is_label_form`` checked that every key is a
    known label)."""
    decision = MergeDecision()
    marked: list[str] = []
    for key, action in obj.items():
        if key == "merged":
            continue
        label = key.upper()
        if not isinstance(action, str) or action.strip().lower() not in MERGE_ACTIONS:
            raise MergeOutputError(f"{key}: {action!r} is not one of {', '.join(MERGE_ACTIONS)}")
        if label in marked or label in decision.discard or label in decision.keep:
            raise MergeOutputError(f"label {label!r} used more than once")
        verdict = action.strip().lower()
        (
            decision.keep
            if verdict == "keep"
            else marked
            if verdict == "merge"
            else decision.discard
        ).append(label)
    if marked:
        body = obj.get("merged")
        text = clean_text(body).strip() if isinstance(body, str) else ""
        if not text:
            raise MergeOutputError("entries are marked merge but the merged text is empty")
        if len(text) > max_len:
            raise MergeOutputError(f"merged text has {len(text)} chars > {max_len}")
        decision.merge.append((marked, text))
    return decision


def parse_merge_decision(
    text: object, labels: Sequence[str], *, max_len: int = DEFAULT_MAX_LEN
) -> MergeDecision:
    """Read a merge answer; raise :class:`MergeOutputError` for anything not applicable.

    Two forms: the schema's (:func:`~crl_gym.experience.schemas.merge_schema`: each label ``keep``,
    ``merge`` or ``discard``, and the ``merged`` text that replaces every ``merge`` one), and the
    lists form of unconstrained models (``{"keep": [...], "merge": [{"from": [...], "text"}],
    "discard": [...]}``). Every label must be known and used at most once; labels not mentioned
    are kept.

    >>> answer = '</think>{"E1": "keep", "E2": "discard", "merged": "x"}'
    >>> parse_merge_decision(answer, ["E1", "E2"]).discard
    ['E2']
    >>> parse_merge_decision('{"keep": ["E1"], "discard": ["e2"]}', ["E1", "E2"]).discard
    ['E2']
    """
    if not isinstance(text, str):
        raise MergeOutputError(f"the answer is a {type(text).__name__}, not text")
    answer, ok = strip_think(text[-MAX_INPUT_CHARS:])
    if not ok:
        raise MergeOutputError("the answer stopped inside <think> (no decision)")
    known = set(labels)
    try:
        whole = json.loads(answer)
    except (ValueError, RecursionError):
        whole = None
    if _is_label_form(whole, known):
        return _label_form(whole, labels, max_len)

    def accept(v: object) -> bool:
        return _is_label_form(v, known) or (
            isinstance(v, dict) and any(k in v for k in ("keep", "merge", "discard"))
        )

    obj = find_json(answer, accept)
    if obj is None:
        raise MergeOutputError("no JSON object with keep / merge / discard found")
    if _is_label_form(obj, known):
        return _label_form(obj, labels, max_len)
    seen: set[str] = set()

    def claim(label: str, where: str) -> str:
        if label not in known:
            raise MergeOutputError(f"{where}: unknown label {label!r}")
        if label in seen:
            raise MergeOutputError(f"{where}: label {label!r} used more than once")
        seen.add(label)
        return label

    decision = MergeDecision()
    decision.keep = [claim(x, "keep") for x in _labels(obj.get("keep", []), "keep")]
    decision.discard = [claim(x, "discard") for x in _labels(obj.get("discard", []), "discard")]
    groups = obj.get("merge", [])
    if not isinstance(groups, list):
        raise MergeOutputError('merge must be a list of {"from": [...], "text": ...} objects')
    for n, g in enumerate(groups):
        if not isinstance(g, dict):
            raise MergeOutputError(f"merge[{n}] is not an object")
        src = next((g[k] for k in ("from", "ids", "sources", "entries") if k in g), None)
        members = [claim(x, f"merge[{n}]") for x in _labels(src, f"merge[{n}].from")]
        body = g.get("text", g.get("content"))
        if not members:
            raise MergeOutputError(f"merge[{n}].from is empty")
        body = clean_text(body).strip() if isinstance(body, str) else ""
        if not body:
            raise MergeOutputError(f"merge[{n}].text is empty")
        if len(body) > max_len:
            raise MergeOutputError(f"merge[{n}].text has {len(body)} chars > {max_len}")
        decision.merge.append((members, body))
    return decision


@dataclass
class _Item:
    """A window item: its prompt view plus the bank entries it stands for."""

    view: MergeItem
    sources: tuple[int, ...]
    original: bool  # True: an untouched bank entry (text as stored)


@dataclass
class MergeReport:
    """What one ``merge_bank`` call did (or why it did nothing)."""

    ok: bool = False
    error: str | None = None
    """Why nothing was applied (generator error, garbage answer, failed swap)."""
    step: int = 0
    entries_before: int = 0
    entries_after: int = 0
    windows: int = 0
    """Generator calls made."""
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    samples: list[ExtractorSample] = field(default_factory=list)
    """Generator outputs that were :class:`ExtractorSample` (with log-probs), for crediting."""
    updated: dict[int, list[int]] = field(default_factory=dict)
    """Anchor id -> all source ids of its merged group (the anchor included)."""
    deleted: dict[int, str] = field(default_factory=dict)
    """Deleted id -> its last text (merged away or discarded)."""
    conflicts: int = 0
    """Groups or discards skipped because a source changed during the merge."""
    oversize: int = 0
    """Entries too long to fit any window (kept unchanged)."""
    protected: int = 0
    """Entries left out of the merge by its ``protect`` rule (kept unchanged)."""


def is_seeded(entry: ExperienceEntry) -> bool:
    """Whether ``entry`` was written without an extractor sample (``provenance is None``): added by
    a user or a config (``apply_ops`` / ``AddOp`` from a client, ``bank.add``), never rewritten by
    the extractor since. A service merges such entries only when told to (``merge_seeded``)."""
    return entry.provenance is None


def _similarity_order(bank: ExperienceBank, entries: list[ExperienceEntry], k: int) -> list[int]:
    """Ids ordered so that neighbours in embedding space are adjacent (chunks stay on topic).

    Greedy: take the oldest unvisited entry, then its unvisited nearest neighbours. The
    neighbour lists come from one batched index search, not an n x n similarity matrix.
    """
    seeds = sorted(
        (e for e in entries if e.embedding is not None), key=lambda e: (e.created_step, e.id)
    )
    known = {e.id for e in entries}
    hits = bank.search(np.stack([e.embedding for e in seeds]), k) if seeds else []  # type: ignore[misc]
    order: list[int] = []
    visited: set[int] = set()
    for e, neighbours in zip(seeds, hits, strict=True):
        if e.id in visited:
            continue
        for hit_id, _ in [(e.id, 1.0), *neighbours]:
            if hit_id in known and hit_id not in visited:
                visited.add(hit_id)
                order.append(hit_id)
    order += [e.id for e in entries if e.id not in visited]
    return order


def merge_bank(
    bank: ExperienceBank,
    embedder: Embedder,
    generate: Generate,
    *,
    token_budget: int = 6000,
    count_tokens: Callable[[str], int] = approx_tokens,
    step: int = 0,
    carry_fraction: float = 0.5,
    order: Literal["similar", "id"] = "similar",
    max_len: int = DEFAULT_MAX_LEN,
    protect: Callable[[ExperienceEntry], bool] | None = None,
    retrieve_by: str = "text",
) -> MergeReport:
    """Merge the bank with ``generate`` (the extractor); all or nothing.

    Args:
        bank: the bank to compact (others may read and write it meanwhile).
        embedder: embeds merged texts (same model as the bank's other entries).
        generate: ``generate([prompt]) -> [answer]``; an answer may be a str or an
            :class:`ExtractorSample` (its ``response`` is read and it is kept for crediting).
        token_budget: max tokens of one window's prompt, instructions included.
        count_tokens: the extractor's token counter (default: ~4 chars per token).
        step: trainer step, recorded in the report.
        carry_fraction: share of the window budget that carried-over results may take.
        order: ``similar`` walks neighbours together; ``id`` walks in id order.
        max_len: longest accepted merged text, in characters.
        protect: entries for which it returns True are left out of the walk: never shown to the
            generator, never merged, rewritten or discarded (e.g. :func:`is_seeded`: the entries a
            user wrote). Counted in ``MergeReport.protected``.
        retrieve_by: the bank's retrieval key rule (``ManagerConfig.retrieve_by``): a merged entry
            is keyed by the task its sources share, or by its text when they come from
            several tasks.
    """
    if not 0.0 <= carry_fraction < 1.0:
        raise ValueError(f"carry_fraction must be in [0, 1), got {carry_fraction}")
    report = MergeReport(step=step)
    everything = list(bank)  # one consistent read
    snapshot = {e.id: e for e in everything if protect is None or not protect(e)}
    report.entries_before = len(everything)
    report.protected = len(everything) - len(snapshot)
    overhead = count_tokens(build_merge_prompt([]))
    if token_budget <= overhead:
        raise ValueError(
            f"token_budget={token_budget} leaves no room: the instructions alone "
            f"take {overhead} tokens"
        )
    ids = (
        _similarity_order(bank, list(snapshot.values()), k=32)
        if order == "similar"
        else sorted(snapshot)
    )
    counter = {"E": 0, "M": 0}

    def label(prefix: str) -> str:
        counter[prefix] += 1
        return f"{prefix}{counter[prefix]}"

    def cost(item: _Item) -> int:
        return count_tokens(render_merge_item(item.view) + "\n")

    pending: deque[_Item] = deque()
    for i in ids:
        e = snapshot[i]
        pending.append(_Item(MergeItem(label("E"), e.text, e.tags, e.retrieval_count), (i,), True))
    final: list[_Item] = []
    carried: list[_Item] = []
    try:
        while pending:
            window_new: list[_Item] = []
            used = overhead + sum(cost(c) for c in carried)
            while pending and used + cost(pending[0]) <= token_budget:
                used += cost(pending[0])
                window_new.append(pending.popleft())
            if not window_new:
                if carried:  # make room: what was carried is final
                    final += carried
                    carried = []
                else:  # a single entry larger than the budget: keep it, unshown
                    final.append(pending.popleft())
                    report.oversize += 1
                continue
            window = carried + window_new
            if len(window) < 2:  # nothing to compare against
                carried = window
                continue
            results = _run_window(window, generate, report, label, max_len)
            # Carry merge results first, then the newest kept items, within the carry budget.
            carry_budget = int(carry_fraction * (token_budget - overhead))
            carried, spent = [], 0
            for item in results:
                if spent + cost(item) <= carry_budget:
                    carried.append(item)
                    spent += cost(item)
                else:
                    final.append(item)
        final += carried
        _swap(bank, embedder, snapshot, final, report, retrieve_by)
    except Exception as err:  # noqa: BLE001 - a failed merge must never take the trainer down
        report.ok = False
        report.updated, report.deleted = {}, {}
        report.error = f"{type(err).__name__}: {err}"
        report.entries_after = len(bank)
        logger.warning("merge at step %d applied nothing: %s", step, report.error)
        return report
    report.ok = True
    report.entries_after = len(bank)
    logger.info(
        "merge at step %d: %d -> %d entries in %d windows",
        step,
        report.entries_before,
        report.entries_after,
        report.windows,
    )
    return report


def _run_window(
    window: list[_Item],
    generate: Generate,
    report: MergeReport,
    label: Callable[[str], str],
    max_len: int,
) -> list[_Item]:
    """One generator call; returns the window's surviving items (merged first)."""
    prompt = MergePrompt(
        build_merge_prompt([w.view for w in window]), [w.view.label for w in window]
    )
    report.prompts.append(prompt)
    report.windows += 1
    try:
        outs = list(generate([prompt]))
    except Exception as err:
        raise RuntimeError(
            f"window {report.windows}: generator raised {type(err).__name__}: {err}"
        ) from err
    if len(outs) != 1:
        raise MergeOutputError(
            f"window {report.windows}: generator returned {len(outs)} answers for 1 prompt"
        )
    out = outs[0]
    if isinstance(out, ExtractorSample):
        report.samples.append(out)
        out = out.response
    report.responses.append(out if isinstance(out, str) else repr(out))
    by_label = {w.view.label: w for w in window}
    try:
        decision = parse_merge_decision(out, list(by_label), max_len=max_len)
    except MergeOutputError as err:
        raise MergeOutputError(f"window {report.windows}: {err}") from err
    gone = set(decision.discard)
    merged: list[_Item] = []
    for members, text in decision.merge:
        gone.update(members)
        parts = [by_label[m] for m in members]
        if len(parts) == 1 and parts[0].view.text.strip() == text:
            gone.discard(members[0])  # a "rewrite" to the same text is a keep
            continue
        sources = tuple(sorted({s for p in parts for s in p.sources}))
        tags = tuple(dict.fromkeys(t for p in parts for t in p.view.tags))
        uses = max(p.view.uses for p in parts)
        merged.append(_Item(MergeItem(label("M"), text, tags, uses), sources, False))
    # Newest first among kept: the window's new chunk sits last, nearest to what comes next.
    kept = [w for w in reversed(window) if w.view.label not in gone]
    return merged + kept


def _anchor(entries: list[ExperienceEntry]) -> ExperienceEntry:
    return max(entries, key=lambda e: (e.retrieval_count, e.train_count, -e.id))


def _common_source(entries: list[ExperienceEntry]) -> str:
    """The task every one of ``entries`` was distilled from, or "" when they differ."""
    sources = {e.source for e in entries}
    return sources.pop() if len(sources) == 1 else ""


def _swap(
    bank: ExperienceBank,
    embedder: Embedder,
    snapshot: dict[int, ExperienceEntry],
    final: list[_Item],
    report: MergeReport,
    retrieve_by: str = "text",
) -> None:
    """Turn the final items into one atomic batch of updates and deletes."""
    survivors = {s for it in final for s in it.sources}
    discarded = [i for i in snapshot if i not in survivors]
    groups = [it for it in final if not it.original]
    keys = [
        stored_key(g.view.text, _common_source([snapshot[s] for s in g.sources]), retrieve_by)
        for g in groups
    ]
    vectors = np.zeros((0, bank.dim), np.float32)
    if groups:
        embedded = [g.view.text if k is None else k for g, k in zip(groups, keys, strict=True)]
        vectors = np.asarray(embedder.encode(embedded), dtype=np.float32)
        if vectors.shape != (len(groups), bank.dim):
            raise ValueError(
                f"embedder returned shape {vectors.shape}, expected ({len(groups)}, {bank.dim})"
            )
    with bank.lock.write():  # re-entrant: apply_batch below takes it again
        current = dict(zip(snapshot, bank.get_many(list(snapshot)), strict=True))

        def unchanged(i: int) -> bool:
            now = current[i]
            return now is not None and now.version == snapshot[i].version

        updates: list[PendingUpdate] = []
        deletes: list[int] = []
        for g, vec, key in zip(groups, vectors, keys, strict=True):
            if not all(unchanged(s) for s in g.sources):
                report.conflicts += 1
                continue
            anchor = _anchor([snapshot[s] for s in g.sources])
            updates.append(PendingUpdate(anchor.id, g.view.text, vec, key=key))
            deletes += [s for s in g.sources if s != anchor.id]
            report.updated[anchor.id] = list(g.sources)
        for i in discarded:
            if unchanged(i):
                deletes.append(i)
            else:
                report.conflicts += 1
        for i in deletes:
            report.deleted[i] = snapshot[i].text
        if updates or deletes:
            bank.apply_batch(
                updates=updates, deletes=deletes, step=report.step, merged=report.updated
            )
