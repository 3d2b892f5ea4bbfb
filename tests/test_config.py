"""Config loading: YAML + --set overrides, validation errors that name the key."""

from pathlib import Path

import pytest

from crl_train.config import (
    PACKAGED_CONFIGS,
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    parse_override,
)

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_defaults_are_paper_values() -> None:
    cfg = TrainConfig()
    assert cfg.algo.clip_eps == 0.2 and cfg.algo.cispo_eps_low == 0.1 and cfg.algo.cispo_eps_high == 0.1
    assert cfg.algo.buffer_size == 64 and cfg.algo.merge_every == 5 and cfg.env.group_size == 8
    assert cfg.actor.lr == 1e-6 and cfg.manager.batch_size == 16


def test_packaged_tiny_is_the_repo_tiny() -> None:
    assert (PACKAGED_CONFIGS / "tiny.yaml").read_text() == (REPO_CONFIGS / "tiny.yaml").read_text()


@pytest.mark.parametrize("name", ["tiny", "minihack_room", "webshop", "alfworld", "multitask"])
def test_every_preset_loads(name: str) -> None:
    cfg = load_config(REPO_CONFIGS / f"{name}.yaml")
    assert cfg.env.group_size % 2 == 0


def test_overrides_parse_yaml_values() -> None:
    cfg = load_config(None, ["train.steps=7", "algo.ratio_level=token", "env.ids=[crl/Sokoban-6x6-v0]", "experience.asynchronous=false"])
    assert cfg.train.steps == 7 and cfg.algo.ratio_level == "token"
    assert cfg.env.ids == ("crl/Sokoban-6x6-v0",) and cfg.experience.asynchronous is False
    assert parse_override("a.b= 1.5") == ("a.b", 1.5)


def test_exponent_floats_without_a_dot_are_floats() -> None:
    # YAML 1.1 reads ``1e-6`` as a string; the paper's learning rate is written that way
    cfg = load_config(None, ["actor.lr=1e-6", "extractor.lr=5E-4", "algo.adv_eps=+1e-8"])
    assert cfg.actor.lr == 1e-6 and cfg.extractor.lr == 5e-4 and cfg.algo.adv_eps == 1e-8
    with pytest.raises(ConfigError, match="actor.lr: expected float"):
        load_config(None, ["actor.lr=1e-6x"])


def test_think_tokens_are_validated() -> None:
    cfg = load_config(None, ["extractor.think_tokens=32"])
    assert cfg.extractor.think_tokens == 32 and cfg.extractor.constrained
    with pytest.raises(ConfigError, match="think_tokens .4. needs constrained=true"):
        load_config(None, ["extractor.constrained=false", "extractor.think_tokens=4"])
    with pytest.raises(ConfigError, match="think_tokens must be >= 0"):
        load_config(None, ["extractor.think_tokens=-1"])
    with pytest.raises(ConfigError, match=r"max_new_tokens \+ think_tokens \(48 \+ 2000\) must be < max_context_tokens \(2048\)"):
        load_config(None, ["extractor.think_tokens=2000"])
    with pytest.raises(ConfigError, match="actor.think_tokens must be 0"):
        load_config(None, ["actor.think_tokens=8"])


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.stepz=3", r"unknown key 'train.stepz' \(did you mean 'train.steps'\?\); "
                          "accepted keys: "
                          "checkpoint_every, eval_episodes, log_every, max_track_failures, steps"),
        ("algo.clip_epz=0.1", r"unknown key 'algo.clip_epz' \(did you mean 'algo.clip_eps'\?\)"),
        ("nope=1", "unknown key 'nope'"),
        ("train.steps=three", r"train.steps: expected int, got 'three'"),
        ("algo.gate=1", r"algo.gate: expected bool"),
        ("algo.ratio_level=word", r"algo.ratio_level: expected one of 'token', 'sequence'"),
        ("method=ppo", "accepted: grpo, complementary, static_online, exp_only, offline_exp, edge"),
        ("env.group_size=3", "env.group_size must be an even number"),
        ("manager.batch_size=0", "manager.*batch_size must be >= 1"),
        ("env=5", "env: expected EnvConfig"),
        ("train.steps", "--set expects key=value"),
    ],
)
def test_bad_input_names_the_key(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_offline_exp_needs_a_source() -> None:
    from crl_train.methods import check_method_config

    with pytest.raises(ConfigError, match="experience.offline_source"):
        check_method_config(load_config(None, ["method=offline_exp"]))  # the method checks what it needs


def test_roundtrip_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(None, ["train.steps=5"])
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_missing_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "bad.yaml")


# Paper values (App. C.2 and the pilot study), written out here: rollout batch = tasks_per_step × K.
@pytest.mark.parametrize(
    ("name", "batch", "micro", "turns", "steps", "max_seq", "max_new"),
    [
        ("minihack_room", 128, 64, 30, 145, 32768, 4096),  # 16 × 8 = 128
        ("webshop", 64, 16, 30, 256, 16384, 4096),  # 8 × 8 = 64; turns / output tokens not given by the paper
        ("alfworld", 128, 32, 40, 128, 16384, 2048),  # 16 × 8 = 128
        ("multitask", 384, 96, 30, 128, 32768, 4096),  # 48 × 8 = 384 (128 per task)
    ],
)
def test_presets_match_the_paper(name: str, batch: int, micro: int, turns: int, steps: int, max_seq: int, max_new: int) -> None:
    cfg = load_config(REPO_CONFIGS / f"{name}.yaml")
    assert cfg.env.group_size == 8 and cfg.env.tasks_per_step * cfg.env.group_size == batch
    assert cfg.actor.micro_batch_size == micro and cfg.env.max_turns == turns and cfg.train.steps == steps
    assert cfg.actor.max_context_tokens == max_seq and cfg.actor.max_new_tokens == max_new
    assert cfg.algo.buffer_size == 64 and cfg.algo.merge_every == 5 and cfg.actor.lr == 1e-6


def test_extractor_process_options() -> None:
    cfg = load_config(None, ["experience.extractor_process=false", "experience.extractor_start_method=forkserver"])
    assert cfg.experience.extractor_process is False and cfg.experience.extractor_start_method == "forkserver"
    assert load_config(None).experience.extractor_process is None  # auto
    with pytest.raises(ConfigError, match="experience.extractor_start_method: expected one of 'spawn', 'forkserver'"):
        load_config(None, ["experience.extractor_start_method=fork"])
    with pytest.raises(ConfigError, match=r"experience.extractor_nice must be in \[0, 19\]"):
        load_config(None, ["experience.extractor_nice=20"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor.lr=.nan", "actor.lr"),
        ("algo.clip_eps=.inf", "algo.clip_eps"),
        ("algo.edge_prune=-.inf", "algo.edge_prune"),
        ("experience.distill_linger_s=1e999", "experience.distill_linger_s"),  # a YAML 1.1 string that overflows
        ("manager.max_wait_ms=.nan", "manager.max_wait_ms"),  # a crl_gym dataclass, checked the same way
        ("env.kwargs={max_turns: .nan}", "env.kwargs.max_turns"),  # free-form mappings too
    ],
)
def test_non_finite_floats_are_refused_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}: expected a finite number, got"):
        load_config(None, [override])


def test_non_finite_floats_in_a_yaml_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("actor:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"actor.lr: expected a finite number, got nan"):
        load_config(tmp_path / "c.yaml")


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("train:\n  steps: 3\n# r\u00e9sum\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 21, line 3"):
        load_config(bad)
    (tmp_path / "utf16.yaml").write_text("train:\n  steps: 3\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"utf16.yaml: not UTF-8 text"):
        load_config(tmp_path / "utf16.yaml")


def test_method_settings_live_in_their_sections_and_the_flat_keys_still_work(caplog: pytest.LogCaptureFixture) -> None:
    new = load_config(None, ["algo.edge.kl_weight=0.3", "algo.gate.enabled=true", "algo.perplexity.transform=tanh"])
    from crl_train.config import io

    io._warned.clear()  # each old key is warned about once per process
    with caplog.at_level("WARNING", logger="crl_train.config.io"):
        old = load_config(None, ["algo.edge_lambda=0.3", "algo.gate=true", "algo.perplexity_bonus=tanh"])
    assert "config key algo.edge_lambda is deprecated: it is algo.edge.kl_weight now" in caplog.text
    assert old == new and new.algo.edge.kl_weight == 0.3 and new.algo.gate.enabled
    assert old.algo.edge_lambda == 0.3 and old.algo.perplexity_bonus == "tanh"  # old attribute names read through
    with pytest.raises(ConfigError, match="algo.edge_lambda and algo.edge.kl_weight are both given"):
        load_config(None, ["algo.edge_lambda=0.3", "algo.edge.kl_weight=0.2"])
    with pytest.raises(ConfigError, match=r"algo.edge.kl_estimator: expected one of 'topk', 'sampled'"):
        load_config(None, ["algo.edge.kl_estimator=exact"])
    with pytest.raises(AttributeError, match="no attribute 'edge_lambd'"):
        _ = new.algo.edge_lambd


def test_a_choice_is_checked_from_its_annotation_on_direct_construction_too() -> None:
    from crl_train.config import EdgeConfig, PerplexityConfig
    from crl_train.service import ServiceOptions

    with pytest.raises(ConfigError, match=r"algo.edge.kl_estimator: expected one of 'topk', 'sampled', got 'x'"):
        EdgeConfig(kl_estimator="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"algo.perplexity.transform: expected one of 'off', 'relative'"):
        PerplexityConfig(transform="cube")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ServiceOptions.entry_reward: expected one of 'direct', 'relative'"):
        ServiceOptions(entry_reward="other")  # type: ignore[arg-type]


def test_extractor_settings_are_the_one_source_of_the_extractors_defaults() -> None:
    from dataclasses import fields

    from crl_train.config import ExtractorSettings, ModelConfig
    from crl_train.extractor import ExtractorSpec
    from crl_train.service.build import extractor_spec

    # a default config's settings are the settings' own defaults (none repeated elsewhere)
    cfg = load_config(None, ["extractor.model=Qwen/Qwen3-0.6B", "extractor.constrained=false"])
    derived = ExtractorSettings.from_config(cfg)
    for f in fields(ExtractorSettings):
        if f.name not in ("max_new_tokens", "max_context_tokens", "max_prompt_chars"):
            assert getattr(derived, f.name) == f.default, f.name
    assert extractor_spec(cfg, None).settings == derived
    # the old keyword forms still work, with a DeprecationWarning
    with pytest.warns(DeprecationWarning, match="settings=ExtractorSettings"):
        spec = ExtractorSpec(ModelConfig(model="tiny"), options={"max_ops": 2})
    assert spec.options is None and spec.extractor_settings.max_ops == 2
    assert spec.extractor_settings.max_entry_chars == 64  # the tiny model's default stays
    with pytest.raises(ValueError, match="ExtractorSettings: max_ops must be >= 1"):
        ExtractorSettings(max_ops=0)
