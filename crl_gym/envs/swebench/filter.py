"""Task filtering as in the paper: keep tasks whose pass@k success rate lies in (low, high).

The paper kept the SWE-Bench-Verified tasks where 16 attempts of the actor succeeded in more
than 0 % and less than 80 % of the cases. A *policy* here is any agent
``Callable[[list[dict[str, str]]], str]``: it gets the chat so far (``user`` messages are
observations, ``assistant`` messages its own turns) and returns its next turn. It is loaded from

* ``path/to/file.py:name`` or ``package.module:name`` — a function, or a zero-argument factory
  (a class or function whose name starts with ``make_``) that returns a fresh agent per episode;
* a model directory — through a model agent registered in the entry point group
  :data:`MODEL_AGENT_GROUP` (``crl_train`` registers the project's policy backend:
  ``crl_train.policy.agent``), or the ``model_agent`` given to :func:`load_policy`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crl_gym.envs.swebench.tasks import SWEInstance
    from crl_gym.json_types import EnvInfo

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Agent = Callable[[Messages], str]
AgentFactory = Callable[[], Agent]


def _import_object(spec: str) -> Any:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(
            f"policy {spec!r}: expected 'file.py:name', 'package.module:name' or a model directory"
        )
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"policy file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"crl_policy_{path.stem}", path)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    if not hasattr(module, name):
        raise AttributeError(f"policy {spec!r}: {target} has no attribute {name!r}")
    return getattr(module, name)


MODEL_AGENT_GROUP = "crl_gym.model_agents"
"""Entry point group of ``model_agent(directory, max_new_tokens) -> AgentFactory``: what loads a
model directory as an agent (``crl_train`` registers
``crl_train.policy.agent:model_agent_factory``)."""

ModelAgent = Callable[[Path, int], AgentFactory]


def _registered_model_agent() -> ModelAgent:
    found = sorted(entry_points(group=MODEL_AGENT_GROUP), key=lambda ep: ep.name)
    if not found:
        raise ImportError(
            f"loading a model directory needs a model agent in the entry point group "
            f"{MODEL_AGENT_GROUP!r}: install complementary-rl with its [train] extra "
            "(crl_train registers one), or pass model_agent"
        )
    agent: ModelAgent = found[0].load()
    return agent


def load_policy(
    spec: str, *, max_new_tokens: int = 2048, model_agent: ModelAgent | None = None
) -> AgentFactory:
    """A factory of agents (one fresh agent per episode) from a policy spec (module doc);
    ``model_agent`` loads a model directory (default: the one registered in
    :data:`MODEL_AGENT_GROUP`)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return (model_agent or _registered_model_agent())(path, max_new_tokens)
    obj = _import_object(spec)
    if inspect.isclass(obj) or getattr(obj, "__name__", "").startswith("make_"):
        return obj
    if not callable(obj):
        raise TypeError(f"policy {spec!r} is not callable")
    return lambda: obj


def run_episode(env: Any, agent: Agent, instance_id: str) -> tuple[bool, EnvInfo]:
    """One episode of ``agent`` on ``instance_id``; ``(success, last info)``."""
    obs, info = env.reset(options={"instance_id": instance_id})
    messages: Messages = [{"role": "user", "content": obs}]
    done = False
    while not done:
        action = agent(list(messages))
        messages.append({"role": "assistant", "content": action})
        obs, _reward, terminated, truncated, info = env.step(action)
        messages.append({"role": "user", "content": obs})
        done = terminated or truncated
    return bool(info.get("success", False)), info


@dataclass
class FilterReport:
    """Success rates per task and which tasks were kept."""

    rates: dict[str, float]
    kept: list[str]
    k: int
    low: float
    high: float
    errors: dict[str, int] = field(default_factory=dict)
    """Episodes that raised (counted as failures), per task."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "low": self.low,
            "high": self.high,
            "rates": self.rates,
            "kept": self.kept,
            "n_tasks": len(self.rates),
            "n_kept": len(self.kept),
            "errors": self.errors,
        }


def keep(rate: float, low: float, high: float) -> bool:
    """True when ``low < rate < high`` (both ends open, as in the paper's (0, 80 %)).

    >>> [keep(r, 0.0, 0.8) for r in (0.0, 1 / 16, 12 / 16, 13 / 16, 1.0)]
    [False, True, True, False, False]
    """
    return low < rate < high


def pass_rates(
    make_env: Callable[[], Any],
    factory: AgentFactory,
    instance_ids: list[str],
    k: int,
    workers: int = 1,
) -> tuple[dict[str, float], dict[str, int]]:
    """``k`` attempts per task; success rate = successes / k. Each worker owns one env."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    jobs = [(iid, j) for iid in instance_ids for j in range(k)]
    wins = dict.fromkeys(instance_ids, 0)
    errors: dict[str, int] = {}

    def work(chunk: list[tuple[str, int]]) -> list[tuple[str, bool]]:
        env = make_env()
        out = []
        try:
            for iid, _ in chunk:
                try:
                    ok, _ = run_episode(env, factory(), iid)
                except Exception as exc:  # one broken episode must not sink the whole filter run
                    log.warning("filter: episode of %s failed: %s", iid, exc)
                    errors[iid] = errors.get(iid, 0) + 1
                    ok = False
                out.append((iid, ok))
        finally:
            env.close()
        return out

    n = max(1, min(workers, len(jobs)))
    chunks = [jobs[i::n] for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        for result in pool.map(work, chunks):
            for iid, ok in result:
                wins[iid] += int(ok)
    return {iid: wins[iid] / k for iid in instance_ids}, errors


def filter_tasks(
    tasks: list[SWEInstance],
    make_env: Callable[[], Any],
    factory: AgentFactory,
    *,
    k: int = 16,
    low: float = 0.0,
    high: float = 0.8,
    workers: int = 1,
) -> tuple[list[SWEInstance], FilterReport]:
    """The tasks to keep (in input order) and the report."""
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}")
    ids = [t["instance_id"] for t in tasks]
    rates, errors = pass_rates(make_env, factory, ids, k, workers)
    kept = [t for t in tasks if keep(rates[t["instance_id"]], low, high)]
    return kept, FilterReport(rates, [t["instance_id"] for t in kept], k, low, high, errors)
