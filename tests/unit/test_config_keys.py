"""Every key of every shipped config is either refused or read: none is parsed and ignored.

Refused: every model under each root config forbids unknown keys (``Strict``), so a key that
no model declares is an error naming the file and key.

Read: for each key a shipped config sets (``configs/<command>/*.toml``, ``configs/ablation/*.toml``, ``configs/learn/*.toml``,
``configs/suites/*.toml``), and for every field of the sandbox sections whether set or not,
an AST scan of ``src/`` and ``benchmarks/`` must find an attribute read of that field on
that section: ``<...>.sandbox.backend``, or ``x.backend`` where ``x`` was assigned from
``<...>.sandbox`` (``x, y = cfg.a, cfg.b`` and ``for x in cfg.libraries`` too), was
annotated with the section's model class, is ``self`` inside it, or is ``self.<attr>``
that some code sets to an instance of the class. A variable's own name never counts (a
``sandbox`` variable holding a Sandbox says nothing about ``[sandbox]``). The scan is
checked against the bug it is for: ``[sandbox] backend`` of ``opencomposer agent``, once
validated and then ignored, is reported unread when its one read is taken away.

Run: ``pytest tests/unit/test_config_keys.py -q``.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import tomllib
import typing
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

from pydantic import BaseModel

from opencomposer.cli.configs import root_model
from opencomposer.config import Strict, load_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(ROOT.glob("configs/*/*.toml"))


# configs/<folder>/ that belong to a benchmark script outside the package: (script, root model)
BENCH_ROOTS = {"ablation": ("ablation_behaviour", "AblationConfig"), "learn": ("learn_run", "LearnConfig")}


@cache
def _bench_root(folder: str) -> type[BaseModel]:
    script, name = BENCH_ROOTS[folder]
    spec = importlib.util.spec_from_file_location(script, ROOT / "benchmarks" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # pydantic resolves the module's annotations through sys.modules
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def root_of(path: Path) -> type[BaseModel]:
    if path.parent.name in BENCH_ROOTS:
        return _bench_root(path.parent.name)
    return root_model(path)


def model_in(annotation) -> type[BaseModel] | None:
    """The config model a field holds, through Optional / list / unions."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (m := model_in(arg)) is not None:
            return m
    return None


def models_under(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    yield model
    for f in model.model_fields.values():
        if (sub := model_in(f.annotation)) is not None:
            yield from models_under(sub)


def keys_set(data: dict, model: type[BaseModel], table: str | None = None,
             path: tuple[str, ...] = ()) -> Iterator[tuple[str, type[BaseModel], str, str | None]]:
    """(dotted key, model declaring it, field, name of its table) for every value the file sets."""
    for key, value in data.items():
        sub = model_in(model.model_fields[key].annotation)
        items = value if isinstance(value, list) and value and isinstance(value[0], dict) else [value]
        if sub is not None and all(isinstance(v, dict) for v in items):
            for v in items:
                yield from keys_set(v, sub, key, path + (key,))
        else:
            yield ".".join(path + (key,)), model, key, table


class Reads(ast.NodeVisitor):
    """Attribute reads as ((receiver kind, receiver), attribute): kind "table" for ``<..>.table.attr``
    and variables assigned from ``<..>.table``; kind "class" for variables known to hold a model."""

    def __init__(self, attr_types: dict[str, set[str]]):
        self.found: set[tuple[tuple[str, str], str]] = set()
        self.attr_types = attr_types  # self.<attr> = <an instance of class C>, anywhere
        self.classes: list[str] = []
        self.scopes: list[dict[str, tuple[str, str]]] = [{}]

    def _lookup(self, name: str) -> tuple[str, str] | None:
        return next((s[name] for s in reversed(self.scopes) if name in s), None)

    def _receivers(self, node: ast.expr) -> list[tuple[str, str]]:
        if isinstance(node, ast.Subscript):
            return self._receivers(node.value)
        if isinstance(node, ast.Attribute):
            return [("table", node.attr)] + [("class", c) for c in self.attr_types.get(node.attr, ())]
        if isinstance(node, ast.Name):
            if node.id in ("self", "cls") and self.classes:
                return [("class", self.classes[-1])]
            known = self._lookup(node.id)
            if known and known[0] == "table":  # cfg = self.cfg: also what self.cfg is known to hold
                return [known] + [("class", c) for c in self.attr_types.get(known[1], ())]
            return [known] if known else []
        return []

    def _kind(self, value: ast.expr) -> tuple[str, str] | None:
        """What an assigned value is: a table (``x.table``) or an instance of a class."""
        if isinstance(value, ast.BoolOp):  # cfg or AgentConfig()
            return next(filter(None, map(self._kind, value.values)), None)
        if isinstance(value, ast.Attribute):
            return ("table", value.attr)
        if isinstance(value, ast.Name):
            return self._lookup(value.id)
        if isinstance(value, ast.Call):
            f = value.func
            if isinstance(f, ast.Name) and f.id[:1].isupper():
                return ("class", f.id)
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            if name in ("load_config", "validate") and len(value.args) >= 2 and isinstance(value.args[1], ast.Name):
                return ("class", value.args[1].id)
        return None

    def visit_ClassDef(self, node):
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _function(self, node):
        scope = {}
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            for n in ast.walk(a.annotation) if a.annotation is not None else ():
                if isinstance(n, ast.Name) and n.id[:1].isupper():
                    scope[a.arg] = ("class", n.id)
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):  # "RLRunConfig"
                    scope[a.arg] = ("class", n.value.split("[")[0].split(" ")[0])
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Assign(self, node):
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                    and len(target.elts) == len(node.value.elts):  # r, m = cfg.rollout, cfg.model
                for t, v in zip(target.elts, node.value.elts):
                    if isinstance(t, ast.Name) and (kind := self._kind(v)):
                        self.scopes[-1][t.id] = kind
            elif (kind := self._kind(node.value)) is not None:
                if isinstance(target, ast.Name):
                    self.scopes[-1][target.id] = kind
                elif isinstance(target, ast.Attribute) and kind[0] == "class":
                    self.attr_types.setdefault(target.attr, set()).add(kind[1])
        self.generic_visit(node)

    def visit_For(self, node):
        it, target = node.iter, node.target
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.args \
                and it.func.id in ("enumerate", "sorted", "list", "reversed"):
            it = it.args[0]
        if isinstance(target, ast.Tuple) and target.elts:  # for i, lib in enumerate(cfg.libraries)
            target = target.elts[-1]
        if isinstance(target, ast.Name) and isinstance(it, ast.Attribute):
            self.scopes[-1][target.id] = ("table", it.attr)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if isinstance(node.ctx, ast.Load):
            for receiver in self._receivers(node.value):
                self.found.add((receiver, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant):
            for receiver in self._receivers(node.args[0]):
                self.found.add((receiver, node.args[1].value))
        self.generic_visit(node)


def scan(sources: Iterable[str]) -> set[tuple[tuple[str, str], str]]:
    trees = [ast.parse(s) for s in sources]
    attr_types: dict[str, set[str]] = {}
    for _ in range(2):  # the first pass learns what self.<attr> holds, the second uses it everywhere
        reads = Reads(attr_types)
        for tree in trees:
            reads.visit(tree)
    return reads.found


def is_read(found, model: type[BaseModel], field: str, table: str | None) -> bool:
    classes = {c.__name__ for c in model.__mro__ if issubclass(c, BaseModel) and c not in (BaseModel, Strict)}
    return any(attr == field and (receiver in {("class", c) for c in classes} or receiver == ("table", table))
               for receiver, attr in found)


def source_files() -> dict[Path, str]:
    return {p: p.read_text() for d in ("src", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))}


@cache
def reads_in_tree() -> frozenset:
    return frozenset(scan(source_files().values()))


def test_every_shipped_config_loads_with_its_root():
    assert len(SHIPPED) >= 15
    for f in SHIPPED:
        load_config(f, root_of(f))


def test_every_config_model_refuses_unknown_keys():
    for f in SHIPPED:
        for m in models_under(root_of(f)):
            assert m.model_config.get("extra") == "forbid", f"{m.__name__} (under {f.name}) would drop unknown keys"


def test_every_key_of_every_shipped_config_is_read():
    found = reads_in_tree()
    unread = sorted({f"{f.relative_to(ROOT)}: {key}" for f in SHIPPED
                     for key, model, field, table in keys_set(tomllib.loads(f.read_text()), root_of(f))
                     if not is_read(found, model, field, table)})
    assert not unread, "set in a shipped config, never read by the code: " + ", ".join(unread)


def test_every_sandbox_setting_is_read_set_or_not():
    from opencomposer.config import AgentRunConfig, SandboxConfig
    from opencomposer.realtime.config import GateSection
    from opencomposer.rl.config import RolloutSection, SandboxPoolSection
    from opencomposer.tasks.factory import FactorySettings

    found = reads_in_tree()
    settings = [(SandboxConfig, f, "sandbox") for f in SandboxConfig.model_fields]
    settings += [(SandboxPoolSection, f, "sandbox_pool") for f in SandboxPoolSection.model_fields]
    settings += [(RolloutSection, "backend", "rollout"), (GateSection, "backend", "gate"),
                 (FactorySettings, "backend", "factory")]
    assert AgentRunConfig.model_fields["sandbox"].annotation is SandboxConfig
    unread = [f"[{table}] {field}" for model, field, table in settings if not is_read(found, model, field, table)]
    assert not unread, f"sandbox settings never read: {unread}"


def test_the_scan_reports_the_ignored_sandbox_key_it_is_for():
    """``[sandbox] backend`` of the agent config, with its one read taken out of the CLI, is unread;
    a ``sandbox.backend`` read on a Sandbox object elsewhere does not count for it."""
    from opencomposer.config import SandboxConfig

    files = source_files()
    cli = ROOT / "src" / "opencomposer" / "cli"
    assert is_read(reads_in_tree(), SandboxConfig, "backend", "sandbox")
    without = {p: (s.replace("cfg.sandbox.backend", "'auto'") if p.parent == cli else s) for p, s in files.items()}
    assert any("sandbox.backend" in s for s in without.values())  # e.g. sandbox/checkpoint.py: a Sandbox's
    assert not is_read(scan(without.values()), SandboxConfig, "backend", "sandbox")
