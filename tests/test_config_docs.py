"""The config key reference read from the dataclasses, and ``crl-train --show-config``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from crl_train.cli import train
from crl_train.config import TrainConfig, config_from_dict, dump_config, load_config
from crl_train.config.docs import (
    ConfigKey,
    config_reference,
    field_docs,
    render_config_yaml,
    type_name,
    undocumented_keys,
)

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


# ------------------------------------------------------------------ small dataclasses for the reader


@dataclass(frozen=True)
class _Base:
    """A base whose field docs must be inherited."""

    a: int = 1
    """Doc of a."""
    b: str = "x"
    """Base doc of b."""


@dataclass(frozen=True)
class _Child(_Base):
    b: str = "y"
    """Child doc of b,
       spread over two lines."""
    c: float = 0.5
    d: tuple[str, ...] = ()
    e: Literal["p", "q"] = "p"
    """Doc of e."""
    not_a_field = "class attribute without annotation"
    """Docstring of a non-field: ignored."""


@dataclass(frozen=True)
class _Inner:
    k: int = 3
    """Doc of k."""


@dataclass(frozen=True)
class _Outer:
    name: str = "n"
    """Doc of name."""
    inner: _Inner = field(default_factory=lambda: _Inner(k=7))
    """The inner section."""
    maybe: _Inner | None = None
    """An optional section, unset."""


def _all_dataclass_fields(cls: type, prefix: str = "") -> list[str]:
    """Every field reachable from ``cls``, found independently of config_docs (annotation walk)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            out += _all_dataclass_fields(tp, f"{prefix}{f.name}.")
    return out


# ------------------------------------------------------------------ the reference


def test_every_config_field_has_a_non_empty_doc() -> None:
    assert undocumented_keys() == [], "fields without an attribute docstring"
    for key in config_reference():
        assert key.doc.strip(), key.key


def test_reference_covers_every_reachable_field_in_order() -> None:
    assert [k.key for k in config_reference()] == _all_dataclass_fields(TrainConfig)
    keys = {k.key: k for k in config_reference()}
    # the section that lives outside crl_train.config (ManagerConfig) is walked too
    assert keys["manager"].section and "manager.diversity_lambda" in keys
    assert keys["manager.batch_size"].doc.startswith("B: a search batch")


def test_defaults_come_from_the_top_level_instance() -> None:
    keys = {k.key: k for k in config_reference()}
    # TrainConfig builds actor = ModelConfig(constrained=True), extractor = ModelConfig(max_new_tokens=96)
    assert keys["actor.constrained"].default is True
    assert keys["extractor.constrained"].default is False
    assert keys["extractor.max_new_tokens"].default == 96 and keys["actor.max_new_tokens"].default == 64
    assert keys["env.ids"] == ConfigKey("env.ids", "list of str", ["crl/MiniHack-Room-5x5-v0"], keys["env.ids"].doc)
    assert keys["algo.ratio_level"].type == "one of 'token', 'sequence'"
    assert keys["experience.offline_source"].type == "str or null" and keys["experience.offline_source"].default is None
    assert keys["env.kwargs"].type == "mapping" and keys["env.kwargs"].default == {}


def test_reader_inherits_overrides_and_ignores_non_docs() -> None:
    docs = field_docs(_Child)
    assert docs == {
        "a": "Doc of a.",
        "b": "Child doc of b, spread over two lines.",  # cleandoc + whitespace folded
        "c": "",
        "d": "",
        "e": "Doc of e.",
    }


def test_reader_walks_nested_and_optional_sections() -> None:
    ref = config_reference(_Outer)
    assert [(k.key, k.type, k.default, k.section) for k in ref] == [
        ("name", "str", "n", False),
        ("inner", "section", None, True),
        ("inner.k", "int", 7, False),  # the factory's value, not _Inner's class default 3
        ("maybe", "section", None, True),
        ("maybe.k", "int", 3, False),  # unset optional section: class defaults
    ]
    assert undocumented_keys(_Outer) == []
    assert undocumented_keys(_Child) == ["c", "d"]


def test_type_names() -> None:
    assert type_name(int) == "int"
    assert type_name(tuple[str, ...]) == "list of str"
    assert type_name(bool | None) == "bool or null"
    assert type_name(dict[str, int]) == "mapping"
    assert type_name(Literal["spawn", "forkserver"]) == "one of 'spawn', 'forkserver'"
    assert type_name(_Inner) == "section"


# ------------------------------------------------------------------ YAML with comments


@pytest.mark.parametrize("preset", PRESETS)
def test_rendered_yaml_reloads_to_the_same_config(preset: str) -> None:
    cfg = load_config(REPO / "configs" / preset)
    text = render_config_yaml(cfg, header="a header\nof two lines")
    assert config_from_dict(yaml.safe_load(text)) == cfg


def test_rendered_yaml_with_awkward_values_reloads() -> None:
    cfg = load_config(None, ["method=grpo", "train.steps=3", "env.kwargs={max_turns: 4, name: 'a: b'}",
                             'experience.seed_entries=["two\\nlines", "x: y", "# not a comment", "yes", "wait..."]'])
    text = render_config_yaml(cfg)
    back = config_from_dict(yaml.safe_load(text))
    assert back == cfg
    assert back.experience.seed_entries == ("two\nlines", "x: y", "# not a comment", "yes", "wait...")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=3), st.integers(min_value=1, max_value=10**6))
def test_rendered_yaml_roundtrips_any_text(entries: list[str], steps: int) -> None:
    base = TrainConfig()
    cfg = dataclasses.replace(base, experience=dataclasses.replace(base.experience, seed_entries=tuple(entries)),
                              train=dataclasses.replace(base.train, steps=steps))
    assert config_from_dict(yaml.safe_load(render_config_yaml(cfg))) == cfg


def test_each_key_has_its_doc_type_and_default_above_it() -> None:
    cfg = load_config(None)
    lines = render_config_yaml(cfg).splitlines()
    for key in config_reference():
        depth = key.key.count(".")
        name = key.key.rsplit(".", 1)[-1]
        indent = "  " * depth
        at = [i for i, line in enumerate(lines) if line.startswith(f"{indent}{name}:")]
        assert at, key.key
        i = at[0] if depth == 0 else next(i for i in at if _parent_of(lines, i) == key.key.rsplit(".", 1)[0])
        comments = []
        j = i - 1
        while j >= 0 and lines[j].startswith(f"{indent}# "):
            comments.insert(0, lines[j][len(indent) + 2:])
            j -= 1
        text = " ".join(comments)
        assert " ".join(key.doc.split()[:4]) in text, key.key
        if not key.section:
            assert comments[-1].startswith(f"type: {key.type}; default: "), key.key


def _parent_of(lines: list[str], i: int) -> str:
    """The dotted section a key line sits under: each nearest line above with less indent (no
    comment), up to the top level (``algo.edge`` for a key at depth 2)."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    parts: list[str] = []
    for j in range(i - 1, -1, -1):
        line = lines[j]
        if not line or line.lstrip().startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        if depth < indent:
            parts.insert(0, line.strip().split(":", 1)[0])
            indent = depth
            if depth == 0:
                break
    return ".".join(parts)


def test_comment_lines_are_wrapped() -> None:
    for line in render_config_yaml(load_config(None)).splitlines():
        if line.lstrip().startswith("# ") and not line.lstrip().startswith("# type:"):
            assert len(line) <= 96, line


# ------------------------------------------------------------------ crl-train --show-config


def test_show_config_prints_resolved_config_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(train, ["--config", str(REPO / "configs" / "webshop.yaml"), "--set", "train.steps=3",
                                     "--set", "method=grpo", "--out", str(out), "--show-config"])
    assert res.exit_code == 0, res.output
    cfg = config_from_dict(yaml.safe_load(res.output))
    assert cfg == load_config(REPO / "configs" / "webshop.yaml", ["train.steps=3", "method=grpo"])
    assert "#   --set train.steps=3" in res.output and "webshop.yaml" in res.output.splitlines()[1]
    assert not out.exists()  # no run directory, no log file, no training


def test_show_config_with_resume_reads_the_run_config(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    saved = load_config(None, ["train.steps=7", "method=static_online"])
    dump_config(saved, run / "config.yaml")
    res = CliRunner().invoke(train, ["--resume", str(run), "--set", "train.steps=9", "--show-config"])
    assert res.exit_code == 0, res.output
    cfg = config_from_dict(yaml.safe_load(res.output))
    assert cfg.method == "static_online" and cfg.train.steps == 9
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_show_config_bad_key_is_a_usage_error() -> None:
    res = CliRunner().invoke(train, ["--set", "algo.clip=0.3", "--show-config"])
    assert res.exit_code == 2 and "unknown key 'algo.clip'" in res.output


def test_show_config_through_the_installed_command(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "crl-train"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    help_text = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "--show-config" in help_text
    saved = tmp_path / "shown.yaml"
    proc = subprocess.run([str(exe), "--show-config", "--set", "env.group_size=6"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    saved.write_text(proc.stdout, encoding="utf-8")
    # what --show-config prints is a config file: it loads back through --config unchanged
    assert load_config(saved) == load_config(None, ["env.group_size=6"])
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ docs/training.md stays true to the code


def test_every_set_key_in_the_training_docs_exists() -> None:
    import re

    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    keys = {k.key for k in config_reference()}
    used = re.findall(r"--set\s+([a-z_.]+)=", text)
    assert len(used) >= 10  # the page shows many overrides; an empty match would make this test vacuous
    assert sorted(set(used) - keys) == []


def test_training_docs_list_every_metrics_field() -> None:
    from crl_train.run.outputs import METRIC_FIELDS

    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    table = text.split("### `metrics.jsonl`", 1)[1].split("\n## ", 1)[0]
    missing = [f for f in METRIC_FIELDS if f"`{f}`" not in table]
    assert missing == []
