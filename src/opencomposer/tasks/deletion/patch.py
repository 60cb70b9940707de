"""The gold patch: a git-style unified diff that turns the deleted file back into the original.

    make_patch(before, after, "pkg/mod.py")   # apply with `patch -p1` or `git apply`

Test: ``.venv/bin/python -m pytest tests/unit/tasks/test_deletion.py -k patch``.
"""

from __future__ import annotations

import difflib
import re

NO_NEWLINE = "\n\\ No newline at end of file\n"  # how diff marks a last line without one


def common_ends(a: list[str], b: list[str]) -> tuple[int, int]:
    """How many lines ``a`` and ``b`` share at the head, and then at the tail (not overlapping the head)."""
    p = 0
    while p < min(len(a), len(b)) and a[p] == b[p]:
        p += 1
    s = 0
    while s < min(len(a), len(b)) - p and a[-1 - s] == b[-1 - s]:
        s += 1
    return p, s


def make_patch(before: str, after: str, path: str) -> str:
    """Git-style unified diff (3 lines of context) that turns ``after`` back into ``before``."""
    a, b = _nl_lines(after), _nl_lines(before)
    if a == b:
        return ""
    # Match only the changed middle: whole-file matching is quadratic in repeated lines.
    p, s = common_ends(a, b)
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


def _nl_lines(text: str) -> list[str]:
    """Lines as GNU patch sees them: split on \\n only."""
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text)


def _hunk_range(start: int, stop: int) -> str:
    length = stop - start
    return f"{start + 1}" if length == 1 else f"{start if not length else start + 1},{length}"
