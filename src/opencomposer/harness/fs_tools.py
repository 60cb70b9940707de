"""File tools: read_file, edit_file, replace_lines, write_file, over the Sandbox file API.

Paths reaching these functions were already normalised by ``tools.workspace_path``; the
sandbox still raises ``PathEscape`` for symlinks that lead outside. Problems the model
can fix (missing file, ambiguous edit) raise ``ToolError``, which ``tools.execute`` turns
into an ``Error: ...`` observation; a failed edit never changes the file.

``read_file`` output is one ``{n:>6}\\t{line}`` row per line, then notices in ``[...]``;
``numbered_lines`` parses it back (the oracle policy relies on that). ``replace_lines`` takes
those numbers, so a model can edit without copying the old text; ``edit_file`` and
``replace_lines`` both answer with the edited region in the same numbered rows.

``AgentConfig.edit_check`` looks at every edit of a ``.py`` file that parsed before: an edit that
would leave it unparseable is refused (``refuse``: file unchanged, the answer names the line and
the error) or made with a warning (``warn``). A 135M agent's failed edits were a third such files
(session 32: 27 of 77 validation failures, 19 a valid statement at an impossible indent).

Test: ``pytest tests/unit/harness/test_tools.py tests/unit/harness/test_replace_lines.py``.
"""

from __future__ import annotations

import re
from typing import Any

from opencomposer import pyparse
from opencomposer.config import AgentConfig
from opencomposer.protocols import Sandbox

NO_NEWLINE = "\\ No newline at end of file"
LINE_CUT = " ...[line cut]"  # ends a row whose line was too long to show whole
_ROW = re.compile(r"^ *(\d+)\t(.*)$")


class ToolError(Exception):
    """A tool could not do what was asked; the message is shown to the model."""


def read_text(sandbox: Sandbox, path: str) -> str:
    """The text of a workspace file; ToolError (shown to the model) when it is missing, a directory,
    binary or not UTF-8."""
    try:
        data = sandbox.read_file(path)
    except FileNotFoundError:
        raise ToolError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise ToolError(f"{path} is a directory; use list_dir to see what it holds") from None
    if b"\0" in data[:8192]:
        raise ToolError(f"{path} is a binary file ({len(data)} bytes); only text files can be read or edited")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not UTF-8 text") from None


def _rows(lines: list[str], first: int) -> list[str]:
    return [f"{first + i:>6}\t{line}" for i, line in enumerate(lines)]


def read_file(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    path = args["path"]
    text = read_text(sandbox, path)
    if not text:
        return f"({path} is empty)"
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    n = len(lines)
    start, end = args.get("start_line", 1), args.get("end_line", n)
    if start > n:
        raise ToolError(f"start_line {start} is past the end: {path} has {n} lines")
    if start < 1 or end < start:
        raise ToolError(f"bad line range {start}-{end}: need 1 <= start_line <= end_line")
    end = min(end, n)
    budget = cfg.max_output_chars - 200  # room for the notice
    out: list[str] = []
    used = 0
    for i in range(start, end + 1):
        row = f"{i:>6}\t{lines[i - 1]}"
        if used + len(row) + 1 > budget:
            if not out:  # one enormous line: show its start rather than nothing
                out.append(row[:budget] + LINE_CUT)
                i += 1
            return "\n".join(out) + (
                f"\n[output cut to {cfg.max_output_chars} chars: showing lines {start}-{i - 1} of {n}. "
                f"Call read_file with start_line={i} to read further]"
            )
        out.append(row)
        used += len(row) + 1
    if end == n and not ends_with_newline:
        out.append(NO_NEWLINE)
    elif end < n:
        out.append(f"[lines {start}-{end} of {n}]")
    return "\n".join(out)


def numbered_lines(observation: str) -> tuple[dict[int, str], bool]:
    """Parse a read_file observation back into ``{line number: text}`` and whether the
    file's last line has no newline. Notice lines in ``[...]`` are skipped."""
    rows: dict[int, str] = {}
    for line in observation.split("\n"):
        m = _ROW.match(line)
        if m:
            rows[int(m.group(1))] = m.group(2)
    return rows, NO_NEWLINE in observation.split("\n")


def _n_lines(text: str) -> int:
    return text.count("\n") + (0 if text.endswith("\n") or not text else 1)


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def parse_problem(path: str, text: str) -> str | None:
    """Why ``text`` does not parse as Python (``line N: message: `the line` ``), or None."""
    try:
        pyparse.parse(text, path)
    except SyntaxError as e:  # IndentationError and TabError too
        line = (e.text or "").strip()
        return f"line {e.lineno}: {e.msg}" + (f": `{line[:120]}`" if line else "")
    except ValueError:  # NUL bytes: read_text refuses binary files before an edit gets here
        return None
    return None


def _edit_check(path: str, before: str | None, after: str, cfg: AgentConfig) -> str:
    """``AgentConfig.edit_check`` on an edit of ``path`` (``before``: its text, None for a new
    file): '' when it has nothing to say; the warning to append (``warn``); ToolError (``refuse``)."""
    if cfg.edit_check == "off" or not path.endswith(".py"):
        return ""
    problem = parse_problem(path, after)
    if problem is None or (before is not None and parse_problem(path, before) is not None):
        return ""  # parses, or did not parse before either: not this edit's doing
    if cfg.edit_check == "refuse":
        raise ToolError(f"edit refused: {path} would no longer parse as Python ({problem}); file unchanged. "
                        "Check the indentation and the statement, then edit again")
    return f"\nWarning: {path} no longer parses as Python ({problem})."


def edit_file(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    path, old, new = args["path"], args["old"], args["new"]
    if not old:
        raise ToolError("old is empty; to create or overwrite a whole file use write_file")
    if old == new:
        raise ToolError("old and new are the same; nothing would change")
    text = read_text(sandbox, path)
    count = text.count(old)
    if count == 0:
        hint = "read the file again and copy the text exactly, indentation and blank lines included"
        if old.strip() and old.strip() in text:
            hint = "it does occur with different leading/trailing whitespace; copy it exactly"
        raise ToolError(f"old text not found in {path}; file unchanged. Hint: {hint}")
    if count > 1:
        starts, i = [], text.find(old)
        while i >= 0 and len(starts) < 10:
            starts.append(_line_of(text, i))
            i = text.find(old, i + len(old))
        raise ToolError(
            f"old text occurs {count} times in {path} (at lines {', '.join(map(str, starts))}); "
            "file unchanged. Include more surrounding lines so it occurs exactly once"
        )
    at = text.find(old)
    edited = text[:at] + new + text[at + len(old) :]
    warning = _edit_check(path, text, edited, cfg)
    sandbox.write_file(path, edited.encode("utf-8"))
    first = _line_of(text, at)
    new_lines = _n_lines(new)
    after = edited.split("\n")
    lo, hi = max(first - 3, 1), min(first + new_lines + 2, len(after))
    snippet = "\n".join(_rows(after[lo - 1 : hi], lo)[:40])
    return (
        f"Edited {path}: replaced {_n_lines(old)} line(s) at line {first} with {new_lines} line(s).\n"
        f"{snippet}{warning}"
    )


def replace_lines(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    """Lines ``start_line``..``end_line`` (1-based, inclusive, as read_file numbers them) become
    ``new``; ``end_line = start_line - 1`` inserts before ``start_line``, an empty ``new`` deletes.
    ``new`` is whole lines: a missing final newline is supplied, and a file without a newline at
    its end keeps that."""
    path, start, end, new = args["path"], args["start_line"], args["end_line"], args["new"]
    text = read_text(sandbox, path)
    lines = text.split("\n")
    ends_with_newline = lines[-1] == ""
    if ends_with_newline:
        lines.pop()
    n = len(lines)
    if not 1 <= start <= n + 1:
        raise ToolError(f"start_line {start} is out of range: {path} has {n} lines, so start_line must be "
                        f"1 to {n + 1} ({n + 1}: insert at the end); file unchanged")
    if end > n:
        raise ToolError(f"end_line {end} is past the end: {path} has {n} lines; file unchanged")
    if end < start - 1:
        raise ToolError(f"end_line {end} is before start_line {start}: give end_line >= start_line to replace "
                        f"lines, or end_line = start_line - 1 = {start - 1} to insert before line {start}; "
                        "file unchanged")
    new_lines = new.split("\n")
    if new.endswith("\n") or not new:
        new_lines.pop()
    after = lines[: start - 1] + new_lines + lines[end:]
    if after == lines:
        raise ToolError(f"new is the same as lines {start}-{end}; nothing would change" if new_lines else
                        "new is empty and no lines are selected; nothing would change")
    edited = "\n".join(after) + ("\n" if ends_with_newline and after else "")
    warning = _edit_check(path, text, edited, cfg)
    sandbox.write_file(path, edited.encode("utf-8"))
    removed, added = end - start + 1, len(new_lines)
    if not removed:
        what = f"inserted {added} line(s) " + (f"before line {start}" if start <= n else "at the end")
    elif not added:
        what = f"deleted lines {start}-{end}"
    else:
        what = f"replaced lines {start}-{end} ({removed} line(s)) with {added} line(s)"
    moved = f" Lines after the edit moved by {added - removed:+d}." if added != removed and end < n else ""
    lo, hi = max(start - 3, 1), min(start + added + 2, len(after))
    snippet = "\n".join(_rows(after[lo - 1 : hi], lo)[:40])
    return f"Edited {path}: {what}; it now has {len(after)} lines.{moved}\n{snippet}".rstrip("\n") + warning


def write_file(sandbox: Sandbox, args: dict[str, Any], cfg: AgentConfig) -> str:
    path, content = args["path"], args["content"]
    data = content.encode("utf-8")
    warning = ""
    if cfg.edit_check != "off" and path.endswith(".py"):
        try:
            before = read_text(sandbox, path)
        except ToolError:  # a new file (or one no edit tool could read): nothing parsed before it
            before = None
        warning = _edit_check(path, before, content, cfg)
    try:
        sandbox.write_file(path, data)
    except FileNotFoundError:  # a missing parent directory: create it and retry once
        parent = path.rsplit("/", 1)[0] if "/" in path else "."
        made = sandbox.exec(["mkdir", "-p", "--", parent], timeout=30)
        if made.exit_code != 0:
            raise ToolError(f"could not create directory {parent}: {made.output.strip()}") from None
        sandbox.write_file(path, data)
    except IsADirectoryError:
        raise ToolError(f"{path} is a directory; give a file path") from None
    return f"Wrote {path}: {_n_lines(content)} line(s), {len(data)} bytes.{warning}"
