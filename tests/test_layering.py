"""Imports point down the map of docs/architecture.md; the few that do not are named there.

Every import statement counts, those inside functions and under ``TYPE_CHECKING`` included: a
lazy import is still a dependency; so does an import by a literal name
(``importlib.import_module("crl_train.x")``, ``__import__("crl_train.x")``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ["cli", "serve", "integrations", "experiment", "openrlhf", "run", "methods", "rollout", "service", "extractor", "policy",
          "algorithms", "config"]
"""crl_train's packages from the top down (docs/architecture.md, "Which way the imports point");
crl_gym is below all of them."""

EXCEPTIONS = {
    ("crl_train.run.evaluate", "crl_train.experiment.stats"): "a leaf: the intervals of eval.json and of reports",
    ("crl_train.extractor.worker", "crl_train.run.affinity"): "a leaf: the worker pins its own process",
    ("crl_gym.envs.swebench.filter", "crl_train.policy"): "optional: a model directory as the filter's agent",
}
"""(importer, imported) pairs that point up, each named in docs/architecture.md with its reason."""

LEAVES = ("crl_train.experiment.stats", "crl_train.run.affinity")
"""Modules any layer may import because they import nothing of the project."""


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _rank(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "crl_gym":
        return len(LAYERS)
    if parts[0] == "crl_train" and len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return None


def _string_import(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("m")`` / ``import_module("m")`` / ``__import__("m")``
    with a literal name (a relative name or a computed one is not a cross-package import by name)."""
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
        return arg.value
    return None


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.Call) and (module := _string_import(node)) is not None:
            out.append(module)
    return [m for m in out if m.split(".")[0] in ("crl_gym", "crl_train")]


def _project_files() -> list[Path]:
    return sorted(p for pkg in ("crl_gym", "crl_train") for p in (ROOT / pkg).rglob("*.py"))


def upward(imports: dict[str, list[str]]) -> set[tuple[str, str]]:
    """The (importer, imported) pairs of ``imports`` (module -> the modules it imports) that point up."""
    found = set()
    for module, targets in imports.items():
        me = _rank(module)
        for target in targets:
            rank = _rank(target)
            if me is not None and rank is not None and rank < me:
                found.add((module, target))
    return found


def upward_imports() -> set[tuple[str, str]]:
    return upward({_module(p): _imports(p) for p in _project_files()})


def test_every_crl_train_package_is_on_the_map() -> None:
    packages = {p.name for p in (ROOT / "crl_train").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "crl_train").glob("*.py")} - {"__init__"}
    assert packages | modules <= set(LAYERS), (packages | modules) - set(LAYERS)


def test_imports_point_down_except_the_named_ones() -> None:
    unexpected = upward_imports() - set(EXCEPTIONS)
    assert not unexpected, f"upward imports not named in docs/architecture.md: {sorted(unexpected)}"


def test_the_checker_sees_an_upward_import() -> None:
    imports = {"crl_train.policy.hf": ["crl_train.run.trainer", "crl_train.algorithms"],
               "crl_gym.wrappers.experience": ["crl_train.rollout.runner", "crl_gym.protocol"],
               "crl_train.run.trainer": ["crl_train.policy.hf", "crl_gym.clients"]}
    assert upward(imports) == {("crl_train.policy.hf", "crl_train.run.trainer"),
                               ("crl_gym.wrappers.experience", "crl_train.rollout.runner")}


def test_the_checker_sees_a_string_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('import importlib\n\n\ndef load():\n'
                       '    a = importlib.import_module("crl_train.serve")\n'
                       '    b = __import__("crl_train.run.trainer")\n'
                       '    c = importlib.import_module(".sibling", __name__)\n'
                       '    return a, b, c\n', encoding="utf-8")
    assert _imports(planted) == ["crl_train.serve", "crl_train.run.trainer"]
    assert upward({"crl_gym.planted": _imports(planted)}) == {("crl_gym.planted", "crl_train.serve"),
                                                            ("crl_gym.planted", "crl_train.run.trainer")}


def test_leaves_import_nothing_of_the_project() -> None:
    for leaf in LEAVES:
        path = ROOT / (leaf.replace(".", "/") + ".py")
        assert _imports(path) == [], f"{leaf} is named as a leaf but imports {_imports(path)}"


def test_the_exceptions_are_named_in_the_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for importer, imported in EXCEPTIONS:
        assert f"`{importer}` → `{imported}`" in doc, (importer, imported)
