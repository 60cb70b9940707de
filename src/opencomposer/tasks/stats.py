"""What a set of tasks looks like: counts by source and level, instruction length, gold
diff size, and the oracle solve rate.

    opencomposer tasks stats tasks/ [--oracle --sandbox namespace]

The solve rate comes from ``--oracle`` (the scripted oracle run through the harness on
every task now) or else from ``DIR/oracle.json`` rows written by an earlier ``--oracle``
run. For scale: CursorBench's median task changes 181 lines from a 390-character prompt;
SWE-bench variants change 7-10 lines from 1,185-3,055 characters.

Test: ``pytest tests/unit/tasks_sources/test_stats.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opencomposer.harness.patch import PatchError, parse_patch
from opencomposer.paths import atomic_write_text
from opencomposer.tasks.format import Task, TaskFormatError, find_tasks

ORACLE_FILE = "oracle.json"


def diff_size(patch: str) -> tuple[int, int]:
    """(changed lines: added + removed, files) of a unified diff."""
    try:
        files = parse_patch(patch)
    except PatchError:
        return 0, 0
    lines = sum(1 for fp in files for h in fp.hunks for tag, _ in h.lines if tag in "+-")
    return lines, len(files)


def run_oracle(tasks: list[Task], backend: str, workers: int = 2) -> list[dict]:
    """The oracle policy on each task through the harness + hidden-test reward."""
    from opencomposer.policies.oracle import OraclePolicy
    from opencomposer.episode.run import run_task

    def one(task: Task) -> dict:
        try:
            r = run_task(task, OraclePolicy(task), backend)
            return {"task": task.id, "reward": r.reward.reward, "seconds": r.seconds["total"],
                    "exit": r.trajectory.exit_reason}
        except Exception as e:  # noqa: BLE001 -- a crash is an unsolved task, reported with its reason
            return {"task": task.id, "reward": 0.0, "seconds": 0.0, "exit": f"crash: {type(e).__name__}: {e}"}

    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, tasks))


def task_stats(paths: list[Path], oracle: str | None = None, workers: int = 2) -> dict:
    """Everything ``tasks stats`` prints; ``oracle`` is a sandbox backend to run the oracle on."""
    t0 = time.time()
    tasks, bad = [], {}
    for p in find_tasks([Path(x) for x in paths]):
        try:
            tasks.append(Task.load(p))
        except TaskFormatError as e:
            bad[p.name] = str(e)
    sizes = [diff_size(t.gold_patch) for t in tasks]
    med = lambda xs: statistics.median(xs) if xs else 0
    result = {
        "tasks": len(tasks), "unreadable": len(bad),
        "by_source": dict(sorted(Counter(t.meta.source.kind for t in tasks).items())),
        "by_level": dict(sorted(Counter(t.meta.feature.level for t in tasks).items())),
        "median_instruction_chars": med([len(t.instruction) for t in tasks]),
        "median_gold_lines": med([s[0] for s in sizes]),
        "median_gold_files": med([s[1] for s in sizes]),
    }
    rows = None
    if oracle:
        rows = run_oracle(tasks, oracle, workers)
        if len(paths) == 1 and Path(paths[0]).is_dir() and not (Path(paths[0]) / "task.toml").exists():
            atomic_write_text(Path(paths[0]) / ORACLE_FILE, json.dumps(rows, indent=1))
    elif len(paths) == 1 and (Path(paths[0]) / ORACLE_FILE).is_file():
        have = {t.id for t in tasks}
        rows = [r for r in json.loads((Path(paths[0]) / ORACLE_FILE).read_text()) if r.get("task") in have]
    if rows is not None:
        solved = [r for r in rows if r["reward"] == 1.0]
        result["oracle"] = {"ran": len(rows), "solved": len(solved),
                            "solve_rate": round(len(solved) / max(len(rows), 1), 4),
                            "sandbox": oracle or "from " + ORACLE_FILE,
                            "unsolved": {r["task"]: r["exit"] for r in rows if r["reward"] != 1.0}}
    if bad:
        result["unreadable_reasons"] = bad
    result["seconds"] = round(time.time() - t0, 2)
    return result
