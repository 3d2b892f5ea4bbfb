"""The primary loop: build everything from a config, then rollout → advantages → actor update.

The outcome reward of an episode is binary, r = 1 on success else 0 (the paper's R ∈ {0, 1});
the extractor's r(m) ∈ {−1, +1} is derived from the same success flag. Episodes that ended
because the env raised are failures for the success rate but are not trained on (the agent's
tokens were not at fault) and do not credit their entry.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from crl_gym.protocol import ExtractorSample
from crl_train.algorithms import (
    ADVANTAGES,
    FREE,
    GATE_SCORES,
    GUIDED,
    clip_surrogate_loss,
    edge_train_mask,
    ema_utility,
    entry_rewards,
    marginal_gain,
    reverse_kl_sampled_loss,
    self_distill_nll_loss,
    sequence_weights,
)
from crl_train.components import (
    Components,
    NoExtractor,
    build_components,
    counters,
    restore_counters,
    save_run_config,
)
from crl_train.config import TrainConfig
from crl_train.extractor_worker import ExtractorUnavailable
from crl_train.methods import get_method
from crl_train.outputs import (
    CKPT,
    MetricsWriter,
    commit_checkpoint,
    make_row,
    metric_fields,
    plot_curves,
    resolve_checkpoint,
    trim_run_outputs,
)
from crl_train.policy.base import TokenSequence, TrainBatch
from crl_train.rollout import Episode, stripped_sequence
from crl_train.tracks import Credit

log = logging.getLogger(__name__)


def _actor_loss(clip_eps: float, ratio_level: str) -> Any:
    def loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             weights: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return clip_surrogate_loss(lp, old, adv, mask, weights, clip_eps=clip_eps, ratio_level=ratio_level)

    return loss


def _nll_loss(coef: float) -> Any:
    def loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **_: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return self_distill_nll_loss(lp, mask, coef=coef)

    return loss


def _reverse_kl_sampled(coef: float) -> Any:
    def loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             teacher: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, dict[str, float]]:
        if teacher is None:
            raise ValueError("EDGE distillation needs the teacher log-probs under extra['teacher']")
        return reverse_kl_sampled_loss(lp, teacher, mask, coef=coef)

    return loss


class Trainer:
    """One run in ``run_dir`` (fresh, or resumed from its last checkpoint).

    ``read_only`` (``crl-eval``): load the checkpoint, leave every run output (config, metrics,
    trajectories, bank) as it is; the bank is used through a copy in ``eval_bank_dir``.
    """

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
                 env_factory: Any = None, generator_factory: Any = None, read_only: bool = False,
                 eval_bank_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.spec = get_method(cfg.method)
        self.progress = progress
        self.read_only = read_only
        self.start_step = 0
        state: dict[str, Any] = {}
        ckpt: Path | None = None
        if resume or read_only:
            ckpt = resolve_checkpoint(self.run_dir) if not read_only else self.run_dir / CKPT
            if ckpt is None or not (ckpt / "state.json").exists():
                raise FileNotFoundError(f"--resume {self.run_dir}: no checkpoint/state.json to resume from")
            state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
            self.start_step = int(state["step"]) + 1
        if not read_only:
            if resume:
                trim_run_outputs(self.run_dir, int(state["step"]))
            save_run_config(cfg, self.run_dir, self.start_step if resume else None)
        self.c: Components = build_components(cfg, self.spec, self.run_dir, checkpoint=ckpt, env_factory=env_factory,
                                             generator_factory=generator_factory, bank_dir=eval_bank_dir)
        if ckpt is not None:
            self.c.track.load_state(state.get("track", {}))
            self.c.track.actor_step = self.start_step
            restore_counters(self.c, state.get("counters", {}))
        self.metrics = None if read_only else MetricsWriter(self.run_dir, purge_step=self.start_step if resume else None)
        self.fields = metric_fields(edge=self.spec.edge, self_distill=self._self_distill_on())
        self.actor_loss = _actor_loss(cfg.algo.clip_eps, cfg.algo.ratio_level)
        self.last_row: dict[str, Any] = {}

    def _self_distill_on(self) -> bool:
        return bool(self.cfg.algo.self_distill and self.spec.uses_experience and self.spec.train_actor)

    # ------------------------------------------------------------------ one step
    def tasks(self, step: int) -> list[tuple[str, int]]:
        e = self.cfg.env
        return [(e.ids[(step * e.tasks_per_step + g) % len(e.ids)], e.seed + step * e.tasks_per_step + g)
                for g in range(e.tasks_per_step)]

    def step(self, t: int) -> dict[str, Any]:
        cfg, c, spec = self.cfg, self.c, self.spec
        t0 = time.perf_counter()
        c.track.actor_step = t
        eps = c.runner.collect(self.tasks(t), guided=spec.uses_experience, step=t)
        t1 = time.perf_counter()
        r = torch.tensor([1.0 if e.success else 0.0 for e in eps])
        g = torch.tensor([e.group for e in eps])
        cond = torch.tensor([GUIDED if e.condition == "guided" else FREE for e in eps])
        adv_fn = ADVANTAGES.get(spec.advantage)
        kw: dict[str, Any] = {"eps": cfg.algo.adv_eps, "unbiased": cfg.algo.std_unbiased}
        if spec.edge:
            kw["threshold"] = cfg.algo.edge_threshold
        adv = adv_fn(r, g, cond if spec.uses_experience else None, **kw)
        keep = torch.tensor([not e.failed_by_error for e in eps])
        if spec.edge:
            keep &= edge_train_mask(r, g, cond, threshold=cfg.algo.edge_threshold)
        row: dict[str, Any] = {"step": t}
        row.update(self._actor_update(eps, adv, g, cond, keep))
        if spec.edge:
            row.update(self._edge(eps, r, g, cond))
        if self._self_distill_on():
            row.update(self._self_distill(eps, r))
        t2 = time.perf_counter()
        self._credit_and_submit(eps, t)
        if cfg.algo.merge_every and spec.distill_online and (t + 1) % cfg.algo.merge_every == 0:
            c.track.request_merge(t)
        if not cfg.experience.asynchronous and spec.uses_experience:
            c.track.run_until_idle()
        t3 = time.perf_counter()
        row.update(self._row(eps, adv, r, t3 - t0, t1 - t0, t2 - t1))
        return make_row(self.fields, row)

    def _actor_update(self, eps: list[Episode], adv: torch.Tensor, g: torch.Tensor, cond: torch.Tensor,
                      keep: torch.Tensor) -> dict[str, Any]:
        if not self.spec.train_actor or not bool(keep.any()):
            return {}
        idx = [i for i in range(len(eps)) if bool(keep[i])]
        w = sequence_weights(g[idx], cond[idx] if self.spec.uses_experience else None)
        batch = TrainBatch.from_sequences([eps[i].sequence for i in idx], adv[idx], self.c.actor.pad_token_id,
                                          group_ids=g[idx].tolist(), condition_ids=cond[idx].tolist(), extra={"weights": w})
        gen = getattr(self.c.actor, "generator", None)
        if gen is not None and not gen.logprobs_exact:
            # the fast generator's log-probs are not π_old's (top-p, raw logits, old vLLM): recompute
            # them with the trained model, whose weights the generator sampled with (synced after each update)
            with torch.no_grad():
                batch.old_logprobs = self.c.actor.logprobs(batch).detach() * batch.loss_mask.to(batch.old_logprobs.dtype)
        m = self.c.actor.train_step(batch, self.actor_loss)
        return {"actor_loss": m.get("loss"), "actor_clip_frac": m.get("clip_frac"), "actor_approx_kl": m.get("approx_kl"),
                "actor_grad_norm": m.get("grad_norm")}

    def _edge(self, eps: list[Episode], r: torch.Tensor, g: torch.Tensor, cond: torch.Tensor) -> dict[str, Any]:
        """Gain gate, EMA utility + pruning of the guiding entries, reverse-KL distillation."""
        cfg, bank = self.cfg, self.c.manager.bank
        gain = marginal_gain(r, g, cond)
        groups = sorted({e.group for e in eps})
        pruned = 0
        for gi, gv in zip(groups, gain.tolist(), strict=True):
            ref = next((e.experience for e in eps if e.group == gi and e.experience is not None), None)
            entry = bank.get(ref.id) if ref is not None else None
            if entry is None:
                continue
            u = float(ema_utility(torch.tensor(entry.utility), torch.tensor(gv), cfg.algo.edge_ema))
            bank.set_utility(entry.id, u)
            if u < cfg.algo.edge_prune:
                from crl_gym.protocol import DeleteOp

                self.c.manager.apply_ops([DeleteOp(entry.id)], step=self.c.track.actor_step)
                pruned += 1
        out: dict[str, Any] = {"edge_gain_mean": float(gain.mean()), "edge_gate_open": float((gain > cfg.algo.edge_threshold).float().mean()),
                               "edge_pruned": pruned}
        open_groups = {gi for gi, gv in zip(groups, gain.tolist(), strict=True) if gv > cfg.algo.edge_threshold}
        students, teachers = [], []
        for gi in open_groups:
            guided = next((e for e in eps if e.group == gi and e.condition == "guided" and e.prompt_ids), None)
            for e in eps:
                if e.group == gi and e.condition == "free" and e.prompt_ids and not e.failed_by_error and guided is not None:
                    students.append(e)
                    teachers.append(_with_prompt(e, guided.prompt_ids))
        if students and self.spec.train_actor:
            pad = self.c.actor.pad_token_id
            sb = TrainBatch.from_sequences([e.sequence for e in students], [0.0] * len(students), pad)
            tb = TrainBatch.from_sequences(teachers, [0.0] * len(students), pad)
            t_lp = self.c.actor.logprobs(tb)
            teacher = torch.zeros_like(sb.old_logprobs)
            for i, e in enumerate(students):
                n_gen = len(e.sequence) - len(e.prompt_ids)
                off_t = len(teachers[i]) - n_gen
                teacher[i, len(e.prompt_ids):len(e.sequence)] = t_lp[i, off_t:off_t + n_gen]
            sb.extra["teacher"] = teacher
            m = self.c.actor.train_step(sb, _reverse_kl_sampled(1.0))
            out["edge_kl"] = m.get("edge_kl")
        return out

    def _self_distill(self, eps: list[Episode], r: torch.Tensor) -> dict[str, Any]:
        """Winning guided trajectories (r above the free mean of their group), experience stripped."""
        seqs = []
        for e in eps:
            if e.condition != "guided" or e.failed_by_error or not e.success:
                continue
            free = [x for x in eps if x.group == e.group and x.condition == "free"]
            free_mean = sum(1.0 if x.success else 0.0 for x in free) / max(1, len(free))
            prompt = next((x.prompt_ids for x in free if x.prompt_ids), None)
            if prompt is not None and 1.0 > free_mean:
                seqs.append(stripped_sequence(e, prompt))
        if not seqs:
            return {"self_distill_samples": 0}
        batch = TrainBatch.from_sequences(seqs, [0.0] * len(seqs), self.c.actor.pad_token_id)
        m = self.c.actor.train_step(batch, _nll_loss(self.cfg.algo.self_distill_coef))
        return {"self_distill_samples": len(seqs), "self_distill_nll": m.get("self_distill_nll")}

    def _gate_bonus(self, eps: list[Episode]) -> dict[int, float]:
        """Actor-critic gate: the actor rates each guided episode's entry (accept/refine/reject)."""
        guided = [e for e in eps if e.experience is not None and not e.failed_by_error]
        if not guided:
            return {}
        actor = self.c.actor
        prompts = [actor.apply_chat([{"role": "user", "content": f"Task: {e.task}\nExperience: {e.experience.text}\n"  # type: ignore[union-attr]
                                      "Was this experience useful? Answer accept, refine or reject."}]) for e in guided]
        with torch.no_grad():
            gens = actor.generate(prompts, 8, allowed=[list(GATE_SCORES)] * len(guided))
        bonus = {}
        for i, (e, gen) in enumerate(zip(guided, gens, strict=True)):
            bonus[i] = GATE_SCORES.get(gen.text.strip(), 0.0)
            e.info["gate"] = gen.text.strip()
        return bonus

    def _credit_and_submit(self, eps: list[Episode], t: int) -> None:
        c = self.c
        with (self.run_dir / "trajectories.jsonl").open("a", encoding="utf-8") as f:
            for e in eps:
                req = e.request
                if req is None and self.spec.uses_experience and not e.failed_by_error and e.prompt_ids:
                    req = c.runner.own_request(e)
                    try:
                        c.client.submit(req)
                    except Exception as exc:  # noqa: BLE001 - counted and logged; the step goes on
                        log.warning("submit of a capped episode failed: %s", exc)
                if req is not None:
                    req.rollout_step = t
                    f.write(req.to_json() + "\n")
        if not self.spec.uses_experience:
            return
        guided = [e for e in eps if e.experience is not None and not e.failed_by_error]
        credits: list[Credit] = []
        if guided:
            bonus = self._gate_bonus(eps) if self.cfg.algo.gate else {}
            b = torch.tensor([bonus.get(i, 0.0) for i in range(len(guided))]) if bonus else None
            ids, rbar = entry_rewards(torch.tensor([e.experience.id for e in guided]),  # type: ignore[union-attr]
                                      torch.tensor([e.success for e in guided]), gate_bonus=b)
            credits += [Credit(t, float(v), entry_id=int(i)) for i, v in zip(ids.tolist(), rbar.tolist(), strict=True)]
        for e in eps:
            if e.request is None:
                continue
            for call in e.request.trajectory.search_calls:
                if call.refined and call.provenance:
                    sample = ExtractorSample.from_dict(call.provenance)
                    if sample is not None:
                        credits.append(Credit(t, 1.0 if e.success else -1.0, sample=sample))
        c.track.credit(credits)

    def _row(self, eps: list[Episode], adv: torch.Tensor, r: torch.Tensor, total: float, rollout: float, update: float) -> dict[str, Any]:
        c = self.c

        def rate(cond: str) -> float | None:
            xs = [e.success for e in eps if e.condition == cond]
            return sum(xs) / len(xs) if xs else None

        st = c.track.stats
        rewards = st.rewards[-200:]
        last = st.last_update
        return {
            "success": float(r.mean()), "success_guided": rate("guided"), "success_free": rate("free"),
            "actions_per_episode": sum(e.num_actions for e in eps) / len(eps),
            "turns_per_episode": sum(e.turns for e in eps) / len(eps),
            "adv_mean": float(adv.mean()), "adv_std": float(adv.std(unbiased=False)), "adv_abs_mean": float(adv.abs().mean()),
            "bank_size": len(c.manager.bank), "search_latency_s": c.runner.last_search_s,
            "queue_depth": c.manager.pending(), "extractor_reward": sum(rewards) / len(rewards) if rewards else None,
            "extractor_updates": st.updates, "extractor_loss": last.get("loss"), "buffer_size": len(c.track.buffer),
            "distilled": st.distilled, "distill_batches": st.distill_batches, "malformed": st.malformed, "added": st.added, "updated": st.updated,
            "uncreditable": st.uncreditable, "merges": st.merges, "merge_failures": st.merge_failures,
            "track_errors": st.errors, "extractor_alive": bool(c.extractor.alive) if self.spec.uses_experience else None,
            "skipped_distill": st.skipped_distill, "skipped_updates": st.skipped_updates, "env_errors": c.runner.errors, "context_truncations": c.runner.context_truncations,
            "step_time_s": total, "rollout_time_s": rollout, "update_time_s": update,
        }

    # ------------------------------------------------------------------ loop
    def checkpoint(self, step: int) -> None:
        tmp = self.run_dir / (CKPT + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self.c.actor.save(tmp / "actor")
        # state() waits for the background track's current pass, so buffer, counters and extractor weights agree
        state = {"step": step, "track": self.c.track.state(), "method": self.cfg.method, "counters": counters(self.c)}
        if self.spec.uses_experience:  # other methods have no extractor (NoExtractor)
            self._save_extractor(tmp / "extractor", self.run_dir / CKPT / "extractor")
        self.c.manager.bank.flush()
        self.c.manager.persist_pending()  # queued requests reach the spill file: a kill after this loses none
        commit_checkpoint(self.run_dir, tmp, state)

    def _save_extractor(self, target: Path, previous: Path) -> None:
        """π_φ's weights (through the worker when it runs in a process). A dead worker has nothing
        to save: the previous checkpoint's extractor is kept, so ``--resume`` still finds one."""
        assert not isinstance(self.c.extractor, NoExtractor)  # checkpoint() calls this only for methods with one
        try:
            self.c.extractor.save(target)
        except ExtractorUnavailable:
            if previous.is_dir():
                shutil.copytree(previous, target)
                log.error("extractor worker is gone: the checkpoint keeps the extractor of the previous checkpoint")
            else:
                log.error("extractor worker is gone and no earlier extractor checkpoint exists: "
                          "--resume will start a fresh extractor")

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        self.c.track.start()
        bar = tqdm(range(self.start_step, cfg.train.steps), initial=self.start_step, total=cfg.train.steps,
                   desc=f"{cfg.method}", disable=not self.progress, unit="step")
        done = self.start_step - 1
        try:
            for t in bar:
                row = self.step(t)
                self.last_row = row
                if (t % cfg.train.log_every == 0 or t == cfg.train.steps - 1) and self.metrics is not None:
                    self.metrics.write(row)
                bar.set_postfix(success=f"{row['success']:.2f}", bank=row["bank_size"])
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
            self.c.track.stop()
            if self.metrics is not None:
                self.metrics.close()
        plot_curves(self.run_dir)
        self.c.manager.bank.export_jsonl(self.run_dir / "bank" / "bank.jsonl")
        return self.last_row

    def close(self) -> None:
        self.c.close()


def _with_prompt(e: Episode, prompt_ids: list[int]) -> TokenSequence:
    """``e``'s sequence with its first prompt replaced (EDGE teacher = same tokens, experience in context)."""
    seq = TokenSequence()
    seq.append_context(prompt_ids)
    tail = e.sequence
    n = len(e.prompt_ids)
    seq.input_ids.extend(tail.input_ids[n:])
    seq.loss_mask.extend(tail.loss_mask[n:])
    seq.old_logprobs.extend(tail.old_logprobs[n:])
    shift = len(prompt_ids) - n
    seq.constraints = {p + shift: a for p, a in tail.constraints.items() if p >= n}
    return seq
