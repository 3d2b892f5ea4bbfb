"""Imports point down the map of docs/architecture.md; the few that do not are named there, and
no two packages import each other (a package-level cycle).

Every import statement counts, those inside functions and under ``TYPE_CHECKING`` included: a
lazy import is still a dependency; so does an import by a literal name
(``importlib.import_module("crl_train.x")``, ``__import__("crl_train.x")``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ["cli", "serve", "integrations", "experiment", "openrlhf", "run", "methods", "service", "extractor", "rollout", "policy",
          "algorithms", "config"]
"""crl_train's packages from the top down (docs/architecture.md, "Which way the imports point");
crl_gym is below all of them."""

EXCEPTIONS: dict[tuple[str, str], str] = {}
"""(importer, imported) pairs that point up, each named in docs/architecture.md with its reason."""

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


def _package(module: str) -> str:
    """``crl_train.run.trainer`` -> ``crl_train.run``; ``crl_gym.outbox`` stays itself."""
    return ".".join(module.split(".")[:2])


def package_cycles(imports: dict[str, list[str]], skip: Collection[tuple[str, str]] = ()) -> list[list[str]]:
    """The groups of packages (``crl_train.<x>``, ``crl_gym.<x>``) that import each other, directly or
    round a loop, from module-level ``imports``; the (importer, imported) pairs in ``skip`` left out."""
    graph: dict[str, set[str]] = {}
    for module, targets in imports.items():
        for target in targets:
            a, b = _package(module), _package(target)
            if a != b and (module, target) not in skip:
                graph.setdefault(a, set()).add(b)
    # Tarjan's strongly connected components: a component of more than one package is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                cycles.append(sorted([v, *group]))

    for v in list(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_package_imports_itself_round_a_loop() -> None:
    """A cycle is allowed only through an upward import named in docs/architecture.md (EXCEPTIONS)."""
    imports = {_module(p): _imports(p) for p in _project_files()}
    assert package_cycles(imports, set(EXCEPTIONS)) == []


def test_the_checker_sees_a_package_cycle() -> None:
    imports = {"crl_train.run.evaluate": ["crl_train.experiment.stats"],
               "crl_train.experiment.suite": ["crl_train.run.trainer"],
               "crl_gym.clients": ["crl_gym.outbox"], "crl_gym.outbox": ["crl_gym.errors"],
               "crl_train.policy.hf": ["crl_gym.protocol"]}
    assert package_cycles(imports) == [["crl_train.experiment", "crl_train.run"]]
    imports["crl_gym.outbox"].append("crl_gym.clients")  # lazy or TYPE_CHECKING: a cycle all the same
    assert sorted(package_cycles(imports)) == [["crl_gym.clients", "crl_gym.outbox"],
                                               ["crl_train.experiment", "crl_train.run"]]
    assert package_cycles(imports, {("crl_train.run.evaluate", "crl_train.experiment.stats")}) == [
        ["crl_gym.clients", "crl_gym.outbox"]]


def test_every_exception_is_still_there() -> None:
    """A named exception whose import is gone is dropped from the list (and from the doc)."""
    assert set(EXCEPTIONS) <= upward_imports(), set(EXCEPTIONS) - upward_imports()


def test_the_exceptions_are_named_in_the_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for importer, imported in EXCEPTIONS:
        assert f"`{importer}` → `{imported}`" in doc, (importer, imported)


def package_imports(imports: dict[str, list[str]]) -> dict[str, set[str]]:
    """crl_train's packages (``run``, ``cli``, …) -> the crl_train packages and ``crl_gym`` they import."""
    out: dict[str, set[str]] = {}
    for module, targets in imports.items():
        parts = module.split(".")
        if parts[0] != "crl_train" or len(parts) < 2:
            continue
        for target in targets:
            t = target.split(".")
            name = "crl_gym" if t[0] == "crl_gym" else t[1] if len(t) > 1 else "crl_train"
            if name != parts[1]:
                out.setdefault(parts[1], set()).add(name)
    return out


def _documented_package_imports() -> dict[str, set[str]]:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("## Which way the imports point"):doc.index("## Typing")]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and cells[0] != "package":
            package = cells[0].strip("`").removesuffix("/").removesuffix(".py")
            table[package] = {re.sub(r"\s*\(.*\)", "", name).strip() for name in cells[1].split(",")}
    return table


def test_the_doc_lists_what_each_package_imports() -> None:
    actual = package_imports({_module(p): _imports(p) for p in _project_files()})
    assert _documented_package_imports() == {k: v for k, v in actual.items() if k in LAYERS}

