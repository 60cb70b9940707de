"""Validate a factory run's tasks while it runs: ``check_task`` (F2P fail, P2P pass, gold fixes
all, leak probe on every channel) and the oracle through the harness, per task.

    nice -n 19 .venv/bin/python benchmarks/validate_factory.py out/factory2k [--sandbox local]
        [--limit N] [--follow] [--shard I/N]

Only libraries whose factory session stopped are taken (the journal's last line is
``stopped``), so a library still being made is left alone. Tasks are drawn round-robin over
libraries in a fixed random order, so a partial pass covers every library evenly. Each
result is appended to ``OUT/_validation.jsonl``; a rerun skips tasks already there. With
``--follow`` it keeps polling for newly finished libraries until killed (or ``--limit``). Prints one JSON line last: checked, ok, leaks, oracle solve
rate, per library.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

from opencomposer.policies.oracle import OraclePolicy
from opencomposer.episode.run import run_task
from opencomposer.grading.check import check_task
from opencomposer.tasks.format import Task


def finished_libraries(out: Path) -> dict[str, list[str]]:
    """Env slug -> tasks made, for libraries whose latest factory session has stopped."""
    done = {}
    for j in sorted((out / "_journal").glob("*.jsonl")):
        lines = [json.loads(x) for x in j.read_text().splitlines() if x.strip().startswith("{")]
        if lines and lines[-1].get("event") == "stopped":
            done[j.stem] = sorted({ln["task"] for ln in lines if ln.get("task") and (out / ln["task"] / "task.toml").exists()})
    return done


def validate(path: Path, backend: str) -> dict:
    c = check_task(path, backend)
    task = Task.load(path)
    try:
        r = run_task(task, OraclePolicy(task), backend)
        reward, why = r.reward.reward, r.trajectory.exit_reason
    except Exception as e:  # noqa: BLE001 - counted as unsolved, reported
        reward, why = 0.0, f"crash: {type(e).__name__}: {e}"
    return {"task": path.name, "check_ok": c.ok, "leaks": c.leaks, "problems": c.problems[:2],
            "channels": len(c.leak_channels), "oracle": reward, "oracle_exit": why, "seconds": c.seconds}


def summary(rows: list[dict], slug_of) -> dict:
    per = defaultdict(lambda: [0, 0, 0, 0])
    for r in rows:
        p = per[slug_of(r["task"])]
        p[0] += 1
        p[1] += r["check_ok"]
        p[2] += r["leaks"] > 0
        p[3] += r["oracle"] == 1.0
    n = len(rows)
    return {"bench": "validate_factory", "checked": n, "check_ok": sum(r["check_ok"] for r in rows),
            "with_leaks": sum(r["leaks"] > 0 for r in rows),
            "oracle_solved": sum(r["oracle"] == 1.0 for r in rows),
            "oracle_solve_rate": round(sum(r["oracle"] == 1.0 for r in rows) / max(n, 1), 4),
            "per_library": {k: {"checked": v[0], "check_ok": v[1], "leaky": v[2], "oracle": v[3]}
                            for k, v in sorted(per.items())},
            "failures": {r["task"]: r["problems"] or [r["oracle_exit"]] for r in rows
                         if not r["check_ok"] or r["oracle"] != 1.0}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sandbox", default="local")
    ap.add_argument("--limit", type=int, default=0, help="stop after this many new tasks (0: all)")
    ap.add_argument("--follow", action="store_true", help="wait for more libraries to finish")
    ap.add_argument("--shard", default="0/1", help="I/N: take only the tasks whose index in the sorted list is I mod N "
                                                    "(N processes share one log)")
    a = ap.parse_args()
    log = a.out / "_validation.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    seen = {r["task"] for r in rows}
    shard, shards = map(int, a.shard.split("/"))
    if not 0 <= shard < shards:
        raise SystemExit(f"--shard {a.shard!r}: expected I/N with 0 <= I < N")
    slug = {}
    new = 0
    while True:
        libs = finished_libraries(a.out)
        for s, ts in libs.items():
            slug.update({t: s for t in ts})
        done = defaultdict(int)
        for t in seen:
            done[slug.get(t)] += 1
        queues = []
        for s, ts in sorted(libs.items(), key=lambda kv: done[kv[0]]):  # least validated first
            todo = [t for i, t in enumerate(ts) if t not in seen and i % shards == shard]
            random.Random(s).shuffle(todo)
            queues.append(todo)
        order = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
        if not order:
            if not a.follow:
                break
            time.sleep(60)
            continue
        for t in order[:1] if a.follow else order:
            r = validate(a.out / t, a.sandbox)
            rows.append(r)
            seen.add(t)
            with open(log, "a") as f:
                f.write(json.dumps(r) + "\n")
            new += 1
            if a.limit and new >= a.limit:
                break
        if a.limit and new >= a.limit or not a.follow and not order:
            break
        if not a.follow:
            break
    print(json.dumps(summary(rows, lambda t: slug.get(t, t.split("__", 1)[0]))))


if __name__ == "__main__":
    main()
