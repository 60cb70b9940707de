"""How often a linter points at the gap of a line task (why the agent has a ``lint`` tool).

For each line task of a learn run's split, ruff (``harness/lint.py``'s rules) checks the file as the
agent finds it and the original (the gold line put back); findings the original lacks are new, and
the task counts when one is within ``--near`` lines of the gap. Never a held-out split.

    python benchmarks/lint_locate.py --tasks runs/learn-gpu/tasks/lines runs/learn-gpu/tasks/lines-more \\
        --splits runs/learn-gpu/lines-more/splits.json --split train validation

Last line: one JSON object, per split: tasks, with a new finding, with one near the gap, codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import line_completer as lc  # noqa: E402

from opencomposer.harness.lint import ruff_binary, ruff_findings  # noqa: E402


def new_findings(d: Path, ruff: str) -> tuple[int, list]:
    """(the gap's line in the file as the agent finds it, 1-based; the findings the original lacks)."""
    gap = lc.read_gap(d)
    gapped = (d / "workspace" / gap.file).read_text()
    original = gap.before + gap.gold + "\n" + gapped[len(gap.before):]
    before = {(f.code, f.message) for f in ruff_findings(original, gap.file, ruff)}
    return gap.before.count("\n") + 1, [f for f in ruff_findings(gapped, gap.file, ruff)
                                         if (f.code, f.message) not in before]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, nargs="+", required=True)
    ap.add_argument("--splits", type=Path, required=True)
    ap.add_argument("--split", nargs="+", default=["validation"])
    ap.add_argument("--near", type=int, default=3, help="lines between a finding and the gap that count as near")
    a = ap.parse_args(argv)
    ruff = ruff_binary()
    if ruff is None:
        sys.exit("ruff is not installed (pip install ruff)")
    splits = json.loads(a.splits.read_text())
    result = {}
    for name in a.split:
        if name in lc.HELD_OUT:
            sys.exit(f"--split {name}: a held-out split is never measured for choosing anything")
        ids = [i for i in splits.get(name, []) if i.endswith("__line")]
        n = with_new = near = 0
        codes: Counter = Counter()
        for d in lc.find_tasks(a.tasks, ids):
            try:
                at, found = new_findings(d, ruff)
            except lc.TaskError as e:
                print(f"skip: {e}", file=sys.stderr)
                continue
            n += 1
            codes.update(f.code for f in found)
            if found:
                with_new += 1
                near += min(abs(f.row - at) for f in found) <= a.near
        result[name] = {"tasks": n, "new_finding": with_new, f"within_{a.near}": near, "codes": dict(codes)}
    print(json.dumps({"bench": "lint_locate", **result}))
    return result


if __name__ == "__main__":
    main()
