"""What ``[agent] grade_fail_fast`` saves on RL's pool: each sampled task graded four ways in the same run.

    .venv/bin/python benchmarks/bench_fail_fast.py out/lines-extra out/lines-more --n 60 --backend namespace

For each task (a seeded sample of the given task folders), alternating which goes first: the unchanged workspace
(what most RL episodes hand in: the deleted code not restored) graded with every target run and with the run
stopped at the first FAIL_TO_PASS / PASS_TO_PASS test that fails; then the gold patch both ways (a passing
episode: nothing may stop, so the two cost the same). The rewards must agree, task by task (the stop is after a
failure that makes the reward 0 whatever follows). Prints a table of the slowest libraries and one JSON line last.
Physical floor of a grade: the sandbox plus pytest's start and the suite's import and collection, which the stop
cannot save (the median task's whole grade).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

from opencomposer.grading import Carry, grade
from opencomposer.grading.grade import opener, patch_carry
from opencomposer.tasks.format import Task, find_tasks


def timed(task: Task, carry: Carry, op, fail_fast: bool) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    r = grade(task, carry, op, fail_fast=fail_fast)
    return time.perf_counter() - t0, r.reward, r.details.get("stopped_at", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="task folders (e.g. out/lines-extra)")
    ap.add_argument("--n", type=int, default=60, help="tasks sampled from all of them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="namespace")
    a = ap.parse_args(argv)
    paths = [p for p in find_tasks(a.dirs) if (p / "task.toml").is_file()]
    if not paths:
        raise SystemExit(f"no tasks under {', '.join(map(str, a.dirs))}")
    rng = random.Random(a.seed)
    paths = rng.sample(paths, min(a.n, len(paths)))
    op = opener(a.backend)
    rows, disagree = [], []
    for i, p in enumerate(paths):
        task = Task.load(p)
        gold = patch_carry(task, task.gold_patch, op)
        row = {"task": task.id, "library": task.meta.source.name}
        for name, carry in (("fail", Carry()), ("gold", gold)):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {ff: timed(task, carry, op, ff) for ff in order}
            row[name] = {"full_s": round(got[False][0], 3), "fast_s": round(got[True][0], 3),
                         "reward": got[False][1], "stopped": bool(got[True][2])}
            if got[False][1] != got[True][1]:
                disagree.append(f"{task.id} ({name}): {got[False][1]} full, {got[True][1]} fail-fast")
        rows.append(row)
        print(f"[{i + 1}/{len(paths)}] {task.id[:70]}: fail {row['fail']['full_s']:.2f} -> {row['fail']['fast_s']:.2f} s, "
              f"gold {row['gold']['full_s']:.2f} -> {row['gold']['fast_s']:.2f} s", file=sys.stderr, flush=True)
    libs = collections.defaultdict(list)
    for r in rows:
        libs[r["library"]].append(r)
    print("| library | tasks | failing: full s | fail-fast s | gold: full s | fail-fast s |")
    print("|---|---|---|---|---|---|")
    for lib, rs in sorted(libs.items(), key=lambda kv: -sum(r["fail"]["full_s"] for r in kv[1]))[:12]:
        f = lambda side, k: sum(r[side][k] for r in rs)  # noqa: E731
        print(f"| {lib} | {len(rs)} | {f('fail', 'full_s'):.2f} | {f('fail', 'fast_s'):.2f} | "
              f"{f('gold', 'full_s'):.2f} | {f('gold', 'fast_s'):.2f} |")
    tot = lambda side, k: round(sum(r[side][k] for r in rows), 2)  # noqa: E731
    out = {"tasks": len(rows), "libraries": len(libs), "backend": a.backend, "seed": a.seed,
           "failing_full_s": tot("fail", "full_s"), "failing_fast_s": tot("fail", "fast_s"),
           "failing_median_full_s": round(statistics.median(r["fail"]["full_s"] for r in rows), 3),
           "failing_median_fast_s": round(statistics.median(r["fail"]["fast_s"] for r in rows), 3),
           "failing_stopped": sum(r["fail"]["stopped"] for r in rows),
           "gold_full_s": tot("gold", "full_s"), "gold_fast_s": tot("gold", "fast_s"),
           "gold_passed": sum(r["gold"]["reward"] == 1.0 for r in rows),
           "gold_failed": [r["task"] for r in rows if r["gold"]["reward"] != 1.0],
           "reward_disagreements": disagree}
    print(json.dumps(out))
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
