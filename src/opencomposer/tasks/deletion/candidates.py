"""Candidates: the functions, methods and classes of a library that make fair deletion tasks.

A function candidate is a function or method in the library's own source (not its tests,
docs or examples) with a real body (>= 3 statements, <= ~60 lines), not an abstract stub,
overload, property setter or boilerplate ``__init__``. Which levels it allows:

- ``body`` always; ``function`` when other library code still uses its name (callers then
  point at what is missing); ``block`` when its body holds a compound statement (``if``,
  ``for``, ``while``, ``with``, ``try``) of >= 2 statements that is not the whole body and,
  given coverage, that the tests executed; ``line`` when it holds a one-line simple statement
  (a ``return`` of a value, an assignment, a call) that is not alone in its suite and, given
  coverage, that the tests executed (one of them, chosen by a checksum of the candidate's name,
  so the same source always gives the same task).

A class candidate (``kind == "class"``, level ``class``: its body is deleted) is a class
with >= 2 methods, >= 5 statements and a body of <= 150 lines whose name other library code
uses. Each candidate also records the names
it calls (``calls``), from which ``feature.find_features`` builds multi-function features.

    cands = find_candidates(repo, ["more_itertools"], covered=lines_by_file)

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_deletion.py``.
"""

from __future__ import annotations

import ast
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer import pyparse
from opencomposer.tasks.deletion.lines import (
    DeletionError,
    alone_after,
    alone_before,
    body_region,
    definition_region,
    is_docstring,
    read_source,
    split_lines,
    statement_region,
)

# Ordered from the least to the most code removed; difficulty.py ranks them this way.
LEVELS: tuple[str, ...] = ("line", "block", "body", "function", "class", "feature")
FUNCTION_LEVELS: tuple[str, ...] = ("line", "block", "body", "function")

SKIP_DIRS = frozenset(
    ["tests", "test", "testing", "docs", "doc", "examples", "example", "benchmarks", "build", "dist", "__pycache__", "_vendor", "vendor", "site-packages"]
)
SKIP_FILES = frozenset({"setup.py", "conftest.py"})
SKIP_DECORATORS = frozenset(
    ["abstractmethod", "abstractproperty", "abstractclassmethod", "abstractstaticmethod", "overload"]
)
ACCESSORS = frozenset({"setter", "getter", "deleter"})  # @prop.setter and friends
BLOCK_TYPES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)
BLOCK_KEYWORDS = ("if", "for", "async", "while", "with", "try")  # not "elif": no line of its own
LINE_TYPES = (ast.Return, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)  # see pick_line


@dataclass(frozen=True)
class Candidate:
    file: str  # repo-relative posix path
    qualname: str  # e.g. "Class.method"
    name: str
    lineno: int  # the `def` / `class` line
    end_lineno: int  # last line of the definition (trailing body comments included)
    body_start_line: int  # first line replaced at body level: after signature and docstring
    n_body_lines: int  # lines replaced at body level
    level: str  # deepest whole-definition level: "function" (then "body" too), "body" or "class"
    decorator_lineno: int  # first line of the definition, decorators included
    n_statements: int  # statements in the body, nested ones counted, docstring not
    has_docstring: bool
    block: tuple[int, int] | None = None  # lines of the block removed at level "block"
    line: int | None = None  # the line removed at level "line"
    kind: str = "function"  # or "class"
    calls: tuple[str, ...] = ()  # names this function calls (for multi-function features)
    id: str = field(init=False)  # stable: "pkg.mod--Class.method"

    def __post_init__(self) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", self.file.removesuffix(".py").replace("/", "."))
        object.__setattr__(self, "id", f"{slug}--{self.qualname}")

    @property
    def levels(self) -> tuple[str, ...]:
        if self.kind == "class":
            return ("class",)
        own = ("body", "function") if self.level == "function" else ("body",)
        return (("line",) if self.line else ()) + (("block",) if self.block else ()) + own


def iter_source_files(repo: Path, package_dirs: list[str]) -> Iterator[Path]:
    """Library .py files under each package dir (a dir or a single .py), tests and docs skipped."""
    seen: set[Path] = set()
    for d in package_dirs:
        root = repo / d
        if root.is_file():
            paths = [root] if root.suffix == ".py" else []
        elif root.is_dir():
            paths = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(n for n in dirnames if n not in SKIP_DIRS and n[0] != ".")
                paths += [Path(dirpath, f) for f in sorted(filenames) if _is_library_file(f)]
        else:
            raise DeletionError(f"{root}: package dir {d!r} does not exist under {repo}")
        for p in paths:
            if p not in seen:
                seen.add(p)
                yield p


def find_candidates(
    repo: Path,
    package_dirs: list[str],
    covered: dict[str, set[int]] | None = None,
    *,
    min_statements: int = 3,
    max_lines: int = 60,
    min_dunder_statements: int = 5,
    classes: bool = False,
    max_class_lines: int = 150,
) -> list[Candidate]:
    """Functions, methods (and, with ``classes``, classes) fit for deletion, in file order.

    ``covered`` maps a file (repo-relative posix, or absolute) to the line numbers the tests
    executed; when given, only definitions with an executed body line are kept, and only
    executed blocks are offered at level ``block``. Files that are not UTF-8 or do not parse
    (Python 2 leftovers) are skipped.
    """
    repo = Path(repo)
    trees: dict[str, tuple[str, ast.Module]] = {}
    for path in iter_source_files(repo, package_dirs):
        try:
            source = read_source(path)
            trees[path.relative_to(repo).as_posix()] = (source, pyparse.parse(source))
        except (DeletionError, SyntaxError, ValueError):
            continue
    used = Counter[str]()  # names used anywhere in the library: who still calls what
    for _, tree in trees.values():
        used.update(names_used(tree))

    out: list[Candidate] = []
    for rel, (source, tree) in trees.items():
        lines = split_lines(source)
        hit = None
        if covered is not None:
            hit = covered.get(rel) or covered.get(str((repo / rel).resolve())) or set()
        for node, qualname, scope in walk_defs(tree, classes=classes):
            if isinstance(node, ast.ClassDef):
                cand = _judge_class(node, qualname, lines, rel, used, max_class_lines)
            else:
                cand = _judge(node, qualname, scope, lines, rel, used, min_statements, max_lines,
                              min_dunder_statements, hit)
            if cand and (hit is None or not hit.isdisjoint(
                    range(cand.body_start_line, cand.end_lineno + 1))):
                out.append(cand)
    return out


def walk_defs(scope: ast.Module | ast.ClassDef, prefix: str = "", classes: bool = False) -> Iterator[tuple]:
    """(node, qualname, enclosing module or class) in file order for module-level functions and
    methods, through nested classes (and the classes themselves with ``classes``); never into
    functions or if/try blocks (conditional defs)."""
    for node in scope.body:
        if isinstance(node, ast.ClassDef):
            if classes:
                yield node, prefix + node.name, scope
            yield from walk_defs(node, f"{prefix}{node.name}.", classes)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name, scope


def names_used(tree: ast.AST) -> Iterator[str]:
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.ImportFrom):
            yield from (a.name for a in n.names)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            yield n.value  # __all__ entries, getattr(obj, "name"), dispatch tables


def names_called(node: ast.AST) -> tuple[str, ...]:
    """What a definition calls, sorted: ``"f"`` for ``f(...)`` (a module-level function) and
    ``".m"`` for ``self.m(...)`` / ``cls.m(...)`` (a method of its own class). Other attribute
    calls (``sep.join(...)``) are left out: their target cannot be told from the name."""
    out = set()
    for n in ast.walk(node):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Name):
            out.add(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("self", "cls"):
            out.add("." + f.attr)
    return tuple(sorted(out))


def decorator_name(d: ast.expr) -> str:
    while isinstance(d, ast.Call):
        d = d.func
    return d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""


def _is_library_file(name: str) -> bool:
    return (name.endswith(".py") and name not in SKIP_FILES and not name.startswith("test_")
            and not name.endswith("_test.py"))


def _is_boilerplate_init(body: list[ast.stmt]) -> bool:
    """Only attribute assignments and super().__init__(...) calls."""
    def trivial(s: ast.stmt) -> bool:
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            return all(isinstance(t, ast.Attribute) for t in targets)
        return (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                and decorator_name(s.value.func) == "__init__")
    return all(trivial(s) for s in body)


def _count_statements(body: list[ast.stmt]) -> int:
    return sum(isinstance(n, ast.stmt) for s in body for n in ast.walk(s))


def _judge(node, qualname: str, scope: ast.AST, lines: list[str], rel: str, used: Counter,
           min_statements: int, max_lines: int, min_dunder_statements: int,
           hit: set[int] | None) -> Candidate | None:
    name = node.name
    decorators = {decorator_name(d) for d in node.decorator_list}
    if decorators & SKIP_DECORATORS or decorators & ACCESSORS:
        return None
    same_name = [n for n in scope.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name]
    later = same_name[same_name.index(node) + 1 :]
    if any(not {decorator_name(d) for d in n.decorator_list} & ACCESSORS for n in later):
        return None  # redefined further down: this one is dead code or an overload
    has_doc = is_docstring(node.body[0])
    body = node.body[1:] if has_doc else node.body
    n_stmts = _count_statements(body)
    if n_stmts < min_statements:
        return None
    dunder = name.startswith("__") and name.endswith("__")
    if name == "__init__" and _is_boilerplate_init(body):
        return None
    if dunder and name != "__init__" and n_stmts < min_dunder_statements:
        return None
    region = body_region(node, lines)
    if region is None or region[1] - region[0] + 1 > max_lines:
        return None
    outside = used[name] - Counter(names_used(node))[name]
    whole = (not dunder and len(same_name) == 1 and outside > 0
             and definition_region(node, lines) is not None)
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return Candidate(rel, qualname, name, node.lineno, region[1], region[0],
                     region[1] - region[0] + 1, "function" if whole else "body", first,
                     n_stmts, has_doc, block=pick_block(body, lines, hit),
                     line=pick_line(body, lines, hit, f"{rel}:{qualname}"), calls=names_called(node))


def pick_block(body: list[ast.stmt], lines: list[str], hit: set[int] | None,
               min_statements: int = 2, max_lines: int = 25) -> tuple[int, int] | None:
    """The largest compound statement of a function body worth deleting on its own: >= 2
    statements, not the only statement of its suite, on lines of its own, executed if
    ``hit`` is given. None if there is none."""
    best: tuple[int, tuple[int, int]] | None = None
    for s, suite in _inner_statements(body):
        if isinstance(s, BLOCK_TYPES) and len(suite) > 1 and \
                lines[s.lineno - 1].lstrip().startswith(BLOCK_KEYWORDS) and \
                not lines[s.lineno - 1].lstrip().startswith("elif"):
            region = statement_region(s, lines)
            n = _count_statements([s]) - 1
            if region and n >= min_statements and region[1] - region[0] < max_lines and (
                    hit is None or not hit.isdisjoint(range(region[0], region[1] + 1))) and (
                    best is None or n > best[0]):
                best = (n, region)
    return best[1] if best else None


def pick_line(body: list[ast.stmt], lines: list[str], hit: set[int] | None, key: str) -> int | None:
    """A one-line simple statement of a function body worth deleting on its own: a ``return``
    of a value (not ``None``), an assignment with a value, or a call; alone on its line, not the
    only statement of its suite, executed if ``hit`` is given. Of those, the one at index
    ``crc32(key) % count`` (stable across runs, unlike ``hash``); None if there is none."""
    found = [s.lineno for s, suite in _inner_statements(body)
             if isinstance(s, LINE_TYPES) and len(suite) > 1 and s.lineno == s.end_lineno and _worth_a_line(s)
             and alone_before(lines, s.lineno, s.col_offset) and alone_after(lines, s.end_lineno, s.end_col_offset)
             and (hit is None or s.lineno in hit)]
    return found[zlib.crc32(key.encode()) % len(found)] if found else None


def _inner_statements(suite: list[ast.stmt]) -> Iterator[tuple[ast.stmt, list[ast.stmt]]]:
    """Every statement of a function body with the suite it sits in, in source order, into
    compound statements' suites (``else``, ``finally`` and handlers too) but not into nested
    definitions."""
    for s in suite:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield s, suite
        for attr in ("body", "orelse", "finalbody"):
            yield from _inner_statements(getattr(s, attr, []) or [])
        for h in getattr(s, "handlers", []) or []:
            yield from _inner_statements(h.body)


def _worth_a_line(s: ast.stmt) -> bool:
    """Not a docstring, ``return``/``return None`` or a value-less annotation: a line whose loss
    the tests can notice and whose text the rest of the function hints at."""
    if isinstance(s, ast.Return):
        return s.value is not None and not (isinstance(s.value, ast.Constant) and s.value.value is None)
    if isinstance(s, ast.AnnAssign):
        return s.value is not None
    if isinstance(s, ast.Expr):
        return isinstance(s.value, (ast.Call, ast.Await))
    return True


def _judge_class(node: ast.ClassDef, qualname: str, lines: list[str], rel: str, used: Counter,
                 max_lines: int) -> Candidate | None:
    region = body_region(node, lines)
    if region is None or region[1] - region[0] + 1 > max_lines:
        return None
    has_doc = is_docstring(node.body[0])
    body = node.body[1:] if has_doc else node.body
    if _count_statements(body) < 5 or sum(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                                           for s in body) < 2:
        return None  # a real class: at least two methods
    if used[node.name] - Counter(names_used(node))[node.name] <= 0:
        return None  # nobody else uses it: deleting it breaks no caller to point at it
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return Candidate(rel, qualname, node.name, node.lineno, region[1], region[0],
                     region[1] - region[0] + 1, "class", first, _count_statements(body), has_doc,
                     kind="class", calls=names_called(node))
