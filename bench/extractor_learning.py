"""Does CISPO teach the configured extractor to write entries the reader plays correctly? A learning curve.

The production path outside the suites, on ``crl/Recall-v0`` with the action slot on: each block,
finished episodes of a seeded random agent, stratified so that every (secret, outcome) pair has the
same number (:func:`stratified_episodes`), are submitted to a real :class:`~crl_train.service.ExperienceService` in
synchronous mode, which distils them with the configured extractor (``Extractor.distill`` under the
answer schema). Each entry that lands in the bank then guides one reader episode: the reader plays the
first action the entry names (``named_actions``), and the episode succeeds iff that is the task's
secret. Those guided episodes are credited by the service's own rule (``step_credits``: r̄(m) = ±1),
their samples go into the service's B_φ, and a CISPO update (``Extractor.train``) runs whenever B_φ
holds ``--buffer-size`` samples. A Return adds nothing and is never credited, as in the service
(``--set algo.return_reward=V``: each Return-only answer enters B_φ with reward V, the service's option).

Two arms per seed on the same episodes: ``trained`` (CISPO on) and ``frozen`` (CISPO off). Per block:
``right_per_request`` = entries the reader plays correctly per request (what a guided actor can
gain: an extractor that learns to stay silent after losses raises its precision, not this),
``precision`` = right entries / entries, ``add_rate`` = entries / request, ``entry_share`` = precision
averaged over the secrets (the tasks' secrets are balanced: ``secret_seed`` is the first seed from
``--secret-seed`` that gives each action word the same number of tasks); the updates run and tied
(every reward in the batch equal: no gradient), and seconds: wall (distillation, training) and
`cpu_s`, the process's CPU time (one torch thread: one core's time, whatever else loads the machine).
Each metric also as the paired trained − frozen difference over seeds (t, 95 %).

Goal (``meets_goal``), fixed before a run: at ``--goal-block`` (default: the last block; the
defaults give 2,016 requests per arm), the paired trained − frozen difference in right entries per
request excludes 0 from above. Compare settings (the paper's rule against the options) with the
same seeds, blocks and goal block, each in its own ``--out``.

Each seed runs both arms block by block (one process; ``--jobs`` seeds at once), appends each block
to ``<--out>/runs/seed<S>_<arm>.jsonl`` as it finishes, and then checkpoints both arms (each service's
extractor with its optimizer, B_φ, counters and bank, and the process's generators) into
``<--out>/runs/seed<S>/checkpoint/`` (the run's checkpoint writer: the previous one stays beside it
until the next is whole). A rerun with the same ``--out`` and settings keeps the finished seeds and
resumes the others after their last checkpointed block, drawing what the uninterrupted run would have
drawn; a larger ``--blocks`` extends finished seeds the same way. ``--report-only`` summarises
whatever blocks are there.

    python bench/extractor_learning.py --json                                  # the defaults below
    python bench/extractor_learning.py --json --seeds 0 1 2 --blocks 10 --requests-per-block 48 --lr 3e-4
    python bench/extractor_learning.py --json --set extractor.lora_rank=4     # any config override

The last line of output is the JSON report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import shutil
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from crl_gym.envs.recall import ACTION_WORDS, task_name, task_secret  # noqa: E402
from crl_gym.experience.service import ClosedStep  # noqa: E402
from crl_gym.protocol import DistillationRequest, ExperienceRef, Trajectory  # noqa: E402
from crl_train.config import TrainConfig, load_config  # noqa: E402
from crl_train.policy import rng_state  # noqa: E402
from crl_train.policy.reader import named_actions  # noqa: E402
from crl_train.run.checkpoints import resolve_checkpoint  # noqa: E402
from crl_train.run.stats import mean_t, paired_difference  # noqa: E402
from crl_train.service.build import service_options, start_service  # noqa: E402
from crl_train.service.checkpoint import STATE, begin_checkpoint, commit_checkpoint  # noqa: E402
from crl_train.service.credit import step_credits  # noqa: E402

GOAL_METRIC = "right_per_request"
ARMS = ("trained", "frozen")
SHOWN = 6
"""Entries kept per block in the report (the first ones written)."""


def _entry_probe() -> Any:
    spec = importlib.util.spec_from_file_location("entry_probe", ROOT / "scripts" / "entry_probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stratified_episodes(cfg: TrainConfig, n: int, seed: int) -> list[DistillationRequest]:
    """``n`` finished Recall episodes of a seeded uniform-random agent, the same number for every
    (secret, outcome) pair: each block holds every secret, won and lost alike, so a shift of the
    extractor toward one action word cannot pass for reading the episode. Episodes are drawn with
    ``entry_probe``'s player (seeds ``seed·1000 + i``) and kept while their cell has room."""
    kwargs = cfg.env.kwargs
    num_actions, secret_seed = int(kwargs.get("num_actions", 2)), int(kwargs.get("secret_seed", 0))
    cells = 2 * num_actions
    if n % cells:
        raise ValueError(f"a stratified block of {n} requests needs a multiple of {cells} (secrets x outcomes)")
    player = _entry_probe().play_episodes
    want = n // cells
    buckets: dict[tuple[str, bool], list[DistillationRequest]] = {}
    for i in range(1000 * n):
        for req in player(cfg, 2, seed * 1000 + i):  # one won and one lost episode
            index = next(t for t in range(int(kwargs.get("num_tasks", 16))) if task_name(t) in req.task)
            key = (task_secret(index, 1, num_actions, secret_seed)[0], req.success)
            if len(buckets.setdefault(key, [])) < want:
                buckets[key].append(req)
        if len(buckets) == cells and all(len(b) == want for b in buckets.values()):
            return [r for key in sorted(buckets) for r in buckets[key]]
    raise RuntimeError(f"stratified_episodes: no {want} episodes for every (secret, outcome) after {1000 * n} draws")


def balanced_secret_seed(num_tasks: int, num_actions: int, start: int = 0) -> int:
    """The first ``secret_seed`` ≥ ``start`` whose L = 1 secrets give every action word the same number
    of tasks (``num_tasks`` a multiple of ``num_actions``)."""
    if num_tasks % num_actions:
        raise ValueError(f"balanced secrets need num_tasks ({num_tasks}) to be a multiple of num_actions ({num_actions})")
    for seed in range(start, start + 10_000):
        counts = [0] * num_actions
        for i in range(num_tasks):
            counts[ACTION_WORDS.index(task_secret(i, 1, num_actions, seed)[0])] += 1
        if len(set(counts)) == 1:
            return seed
    raise RuntimeError("no balanced secret_seed found")


@dataclass(frozen=True)
class Setting:
    config: str | None
    overrides: tuple[str, ...]
    blocks: int
    requests_per_block: int
    out: Path
    samples_per_request: int = 1

    def cfg(self, seed: int) -> TrainConfig:
        return load_config(self.config, [*self.overrides, f"seed={seed}"])

    def identity(self) -> dict[str, Any]:
        """What a resumed seed must share with the run it goes on (all but the number of blocks)."""
        return {"config": self.config, "overrides": list(self.overrides),
                "requests_per_block": self.requests_per_block, "samples_per_request": self.samples_per_request}


def reader_plays(entry: str, prompt: str, cfg: TrainConfig) -> tuple[str | None, str]:
    """The action the reader plays from ``entry`` on the task that ``prompt`` (the distillation prompt
    the entry was written from) names: the first admissible action the entry names (None: it names
    none, and the reader would flip a coin); and that task's secret."""
    kwargs = cfg.env.kwargs
    num_actions, secret_seed = int(kwargs.get("num_actions", 2)), int(kwargs.get("secret_seed", 0))
    index = next(i for i in range(int(kwargs.get("num_tasks", 16))) if task_name(i) in prompt)
    named = named_actions(entry, ACTION_WORDS[:num_actions])
    return (named[0] if named else None), task_secret(index, 1, num_actions, secret_seed)[0]


EPISODE_ACTION = re.compile(r"^\s*action: (\S+)\s*$", re.MULTILINE)
EPISODE_OUTCOME = re.compile(r"^## Outcome\n(SUCCESS|FAILURE)", re.MULTILINE)


def episode_of(prompt: str) -> tuple[str | None, bool | None]:
    """The last action the distilled episode played and whether it won, read from the distillation
    prompt an entry was written from (None where the prompt does not say).

    >>> episode_of("## Outcome\\nFAILURE: episode return +0 after 1 actions.\\n\\n    action: north")
    ('north', False)
    """
    actions = EPISODE_ACTION.findall(prompt)
    outcome = EPISODE_OUTCOME.search(prompt)
    return (actions[-1] if actions else None), (outcome.group(1) == "SUCCESS" if outcome else None)


class Arm:
    """One arm of one seed: the configured extractor behind a real service (CISPO on or off), its
    bank in ``bank_dir``; with ``checkpoint`` (a directory :meth:`save` wrote, and the state it
    returned) the arm goes on from there."""

    def __init__(self, cfg: TrainConfig, train: bool, bank_dir: Path, samples_per_request: int = 1,
                 checkpoint: tuple[Path, dict[str, Any]] | None = None) -> None:
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.samples_per_request = samples_per_request
        # the config's own service options (B_φ, return_reward, ...), run synchronously without Merge
        options = service_options(cfg, distill=True, train=train, refine=False, asynchronous=False, merge_every=0,
                                  seed_bank=False)
        if checkpoint is None and bank_dir.exists():
            shutil.rmtree(bank_dir)  # a seed started over
        self.service = start_service(cfg, options, bank_dir, in_worker=False,
                                     extractor_checkpoint=None if checkpoint is None else checkpoint[0] / "extractor",
                                     state=None if checkpoint is None else checkpoint[1])
        if checkpoint is not None:
            self.service.restore(checkpoint[0] / "bank")
        self.tied = count_tied_batches(self.service.extractor)

    def save(self, target: Path) -> dict[str, Any]:
        """The extractor (weights and optimizer) and the bank into ``target``; returns the service's
        state (B_φ, counters) for the checkpoint's ``state.json``."""
        return self.service.save(target)

    def block(self, block: int, requests: list[DistillationRequest]) -> dict[str, Any]:
        """Distil ``requests``; credit each new entry with the reader's episode on it; CISPO when B_φ is full."""
        service, track = self.service, self.service.track
        assert track is not None
        step = 2 * block
        updates0, tied0, returns0 = track.stats.updates, self.tied[0], track.stats.credited_returns
        before = set(service.manager.bank.ids())
        t0, c0 = time.perf_counter(), time.process_time()
        for r in requests:
            for _ in range(self.samples_per_request):  # each copy is distilled by its own sample
                service.submit(dataclasses.replace(r, rollout_step=step, request_id=uuid.uuid4().hex))
        service.end_step(step)  # distils the block (nothing to credit: its episodes were free)
        t1 = time.perf_counter()
        rows, guided = [], []
        for e in (e for e in service.manager.bank if e.id not in before):
            prompt = e.provenance.prompt if e.provenance is not None else ""
            played, secret = reader_plays(e.text, prompt, self.cfg)
            episode_action, episode_won = episode_of(prompt)
            rows.append({"secret": secret, "played": played, "correct": played == secret, "text": e.text,
                         "episode_action": episode_action, "episode_won": episode_won})
            guided.append(DistillationRequest(task=prompt, trajectory=Trajectory(), outcome=float(played == secret),
                                              success=played == secret, experience=ExperienceRef(e.id, e.text),
                                              condition="guided", env_id="crl/Recall-v0", seed=e.id,
                                              rollout_step=step + 1))
        # the reader's guided episodes, credited by the service's rule into its B_φ (CISPO when full)
        track.credit(step_credits(ClosedStep(step + 1, guided)))
        track.run_until_idle()
        t2 = time.perf_counter()
        row = block_row(block, len(requests) * self.samples_per_request, rows, t1 - t0, t2 - t1,
                        track.stats.updates - updates0, self.tied[0] - tied0, dict(track.stats.last_update))
        row["cpu_s"] = round(time.process_time() - c0, 1)  # one torch thread: this process's CPU is one core's time
        row["track_errors"] = track.stats.errors  # the extractor track's failures so far (a failed update trains nothing)
        row["credited_returns"] = track.stats.credited_returns - returns0  # only with algo.return_reward set
        return row

    def close(self) -> None:
        self.service.close()


def run_seed(setting: Setting, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Both arms of one seed, block by block on the same episodes; each block appended to
    ``runs/seed<S>_<arm>.jsonl`` as it finishes, then both arms checkpointed into ``runs/seed<S>/``.
    A seed with a checkpoint goes on after its block (later rows, of a block that was not
    checkpointed, are dropped); one without starts over."""
    runs = setting.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    paths = {arm: runs / f"seed{seed}_{arm}.jsonl" for arm in ARMS}
    seed_dir = runs / f"seed{seed}"
    ckpt = resolve_checkpoint(seed_dir) if seed_dir.is_dir() else None
    state = json.loads((ckpt / STATE).read_text(encoding="utf-8")) if ckpt is not None else None
    out: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    if state is not None and state.get("setting") != setting.identity():
        raise RuntimeError(f"{seed_dir} holds a run of another setting ({state.get('setting')}): rerun with its "
                           f"settings, or use another --out")
    first = 0 if state is None else int(state["step"]) + 1
    for arm, path in paths.items():
        kept = [line for line in path.read_text().splitlines() if line][:first] if path.exists() else []
        if len(kept) < first:
            raise RuntimeError(f"{path} has {len(kept)} blocks but its checkpoint is of block {first - 1}")
        out[arm] = [json.loads(line) for line in kept]
        path.write_text("".join(line + "\n" for line in kept))
    cfg = setting.cfg(seed)
    torch.set_num_threads(cfg.experience.extractor_threads)
    arms = {arm: Arm(cfg, train=arm == "trained", bank_dir=seed_dir / f"bank_{arm}",
                     samples_per_request=setting.samples_per_request,
                     checkpoint=None if ckpt is None or state is None else (ckpt / arm, state["arms"][arm]))
            for arm in ARMS}
    if state is not None:
        rng_state.restore(state["rng"])
        print(f"seed {seed}: resumed after block {first - 1}", file=sys.stderr, flush=True)
    try:
        for block in range(first, setting.blocks):
            requests = stratified_episodes(cfg, setting.requests_per_block, seed * 100_003 + block)
            for arm in ARMS:
                row = arms[arm].block(block, requests)
                out[arm].append(row)
                with paths[arm].open("a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"seed {seed} {arm} block {block}: right per request {row['right_per_request']} adds {row['entries']}/"
                      f"{row['requests']} updates {row['updates']} ({row['distill_s']:.0f} + {row['train_s']:.0f} s)",
                      file=sys.stderr, flush=True)
            tmp = begin_checkpoint(seed_dir)
            saved = {arm: arms[arm].save(tmp / arm) for arm in ARMS}
            # the checkpoint writer's "step" is the probe's block
            commit_checkpoint(seed_dir, tmp, {"step": block, "setting": setting.identity(), "arms": saved,
                                                "rng": rng_state.capture()})
    finally:
        for a in arms.values():
            a.close()
    (runs / f"seed{seed}.done").write_text("")
    return out


def count_tied_batches(extractor: Any) -> list[int]:
    """A counter of CISPO batches whose rewards are all equal (Â = 0 for every sample: no gradient),
    kept by wrapping the extractor's ``train`` (the weightless oracle has none)."""
    tied = [0]
    train = getattr(extractor, "train", None)
    if train is None:
        return tied

    def counting(items: Any, counts: Any, lasts: Any, step: int) -> dict[str, float]:
        if len({it.reward for it in items}) <= 1:
            tied[0] += 1
        result: dict[str, float] = train(items, counts, lasts, step)
        return result

    extractor.train = counting
    return tied


def block_row(block: int, requests: int, rows: list[dict[str, Any]], distill_s: float, train_s: float,
              updates: int, tied: int, last_update: dict[str, float]) -> dict[str, Any]:
    by_secret: dict[str, list[int]] = {}
    for r in rows:
        by_secret.setdefault(r["secret"], [0, 0])
        by_secret[r["secret"]][0] += 1
        by_secret[r["secret"]][1] += int(r["correct"])
    shares = [c / n for n, c in by_secret.values() if n]
    played: dict[str, int] = {}
    for r in rows:
        played[str(r["played"])] = played.get(str(r["played"]), 0) + 1
    return {
        "block": block, "requests": requests, "entries": len(rows), "correct": sum(r["correct"] for r in rows),
        "entry_share": round(sum(shares) / len(shares), 4) if shares else None,
        # right entries per request: what a guided actor gains; precision alone rises when the extractor goes silent
        "right_per_request": round(sum(r["correct"] for r in rows) / requests, 4),
        "precision": round(sum(r["correct"] for r in rows) / len(rows), 4) if rows else None,
        "add_rate": round(len(rows) / requests, 4),
        "by_secret": {k: {"entries": n, "correct": c} for k, (n, c) in sorted(by_secret.items())},
        "played": dict(sorted(played.items())),
        "updates": updates, "tied_updates": tied, "last_update": {k: round(v, 5) for k, v in last_update.items()},
        "distill_s": round(distill_s, 1), "train_s": round(train_s, 1),
        "shown": [r["text"] for r in rows[:SHOWN]],
        # each entry: [its task's secret, the action the reader plays from it, the distilled episode's action, won]
        "episodes": [[r["secret"], r["played"], r["episode_action"], r["episode_won"]] for r in rows],
    }


def load_runs(setting: Setting, seed: int, finished_only: bool) -> dict[str, list[dict[str, Any]]] | None:
    """A seed's blocks as its files hold them (``finished_only``: only a seed whose run ended)."""
    runs = setting.out / "runs"
    if finished_only and not (runs / f"seed{seed}.done").exists():
        return None
    out = {}
    for arm in ARMS:
        path = runs / f"seed{seed}_{arm}.jsonl"
        if not path.exists():
            return None
        out[arm] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def block_seconds(row: dict[str, Any]) -> float:
    """One core's seconds for a block: its CPU time where recorded, else its wall time."""
    return float(row["cpu_s"]) if "cpu_s" in row else float(row["distill_s"]) + float(row["train_s"])


METRICS = ("right_per_request", "precision", "add_rate", "entry_share")
"""Per block and arm: right entries per request (the goal's quantity: what a guided actor can gain),
precision (right entries / entries), add rate (entries / request) and the secret-balanced share."""


def metric(row: dict[str, Any], name: str) -> float | None:
    """A block's value of ``name``; rows written before ``right_per_request`` called it ``request_share``
    (the same count: right entries / requests)."""
    if name == "right_per_request" and name not in row:
        name = "request_share"
    if name == "precision" and name not in row:
        return round(row["correct"] / row["entries"], 4) if row.get("entries") else None
    value = row.get(name)
    return None if value is None else float(value)


def summarise(setting: Setting, runs: dict[tuple[int, str], list[dict[str, Any]]], seeds: list[int],
              goal_block: int | None = None) -> dict[str, Any]:
    """The curve over the blocks every seed's both arms have finished, and the goal at ``goal_block``
    (fixed before the run; None: the last block of the run): the paired trained − frozen difference
    in right entries per request, over the seeds, excludes 0 from above."""
    curve = []
    blocks = min(len(v) for v in runs.values()) if runs else 0
    for b in range(blocks):
        row: dict[str, Any] = {"block": b, "requests_so_far": (b + 1) * setting.requests_per_block * setting.samples_per_request}
        for arm in ARMS:
            row[arm] = {name: mean_t([v for s in seeds if (v := metric(runs[(s, arm)][b], name)) is not None]).rounded()
                        for name in METRICS}
            row[arm]["by_seed"] = {name: [metric(runs[(s, arm)][b], name) for s in seeds] for name in METRICS}
            row[arm]["seconds"] = mean_t([block_seconds(runs[(s, arm)][b]) for s in seeds]).rounded(1)
        row["trained_minus_frozen"] = {}
        for name in METRICS:
            pairs = [(metric(runs[(s, "trained")][b], name), metric(runs[(s, "frozen")][b], name)) for s in seeds]
            kept = [(t, f) for t, f in pairs if t is not None and f is not None]
            row["trained_minus_frozen"][name] = paired_difference([t for t, _ in kept], [f for _, f in kept]).rounded()
        row["trained_seconds_so_far_max_seed"] = round(
            max(sum(block_seconds(runs[(s, "trained")][i]) for i in range(b + 1)) for s in seeds), 1)
        curve.append(row)
    target = (setting.blocks - 1) if goal_block is None else goal_block
    at = curve[target] if 0 <= target < len(curve) else None
    low = at["trained_minus_frozen"]["right_per_request"][1] if at is not None else None
    return {"blocks_done": blocks, "curve": curve, "goal_block": target, "goal_metric": "right_per_request",
            "goal_reached_block": at is not None,
            "meets_goal": bool(at is not None and low is not None and low > 0),
            "by_episode": by_episode(runs, seeds, blocks)}


def by_episode(runs: dict[tuple[int, str], list[dict[str, Any]]], seeds: list[int], blocks: int) -> list[dict[str, Any]]:
    """Per seed, arm and half of the first ``blocks`` blocks: how the entries written from won and from
    lost episodes were played. On a won episode the right action is the one it played; on a lost one
    (L = 1, A = 2) it is the other, so ``lost_copied`` counts entries that repeat the lost episode's
    own action. Reading the episode gets both right; copying the played action gets won right and
    lost wrong. Entries whose prompt does not show its episode (the oracle's) and blocks that predate
    the ``episodes`` field are left out."""
    out = []
    half = blocks // 2
    for s in seeds:
        for arm in ARMS:
            for name, part in (("first", runs[(s, arm)][:half]), ("second", runs[(s, arm)][half:blocks])):
                eps = [e for b in part for e in b.get("episodes", []) if e[3] is not None]
                if not eps:
                    continue
                won = [e for e in eps if e[3] is True]
                lost = [e for e in eps if e[3] is False]
                out.append({"seed": s, "arm": arm, "half": name, "blocks": [part[0]["block"], part[-1]["block"]],
                            "won": len(won), "won_right": sum(e[1] == e[0] for e in won),
                            "lost": len(lost), "lost_right": sum(e[1] == e[0] for e in lost),
                            "lost_copied": sum(e[1] == e[2] for e in lost)})
    return out


def _curve_of(row: dict[str, Any], arm: str, name: str) -> list[float | None]:
    """``[mean, low, high]`` of ``name`` in a curve row (an older report's ``request_share`` for right entries per request)."""
    got = row[arm].get(name) or (row[arm].get("request_share") if name == "right_per_request" else None)
    return list(got) if got else [None, None, None]


def figure(report: dict[str, Any], path: Path, baseline: dict[str, Any] | None = None) -> None:
    """The curve: right entries per request per block, trained and frozen (mean over seeds, 95 % t
    interval), precision, and the add rate, against requests distilled; ``baseline``: an earlier run's
    report, its means dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = report["curve"]
    x = [row["requests_so_far"] for row in curve]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True, height_ratios=[2, 1, 1])
    for ax, name, label in ((axes[0], "right_per_request", "right entries\nper request"),
                            (axes[1], "precision", "precision\n(right / entries)"),
                            (axes[2], "add_rate", "add rate\n(entries / request)")):
        for arm, colour in (("trained", "tab:blue"), ("frozen", "tab:gray")):
            vals = [_curve_of(row, arm, name) for row in curve]
            mean = [v[0] for v in vals]
            ax.plot(x, mean, marker="o", color=colour, label=arm)
            if any(v[1] is not None for v in vals):
                ax.fill_between(x, [v[1] if v[1] is not None else m for v, m in zip(vals, mean, strict=True)],
                                [v[2] if v[2] is not None else m for v, m in zip(vals, mean, strict=True)],
                                color=colour, alpha=0.2)
            if baseline is not None and baseline.get("curve"):
                bx = [row["requests_so_far"] for row in baseline["curve"]]
                ax.plot(bx, [_curve_of(row, arm, name)[0] for row in baseline["curve"]], linestyle="--", marker="x",
                        color=colour, alpha=0.7, label=f"{arm}, baseline")
        ax.set_ylabel(label)
    axes[0].axvline(report["curve"][min(report["goal_block"], len(curve) - 1)]["requests_so_far"], color="tab:green",
                    linestyle="--", linewidth=1, label="goal block (fixed before the run)")
    axes[0].set_title(f"{report['model']}, lr {report['lr']}, T {report['temperature']}, B_φ {report['buffer_size']}, "
                      f"{len(report['seeds'])} seeds (95 % t)", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[2].set_xlabel("requests distilled per arm")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ci(v: list[float | None]) -> str:
    mean, low, high = v
    if mean is None:
        return "n/a"
    return f"{mean:.3f}" if low is None or high is None else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def markdown(report: dict[str, Any], out: Path) -> str:
    """The curve as a table and every entry the blocks kept, per seed and arm."""
    lines = ["| block | requests per arm | right per request: trained | frozen | trained − frozen (paired) | "
             "precision: trained | frozen | trained − frozen | add rate: trained | frozen | "
             "trained s per block (CPU where recorded, else wall) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["curve"]:
        diff = row["trained_minus_frozen"]
        goal = " (goal block)" if row["block"] == report.get("goal_block") else ""
        lines.append(f"| {row['block']}{goal} | {row['requests_so_far']} | {_ci(row['trained']['right_per_request'])} | "
                     f"{_ci(row['frozen']['right_per_request'])} | {_ci(diff['right_per_request'])} | "
                     f"{_ci(row['trained']['precision'])} | {_ci(row['frozen']['precision'])} | "
                     f"{_ci(diff['precision'])} | {_ci(row['trained']['add_rate'])} | {_ci(row['frozen']['add_rate'])} | "
                     f"{_ci(row['trained']['seconds'])} |")
    if report.get("by_episode"):
        lines += ["", "Per seed, arm and half: the entries written from won and from lost episodes, and how the "
                  "reader plays them (right on a lost episode = the action it did not play; copied = its own "
                  "losing action).", "",
                  "| seed | arm | blocks | won: right | lost: right | lost: copied |", "|---|---|---|---|---|---|"]
        for r in report["by_episode"]:
            lines.append(f"| {r['seed']} | {r['arm']} | {r['blocks'][0]}–{r['blocks'][1]} | "
                         f"{r['won_right']} of {r['won']} | {r['lost_right']} of {r['lost']} | "
                         f"{r['lost_copied']} of {r['lost']} |")
    lines += ["", "Per seed and block: entries written, of them played correctly (by secret), the words played, "
              "CISPO updates (tied: every reward equal), and the entries as written (the first few).", ""]
    for seed in report["seeds"]:
        for arm in ARMS:
            path = out / "runs" / f"seed{seed}_{arm}.jsonl"
            for line in path.read_text().splitlines() if path.exists() else []:
                b = json.loads(line)
                secrets = ", ".join(f"{k} {v['correct']}/{v['entries']}" for k, v in b["by_secret"].items())
                lines.append(f"* seed {seed}, {arm}, block {b['block']}: {b['entries']} entries of {b['requests']} "
                             f"requests, correct {b['correct']} ({secrets}); played {b['played']}; updates "
                             f"{b['updates']} (tied {b['tied_updates']}); track errors {b.get('track_errors', 'not recorded')}")
                lines += [f"  * `{t}`" for t in b["shown"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "small.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--blocks", type=int, default=42, help="blocks per seed (42 x 48 = 2,016 requests per arm)")
    ap.add_argument("--goal-block", type=int, default=None,
                    help="the block meets_goal is decided at, fixed before the run (default: the last one)")
    ap.add_argument("--requests-per-block", type=int, default=48, help="finished episodes distilled per block")
    ap.add_argument("--buffer-size", type=int, default=16, help="credited samples per CISPO update (algo.buffer_size)")
    ap.add_argument("--samples-per-request", type=int, default=1,
                    help="exploration: each episode distilled this many times (its samples meet in B_phi, whose "
                         "advantage is r - the batch mean); 1 is the service's rule. A block then distils "
                         "requests-per-block x this many answers")
    ap.add_argument("--lr", type=float, help="extractor.lr (default: the config's)")
    ap.add_argument("--temperature", type=float, help="extractor.temperature (default: the config's)")
    ap.add_argument("--num-tasks", type=int, default=8)
    ap.add_argument("--num-actions", type=int, default=2)
    ap.add_argument("--secret-seed", type=int, default=0, help="the search for balanced secrets starts here")
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process (one torch thread) each")
    ap.add_argument("--report-only", action="store_true",
                    help="summarise the blocks already in --out (an unfinished run's too); run nothing")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "extractor_learning")
    ap.add_argument("--figure", type=Path, help="also draw the curve into this PNG")
    ap.add_argument("--markdown", type=Path, help="also write the curve's table and the entries into this file")
    ap.add_argument("--baseline", type=Path, metavar="REPORT_JSON",
                    help="with --figure: an earlier run's report.json, its curve drawn dashed for comparison")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = ap.parse_args(argv)
    secret_seed = balanced_secret_seed(args.num_tasks, args.num_actions, args.secret_seed)
    overrides = [
        f"env.kwargs={{num_tasks: {args.num_tasks}, length: 1, num_actions: {args.num_actions}, secret_seed: {secret_seed}}}",
        "env.ids=[crl/Recall-v0]", "env.max_turns=2", "experience.action_slot=1", "experience.seed_entries=[]",
        f"algo.buffer_size={args.buffer_size}", "experience.extractor_threads=1",
        *([f"extractor.lr={args.lr}"] if args.lr is not None else []),
        *([f"extractor.temperature={args.temperature}"] if args.temperature is not None else []),
        *args.set,
    ]
    if args.samples_per_request < 1:
        ap.error("--samples-per-request must be >= 1")
    setting = Setting(args.config, tuple(overrides), args.blocks, args.requests_per_block, args.out,
                      args.samples_per_request)
    cfg = setting.cfg(args.seeds[0])
    if cfg.extractor.model == "tiny":
        ap.error("the tiny extractor is a random-initialised test model: probe a real one (extractor.model=smollm2-135m)")
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {"config": args.config, "overrides": overrides, "blocks": args.blocks,
                "requests_per_block": args.requests_per_block, "samples_per_request": args.samples_per_request}
    if not args.report_only:
        (args.out / "setting.json").write_text(json.dumps(manifest, indent=1))
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    todo = []
    for s in args.seeds:
        done = load_runs(setting, s, finished_only=not args.report_only)
        if done is not None and (args.report_only or all(len(v) >= args.blocks for v in done.values())):
            runs.update({(s, arm): blocks[:args.blocks] for arm, blocks in done.items()})
        elif args.report_only:
            ap.error(f"--report-only: seed {s} has no blocks in {args.out / 'runs'}")
        else:
            todo.append(s)
    start = time.perf_counter()
    if args.jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {s: pool.submit(run_seed, setting, s) for s in todo}
            for s, fut in futures.items():
                runs.update({(s, arm): blocks for arm, blocks in fut.result().items()})
    else:
        for s in todo:
            runs.update({(s, arm): blocks for arm, blocks in run_seed(setting, s).items()})
    report = {
        "bench": "extractor_learning", "model": cfg.extractor.model, "dtype": cfg.extractor.dtype,
        "lr": cfg.extractor.lr, "temperature": cfg.extractor.temperature, "lora_rank": cfg.extractor.lora_rank,
        "buffer_size": args.buffer_size, "requests_per_block": args.requests_per_block, "blocks": args.blocks,
        "samples_per_request": args.samples_per_request,
        "seeds": args.seeds, "num_tasks": args.num_tasks, "num_actions": args.num_actions, "secret_seed": secret_seed,
        "overrides": overrides, "jobs": args.jobs, "wall_s_this_call": round(time.perf_counter() - start, 1),
        "goal": {"metric": GOAL_METRIC, "block": args.blocks - 1 if args.goal_block is None else args.goal_block,
                 "rule": "paired trained - frozen interval (95 % t over seeds) above 0"},
        **summarise(setting, runs, args.seeds, args.goal_block),
    }
    line = json.dumps(report)
    (args.out / "report.json").write_text(line + "\n")
    if args.figure is not None and report["curve"]:
        baseline = json.loads(args.baseline.read_text(encoding="utf-8")) if args.baseline is not None else None
        figure(report, args.figure, baseline)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report, args.out))
    print(line if args.json else json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
