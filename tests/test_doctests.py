"""Every docstring example in crl_gym and crl_train runs, module by module.

A module whose import needs a CUDA-only package is skipped, with the package named; any other
import error fails. Today that is ``crl_train.openrlhf.trainer`` (OpenRLHF's trainers import
``flash_attn``, which has no CPU wheel).
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

CUDA_ONLY = frozenset({"flash_attn", "vllm", "deepspeed"})
"""Packages with no CPU install: a module that needs one at import time cannot be doc-tested here."""
VERL_ENV = frozenset({"crl_gym.integrations.verl.agent_loop", "crl_gym.integrations.verl.tool",
                      "crl_train.integrations.verl"})
"""Modules that import verl: doc-tested by ``make test-verl`` in .venv-verl (``-k verl``), where verl
is installed; not collected where it is not (verl's pins cannot share the main environment)."""


def _modules() -> list[str]:
    names = []
    for pkg in ("crl_gym", "crl_train"):
        root = importlib.import_module(pkg)
        names += [pkg] + [m.name for m in pkgutil.walk_packages(root.__path__, pkg + ".")]
    return sorted(names)


MODULES = [m for m in _modules() if m not in VERL_ENV or importlib.util.find_spec("verl") is not None]


def test_every_package_module_is_collected() -> None:
    # the walk reaches nested packages (a module missing here would have its examples skipped silently)
    assert {"crl_gym.experience.manager", "crl_gym.envs.swebench.filter", "crl_train.policy.hf",
            "crl_train.extractor.worker", "crl_train.openrlhf.trainer"} <= set(MODULES)
    assert VERL_ENV <= set(_modules())


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] in CUDA_ONLY:
            pytest.skip(f"{name} imports {exc.name}, which needs CUDA")
        raise
    result = doctest.testmod(module, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
