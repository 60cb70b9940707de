"""The grader's cost per episode, and the oracle's solve rate through it.

    .venv/bin/opencomposer tasks make --config benchmarks/grader-sample.toml     # ~200 tasks, once
    .venv/bin/python benchmarks/bench_grader.py --tasks out/grader-sample --backend namespace --n 200

For each task, in the same run and alternating which goes first:

* **old**: the grader before issue 28, in the episode's own sandbox: the gold patch applied,
  the hidden tests copied over the workspace, ``python -m pytest -rA`` and its printed
  summary parsed (``tasks/testrun.run_tests``);
* **new**: ``grading``: the agent's changed files read from the episode's sandbox (their
  list, from git, is made for the monitors and lint in both, so not timed), a fresh sandbox, the carried files, the hidden tests and a canary laid, pytest under the
  nonce-report launcher.

The episode's own work (applying the gold patch) is outside both timings. Then the oracle
plays each task through ``run_task`` (the harness, the new grader, the monitors): its solve
rate and any monitor flag. Prints a table and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from opencomposer.grading import collect, grade
from opencomposer.grading.grade import apply_patch, lay_hidden_tests, opener
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.rewards.changes import workspace_changes
from opencomposer.episode.run import run_task
from opencomposer.tasks.format import Task, find_tasks
from opencomposer.tasks.testrun import run_tests


def old_grade(task: Task, backend: str) -> tuple[float, bool]:
    """(seconds, passed) of the pre-issue-28 grader, in the sandbox the 'agent' worked in."""
    t = task.meta.tests
    with opener(backend)(task.sandbox_spec()) as sb:
        apply_patch(sb, task.gold_patch, "gold")
        t0 = time.perf_counter()
        lay_hidden_tests(task, sb)
        rep = run_tests(sb, t.targets, t.command, timeout=t.timeout)
        ok = all(rep.status(n) in ("PASSED", "XFAIL") for n in t.fail_to_pass + t.pass_to_pass) and not rep.timed_out
        return time.perf_counter() - t0, ok


def new_grade(task: Task, backend: str) -> tuple[float, bool]:
    open_sandbox = opener(backend)
    with open_sandbox(task.sandbox_spec()) as sb:
        apply_patch(sb, task.gold_patch, "gold")
        changes = workspace_changes(task.workspace, sb)  # run_task lists them for the monitors either way
        t0 = time.perf_counter()
        carry = collect(task.workspace, sb, changes)
    res = grade(task, carry, open_sandbox)
    return time.perf_counter() - t0, res.passed


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=Path, default=Path("out/grader-sample"))
    ap.add_argument("--backend", default="namespace")
    ap.add_argument("--n", type=int, default=200, help="tasks sampled (all if fewer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    paths = [p for p in find_tasks([args.tasks]) if (p / "task.toml").is_file()]
    if not paths:
        sys.exit(f"--tasks {args.tasks}: no task directories (make them with benchmarks/grader-sample.toml)")
    random.Random(args.seed).shuffle(paths)
    paths = sorted(paths[: args.n])
    rows = []
    for i, p in enumerate(paths):
        task = Task.load(p)
        order = [old_grade, new_grade] if i % 2 else [new_grade, old_grade]
        got = {f.__name__: f(task, args.backend) for f in order}
        ep = run_task(task, OraclePolicy(task), args.backend)
        rows.append({"task": task.id, "old_s": got["old_grade"][0], "old_ok": got["old_grade"][1],
                     "new_s": got["new_grade"][0], "new_ok": got["new_grade"][1],
                     "oracle": ep.reward.reward, "flags": sorted(ep.flags), "details": ep.reward.details["report"]})
        print(f"[{i + 1}/{len(paths)}] {task.id}: old {got['old_grade'][0] * 1e3:.0f} ms, new "
              f"{got['new_grade'][0] * 1e3:.0f} ms, oracle {ep.reward.reward} {sorted(ep.flags) or ''}", flush=True)
    old = [r["old_s"] * 1e3 for r in rows]
    new = [r["new_s"] * 1e3 for r in rows]
    added = [n - o for n, o in zip(new, old)]
    libs = sorted({r["task"].split("__")[0] for r in rows})
    out = {
        "bench": "grader", "backend": args.backend, "tasks": len(rows), "libraries": len(libs),
        "old_ms_p50": round(statistics.median(old), 1), "old_ms_p99": round(pct(old, 0.99), 1),
        "new_ms_p50": round(statistics.median(new), 1), "new_ms_p99": round(pct(new, 0.99), 1),
        "added_ms_p50": round(statistics.median(added), 1), "added_ms_p99": round(pct(added, 0.99), 1),
        "gold_passed_old": sum(r["old_ok"] for r in rows), "gold_passed_new": sum(r["new_ok"] for r in rows),
        "oracle_solved": sum(r["oracle"] == 1.0 for r in rows), "oracle_flagged": sum(bool(r["flags"]) for r in rows),
        "unsolved": [r["task"] for r in rows if r["oracle"] != 1.0][:20],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
