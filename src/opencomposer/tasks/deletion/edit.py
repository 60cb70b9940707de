"""Delete one candidate from its source at one level; the result parses, the rest is untouched.

- ``line``: one simple statement of the body on a line of its own (``Candidate.line``) goes.
- ``block``: one compound statement of the body (``Candidate.block``) goes, nothing replaces it.
- ``body``: decorators, signature and docstring stay; the body becomes ``raise NotImplementedError``.
- ``function``: the whole definition goes, decorators included.
- ``class``: the class's body goes (methods, attributes); its ``class`` line, decorators and
  docstring stay, so the module still imports and only the class's users fail.

    d = delete(read_source(repo / c.file), c, "body")   # d.after, d.removed, d.patch
    delete_in_repo(repo, c, "function")                 # the same, written to the file

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_deletion.py``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from opencomposer import pyparse
from opencomposer.tasks.deletion.candidates import Candidate, walk_defs
from opencomposer.tasks.deletion.lines import (
    DeletionError,
    body_region,
    definition_region,
    ending,
    indent,
    parse,
    read_source,
    split_lines,
    swallow_blank_lines,
)
from opencomposer.tasks.deletion.patch import make_patch

STUB = "raise NotImplementedError"


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

    @property
    def files(self) -> dict[str, tuple[str, str]]:
        """file -> (before, after): what a task's workspace must change (one file here)."""
        return {self.candidate.file: (self.before, self.after)}

    @property
    def members(self) -> tuple[Candidate, ...]:
        return (self.candidate,)


def delete(source: str, cand: Candidate, level: str) -> Deletion:
    """Delete ``cand`` from ``source`` at ``level``; the result parses, the rest is untouched."""
    where = f"{cand.file}: {cand.qualname}"
    if level not in cand.levels:
        raise DeletionError(f"{where}: level {level!r} not allowed here (allowed: {cand.levels})")
    try:
        tree = parse(source)
    except SyntaxError as e:
        raise DeletionError(f"{where}: source does not parse: {e}") from None
    found = [(n, s) for n, q, s in walk_defs(tree, classes=cand.kind == "class")
             if q == cand.qualname and isinstance(n, ast.ClassDef) == (cand.kind == "class")]
    found = [(n, s) for n, s in found if n.lineno == cand.lineno] or found
    if len(found) != 1:
        raise DeletionError(f"{where}: {len(found)} definitions match (source changed?)")
    node, scope = found[0]
    lines = split_lines(source)
    if level in ("body", "class"):
        region = body_region(node, lines)
    elif level == "block":
        region = cand.block
    elif level == "line":
        region = (cand.line, cand.line) if cand.line else None
    else:
        region = definition_region(node, lines)
    if region is None:
        raise DeletionError(f"{where}: definition shares lines with other code; not line-editable")
    start, end = region
    if level == "body":
        ind = indent(lines[node.body[-1].lineno - 1])  # every body statement has this indent
        new = [ind + STUB + ending(lines[end - 1])]
    elif level in ("block", "line"):
        new = []  # pick_block and pick_line never take the only statement of a suite
    elif level == "class":  # the class statement, bases and docstring stay: it still imports
        new = [indent(lines[node.body[-1].lineno - 1]) + "pass" + ending(lines[end - 1])]
    elif len(scope.body) == 1 and not isinstance(scope, ast.Module):  # a class needs a body
        new = [indent(lines[node.lineno - 1]) + "pass" + ending(lines[end - 1])]
    else:
        new = []
        start, end = swallow_blank_lines(lines, start, end)
    after = "".join(lines[: start - 1] + new + lines[end:])
    try:
        pyparse.parse(after)
    except SyntaxError as e:  # a bug here, not in the library: say so loudly
        raise DeletionError(f"{where}: deleting at level {level!r} broke the syntax: {e}") from None
    return Deletion(cand, level, source, after, "".join(lines[start - 1 : end]))


def apply_deletion(source: str, cand: Candidate, level: str) -> str:
    """``delete(...).after``: the source with the feature deleted."""
    return delete(source, cand, level).after


def definition_text(source: str, cand: Candidate) -> str:
    """The original definition, decorators and docstring included (for instructions)."""
    return "".join(split_lines(source)[cand.decorator_lineno - 1 : cand.end_lineno])


def delete_in_repo(repo: Path, cand: Candidate, level: str) -> Deletion:
    """Delete in place in ``repo / cand.file``; the Deletion's ``.patch`` is the gold patch."""
    path = Path(repo) / cand.file
    d = delete(read_source(path), cand, level)
    path.write_bytes(d.after.encode("utf-8"))
    return d
