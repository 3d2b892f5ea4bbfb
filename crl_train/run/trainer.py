"""The actor loop: rollout → advantages → actor update → ``end_step``, then log.

Everything the extractor learns happens behind the experience service (``crl_train.service``):
the wrappers submit each finished episode, and ``end_step(t)`` tells the service that step t is
done, so it credits the entries used in it. The method (``crl_train.methods``) supplies the
advantages, the episodes that train, any extra actor updates and the entries' extra reward.

The outcome reward of an episode is binary, r = 1 on success else 0 (the paper's R ∈ {0, 1});
the extractor's r(m) ∈ {−1, +1} is derived by the service from the same success flag. Episodes
that ended because the env raised are failures for the success rate but are never trained on
(the agent's tokens were not at fault), never enter a mean or a gain, and credit nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from crl_gym.experience.store import BankCorruptError, verify_bank_copy
from crl_gym.json_types import JSONDict
from crl_train.algorithms import ClipParams, PolicyLoss, sequence_weights
from crl_train.config import TrainConfig
from crl_train.methods import Method, Rollout, make_method
from crl_train.policy.base import LossTerm, TrainBatch, recompute_old_logprobs
from crl_train.policy.checkpoint import CheckpointError, verify_checkpoint
from crl_train.policy.factory import GeneratorFactory, trains
from crl_train.rollout.runner import Episode
from crl_train.rollout.tasks import task_seeds
from crl_train.run.build import Run, build_run
from crl_train.run.checkpoints import (
    Checkpoint,
    ResumeError,
    find_checkpoint,
    read_checkpoint_state,
    settle_checkpoint,
)
from crl_train.run.columns import (
    RL_TERM,
    actor_columns,
    rollout_columns,
    service_columns,
    time_columns,
)
from crl_train.run.config_file import save_run_config
from crl_train.run.metrics import MetricsWriter, make_row, metric_fields
from crl_train.run.new_entries import NewEntryLog, trim_new_entries
from crl_train.run.plots import plot_curves
from crl_train.run.trim import trim_run_outputs
from crl_train.run.unsent import deliver_unsent, unsent_paths
from crl_train.service.checkpoint import CKPT, STATE, begin_checkpoint, commit_checkpoint
from crl_train.service.service import check_service_state, row_columns

log = logging.getLogger(__name__)


class TrackFailure(RuntimeError):
    """The extractor's background track failed ``train.max_track_failures`` times: the run stops,
    naming the cause."""


FAILURE_COLUMNS = ("track_errors", "skipped_updates", "unreplayable")
"""Metrics columns that count what kept the extractor from training
(``train.max_track_failures``)."""


class Trainer:
    """One run in ``run_dir`` (fresh, or resumed from its last checkpoint).

    ``read_only`` (``crl-eval``): load the checkpoint, leave every run output (config, metrics,
    trajectories, bank) as it is; the bank is used through a copy in ``eval_bank_dir``.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        *,
        resume: bool = False,
        progress: bool = True,
        env_factory: Callable[[str], Any] | None = None,
        generator_factory: GeneratorFactory | None = None,
        read_only: bool = False,
        eval_bank_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.method: Method = make_method(cfg)
        self.trains_actor = self.method.trains_actor and trains(cfg.actor)
        """The actor is updated: the method trains it and it has weights (the reader has none)."""
        self.progress = progress
        self.read_only = read_only
        self.start_step = 0
        # A resume checks and loads everything that can fail before it changes the run directory:
        # the checkpoint's state and files, then the models and the bank, then the state applied to
        # them. Only then are later rows trimmed, the config saved and the checkpoint moved
        # into place.
        ckpt = self._checkpoint_to_load(resume or read_only)
        if ckpt is not None:
            self.start_step = ckpt.step + 1
        try:
            self.c: Run = build_run(
                cfg,
                self.method,
                self.run_dir,
                checkpoint=None if ckpt is None else ckpt.path,
                env_factory=env_factory,
                generator_factory=generator_factory,
                bank_dir=eval_bank_dir,
            )
        except CheckpointError as exc:  # found by the loader although the files passed verification
            if ckpt is None:
                raise
            raise self._resume_error(ckpt, str(exc)) from exc
        try:
            if ckpt is not None:
                try:
                    self.c.load_state(
                        ckpt.state, step=ckpt.step, directory=None if read_only else ckpt.path
                    )
                except (ValueError, TypeError, KeyError) as exc:
                    raise self._resume_error(ckpt, f"{ckpt.path / STATE}: {exc}") from exc
            if not read_only:
                if resume and ckpt is not None:
                    settle_checkpoint(self.run_dir, ckpt)
                    trim_run_outputs(self.run_dir, ckpt.step)
                    trim_new_entries(self.run_dir, self.c.bank)
                save_run_config(cfg, self.run_dir, self.start_step if resume else None)
                # what the wrappers of an earlier start could not submit (this run dir's, or an
                # older run's bank dir's)
                deliver_unsent(self.c.service, unsent_paths(self.run_dir, self.run_dir / "bank"))
            self.metrics = (
                None
                if read_only
                else MetricsWriter(self.run_dir, purge_step=self.start_step if resume else None)
            )
            self.new_entries = None if read_only else NewEntryLog(self.c.bank, self.run_dir)
        except BaseException:
            self.c.close()  # the extractor's process, the bank's lock
            raise
        self.fields = metric_fields(self.method.metric_fields())
        self.last_row: dict[str, Any] = {}
        self.problems: dict[str, Any] = {}
        """What kept the extractor from training (failures and their last cause): the run's
        summary shows it."""
        self._failures_seen = 0
        self._failures_base = 0
        """Failures a resumed run's checkpoint already counted: the limit counts those of
        this start."""

    def _checkpoint_to_load(self, wanted: bool) -> Checkpoint | None:
        """The checkpoint to resume (or evaluate) from, its state and files checked; None for a
        fresh run.

        Reads only: a damaged checkpoint raises :class:`ResumeError` naming the file and the
        previous checkpoint, with the run directory as it was.
        """
        if not wanted:
            return None
        if self.read_only:
            d = self.run_dir / CKPT
            if not d.is_dir():
                raise FileNotFoundError(f"{self.run_dir}: no checkpoint/state.json to evaluate")
            state = read_checkpoint_state(d)
            ckpt: Checkpoint | None = Checkpoint(d, int(state["step"]), state)
        else:
            ckpt = find_checkpoint(self.run_dir)
        if ckpt is None:
            raise FileNotFoundError(
                f"--resume {self.run_dir}: no checkpoint/state.json to resume from"
            )
        try:
            check_service_state({"last_ended": ckpt.step, **_section(ckpt.state, "service")})
            for k, v in _section(ckpt.state, "runner").items():
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"runner.{k} must be a non-negative integer, got {v!r}")
        except ValueError as exc:
            raise self._resume_error(ckpt, f"{ckpt.path / STATE}: {exc}") from None
        try:
            verify_checkpoint(ckpt.path / "actor")
            if self.method.service_options().extractor and (ckpt.path / "extractor").is_dir():
                verify_checkpoint(ckpt.path / "extractor")
            if (ckpt.path / "bank").is_dir():
                verify_bank_copy(ckpt.path / "bank")
        except (CheckpointError, BankCorruptError) as exc:
            raise self._resume_error(ckpt, str(exc)) from None
        return ckpt

    def _resume_error(self, ckpt: Checkpoint, problem: str) -> ResumeError:
        what = "evaluate" if self.read_only else "resume"
        return ResumeError(
            f"cannot {what} {self.run_dir} from {ckpt.path.name}/ (step {ckpt.step}): {problem}. "
            f"Nothing in {self.run_dir} was changed. {ckpt.alternatives()}"
        )

    # ------------------------------------------------------------------ one step
    def step(self, t: int) -> JSONDict:
        c, method = self.c, self.method
        t0 = time.perf_counter()
        # warm-up (experience.warmup_steps): every copy runs free while the bank fills
        guided = method.guided and t >= self.cfg.experience.warmup_steps
        eps = c.runner.collect(task_seeds(self.cfg.env, t), guided=guided, step=t)  # rollout
        t1 = time.perf_counter()
        rollout = Rollout.of(eps)
        adv = method.advantages(rollout)  # advantages
        row: dict[str, Any] = {"step": t, **self._update(rollout, adv)}  # actor update
        bonus = method.entry_bonus(rollout, c.actor)
        t2 = time.perf_counter()
        self._write_trajectories(eps)
        c.client.end_step(t, bonus or None)  # the service credits step t
        if self.new_entries is not None:
            self.new_entries.record()  # what the extractor wrote, before an Update rewrites it
        t3 = time.perf_counter()
        row.update(self._row(rollout, adv, t3 - t0, t1 - t0, t2 - t1))  # log
        return make_row(self.fields, row)

    def _update(self, rollout: Rollout, adv: torch.Tensor) -> JSONDict:
        """One actor step on the RL loss over the method's train mask plus the method's own terms
        (EDGE's distillation, self-distillation), all under the same weights; a frozen actor (or one
        without weights, the reader) has none."""
        method, actor, algo = self.method, self.c.actor, self.cfg.algo
        terms: list[LossTerm] = []
        idx = (
            [i for i, keep in enumerate(method.train_mask(rollout).tolist()) if keep]
            if self.trains_actor
            else []
        )
        if idx:
            g, cond = rollout.group[idx], rollout.condition[idx]
            w = sequence_weights(g, cond if method.guided else None)
            batch = TrainBatch.from_sequences(
                [rollout.episodes[i].sequence for i in idx],
                adv[idx],
                actor.pad_token_id,
                group_ids=g.tolist(),
                condition_ids=cond.tolist(),
                extra={"weights": w},
            )
            recompute_old_logprobs(
                actor, batch
            )  # 16-bit compute or a fast generator: π_old as training computes it
            terms.append(
                LossTerm.registered(
                    batch, PolicyLoss.CLIP, ClipParams(algo.clip_eps, algo.ratio_level), RL_TERM
                )
            )
        extra_terms, row = method.extra_terms(rollout, actor)
        terms += [LossTerm.registered(u.batch, u.loss, u.params, u.loss.value) for u in extra_terms]
        if not terms:
            return row
        m = actor.train_objective(terms)
        row.update(actor_columns(m))
        for u in extra_terms:
            row.update({k: m.get(src) for k, src in u.metrics.items()})
        return row

    def _write_trajectories(self, eps: list[Episode]) -> None:
        """Every episode's request, for ``offline_exp`` runs that start from this one."""
        with (self.run_dir / "trajectories.jsonl").open("a", encoding="utf-8") as f:
            for e in eps:
                if e.request is not None:
                    f.write(e.request.to_json() + "\n")

    def _row(
        self, rollout: Rollout, adv: torch.Tensor, total: float, rollout_s: float, update_s: float
    ) -> JSONDict:
        stats = self.c.client.stats()
        return {
            **service_columns(stats, self.method.service_metrics),
            **rollout_columns(rollout, adv, self.c.runner, stats),
            **time_columns(total, rollout_s, update_s),
        }

    # ------------------------------------------------------------------ loop
    def checkpoint(self, step: int) -> None:
        tmp = begin_checkpoint(
            self.run_dir
        )  # drops the checkpoint before the current one: two on disk at most
        self.c.actor.save(tmp / "actor")
        # one moment of the service: B_φ, π_φ, the bank and the queue, taken between two of
        # its passes
        state = {"step": step, "method": self.cfg.method, **self.c.save(tmp, self.run_dir / CKPT)}
        self.c.service.flush()  # queued requests reach the spill file: a kill after this loses none
        commit_checkpoint(self.run_dir, tmp, state)

    def run(self) -> JSONDict:
        from tqdm import tqdm

        cfg = self.cfg
        self.c.service.start()
        stats, cols = self.c.client.stats(), row_columns()
        self._failures_base = self._failures_seen = sum(
            int(stats.get(cols[k]) or 0) for k in FAILURE_COLUMNS
        )
        bar = tqdm(
            range(self.start_step, cfg.train.steps),
            initial=self.start_step,
            total=cfg.train.steps,
            desc=f"{cfg.method}",
            disable=not self.progress,
            unit="step",
        )
        done = self.start_step - 1
        try:
            for t in bar:
                row = self.step(t)
                self.last_row = row
                if (
                    t % cfg.train.log_every == 0 or t == cfg.train.steps - 1
                ) and self.metrics is not None:
                    self.metrics.write(row)
                failures = self._check_track(row)
                bar.set_postfix(
                    success=f"{row['success']:.2f}",
                    bank=row["bank_size"],
                    **({"track_failures": failures} if failures else {}),
                )
                done = t
                if (t + 1) % cfg.train.checkpoint_every == 0 or t == cfg.train.steps - 1:
                    self.checkpoint(t)
        except KeyboardInterrupt:
            if done >= self.start_step:  # keep the last finished step: --resume continues from it
                log.warning("interrupted: checkpointing step %d before exiting", done)
                self.checkpoint(done)
            raise
        finally:
            bar.close()
            self.c.service.stop()
            if self.metrics is not None:
                self.metrics.close()
        plot_curves(self.run_dir)
        self.c.bank.export_jsonl(self.run_dir / "bank" / "bank.jsonl")
        return self.last_row

    def _check_track(self, row: dict[str, Any]) -> int:
        """The extractor's failures so far (the :data:`FAILURE_COLUMNS`): each new one is
        logged with its cause and kept in :attr:`problems`; at ``train.max_track_failures`` of them
        since this start (a resume does not count its checkpoint's again) the run stops with
        :class:`TrackFailure`."""
        failures = sum(int(row.get(k) or 0) for k in FAILURE_COLUMNS)
        if failures <= self._failures_seen:
            return failures
        self._failures_seen = failures
        stats = self.c.client.stats()
        cause = stats.last_error
        for key, what in (
            ("skipped_updates", "CISPO batches dropped: the extractor's worker is gone"),
            ("unreplayable", "samples left out of CISPO: they do not replay under their grammar"),
        ):
            if row.get(key):
                cause = f"{cause}; {row[key]} {what}" if cause else f"{row[key]} {what}"
        self.problems = {
            "track_failures": failures,
            **{k: row.get(k) for k in FAILURE_COLUMNS},
            "cause": cause,
            "step": row.get("step"),
        }
        limit, new = self.cfg.train.max_track_failures, failures - self._failures_base
        log.warning(
            "the extractor's background track has failed %d time(s)%s; last cause: %s",
            failures,
            f" ({new} since this start; the run stops at train.max_track_failures={limit})"
            if limit
            else "",
            cause,
        )
        if limit and new >= limit:
            raise TrackFailure(
                f"the extractor's background track failed {new} times by step {row.get('step')} "
                f"(train.max_track_failures={limit}); last cause: {cause}. The run stops here; "
                f"fix the cause and --resume {self.run_dir} (from its last checkpoint), or raise "
                f"the limit (0: never stop)"
            )
        return failures

    def close(self) -> None:
        self.c.close()


def _section(state: dict[str, Any], key: str) -> JSONDict:
    """``state[key]`` (a JSON object, empty when absent) of a checkpoint's state.json."""
    value = state.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a JSON object, got {type(value).__name__}")
    return value
