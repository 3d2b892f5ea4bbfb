"""Configuration of the ExperienceManager (paper defaults where the paper gives one).

>>> ManagerConfig().batch_size, ManagerConfig().max_wait_ms, ManagerConfig().num_workers
(16, 1.0, 4)
>>> ManagerConfig(batch_size=0)
Traceback (most recent call last):
...
ValueError: ManagerConfig.batch_size must be >= 1, got 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from crl_gym.experience.keys import RETRIEVE_BY, RetrieveBy


@dataclass(frozen=True)
class ManagerConfig:
    """Sizes and knobs of :class:`~crl_gym.experience.manager.ExperienceManager`."""

    batch_size: int = 16
    """B: a search batch is dispatched as soon as it holds this many queries (paper: 16)."""
    max_wait_ms: float = 1.0
    """t_max: ... or when its first query has waited this long, in milliseconds (paper: 1 ms)."""
    num_workers: int = 4
    """W: search workers that batches are spread over round-robin (paper: 4)."""
    adaptive_batching: bool = True
    """Take every query already waiting (up to ``max_batch_size``) instead of exactly B. Under
    load this turns many small batches into one, which is what keeps latency flat at 1,024
    concurrent searchers; at low load it behaves exactly like the paper's B / t_max rule."""
    max_batch_size: int = 1024
    """Upper bound of one adaptive batch."""
    cache_size: int = 4096
    """Entries of the LRU query-embedding cache (group RL repeats each task text K times)."""
    pool_cache: bool = True
    """Reuse the over-fetched candidate pool of a query text until the bank changes (keyed by the
    bank's write generation, so it is never stale)."""
    diversity_lambda: float = 0.1
    """λ in s(m) = s_rank(m) − λ·log(1 + c(m)) − 1[recent(m)] (not reported by the paper)."""
    recency_window_s: float = 30.0
    """An entry retrieved less than this many seconds ago counts as recent (penalty 1)."""
    overfetch: int = 8
    """N: the candidate pool holds N×k entries for a request of k (re-ranked by s(m))."""
    queue_size: int = 4096
    """In-memory distillation requests; beyond it requests spill to ``pending_requests.jsonl``."""
    stats_flush_interval_s: float = 1.0
    """Retrieval counters are persisted to SQLite at most this often (they are updated in memory
    immediately, so diversification always sees them)."""
    dedup_similarity: float | None = None
    """Refuse (and count) a new entry whose cosine similarity to an entry already in the bank, or to
    an earlier one of the same batch, is at least this; None = off (EDGE switches it on)."""
    name_task: bool = False
    """Start each entry written from a distillation request with its episode's task (``<task>`` and
    a newline before the text, unless the text already starts with it); not in the paper, whose
    extractor names the task itself. Retrieval embeds the entry's text (v_m = f_ψ(m)), so an entry
    that does not name its task is found for any task, and its credit (the outcome of the episode it
    guided) says little about the episode it was distilled from: a small extractor's entries do not
    name their task (docs/results/small_recall_extractor). The prefix is part of the entry: the
    actor reads it, the bank embeds it."""

    retrieve_by: RetrieveBy = "text"
    """What an entry is found by (:mod:`crl_gym.experience.keys`): ``text`` (its text, v_m = f_ψ(m):
    the paper), ``task`` (the task of the episode it was distilled from) or ``task_text`` (both).
    The key is stored with the entry; an entry without a task (a user's) is found by its text.
    Chosen by measurement: docs/results/retrieval_quality."""

    max_query_chars: int = 2000
    """Queries are cut to this many characters before they are embedded (longer ones are not
    refused: the head of a task text carries the retrieval signal)."""
    persist_interval_s: float = 0.5
    """Queued distillation requests are checkpointed to the spill file this often, when the queue
    changed (a hard kill loses at most this window); 0 = only at ``persist_pending`` / close."""
    top1_dropout: float = 0.0
    """Top-1 dropout (the authors' ``diversity_dropout_p``; 0 = off, as in the paper): with this
    probability the best candidate, when it was retrieved within the recency window, goes to the
    end of the ranking."""
    utility_weight: float = 0.0
    """β of the utility term u(m) = β·(r̄(m) + κ·sqrt(ln(1+N)/(1+n(m)))) added to s(m) (0 = off,
    as in the paper): ranks by the entries' credited r̄(m), with a UCB-style bonus for rarely
    credited ones (:func:`crl_gym.experience.diversify.utility_term`)."""
    utility_exploration: float = 1.0
    """κ of the utility term: the weight of the bonus of entries credited in few episodes."""
    bank_capacity: int | None = None
    """Most entries the bank holds (None = unbounded, as in the paper; the authors' MiniHack run:
    20,000): a write that would exceed it evicts, in the same transaction, by ``bank_eviction``."""
    bank_eviction: Literal["fifo", "least_useful"] = "fifo"
    """Which entries a full bank gives up: ``fifo`` (oldest first, the authors' rule) or
    ``least_useful`` (lowest credited r̄(m) first, never-credited entries counting as 0)."""
    pin_user_entries: bool = True
    """A user's entries (written without an extractor sample: API, CLI, ``seed_entries``) are
    pinned: the extractor's Update and Delete ops and the Merge never rewrite or delete them, only
    cite them (:mod:`crl_gym.experience.pinning`; the tag ``crl:unpinned`` unpins one). False: the
    extractor may rewrite them like its own (the paper compacts a run's seed entries too)."""

    def __post_init__(self) -> None:
        if self.dedup_similarity is not None and not -1.0 <= self.dedup_similarity <= 1.0:
            raise ValueError(
                "ManagerConfig.dedup_similarity must be in [-1, 1] or null, got "
                f"{self.dedup_similarity!r}"
            )
        for name in (
            "batch_size",
            "num_workers",
            "max_batch_size",
            "cache_size",
            "overfetch",
            "queue_size",
            "max_query_chars",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ManagerConfig.{name} must be >= 1, got {value!r}")
        for name in (
            "max_wait_ms",
            "diversity_lambda",
            "recency_window_s",
            "stats_flush_interval_s",
            "persist_interval_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"ManagerConfig.{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.top1_dropout, (int, float)) or not 0.0 <= self.top1_dropout <= 1.0:
            raise ValueError(
                f"ManagerConfig.top1_dropout must be in [0, 1], got {self.top1_dropout!r}"
            )
        for name in ("utility_weight", "utility_exploration"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ValueError(f"ManagerConfig.{name} must be a finite number, got {value!r}")
        if self.bank_capacity is not None and (
            isinstance(self.bank_capacity, bool)
            or not isinstance(self.bank_capacity, int)
            or self.bank_capacity < 1
        ):
            raise ValueError(
                "ManagerConfig.bank_capacity must be an integer >= 1 or null, got "
                f"{self.bank_capacity!r}"
            )
        if self.retrieve_by not in RETRIEVE_BY:
            raise ValueError(
                f"ManagerConfig.retrieve_by must be one of {RETRIEVE_BY}, got {self.retrieve_by!r}"
            )
        if self.bank_eviction not in ("fifo", "least_useful"):
            raise ValueError(
                "ManagerConfig.bank_eviction must be 'fifo' or 'least_useful', got "
                f"{self.bank_eviction!r}"
            )
        if self.max_batch_size < self.batch_size:
            raise ValueError(
                f"ManagerConfig.max_batch_size ({self.max_batch_size}) must be >= "
                f"batch_size ({self.batch_size})"
            )
