"""The optional extras resolve with current releases of what they name, or say why they pin."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    section = cfg["options.extras_require"]
    return {name: [line.strip() for line in section[name].splitlines() if line.strip()] for name in section}


def test_dev_does_not_pull_gem_llms_reasoning_gym_pin() -> None:
    # gem-llm 0.1.0 pins reasoning-gym==0.1.23: in `dev` it would conflict with any current reasoning-gym
    assert not any(req.startswith("gem-llm") for req in _extras()["dev"])


def test_the_gem_extra_pins_gem_llm_and_says_why() -> None:
    assert any(req.startswith("gem-llm==0.1.0") for req in _extras()["gem"])
    text = (ROOT / "setup.cfg").read_text()
    reason = text[: text.index("\ngem =")].rsplit("\n\n", 1)[-1]
    assert "reasoning-gym==0.1.23" in reason and "conflict" in reason


def test_make_install_still_installs_the_gem_extra_for_ci() -> None:
    assert '".[train,envs,swe,gem,dev]"' in (ROOT / "Makefile").read_text()


def test_the_readme_says_what_the_tiny_extractor_can_and_cannot_write() -> None:
    readme = (ROOT / "README.md").read_text()
    said = readme[readme.index("What `--extractor tiny` can and cannot write"):]
    said = said[: said.index("\n\n")]
    assert "cannot write advice" in said and "--merge-seeded" in said and "never merged" in said
