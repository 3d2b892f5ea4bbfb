"""The run's client-side spill: requests an ``ExperienceWrapper`` could not submit, delivered at the
next start.

The wrappers of a run append a request their client refused (an outage) to
``<run dir>/unsent_requests.jsonl`` (:data:`UNSENT_FILE`), so the bank directory holds one spill
file only, the distillation queue's ``pending_requests.jsonl``. Runs made before that kept the
wrapper's file in ``<run dir>/bank/``; :func:`deliver_unsent` reads both places.

When a run starts again in its directory, :func:`deliver_unsent` hands what those files hold to the
distillation queue and removes them: their episodes are distilled, never credited (like the queue's
own pending requests after a resume: their steps were credited, or are re-run, without them). The
queue is persisted before a file is removed, so a kill in between delivers a request twice (at
least once), never zero times. Lines that do not parse go to ``unsent_requests.rejected.jsonl``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from crl_gym import spill
from crl_gym.protocol import DistillationRequest
from crl_train.service import ExperienceService

log = logging.getLogger(__name__)

UNSENT_FILE = "unsent_requests.jsonl"
"""The wrappers' spill file, in the run directory."""

_CHUNK = 1024  # requests read at a time: a long outage's file is not held in memory at once


def unsent_path(run_dir: Path) -> Path:
    """Where the wrappers of the run in ``run_dir`` spill."""
    return run_dir / UNSENT_FILE


def unsent_paths(run_dir: Path, bank_dir: Path) -> tuple[Path, ...]:
    """Every place a run's wrappers may have spilled to: the run dir, and the bank dir of
    older runs."""
    return (unsent_path(run_dir), bank_dir / UNSENT_FILE)


def deliver_unsent(service: ExperienceService, paths: tuple[Path, ...]) -> int:
    """Queue every request of the files in ``paths`` for distillation, persist the queue, remove
    the files; returns how many were queued. A file that cannot be read or delivered is kept
    (logged) for the next start."""
    total = 0
    for path in paths:
        if not path.is_file():
            continue
        try:
            n, bad = _queue_all(service, path)
            service.flush()  # in pending_requests.jsonl before the file goes: a kill now loses none
            spill.set_aside(path, bad)
            path.unlink()
        except OSError as exc:
            log.error(
                "%s: cannot deliver the requests it holds (%s); kept for the next start", path, exc
            )
            continue
        total += n
        log.info(
            "%s: %d unsent request(s) queued for distillation (not credited)%s",
            path,
            n,
            f"; {len(bad)} unreadable line(s) moved to {spill.rejected_path(path)}" if bad else "",
        )
    return total


def _queue_all(service: ExperienceService, path: Path) -> tuple[int, list[bytes]]:
    spill.terminate_partial_line(path)
    pos, n, bad = 0, 0, []
    while True:
        got, end, rejected = spill.read(path, pos, _CHUNK, DistillationRequest.from_json)
        bad += [line for _, line, _ in rejected]
        for request, _ in got:
            service.manager.submit(request)  # the queue, not the step ledger: never credited
        n += len(got)
        if end == pos:
            return n, bad
        pos = end
