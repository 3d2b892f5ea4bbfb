"""The launcher: every flag it emits against the installed OpenRLHF's own parser (read, not imported),
the dry run, the checks, the dataset, the trainer's ``end_step`` mixin, and imports without CUDA packages."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from crl_gym.clients import ExperienceUnavailable, LocalClient
from crl_gym.experience.service import RetrievalService
from crl_train.config.io import ConfigError
from crl_train.openrlhf.config import load_cluster_config
from crl_train.openrlhf.launcher import AGENT_FILE, build_plan, dataset_rows, openrlhf_args
from crl_train.openrlhf.steps import ServiceStepMixin, rollout_metrics
from crl_train.openrlhf.tasks import TaskLabel
from crl_train.rollout.tasks import task_seeds

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted((REPO / "configs" / "cluster").glob("*.yaml"))


# ---------------------------------------------------------------------------------------- OpenRLHF's parser


def _entry_file() -> Path:
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or spec.origin is None:
        pytest.skip("openrlhf is not installed (make install puts it in with --no-deps)")
    path = Path(spec.origin).parent / "cli" / "train_ppo_ray.py"
    assert path.is_file(), path
    return path


def _value(node: ast.AST, env: dict[str, Any]) -> Any:
    """A literal, a name bound by an enclosing ``for``, or an f-string over those."""
    if isinstance(node, ast.JoinedStr):
        return "".join(str(_value(v.value, env)) if isinstance(v, ast.FormattedValue) else str(v.value)  # type: ignore[attr-defined]
                       for v in node.values)
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        return {"int": int, "float": float, "str": str}.get(node.id)
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError):
        return None


def openrlhf_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """An argparse parser with the type / action / nargs / choices of every ``add_argument`` call in
    OpenRLHF's ``cli/train_ppo_ray.py`` (``for prefix in (...)`` loops expanded), and the flag names."""
    tree = ast.parse(_entry_file().read_text(encoding="utf-8"))
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    flags: set[str] = set()

    def visit(stmts: list[ast.stmt], env: dict[str, Any]) -> None:
        for st in stmts:
            if isinstance(st, ast.For) and isinstance(st.target, ast.Name):
                for v in ast.literal_eval(st.iter):
                    visit(st.body, {**env, st.target.id: v})
            elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                call = st.value
                if not (isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
                    continue
                names = [_value(a, env) for a in call.args]
                kw = {k.arg: _value(k.value, env) for k in call.keywords if k.arg in
                      ("type", "action", "nargs", "choices", "dest")}
                kw = {k: v for k, v in kw.items() if v is not None}
                parser.add_argument(*names, **kw)
                flags.update(names)

    visit(main.body, {})
    return parser, flags


@pytest.fixture(scope="module")
def parser() -> tuple[argparse.ArgumentParser, set[str]]:
    p, flags = openrlhf_parser()
    assert len(flags) > 150 and "--actor.adam.lr" in flags and "--critic.adam.lr" in flags  # the loop was expanded
    return p, flags


def check_args(argv: list[str], parser: tuple[argparse.ArgumentParser, set[str]]) -> Any:
    p, flags = parser
    emitted = [a for a in argv if a.startswith("--")]
    unknown = [a for a in emitted if a not in flags]
    assert not unknown, f"flags OpenRLHF does not define: {unknown}"
    assert len(emitted) == len(set(emitted)), "a flag is given twice"
    ns, rest = p.parse_known_args(argv)
    assert not rest, rest
    from openrlhf.utils.config import hierarchize

    return hierarchize(ns)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_flag_of_every_preset_is_openrlhfs(preset: Path, parser: Any, tmp_path: Path) -> None:
    cfg, ocfg = load_cluster_config(preset)
    args = check_args(openrlhf_args(cfg, ocfg, tmp_path), parser)
    assert args.rollout.n_samples_per_prompt == cfg.env.group_size == 8
    assert args.rollout.batch_size == cfg.env.tasks_per_step
    assert args.train.batch_size == cfg.env.tasks_per_step * 8
    assert args.algo.kl.init_coef == 0.0 and args.actor.eps_clip == 0.2
    assert args.actor.policy_loss_type == "gspo" and args.algo.advantage.estimator == "group_norm"
    assert args.actor.adam.lr == 1e-6 and args.actor.lr_scheduler == "constant" and args.actor.lr_warmup_ratio == 0.0
    assert args.data.max_len == cfg.actor.max_context_tokens and args.data.label_key == "label"
    assert args.train.agent_func_path == str(AGENT_FILE) and AGENT_FILE.is_file()
    assert args.actor.adam.betas == [0.9, 0.999] and args.ckpt.load_enable is True
    assert args.actor.num_gpus_per_node * args.actor.num_nodes + args.vllm.num_engines + ocfg.service_gpus == 16


def test_variants_emit_openrlhf_flags_too(parser: Any, tmp_path: Path) -> None:
    cfg, ocfg = load_cluster_config(PRESETS[0], [
        "algo.ratio_level=token", "openrlhf.async_train=true", "openrlhf.packing_samples=false",
        "openrlhf.gradient_checkpointing=false", "openrlhf.adam_offload=true", "openrlhf.vllm_prefix_caching=false",
        "openrlhf.zero_stage=2", "actor.dtype=float16", "openrlhf.extra_args=[--train.async_queue_size, '2']"])
    args = check_args(openrlhf_args(cfg, ocfg, tmp_path), parser)
    assert args.train.async_enable is True and args.ds.packing_samples is False and args.ds.adam_offload is True
    assert args.actor.policy_loss_type == "ppo" and args.ds.param_dtype == "fp16" and args.train.async_queue_size == 2


def test_dry_run_prints_the_command_and_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from crl_train.cli import train\n"
        f"r = CliRunner().invoke(train, ['--backend', 'openrlhf', '--config', {str(PRESETS[1])!r}, '--dry-run', "
        f"'--out', {str(out)!r}])\n"
        "print(r.output)\n"
        "assert r.exit_code == 0, r.output\n"
        "loaded = [m for m in ('ray', 'openrlhf', 'vllm', 'deepspeed') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    assert "python -m openrlhf.cli.train_ppo_ray" in text and "--train.agent_func_path" in text
    assert "--rollout.n_samples_per_prompt 8" in text and "--algo.kl.init_coef 0" in text
    assert "Ray resource plan (16 GPUs" in text
    for role in ("actor training", "actor generation", "experience service", "trainer controller"):
        assert role in text
    assert "Qwen/Qwen3-Embedding-0.6B" in text and "4 search workers" in text and "2 x " in text
    assert not out.exists()


def test_backend_options_are_checked() -> None:
    from click.testing import CliRunner

    from crl_train.cli import train

    r = CliRunner().invoke(train, ["--dry-run"])
    assert r.exit_code == 2 and "--dry-run goes with --backend openrlhf" in r.output
    r = CliRunner().invoke(train, ["--backend", "openrlhf", "--config", str(PRESETS[0]), "--show-config"])
    assert r.exit_code == 2 and "--show-config" in r.output
    r = CliRunner().invoke(train, ["--backend", "openrlhf", "--dry-run"])  # the tiny preset: a tiny actor
    assert r.exit_code == 2 and "actor.model: tiny" in r.output


@pytest.mark.parametrize("overrides, match", [
    (["method=edge"], "method 'edge'"),
    (["method=exp_only"], "method 'exp_only'"),
    (["algo.gate=true"], "algo.gate"),
    (["actor.constrained=true"], "constrained decoding"),
    (["actor.dtype=float32"], "bfloat16 or float16"),
    (["extractor.device=cuda:2"], "extractor.device 'cuda:2'"),
    (["openrlhf.service_gpus=0", "openrlhf.embedder_device=cpu", "extractor.device=cpu"], "needs a GPU"),
    (["env.tasks_per_step=3"], "not a multiple"),
    (["openrlhf.rollout_micro_batch_size=64", "env.tasks_per_step=4", "openrlhf.train_micro_batch_size=1",
      "openrlhf.actor_gpus_per_node=8"], "fewer batches"),
])
def test_configs_it_cannot_run_are_refused_with_the_reason(overrides: list[str], match: str, tmp_path: Path) -> None:
    cfg, ocfg = load_cluster_config(PRESETS[1], overrides)
    with pytest.raises(ConfigError, match=match):
        build_plan(cfg, ocfg, tmp_path)


def test_grpo_needs_no_extractor_gpus(tmp_path: Path) -> None:
    cfg, ocfg = load_cluster_config(PRESETS[1], ["method=grpo", "openrlhf.service_gpus=0",
                                                 "openrlhf.embedder_device=cpu", "openrlhf.vllm_engines=8"])
    plan = build_plan(cfg, ocfg, tmp_path)
    assert plan.total_gpus == 16 and "no extractor" in plan.describe()


def test_launch_without_the_cuda_stack_stops_before_starting_anything(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: launch would start a real run")
    import ray

    from crl_train.openrlhf.launcher import LaunchError, launch

    cfg, ocfg = load_cluster_config(PRESETS[0], ["openrlhf.ray_address=local"])
    plan = build_plan(cfg, ocfg, tmp_path / "run")
    with pytest.raises(LaunchError, match=r"complementary-rl\[openrlhf\]"):
        launch(plan, cfg, ocfg, echo=lambda _: None)
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_openrlhf_section_is_validated() -> None:
    with pytest.raises(ConfigError, match="openrlhf.max_concurrency must be >= 2"):
        load_cluster_config(PRESETS[0], ["openrlhf.max_concurrency=1"])
    with pytest.raises(ConfigError, match="packing_samples needs a flash attention"):
        load_cluster_config(PRESETS[0], ["openrlhf.attn_implementation=sdpa"])
    with pytest.raises(ConfigError, match="unknown key 'openrlhf.gpu'"):
        load_cluster_config(PRESETS[0], ["openrlhf.gpu=1"])


def test_dataset_has_the_hf_backends_task_groups(tmp_path: Path) -> None:
    cfg, ocfg = load_cluster_config(PRESETS[2], ["train.steps=3"])
    rows = dataset_rows(cfg)
    plan = build_plan(cfg, ocfg, tmp_path)
    assert len(rows) == plan.rows == 3 * cfg.env.tasks_per_step
    labels = [TaskLabel.parse(r["label"]) for r in rows]
    want = [t for step in range(3) for t in task_seeds(cfg.env, step)]
    assert [(lab.env_id, lab.seed) for lab in labels] == want
    assert len({r["label"] for r in rows}) == len(rows)  # one counter per row in the executor
    assert json.loads(json.dumps(rows)) == rows


# ---------------------------------------------------------------------------------------- the trainer's mixin


class OpenRLHFTrainerStandIn:
    """Stands in for OpenRLHF's ``BasePPOTrainer`` (which needs DeepSpeed and CUDA): ``train_step``
    returns ``(status, global_step + 1)`` as it does."""

    def train_step(self, rollout_samples: Any, global_step: int) -> tuple[dict[str, Any], int]:
        return {"policy_loss": 0.5}, global_step + 1


class Trainer(ServiceStepMixin, OpenRLHFTrainerStandIn):
    pass


def sample_with(guided: list[float], success: list[float]) -> Any:
    import torch

    return SimpleNamespace(info={"crl_guided": torch.tensor(guided), "crl_success": torch.tensor(success)})


def test_end_step_follows_each_update_and_continues_the_services_count() -> None:
    from _trainer_fixtures import manager

    service = RetrievalService(manager(("walk east",)))
    service.end_step(0)
    service.end_step(1)  # a previous attempt of the run ended two steps
    trainer = Trainer()
    trainer.crl_setup(LocalClient(service), checkpoint_every=0)
    assert trainer.crl_step == 2
    samples = [sample_with([1.0, 1.0], [1.0, 0.0]), sample_with([0.0, 0.0], [0.0, 0.0])]
    status, step = trainer.train_step(samples, 7)
    assert step == 8 and status["policy_loss"] == 0.5
    assert status["crl/service_step"] == 2.0 and status["crl/service_up"] == 1.0 and status["crl/bank_size"] == 1.0
    assert status["crl/success_guided"] == 0.5 and status["crl/success_free"] == 0.0
    assert service.ledger.last_ended == 2
    trainer.train_step(samples, 8)
    assert service.ledger.last_ended == 3
    assert rollout_metrics([SimpleNamespace(info={})]) == {}


def test_an_unreachable_service_costs_the_credit_not_the_update() -> None:
    class Down:
        def end_step(self, step: int, bonus: Any = None) -> Any:
            raise ExperienceUnavailable("service gone")

        def stats(self) -> Any:
            raise ExperienceUnavailable("service gone")

    trainer = Trainer()
    trainer.crl_setup(Down(), checkpoint_every=1)
    assert trainer.crl_step == 0
    status, step = trainer.train_step([], 0)
    assert step == 1 and status["crl/service_up"] == 0.0 and trainer.crl_step == 1


# ---------------------------------------------------------------------------------------- imports


def test_crl_train_imports_without_cuda_packages() -> None:
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'flash_attn', 'deepspeed'):\n"
        "            raise ImportError(f'{name} is not installed here')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Block())\n"
        "import crl_train, crl_train.cli, crl_train.policy.vllm_engine, crl_train.policy.factory\n"
        "import crl_train.service.ray_actor, crl_train.openrlhf.launcher, crl_train.openrlhf.advantages\n"
        "import crl_train.openrlhf.steps, crl_train.openrlhf.executor\n"
        "try:\n"
        "    import crl_train.openrlhf.trainer\n"
        "except ImportError as exc:\n"
        "    print('trainer needs:', exc)\n"
        "else:\n"
        "    raise AssertionError('the trainer module imported without DeepSpeed')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "trainer needs:" in res.stdout  # OpenRLHF's CUDA stack (peft, DeepSpeed, vLLM): cluster only


def test_module_doctests() -> None:
    import doctest

    from crl_train.openrlhf import config, settings, tasks
    from crl_train.service import ray_actor

    for module in (config, settings, tasks, ray_actor):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
