"""The number of bare ``Any`` annotations in crl_gym + crl_train stays at most the one docs/architecture.md
states ("## Typing"): a new one needs a reason and a raised figure there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bare_any(source: str) -> int:
    """Annotations that are exactly ``Any``: a parameter (``*args`` / ``**kwargs`` included), a return or an
    annotated variable (``dict[str, Any]`` and ``Callable[..., Any]`` are not bare)."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            annotations = [p.annotation for p in params if p is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        else:
            continue
        count += sum(isinstance(x, ast.Name) and x.id == "Any" for x in annotations)
    return count


def documented_limit() -> int:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    found = re.search(r"bare `Any`\s+annotations stay at most (\d+)", text)
    assert found, "docs/architecture.md (## Typing) states the limit as 'bare `Any` annotations stay at most N'"
    return int(found.group(1))


def test_the_counter_sees_each_kind_of_bare_any() -> None:
    source = ("from typing import Any\n"
              "def f(a: Any, *args: Any, b: dict[str, Any], **kw: Any) -> Any: ...\n"
              "x: Any = 1\n"
              "y: list[Any] = []\n"
              "async def g(c: object) -> Any: ...\n")
    assert bare_any(source) == 6


def test_bare_any_stays_within_the_documented_limit() -> None:
    files = sorted(p for pkg in ("crl_gym", "crl_train") for p in (ROOT / pkg).rglob("*.py"))
    total = sum(bare_any(p.read_text(encoding="utf-8")) for p in files)
    limit = documented_limit()
    assert total <= limit, (f"{total} bare Any annotations in crl_gym + crl_train, above the {limit} of "
                            f"docs/architecture.md: type the new ones (or say there why not and raise the figure)")
    assert limit <= 100, "the issue's bound: at most 100 bare Any annotations"
