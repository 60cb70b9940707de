"""Feature deletion: pick functions worth deleting, delete them, and write the gold patch back.

A *candidate* is a function or method in a library's own source (not its tests, docs or
examples) that makes a fair "implement the missing feature" task: a real body (>= 3
statements, <= ~60 lines), not an abstract stub, overload, property setter or boilerplate
``__init__``. Two deletion levels:

- ``body``: decorators, signature and docstring stay; the body becomes
  ``raise NotImplementedError``.
- ``function``: the whole definition goes, decorators included. Offered (``cand.level ==
  "function"``) only for module-level functions and methods whose name other library code
  still uses, so the callers point at what is missing.

Edits are made on lines, never via ``ast.unparse``, so every untouched byte stays as it was::

    c = find_candidates(repo, ["more_itertools"])[0]
    d = delete(read_source(repo / c.file), c, "body")   # d.after, d.removed, d.patch
    delete_in_repo(repo, c, "function")                 # the same, written to the file

Only UTF-8 sources without a BOM are candidates, so str edits are byte-exact on disk.
Test: ``.venv/bin/python -m pytest tests/unit/test_deletion.py``.
"""

from __future__ import annotations

import ast
import difflib
import functools
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Level = Literal["body", "function"]
LEVELS: tuple[str, ...] = ("body", "function")

SKIP_DIRS = frozenset(
    "tests test testing docs doc examples example benchmarks build dist __pycache__ "
    "_vendor vendor site-packages".split()
)
SKIP_FILES = frozenset({"setup.py", "conftest.py"})
SKIP_DECORATORS = frozenset(
    "abstractmethod abstractproperty abstractclassmethod abstractstaticmethod overload".split()
)
ACCESSORS = frozenset({"setter", "getter", "deleter"})  # @prop.setter and friends
STUB = "raise NotImplementedError"
NO_NEWLINE = "\n\\ No newline at end of file\n"  # how diff marks a last line without one

# The line breaks ast counts; str.splitlines would also break at \f, \x1c, \u2028...
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class DeletionError(ValueError):
    """A deletion that cannot be made; the message names the file, the symbol and why."""


@dataclass(frozen=True)
class Candidate:
    file: str  # repo-relative posix path
    qualname: str  # e.g. "Class.method"
    name: str
    lineno: int  # the `def` line
    end_lineno: int  # last line of the definition (trailing body comments included)
    body_start_line: int  # first line replaced at body level: after signature and docstring
    n_body_lines: int  # lines replaced at body level
    level: str  # deepest level allowed: "function" (then "body" too) or "body"
    decorator_lineno: int  # first line of the definition, decorators included
    n_statements: int  # statements in the body, nested ones counted, docstring not
    has_docstring: bool
    id: str = field(init=False)  # stable: "pkg.mod--Class.method"

    def __post_init__(self) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", self.file.removesuffix(".py").replace("/", "."))
        object.__setattr__(self, "id", f"{slug}--{self.qualname}")

    @property
    def levels(self) -> tuple[str, ...]:
        return LEVELS if self.level == "function" else ("body",)


@dataclass(frozen=True)
class Deletion:
    candidate: Candidate
    level: str
    before: str
    after: str
    removed: str  # the exact text taken out (the stub or `pass` that replaced it not included)

    @property
    def patch(self) -> str:
        """The gold patch: turns the deleted file back into the original."""
        return make_patch(self.before, self.after, self.candidate.file)


def read_source(path: Path) -> str:
    """The file's text with line endings untouched; DeletionError unless plain UTF-8."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        raise DeletionError(f"{path}: starts with a UTF-8 BOM; only plain UTF-8 is edited")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DeletionError(f"{path}: not UTF-8 ({e})") from None


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
) -> list[Candidate]:
    """Functions and methods fit for deletion, in file order.

    ``covered`` maps a file (repo-relative posix, or absolute) to the line numbers the tests
    executed; when given, only functions with an executed body line are kept. Files that are
    not UTF-8 or do not parse (Python 2 leftovers) are skipped.
    """
    repo = Path(repo)
    trees: dict[str, tuple[str, ast.Module]] = {}
    for path in iter_source_files(repo, package_dirs):
        try:
            source = read_source(path)
            trees[path.relative_to(repo).as_posix()] = (source, ast.parse(source))
        except (DeletionError, SyntaxError, ValueError):
            continue
    used = Counter[str]()  # names used anywhere in the library: who still calls what
    for _, tree in trees.values():
        used.update(_names_used(tree))

    out: list[Candidate] = []
    for rel, (source, tree) in trees.items():
        lines = _split_lines(source)
        hit = None
        if covered is not None:
            hit = covered.get(rel) or covered.get(str((repo / rel).resolve())) or set()
        for node, qualname, scope in _walk_defs(tree):
            cand = _judge(node, qualname, scope, lines, rel, used, min_statements, max_lines,
                          min_dunder_statements)
            if cand and (hit is None or not hit.isdisjoint(
                    range(cand.body_start_line, cand.end_lineno + 1))):
                out.append(cand)
    return out


def delete(source: str, cand: Candidate, level: Level) -> Deletion:
    """Delete ``cand`` from ``source`` at ``level``; the result parses, the rest is untouched."""
    where = f"{cand.file}: {cand.qualname}"
    if level not in cand.levels:
        raise DeletionError(f"{where}: level {level!r} not allowed here (allowed: {cand.levels})")
    try:
        tree = _parse(source)
    except SyntaxError as e:
        raise DeletionError(f"{where}: source does not parse: {e}") from None
    found = [(n, s) for n, q, s in _walk_defs(tree) if q == cand.qualname]
    found = [(n, s) for n, s in found if n.lineno == cand.lineno] or found
    if len(found) != 1:
        raise DeletionError(f"{where}: {len(found)} definitions match (source changed?)")
    node, scope = found[0]
    lines = _split_lines(source)
    region = _body_region(node, lines) if level == "body" else _function_region(node, lines)
    if region is None:
        raise DeletionError(f"{where}: definition shares lines with other code; not line-editable")
    start, end = region
    if level == "body":
        indent = _indent(lines[node.body[-1].lineno - 1])  # every body statement has this indent
        new = [indent + STUB + _ending(lines[end - 1])]
    else:
        if isinstance(scope, ast.ClassDef) and len(scope.body) == 1:  # a class needs a body
            new = [_indent(lines[node.lineno - 1]) + "pass" + _ending(lines[end - 1])]
        else:
            new = []
            start, end = _swallow_blank_lines(lines, start, end)
    after = "".join(lines[: start - 1] + new + lines[end:])
    try:
        ast.parse(after)
    except SyntaxError as e:  # a bug here, not in the library: say so loudly
        raise DeletionError(f"{where}: deleting at level {level!r} broke the syntax: {e}") from None
    return Deletion(cand, level, source, after, "".join(lines[start - 1 : end]))


def apply_deletion(source: str, cand: Candidate, level: Level) -> str:
    """``delete(...).after``: the source with the feature deleted."""
    return delete(source, cand, level).after


def definition_text(source: str, cand: Candidate) -> str:
    """The original definition, decorators and docstring included (for instructions)."""
    return "".join(_split_lines(source)[cand.decorator_lineno - 1 : cand.end_lineno])


def delete_in_repo(repo: Path, cand: Candidate, level: Level) -> Deletion:
    """Delete in place in ``repo / cand.file``; the Deletion's ``.patch`` is the gold patch."""
    path = Path(repo) / cand.file
    d = delete(read_source(path), cand, level)
    path.write_bytes(d.after.encode("utf-8"))
    return d


def make_patch(before: str, after: str, path: str) -> str:
    """Git-style unified diff (3 lines of context) that turns ``after`` back into ``before``."""
    a, b = _nl_lines(after), _nl_lines(before)
    if a == b:
        return ""
    # Match only the changed middle: whole-file matching is quadratic in repeated lines.
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    mid = difflib.SequenceMatcher(None, a[p : len(a) - s], b[p : len(b) - s], autojunk=False)
    ops = [("equal", 0, p, 0, p)] if p else []
    ops += [(t, i1 + p, i2 + p, j1 + p, j2 + p) for t, i1, i2, j1, j2 in mid.get_opcodes()]
    ops += [("equal", len(a) - s, len(a), len(b) - s, len(b))] if s else []
    sm = difflib.SequenceMatcher(None, a, b, autojunk=False)
    sm.opcodes = ops  # get_grouped_opcodes() groups these cached opcodes into hunks
    out = [f"diff --git a/{path} b/{path}\n", f"--- a/{path}\n", f"+++ b/{path}\n"]
    for group in sm.get_grouped_opcodes(3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_hunk_range(i1, i2)} +{_hunk_range(j1, j2)} @@\n")
        for tag, i1, i2, j1, j2 in group:
            body = [" " + x for x in a[i1:i2]] if tag == "equal" else (
                ["-" + x for x in a[i1:i2]] + ["+" + x for x in b[j1:j2]])
            for line in body:
                out.append(line if line.endswith("\n") else line + NO_NEWLINE)
    return "".join(out)


# --- helpers -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)  # a file's candidates are deleted one after another
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _is_library_file(name: str) -> bool:
    return (name.endswith(".py") and name not in SKIP_FILES and not name.startswith("test_")
            and not name.endswith("_test.py"))


def _split_lines(text: str) -> list[str]:
    """Lines with their endings, split exactly where ast counts a new line."""
    return _LINE.findall(text)


def _nl_lines(text: str) -> list[str]:
    """Lines as GNU patch sees them: split on \\n only."""
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text)


def _hunk_range(start: int, stop: int) -> str:
    length = stop - start
    return f"{start + 1}" if length == 1 else f"{start if not length else start + 1},{length}"


def _walk_defs(scope: ast.Module | ast.ClassDef, prefix: str = "") -> Iterator[tuple]:
    """(def, qualname, enclosing module or class) in file order for module-level functions and
    methods, through nested classes; never into functions or if/try blocks (conditional defs)."""
    for node in scope.body:
        if isinstance(node, ast.ClassDef):
            yield from _walk_defs(node, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name, scope


def _names_used(tree: ast.AST) -> Iterator[str]:
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.ImportFrom):
            yield from (a.name for a in n.names)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            yield n.value  # __all__ entries, getattr(obj, "name"), dispatch tables


def _decorator_name(d: ast.expr) -> str:
    while isinstance(d, ast.Call):
        d = d.func
    return d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and \
        isinstance(stmt.value.value, str)


def _is_boilerplate_init(body: list[ast.stmt]) -> bool:
    """Only attribute assignments and super().__init__(...) calls."""
    def trivial(s: ast.stmt) -> bool:
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            return all(isinstance(t, ast.Attribute) for t in targets)
        return (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                and _decorator_name(s.value.func) == "__init__")
    return all(trivial(s) for s in body)


def _judge(node, qualname: str, scope: ast.AST, lines: list[str], rel: str, used: Counter,
           min_statements: int, max_lines: int, min_dunder_statements: int) -> Candidate | None:
    name = node.name
    decorators = {_decorator_name(d) for d in node.decorator_list}
    if decorators & SKIP_DECORATORS or decorators & ACCESSORS:
        return None
    same_name = [n for n in scope.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name]
    later = same_name[same_name.index(node) + 1 :]
    if any(not {_decorator_name(d) for d in n.decorator_list} & ACCESSORS for n in later):
        return None  # redefined further down: this one is dead code or an overload
    has_doc = _is_docstring(node.body[0])
    body = node.body[1:] if has_doc else node.body
    n_stmts = sum(isinstance(n, ast.stmt) for s in body for n in ast.walk(s))
    if n_stmts < min_statements:
        return None
    dunder = name.startswith("__") and name.endswith("__")
    if name == "__init__" and _is_boilerplate_init(body):
        return None
    if dunder and name != "__init__" and n_stmts < min_dunder_statements:
        return None
    region = _body_region(node, lines)
    if region is None or region[1] - region[0] + 1 > max_lines:
        return None
    outside = used[name] - Counter(_names_used(node))[name]
    whole = (not dunder and len(same_name) == 1 and outside > 0
             and _function_region(node, lines) is not None)
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return Candidate(rel, qualname, name, node.lineno, region[1], region[0],
                     region[1] - region[0] + 1, "function" if whole else "body", first,
                     n_stmts, has_doc)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")) :]


def _blank_or_comment(s: str) -> bool:
    return not s.strip() or s.lstrip().startswith("#")


def _alone_after(lines: list[str], lineno: int, col: int) -> bool:
    """Nothing but whitespace or a comment after byte column ``col`` of line ``lineno``."""
    return _blank_or_comment(lines[lineno - 1].encode()[col:].decode(errors="replace"))


def _alone_before(lines: list[str], lineno: int, col: int) -> bool:
    return not lines[lineno - 1].encode()[:col].strip()


def _last_line(node, lines: list[str]) -> int | None:
    """End of the definition, stretched over comment lines indented into its body."""
    if not _alone_after(lines, node.end_lineno, node.end_col_offset):
        return None
    end, depth = node.end_lineno, len(_indent(lines[node.lineno - 1]))
    for j in range(node.end_lineno + 1, len(lines) + 1):
        text = lines[j - 1]
        if text.strip() and not (text.lstrip().startswith("#") and len(_indent(text)) > depth):
            break
        if text.strip():
            end = j
    return end


def _body_region(node, lines: list[str]) -> tuple[int, int] | None:
    """Lines (1-based, inclusive) replaced at body level: after the docstring (or signature)
    through the end, comments included; None if the body shares a line with other code."""
    body = node.body
    if _is_docstring(body[0]):
        doc, body = body[0], body[1:]
        if not body or not _alone_after(lines, doc.end_lineno, doc.end_col_offset):
            return None
        start = doc.end_lineno + 1
    else:
        start = body[0].lineno
        while start - 1 > node.lineno and _blank_or_comment(lines[start - 2]):
            start -= 1  # comments between signature and body go with the body
    end = _last_line(node, lines)
    if end is None or not _alone_before(lines, body[0].lineno, body[0].col_offset):
        return None
    return (start, end) if start <= body[0].lineno else None


def _function_region(node, lines: list[str]) -> tuple[int, int] | None:
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    if node.decorator_list and not lines[first - 1].lstrip().startswith("@"):
        return None
    if not _alone_before(lines, node.lineno, node.col_offset):
        return None
    end = _last_line(node, lines)
    return None if end is None else (first, end)


def _swallow_blank_lines(lines: list[str], start: int, end: int) -> tuple[int, int]:
    """Take one run of blank lines along, so the gap the definition leaves looks like the others."""
    if start > 1 and not lines[start - 2].strip():
        while start > 1 and not lines[start - 2].strip():
            start -= 1
    else:
        while end < len(lines) and not lines[end].strip():
            end += 1
    return start, end
