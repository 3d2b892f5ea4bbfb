"""A Recall bank where half of the entries are wrong: per task, one entry naming its secret and one
naming another action, worded alike, so similarity alone cannot tell them apart.

The input of the utility-ranking suite (``experiments/utility_ranking.yaml``): a frozen bank
(``method: offline_exp``) that the ``reader`` actor follows, so guided success measures only which
entry retrieval picks. Without the utility term the better-ranked of a task's two entries is shown
every time; with it, r̄(m) of what was shown decides.

    python scripts/recall_seeded_bank.py --num-tasks 32 --out runs/utility_bank.jsonl

Writes a bank JSONL export (``ExperienceBank.import_jsonl`` reads it) embedded with the tiny
preset's embedder (``hashing``, dim 256) unless ``--embed-dim`` says otherwise. The last line of
output is JSON: the file, the number of entries, and per task which entry is right.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from crl_gym.envs.recall import ACTION_WORDS, task_name, task_secret
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder


def seeded_entries(num_tasks: int, num_actions: int, secret_seed: int = 0) -> list[tuple[int, str, bool]]:
    """``(task, text, right)`` per entry: for each task its secret, then the next action word (length 1).

    >>> seeded_entries(2, 2)[:2]
    [(0, 'amber badger: play east.', True), (0, 'amber badger: play north.', False)]
    """
    out: list[tuple[int, str, bool]] = []
    words = ACTION_WORDS[:num_actions]
    for task in range(num_tasks):
        secret = task_secret(task, 1, num_actions, secret_seed)[0]
        wrong = words[(words.index(secret) + 1) % num_actions]
        name = task_name(task)
        out += [(task, f"{name}: play {secret}.", True), (task, f"{name}: play {wrong}.", False)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tasks", type=int, default=32)
    parser.add_argument("--num-actions", type=int, default=2)
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    emb = HashingEmbedder(args.embed_dim)
    bank = ExperienceBank(None, dim=args.embed_dim)
    entries = seeded_entries(args.num_tasks, args.num_actions)
    vectors = emb.encode([text for _, text, _ in entries])
    for (_, text, _), vec in zip(entries, vectors, strict=True):
        bank.add(text, vec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    n = bank.export_jsonl(args.out)
    bank.close()
    print(json.dumps({"file": str(args.out), "entries": n, "right": [text for _, text, ok in entries if ok]}))


if __name__ == "__main__":
    main()
