"""Imports point one way, downwards, and nothing imports in a circle (issue 29).

The layering of docs/architecture.md, top first; a module may import its own layer or any below:

    cli, bench -> pipeline, realtime -> rl, eval -> train -> episode, policies, inference
      -> grading -> tasks, rewards -> harness, sandbox, models, sync -> protocols, config, paths

A module's layer is its package's (``opencomposer/<package>/...``; the top-level modules and the
package ``__init__`` are the bottom layer). Three rules, each a test:
- no upward import: the failure names file:line, both layers and the rule;
- no cycle between packages (two packages of one layer importing each other, directly or round
  a longer loop);
- no cycle between modules (files), anywhere.

What counts as an import of module M (read with ``ast``, every ``.py`` under src/opencomposer):
``import``/``from ... import`` anywhere in the file, relative ones resolved, including lazy ones
inside functions (a lazy import defers loading, not the dependency); a literal
``importlib.import_module("opencomposer...")``; and a registry string ``"opencomposer.x.y:Name"``
(a lazy registry is an import by name). Not counted: imports under ``if TYPE_CHECKING:`` (they
never run; annotations only) and ``from __future__``.

Run: ``pytest -q tests/unit/test_layers.py``; ``python tests/unit/test_layers.py`` prints the
counts as one JSON line (``--list`` first prints any upward edges and cycles).
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PKG = "opencomposer"

# Bottom first. "__init__" stands for the package's own __init__.py (module ``opencomposer``).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("protocols", "config", "paths", "pyparse", "__init__"),
    ("harness", "sandbox", "models", "sync"),
    ("tasks", "rewards"),
    ("grading",),
    ("episode", "policies", "inference"),
    ("train",),
    ("rl", "eval"),
    ("pipeline", "realtime"),
    ("cli", "bench"),
)
RULE = " -> ".join(", ".join(p for p in layer if p != "__init__") for layer in reversed(LAYERS))


@dataclass(frozen=True)
class Import:
    """One import site: ``importer`` (a module) imports ``imported`` (a module of the tree)."""

    importer: str
    imported: str
    path: Path
    line: int
    lazy: bool  # inside a function body (or a registry string / import_module call)


def package_of(module: str) -> str:
    """``opencomposer.rl.run`` -> ``rl``; top-level modules are their own package; the root package
    is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    """Index into LAYERS (0 = bottom) of ``module``; KeyError names a package with no layer yet."""
    package = package_of(module)
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise KeyError(f"{module}: package '{package}' has no layer; add it to LAYERS in {Path(__file__).name}")


def layer_name(i: int) -> str:
    return ", ".join(p for p in LAYERS[i] if p != "__init__")


def modules(src: Path) -> dict[str, Path]:
    """Every module under ``src/opencomposer``: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for path in sorted((src / PKG).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _registry_target(node: ast.AST) -> str | None:
    """``"opencomposer.x:Name"`` and ``importlib.import_module("opencomposer.x")``: the module named."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        module, colon, attr = node.value.partition(":")
        if colon and attr.isidentifier() and module.startswith(PKG + ".") and all(
                p.isidentifier() for p in module.split(".")):
            return module
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.AST, bool]]:
    """Each import statement or registry reference with whether it is lazy; TYPE_CHECKING bodies skipped."""
    def visit(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.AST, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the ``else:`` of a TYPE_CHECKING guard does run
                yield from visit(child, lazy)
            return
        if _registry_target(node):
            yield node, True
        # class bodies run at import time; only function bodies defer their imports
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    yield from visit(tree, False)


def _known(name: str, mods: dict[str, Path]) -> str:
    """The longest prefix of dotted ``name`` that is a module of the tree."""
    parts = name.split(".")
    while parts and ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts) or PKG


def _targets(node: ast.AST, importer: str, mods: dict[str, Path]) -> list[str]:
    """The tree modules ``node`` imports from ``importer`` (relative imports resolved)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = importer.split(".")
            if mods[importer].name != "__init__.py":
                package.pop()
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        # ``from pkg import sub`` imports module pkg.sub when there is one, else a name of pkg
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    else:
        names = [_registry_target(node) or ""]
    return [_known(n, mods) for n in names if n == PKG or n.startswith(PKG + ".")]


def scan(src: Path = SRC) -> list[Import]:
    """Every import of a tree module by another module of the tree, in file and line order."""
    mods = modules(src)
    out = []
    for importer, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, lazy in _import_nodes(tree):
            for imported in dict.fromkeys(_targets(node, importer, mods)):  # once per statement
                if imported != importer:
                    out.append(Import(importer, imported, path, node.lineno, lazy))
    return out


def upward(imports: list[Import]) -> list[Import]:
    """Imports across packages whose target sits in a higher layer than the importer."""
    return [i for i in imports
            if package_of(i.importer) != package_of(i.imported) and layer_of(i.importer) < layer_of(i.imported)]


def package_graph(imports: list[Import]) -> dict[str, set[str]]:
    """package -> the other packages it imports, lazily or not."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        a, b = package_of(i.importer), package_of(i.imported)
        if a != b:
            graph[a].add(b)
    return graph


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    """module -> the other modules of the tree it imports, lazily or not."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        graph[i.importer].add(i.imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected sets of two or more nodes (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _site(i: Import, src: Path) -> str:
    return f"{i.path.relative_to(src.parent)}:{i.line}"


def upward_problems(imports: list[Import], src: Path = SRC) -> list[str]:
    """One line per upward import site."""
    return [
        f"{_site(i, src)}: {i.importer} (layer {layer_name(layer_of(i.importer))}) imports {i.imported} "
        f"(layer {layer_name(layer_of(i.imported))}){' lazily' if i.lazy else ''}: an upward import. "
        f"Dependencies point one way, downwards: {RULE}. Move what is shared down, or pass it in."
        for i in upward(imports)]


def cycle_problems(imports: list[Import], kind: str, src: Path = SRC) -> list[str]:
    """One line per cycle between packages (``kind="package"``) or modules (``"module"``), with its edges."""
    node = package_of if kind == "package" else (lambda m: m)
    graph = package_graph(imports) if kind == "package" else module_graph(imports)
    problems = []
    for cycle in sorted(cycles(graph)):
        members = set(cycle)
        edges = sorted({f"{_site(i, src)}: {i.importer} -> {i.imported}{' (lazy)' if i.lazy else ''}"
                        for i in imports if node(i.importer) in members and node(i.imported) in members
                        and node(i.importer) != node(i.imported)})
        problems.append(f"import cycle between {kind}s {cycle}: move what both need into one of them or "
                        f"below both, or pass it in. Edges:\n    " + "\n    ".join(edges))
    return problems


# ---- the tests ----

def test_every_module_has_a_layer():
    missing = []
    for module in modules(SRC):
        try:
            layer_of(module)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_no_upward_import():
    problems = upward_problems(scan())
    assert not problems, f"{len(problems)} layering problem(s):\n" + "\n".join(problems)


def test_no_cycle_between_packages():
    problems = cycle_problems(scan(), "package")
    assert not problems, "\n".join(problems)


def test_no_cycle_between_modules():
    problems = cycle_problems(scan(), "module")
    assert not problems, "\n".join(problems)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / PKG / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_scanner_catches_each_kind_of_upward_import_and_cycle(tmp_path):
    """A synthetic tree with one of each kind of upward import, one exempt import and cycles."""
    src = tmp_path / "src"
    _write(src, {
        "__init__.py": "",
        "protocols.py": "from __future__ import annotations\n"
                        "from typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from opencomposer.cli import main\n"  # exempt: never runs
                        "def f():\n    from opencomposer.rl import run\n    return run\n",  # lazy, upward
        "harness/__init__.py": "",
        "harness/loop.py": "from ..rl.run import step\nfrom . import tools\n",  # relative, upward
        "harness/tools.py": "",
        "rl/__init__.py": "",
        "rl/run.py": "import opencomposer.harness.loop\nfrom opencomposer import protocols\ndef step(): ...\n",
        "episode/run.py": "from opencomposer.rl.run import step\n",  # episode -> rl
        "pipeline/run.py": "from opencomposer.cli import main\n",  # pipeline -> cli
        "cli/__init__.py": "ROOTS = {'rl': 'opencomposer.rl.run:step'}\ndef main(): ...\n",  # registry
        "tasks/a.py": "def f():\n    from opencomposer.rewards import b\n",  # one layer, lazily...
        "rewards/b.py": "from opencomposer.tasks import a\n",  # ...and back: a package cycle
    })
    imports = scan(src)
    assert {(i.importer, i.imported, i.line, i.lazy) for i in upward(imports)} == {
        ("opencomposer.protocols", "opencomposer.rl.run", 6, True),
        ("opencomposer.harness.loop", "opencomposer.rl.run", 1, False),
        ("opencomposer.episode.run", "opencomposer.rl.run", 1, False),
        ("opencomposer.pipeline.run", "opencomposer.cli", 1, False),
    }
    assert ("opencomposer.cli", "opencomposer.rl.run", True) in {(i.importer, i.imported, i.lazy) for i in imports}
    problems = upward_problems(imports, src)
    assert len(problems) == 4
    assert any(p.startswith("src/opencomposer/harness/loop.py:1: opencomposer.harness.loop (layer harness, ")
               and "(layer rl, eval)" in p and RULE in p for p in problems), problems
    # harness <-> rl and rl <-> protocols (lazy) and tasks <-> rewards (lazy) are package cycles
    assert cycles(package_graph(imports)) == {("harness", "protocols", "rl"), ("rewards", "tasks")}
    packages = cycle_problems(imports, "package", src)
    assert len(packages) == 2
    assert any("('rewards', 'tasks')" in p and "src/opencomposer/tasks/a.py:2: opencomposer.tasks.a -> "
               "opencomposer.rewards.b (lazy)" in p for p in packages), packages
    modules_ = cycle_problems(imports, "module", src)
    assert any("src/opencomposer/rl/run.py:1: opencomposer.rl.run -> opencomposer.harness.loop" in p
               for p in modules_), modules_


def test_real_tree_with_one_lazy_upward_import_added_fails_naming_it(tmp_path):
    """Today's tree plus one lazy ``harness/loop.py -> cli`` import: exactly that one is reported."""
    src = tmp_path / "src"
    shutil.copytree(SRC / PKG, src / PKG, ignore=shutil.ignore_patterns("__pycache__", "*.jsonl"))
    loop = src / PKG / "harness" / "loop.py"
    loop.write_text(loop.read_text() + "\n\ndef _late():\n    from opencomposer.cli.common import main\n")
    problems = upward_problems(scan(src), src)
    assert len(problems) == 1 and problems[0].startswith("src/opencomposer/harness/loop.py:"), problems
    assert "imports opencomposer.cli.common (layer cli, bench) lazily" in problems[0]


def main(argv: list[str]) -> int:
    imports = scan()
    problems = upward_problems(imports) + cycle_problems(imports, "package") + cycle_problems(imports, "module")
    for p in problems:
        print(p, file=sys.stderr if "--list" not in argv else sys.stdout)
    print(json.dumps({
        "check": "layers", "ok": not problems, "modules": len(modules(SRC)), "imports": len(imports),
        "upward": len(upward(imports)), "package_cycles": len(cycles(package_graph(imports))),
        "module_cycles": len(cycles(module_graph(imports))),
    }))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
