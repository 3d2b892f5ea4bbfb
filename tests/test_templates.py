"""crl_gym.templates: every template in one module, documented, and the old names still import."""

from __future__ import annotations

import ast
import doctest
import re
import string
from pathlib import Path

import pytest

import crl_gym.templates as templates
from crl_gym.wrappers.text_actions import check_template

ROOT = Path(__file__).resolve().parents[1]


def _constants(tree: ast.Module) -> list[tuple[str, ast.expr, ast.stmt | None]]:
    """(name, value, next statement) of every UPPER_CASE module-level assignment."""
    out = []
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper() and name != "__ALL__":
                out.append((name, node.value, tree.body[i + 1] if i + 1 < len(tree.body) else None))
    return out


def test_every_template_is_a_str_with_a_short_docstring() -> None:
    tree = ast.parse(Path(templates.__file__).read_text(encoding="utf-8"))
    names = []
    for name, _, nxt in _constants(tree):
        names.append(name)
        assert isinstance(getattr(templates, name), str), name
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
        # one short paragraph (wrapped at 100 columns): what the template is and its fields
        assert isinstance(doc, str) and doc.strip(), f"{name} needs a docstring"
        assert "\n\n" not in doc.strip() and doc.strip().count("\n") <= 2, f"{name}: keep it short"
    assert sorted(names) == sorted(templates.__all__)
    assert len(names) >= 25


def test_old_names_are_the_same_objects() -> None:
    import crl_gym.experience.prompts as prompts
    import crl_gym.wrappers as wrappers
    import crl_gym.wrappers.experience as experience
    import crl_gym.wrappers.search_and_ask as search_and_ask

    assert experience.DEFAULT_TEMPLATE is wrappers.DEFAULT_TEMPLATE is templates.GUIDED_OBSERVATION_TEMPLATE
    for old, new in (("ANSWER_TEMPLATE", "SEARCH_AND_ASK_ANSWER_TEMPLATE"),
                     ("NO_ENTRY_TEMPLATE", "SEARCH_AND_ASK_NO_ENTRY_TEMPLATE"),
                     ("OVER_CAP_TEMPLATE", "SEARCH_AND_ASK_OVER_CAP_TEMPLATE"),
                     ("EMPTY_QUERY_TEMPLATE", "SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE"),
                     ("ERROR_TEMPLATE", "SEARCH_AND_ASK_ERROR_TEMPLATE")):
        assert getattr(search_and_ask, old) is getattr(templates, new), old
    for name in ("DISTILLATION_TEMPLATE", "REFINEMENT_TEMPLATE", "MERGE_TEMPLATE", "EXPERIENCE_TEMPLATE",
                 "SEARCH_AND_ASK_TOOL", "SEARCH_ANSWER_TEMPLATE", "SEARCH_NO_RESULT"):
        assert getattr(prompts, name) is getattr(templates, name), name
    assert prompts._UPDATE_RULE_GUIDED is templates.UPDATE_RULE_GUIDED
    assert prompts._UPDATE_RULE_FREE is templates.UPDATE_RULE_FREE


@pytest.mark.parametrize("module", ["crl_gym/wrappers", "crl_gym/experience"])
def test_no_other_module_of_the_wrappers_or_the_experience_layer_writes_a_template(module: str) -> None:
    for path in sorted((ROOT / module).glob("*.py")):
        for name, value, _ in _constants(ast.parse(path.read_text(encoding="utf-8"))):
            text = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
            if text is not None:  # a text template: a *_TEMPLATE name, or {field} placeholders
                assert "TEMPLATE" not in name and not re.search(r"\{[a-z_]+\}", text), f"{path.name}: {name}"


def test_the_trainer_texts_are_the_ones_crl_train_wrote_inline() -> None:
    # Pinned: these were crl_train's own constants (rollout) and f-string (trainer's gate) and are
    # model-facing; a change of wording is a change of experiment, so it must show in a diff here.
    assert templates.SYSTEM_CONSTRAINED == "You are an agent in a text environment. Answer with one action."
    assert templates.SYSTEM_REACT == (
        "You are an agent in a text environment. Think briefly, then give exactly one action inside "
        "<action>...</action>. You may also write search_and_ask[<your question>] inside the tags to "
        "ask the experience bank for advice.")
    assert templates.SEARCH_ACTION == "search_and_ask[what should I do next?]"
    task, text = "Push the box {left}", "Boxes in corners are lost."
    assert templates.GATE_TEMPLATE.format(task=task, success_rate="0.50", experience=text) == (
        f"Task: {task}\nYour success rate on this task so far: 0.50\nExperience: {text}\n"
        "Before you start: will this experience help you? Answer accept, refine or reject.")


def test_wrapper_templates_are_valid_format_strings_with_their_fields() -> None:
    check_template(templates.GUIDED_OBSERVATION_TEMPLATE, "guided", ("experience", "observation"),
                   ("experience", "observation"))
    for name in ("SEARCH_AND_ASK_ANSWER_TEMPLATE", "SEARCH_AND_ASK_NO_ENTRY_TEMPLATE", "SEARCH_AND_ASK_OVER_CAP_TEMPLATE",
                 "SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE", "SEARCH_AND_ASK_ERROR_TEMPLATE"):
        check_template(getattr(templates, name), name, ("query", "answer", "observation", "max_calls"), ("observation",))
    fields = {f for _, f, _, _ in string.Formatter().parse(templates.GATE_TEMPLATE) if f}
    assert fields == {"task", "success_rate", "experience"}
    fields = {f for _, f, _, _ in string.Formatter().parse(templates.GATE_REFINE_TEMPLATE) if f}
    assert fields == {"task", "experience"}


def test_docstring_example_runs() -> None:
    result = doctest.testmod(templates)
    assert result.attempted > 0 and result.failed == 0
