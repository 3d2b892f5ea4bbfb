"""The small preset: a file in configs/, the same file packaged (``--config small``), and what it chooses."""

from __future__ import annotations

from pathlib import Path

import pytest

from crl_train.config import PACKAGED_CONFIGS, ConfigError, load_config, preset_path

REPO = Path(__file__).resolve().parents[1]


def test_the_packaged_small_preset_is_the_repository_file() -> None:
    assert (PACKAGED_CONFIGS / "small.yaml").read_text() == (REPO / "configs" / "small.yaml").read_text()


def test_a_preset_name_loads_the_packaged_file() -> None:
    assert preset_path("small") == PACKAGED_CONFIGS / "small.yaml"
    assert load_config("small") == load_config(REPO / "configs" / "small.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no_such_preset")


def test_the_small_preset_trains_smollm2_with_lora_as_extractor_and_the_tiny_actor() -> None:
    cfg = load_config("small")
    assert (cfg.extractor.model, cfg.extractor.lora_rank, cfg.extractor.structured) == ("smollm2-135m", 16, True)
    assert cfg.actor.model == "tiny" and cfg.actor.constrained
    assert cfg.experience.max_entry_chars == 160 and cfg.experience.max_prompt_chars == 1500
    assert cfg.extractor.temperature < 1.0 and cfg.extractor.top_p == 1.0  # CISPO needs exact log-probs
    # docs/results/retrieval_quality: SmolLM2's entries name no task; keyed by task they are found for it
    assert (cfg.manager.retrieve_by, cfg.experience.embedder) == ("task", "minilm")


def test_the_small_recall_preset_is_the_setting_its_pilots_and_suite_measured() -> None:
    assert (PACKAGED_CONFIGS / "small_recall.yaml").read_text() == (REPO / "configs" / "small_recall.yaml").read_text()
    cfg = load_config("small_recall")
    assert cfg.env.kwargs == {"num_tasks": 256, "length": 1, "num_actions": 2, "secret_seed": 1}
    assert (cfg.manager.retrieve_by, cfg.experience.embedder, cfg.experience.distill_per_group) == ("task", "minilm", 1)
    assert cfg.experience.distill_fraction == 1.0 and cfg.train.steps * cfg.env.tasks_per_step == 2000  # requests
    assert cfg.experience.max_ops == 1 and cfg.algo.cispo_normalisation == "sequences" and cfg.algo.buffer_size == 8
