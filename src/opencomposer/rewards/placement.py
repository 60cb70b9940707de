"""Where an episode's change sits against the task's gold patch: a diagnostic, never a reward.

    placement(task.gold_patch, carry.files, task.workspace)
    # {"edit_gold_file": 1.0, "edit_line_distance": 2.0, "edit_gold_text": 0.0}

For a gold patch that adds lines to one file (a deleted statement, body or block: the factory's
tasks; HumanEval's body): ``edit_gold_file`` says whether the episode changed that file,
``edit_line_distance`` is how many lines lie between the gold's first added line and the nearest
line the episode added or changed there (new-file numbering; absent when it changed none), and
``edit_gold_text`` whether one of its added lines equals one of the gold's (whitespace aside).
Gold patches that touch several files give ``{}``. Session 41 found that failed rollouts of the
long run misplace the line as often as they miss its text; RL's rows average these per step
(``rl/metrics.py``) so a run shows whether it learns where to edit before it passes more tests.

``run_task`` (``episode/run.py``) records it in the trajectory's ``meta["placement"]`` after
grading; the agent never sees the gold, and nothing here reaches the reward.

Test: ``pytest tests/unit/rewards/test_placement.py``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path

from opencomposer.tasks.deletion.patch import common_ends

_HUNK = re.compile(r"@@ -\d+(?:,\d+)? \+(\d+)")
_MAX_DIFF_CELLS = 1_000_000  # lines x lines of the changed middle that get a line diff (milliseconds); more: one range


def gold_additions(patch: str) -> dict[str, list[tuple[int, str]]]:
    """The lines ``patch`` adds, by file: (line number in the new file, text)."""
    out: dict[str, list[tuple[int, str]]] = {}
    path, n = None, 0
    for line in patch.splitlines():
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0]
            path = None if target == "/dev/null" else target.removeprefix("b/")
        elif m := _HUNK.match(line):
            n = int(m[1])
        elif path is not None and not line.startswith(("--- ", "diff ", "index ", "\\")):
            if line.startswith("+"):
                out.setdefault(path, []).append((n, line[1:]))
            if not line.startswith("-"):
                n += 1
    return out


def placement(gold_patch: str, files: Mapping[str, bytes], base: Path | None) -> dict[str, float]:
    """The episode's change (``files``: the carried code, path -> content; ``base``: the task's
    workspace) against the gold patch's one changed file; ``{}`` when the gold touches several or adds nothing."""
    gold = gold_additions(gold_patch)
    if len(gold) != 1:
        return {}
    path, added = next(iter(gold.items()))
    if path not in files:
        return {"edit_gold_file": 0.0, "edit_gold_text": 0.0}
    old = (base / path).read_text(errors="replace").splitlines() if base and (base / path).is_file() else []
    new = files[path].decode(errors="replace").splitlines()
    changed, written = _changed_ranges(old, new)
    if not changed:  # carried but as it was
        return {"edit_gold_file": 0.0, "edit_gold_text": 0.0}
    first = added[0][0]
    return {"edit_gold_file": 1.0,
            "edit_gold_text": float(any(t.strip() and t.strip() in written for _, t in added)),
            "edit_line_distance": float(min(0 if a <= first <= b else min(abs(first - a), abs(first - b))
                                            for a, b in changed))}


def _changed_ranges(old: list[str], new: list[str]) -> tuple[list[tuple[int, int]], set[str]]:
    """The 1-based new-file ranges ``new`` adds or changes against ``old`` (a deletion: its place), and the
    stripped lines it writes there. The common head and tail are cut first; a middle too large for a line
    diff in bounded time (a file rewritten, or repeated lines: difflib is quadratic there) counts as one range."""
    head, tail = common_ends(old, new)
    mid_old, mid_new = old[head:len(old) - tail], new[head:len(new) - tail]
    if not mid_old and not mid_new:
        return [], set()
    if len(mid_old) * len(mid_new) > _MAX_DIFF_CELLS:
        return [(head + 1, max(head + len(mid_new), head + 1))], {x.strip() for x in mid_new}
    changed, written = [], set()
    for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(None, mid_old, mid_new, autojunk=False).get_opcodes():
        if tag != "equal":
            changed.append((head + j1 + 1, head + max(j2, j1 + 1)))
            written.update(x.strip() for x in mid_new[j1:j2])
    return changed, written
