"""Line geometry of Python source: where a definition, its body or a block starts and ends.

Deletions edit lines, never ``ast.unparse`` output, so every untouched byte stays as it was.
These helpers answer "which lines can be cut out cleanly" for a node: None whenever the node
shares a line with other code (``x = 1; def f(): ...``), so callers skip it.

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_deletion.py``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from opencomposer import pyparse

# The line breaks ast counts; str.splitlines would also break at \f, \x1c, \u2028...
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class DeletionError(ValueError):
    """A deletion that cannot be made; the message names the file, the symbol and why."""


def read_source(path: Path) -> str:
    """The file's text with line endings untouched; DeletionError unless plain UTF-8."""
    data = Path(path).read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        raise DeletionError(f"{path}: starts with a UTF-8 BOM; only plain UTF-8 is edited")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DeletionError(f"{path}: not UTF-8 ({e})") from None


@functools.lru_cache(maxsize=8)  # a file's candidates are deleted one after another
def parse(source: str) -> ast.Module:
    return pyparse.parse(source)


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split exactly where ast counts a new line."""
    return _LINE.findall(text)


def indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def ending(line: str) -> str:
    return line[len(line.rstrip("\r\n")) :]


def blank_or_comment(s: str) -> bool:
    return not s.strip() or s.lstrip().startswith("#")


def is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and \
        isinstance(stmt.value.value, str)


def alone_after(lines: list[str], lineno: int, col: int) -> bool:
    """Nothing but whitespace or a comment after byte column ``col`` of line ``lineno``."""
    return blank_or_comment(lines[lineno - 1].encode()[col:].decode(errors="replace"))


def alone_before(lines: list[str], lineno: int, col: int) -> bool:
    return not lines[lineno - 1].encode()[:col].strip()


def last_line(node, lines: list[str]) -> int | None:
    """End of a compound statement, stretched over comment lines indented into its body."""
    if not alone_after(lines, node.end_lineno, node.end_col_offset):
        return None
    end, depth = node.end_lineno, len(indent(lines[node.lineno - 1]))
    for j in range(node.end_lineno + 1, len(lines) + 1):
        text = lines[j - 1]
        if text.strip() and not (text.lstrip().startswith("#") and len(indent(text)) > depth):
            break
        if text.strip():
            end = j
    return end


def body_region(node, lines: list[str]) -> tuple[int, int] | None:
    """Lines (1-based, inclusive) replaced at body level: after the docstring (or signature)
    through the end, comments included; None if the body shares a line with other code."""
    body = node.body
    if is_docstring(body[0]):
        doc, body = body[0], body[1:]
        if not body or not alone_after(lines, doc.end_lineno, doc.end_col_offset):
            return None
        start = doc.end_lineno + 1
    else:
        start = body[0].lineno
        while start - 1 > node.lineno and blank_or_comment(lines[start - 2]):
            start -= 1  # comments between signature and body go with the body
    end = last_line(node, lines)
    if end is None or not alone_before(lines, body[0].lineno, body[0].col_offset):
        return None
    return (start, end) if start <= body[0].lineno else None


def definition_region(node, lines: list[str]) -> tuple[int, int] | None:
    """A whole def or class, decorators included."""
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    if node.decorator_list and not lines[first - 1].lstrip().startswith("@"):
        return None
    if not alone_before(lines, node.lineno, node.col_offset):
        return None
    end = last_line(node, lines)
    return None if end is None else (first, end)


def statement_region(node, lines: list[str]) -> tuple[int, int] | None:
    """A compound statement inside a body (``if``/``for``/``with``/...), on lines of its own."""
    if not alone_before(lines, node.lineno, node.col_offset):
        return None
    end = last_line(node, lines)
    return None if end is None else (node.lineno, end)


def swallow_blank_lines(lines: list[str], start: int, end: int) -> tuple[int, int]:
    """Take one run of blank lines along, so the gap a definition leaves looks like the others."""
    if start > 1 and not lines[start - 2].strip():
        while start > 1 and not lines[start - 2].strip():
            start -= 1
    else:
        while end < len(lines) and not lines[end].strip():
            end += 1
    return start, end
