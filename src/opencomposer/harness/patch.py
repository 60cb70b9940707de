"""Unified diffs: parse them and apply them to file contents, with clear errors.

The one patch applier: the oracle policy uses it to turn a task's ``gold.patch`` into ordinary
edits (and to compute a whole patched file when an edit cannot be made unique), the grader to
apply a patch in a sandbox (``grading/grade.apply_patch``), Harbor export to write ``solve.sh``,
and the task sources to lay SWE-bench test patches. It reads what
``diff -u``, ``git diff`` and ``difflib.unified_diff`` write: several files, several hunks,
new files (``--- /dev/null``), deleted files (``+++ /dev/null``) and the
``\\ No newline at end of file`` marker. Lines keep their ``\\n`` so that applying a patch
round-trips files byte for byte.

Test: ``pytest tests/unit/harness/test_patch.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEV_NULL = "/dev/null"
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch that cannot be parsed or does not apply; the message says where and why."""


@dataclass
class Hunk:
    old_start: int  # 1-based line number in the old file (0 for an empty old side)
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]] = field(default_factory=list)  # (" "|"-"|"+", text with \n)

    @property
    def old_lines(self) -> list[str]:
        return [t for tag, t in self.lines if tag in " -"]

    @property
    def new_lines(self) -> list[str]:
        return [t for tag, t in self.lines if tag in " +"]

    @property
    def old_text(self) -> str:
        return "".join(self.old_lines)

    @property
    def new_text(self) -> str:
        return "".join(self.new_lines)


@dataclass
class FilePatch:
    old_path: str  # DEV_NULL for a new file
    new_path: str  # DEV_NULL for a deleted file
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def is_new(self) -> bool:
        return self.old_path == DEV_NULL

    @property
    def is_delete(self) -> bool:
        return self.new_path == DEV_NULL

    @property
    def path(self) -> str:
        """The workspace-relative path this patch touches."""
        return self.old_path if self.is_delete else self.new_path


def split_lines(text: str) -> list[str]:
    """Lines with their ``\\n`` kept; unlike ``str.splitlines`` only ``\\n`` ends a line
    (form feeds and lone ``\\r`` occur inside real source files)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _header_path(line: str) -> str:
    # "--- a/pkg/mod.py\t2024-01-01 ..." -> "a/pkg/mod.py"; a tab separates an optional date.
    return line[4:].split("\t")[0].strip()


def _strip_prefixes(old: str, new: str) -> tuple[str, str]:
    """Drop git's a/ b/ prefixes, only when both sides carry them (or one is /dev/null)."""
    old_ok = old == DEV_NULL or old.startswith("a/")
    new_ok = new == DEV_NULL or new.startswith("b/")
    if old_ok and new_ok and not (old == DEV_NULL and new == DEV_NULL):
        old = old if old == DEV_NULL else old[2:]
        new = new if new == DEV_NULL else new[2:]
    return old, new


def parse_patch(text: str) -> list[FilePatch]:
    """Parse a unified diff into one ``FilePatch`` per file, in order."""
    lines = split_lines(text)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1  # "diff --git", "index ...", "new file mode" and prose are skipped
            continue
        old, new = _strip_prefixes(_header_path(lines[i]), _header_path(lines[i + 1]))
        fp = FilePatch(old, new)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i, fp.path)
            fp.hunks.append(hunk)
        if not fp.hunks:
            raise PatchError(f"patch for {fp.path}: a file header with no @@ hunk after it")
        patches.append(fp)
    if not patches:
        raise PatchError("no file in patch: expected '--- old' / '+++ new' headers followed by @@ hunks")
    return patches


def _parse_hunk(lines: list[str], i: int, path: str) -> tuple[Hunk, int]:
    m = _HUNK_HEADER.match(lines[i])
    if not m:
        raise PatchError(f"patch for {path}: bad hunk header {lines[i].rstrip()!r}")
    a, alen, b, blen = m.groups()
    hunk = Hunk(int(a), 1 if alen is None else int(alen), int(b), 1 if blen is None else int(blen))
    i += 1
    old_seen = new_seen = 0
    while i < len(lines) and (old_seen < hunk.old_len or new_seen < hunk.new_len):
        line = lines[i]
        tag, body = line[:1], line[1:]
        if line in ("\n", "\r\n"):  # some tools strip the space of an empty context line
            tag, body = " ", line
        if tag not in " -+":
            raise PatchError(
                f"patch for {path}: hunk at line {hunk.old_start} ends early: expected "
                f"{hunk.old_len} old / {hunk.new_len} new lines, got {old_seen} / {new_seen}"
            )
        hunk.lines.append((tag, body))
        old_seen += tag in " -"
        new_seen += tag in " +"
        i += 1
        if i < len(lines) and lines[i].startswith("\\"):  # "\ No newline at end of file"
            hunk.lines[-1] = (tag, body.rstrip("\n"))
            i += 1
    if old_seen != hunk.old_len or new_seen != hunk.new_len:
        raise PatchError(f"patch for {path}: hunk at line {hunk.old_start} is cut short")
    return hunk, i


def find_hunk(lines: list[str], hunk: Hunk, expected: int) -> int:
    """Index in ``lines`` where the hunk's old side matches, nearest to ``expected`` (0-based).

    Returns -1 when it matches nowhere. Searching outward from the expected place keeps
    the right spot when the same text occurs twice and earlier hunks moved the lines.
    """
    old = hunk.old_lines
    n = len(old)
    last = len(lines) - n
    for d in range(0, max(expected, last - expected) + 1):
        for pos in (expected - d, expected + d) if d else (expected,):
            if 0 <= pos <= last and lines[pos : pos + n] == old:
                return pos
    return -1


def apply_hunks(content: str, hunks: list[Hunk], path: str = "<file>") -> str:
    """Apply ``hunks`` (in file order) to ``content``; PatchError names the hunk that fails."""
    lines = split_lines(content)
    grown = 0  # lines added minus removed by earlier hunks
    drift = 0  # where the last hunk was found minus where the patch said it would be
    for k, hunk in enumerate(hunks, 1):
        # "-5,0" means "insert after line 5", so an empty old side starts at index old_start.
        nominal = (hunk.old_start if hunk.old_len == 0 else hunk.old_start - 1) + grown
        pos = find_hunk(lines, hunk, min(max(nominal + drift, 0), len(lines)))
        if pos < 0:
            first = next(iter(hunk.old_lines), "").rstrip("\n")
            raise PatchError(
                f"{path}: hunk {k} of {len(hunks)} (old line {hunk.old_start}) does not apply: "
                f"its {hunk.old_len} old lines (starting {first!r}) are not in the file"
            )
        lines[pos : pos + hunk.old_len] = hunk.new_lines
        drift = pos - nominal
        grown += hunk.new_len - hunk.old_len
    return "".join(lines)


def apply_patch(files: dict[str, str], patch: str | list[FilePatch]) -> dict[str, str | None]:
    """Apply a whole patch to ``{path: content}``; returns the changed files (deleted ones map to None).

    New files must be absent from ``files``; every other file must be present.
    """
    out: dict[str, str | None] = {}
    for fp in parse_patch(patch) if isinstance(patch, str) else patch:
        current = out[fp.path] if fp.path in out else files.get(fp.path)
        if fp.is_new:
            if current is not None:
                raise PatchError(f"{fp.path}: the patch creates it, but it already exists")
            out[fp.path] = apply_hunks("", fp.hunks, fp.path)
            continue
        if current is None:
            raise PatchError(f"{fp.path}: the patch changes it, but it does not exist")
        out[fp.path] = None if fp.is_delete else apply_hunks(current, fp.hunks, fp.path)
    return out
