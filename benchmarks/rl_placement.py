"""Where an RL run's kept rollouts put their edit, against the gold patch of a one-line task: the last
applied ``replace_lines`` call's file, its start line (the gold's line exactly, or within 2) and whether
its text holds the gold's line. Passed and other (sampled or flagged) rollouts are counted apart.

    python benchmarks/rl_placement.py RUN_DIR/transcripts [TASK_ROOT ...]
        (task roots default to out/lines-extra, out/lines-more, out/lines: where the tasks' gold patches are)

Prints one JSON line. Session 41: issue 30's long run, updates 1-24 (``benchmarks/RESULTS.md``). Runs from then on
record the same for every rollout, from the carried code rather than the tool calls (``rewards/placement.py``).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

from opencomposer.rewards.placement import gold_additions

ROOTS = ("out/lines-extra", "out/lines-more", "out/lines")


def placement(transcripts: Path, roots: list[Path]) -> dict[str, int]:
    stats: collections.Counter[str] = collections.Counter()
    for f in sorted(transcripts.glob("step-*/*.json")):
        d = json.loads(f.read_text())
        gold = next((r / d["task_id"] / "solution" / "gold.patch" for r in roots
                     if (r / d["task_id"] / "solution" / "gold.patch").is_file()), None)
        if gold is None:
            stats["no gold patch found"] += 1
            continue
        added = gold_additions(gold.read_text())
        if len(added) != 1 or len(next(iter(added.values()))) != 1:
            stats["gold adds more than one line"] += 1
            continue
        path, [(line, text)] = next(iter(added.items()))
        k = "pass" if d.get("meta", {}).get("rl", {}).get("passed") else "other"
        stats[f"{k} episodes"] += 1
        edits = [e for s in d["steps"] for e in s["tool_events"] if e["name"] == "replace_lines" and e.get("ok")]
        if not edits:
            stats[f"{k} no applied edit"] += 1
            continue
        a = edits[-1]["arguments"]
        same = a.get("path") == path
        start = int(a.get("start_line", -99))
        stats[f"{k} right file"] += same
        stats[f"{k} right line"] += same and start == line
        stats[f"{k} within 2 lines"] += same and abs(start - line) <= 2
        stats[f"{k} gold text"] += text.strip() in [x.strip() for x in str(a.get("new", "")).splitlines()]
    return dict(stats)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    transcripts = Path(argv[0])
    if not transcripts.is_dir():
        print(f"{transcripts}: no such directory (expected an RL run's transcripts/)", file=sys.stderr)
        return 2
    print(json.dumps(placement(transcripts, [Path(r) for r in argv[1:] or ROOTS])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
