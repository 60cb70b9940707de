"""Oracle solve rate: the scripted oracle on every task, through the real harness and sandbox.

    .venv/bin/python benchmarks/oracle_solve.py out/tasks --sandbox namespace --workers 2

Proves tasks are solvable through the ordinary tools. Prints failures, then one JSON line
with the solve rate, per-source counts and mean seconds per episode.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opencomposer.policies.oracle import OraclePolicy
from opencomposer.episode.run import run_task
from opencomposer.tasks.format import Task, find_tasks


def one(path: Path, backend: str) -> dict:
    task = Task.load(path)
    try:
        r = run_task(task, OraclePolicy(task), backend)
        return {"task": task.id, "source": task.meta.source.spec, "reward": r.reward.reward,
                "exit": r.trajectory.exit_reason, "seconds": r.seconds["total"],
                "tool_calls": r.trajectory.tool_calls, "invalid": r.trajectory.invalid_calls}
    except Exception as e:  # counted as unsolved, reported
        return {"task": task.id, "source": task.meta.source.spec, "reward": 0.0, "exit": f"crash: {e}",
                "seconds": 0.0, "tool_calls": 0, "invalid": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--sandbox", default="local")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    paths = find_tasks(a.paths)
    t0 = time.time()
    with ThreadPoolExecutor(a.workers) as ex:
        rows = list(ex.map(lambda p: one(p, a.sandbox), paths))
    solved = [r for r in rows if r["reward"] == 1.0]
    for r in rows:
        if r["reward"] != 1.0:
            print(f"unsolved: {r['task']} ({r['exit']})")
    by_src = Counter(r["source"] for r in rows)
    ok_src = Counter(r["source"] for r in solved)
    print(json.dumps({
        "bench": "oracle_solve", "sandbox": a.sandbox, "tasks": len(rows), "solved": len(solved),
        "solve_rate": round(len(solved) / max(len(rows), 1), 4),
        "per_source": {s: f"{ok_src[s]}/{n}" for s, n in sorted(by_src.items())},
        "invalid_calls": sum(r["invalid"] for r in rows),
        "mean_seconds": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 2),
        "wall_seconds": round(time.time() - t0, 1),
    }))


if __name__ == "__main__":
    main()
