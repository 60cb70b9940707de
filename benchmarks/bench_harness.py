"""Harness overhead per tool call, per sandbox backend.

    .venv/bin/python benchmarks/bench_harness.py --task out/tasks/<id> --rounds 20

A scripted policy (no model time) drives the real agent loop on a task's workspace:
each round calls read_file, list_dir, search, edit_file, write_file and run('true').
Reports p50/p99 seconds per tool and the loop's overhead per call (wall time of the
episode minus time inside the tools, over the number of calls), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from opencomposer.config import AgentConfig
from opencomposer.harness.loop import Agent
from opencomposer.policies.scripted import ScriptedPolicy, tool_call
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.format import Task


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench(task: Task, backend: str, rounds: int) -> dict:
    f = task.meta.feature.file
    turns = []
    for i in range(rounds):
        turns.append([
            tool_call("read_file", path=f, start_line=1, end_line=80),
            tool_call("list_dir", path="."),
            tool_call("search", pattern=r"def \w+", path="."),
            tool_call("write_file", path=f"scratch_{i}.txt", content="x = 1\n"),
            tool_call("edit_file", path=f"scratch_{i}.txt", old="x = 1", new="x = 2"),
            tool_call("run", command="true"),
        ])
    turns.append([tool_call("submit", message="done")])
    cfg = AgentConfig(max_turns=rounds + 5, max_tokens=10**9, max_seconds=3600)
    with make_sandbox(task.sandbox_spec(), backend) as sb:
        t0 = time.perf_counter()
        traj = Agent(sb, ScriptedPolicy(turns), cfg).run(task.instruction)
        wall = time.perf_counter() - t0
    events = [e for s in traj.steps for e in s.tool_events]
    assert traj.exit_reason == "submitted" and all(e.ok for e in events), [e.observation for e in events if not e.ok][:2]
    by_tool: dict[str, list[float]] = {}
    for e in events:
        by_tool.setdefault(e.name, []).append(e.seconds)
    in_tools = sum(e.seconds for e in events)
    policy = sum(s.policy_seconds for s in traj.steps)
    return {
        "backend": backend, "calls": len(events),
        "tools": {k: {"p50_ms": round(statistics.median(v) * 1e3, 2), "p99_ms": round(pct(v, 0.99) * 1e3, 2)}
                  for k, v in by_tool.items()},
        "mean_ms_per_call": round(in_tools / len(events) * 1e3, 2),
        "loop_overhead_ms_per_call": round((wall - in_tools - policy) / len(events) * 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--backends", default="local,namespace")
    a = ap.parse_args()
    task = Task.load(a.task)
    results = [bench(task, b, a.rounds) for b in a.backends.split(",")]
    for r in results:
        print(f"{r['backend']:>10}: {r['calls']} calls, mean {r['mean_ms_per_call']} ms/call in tools, "
              f"loop overhead {r['loop_overhead_ms_per_call']} ms/call")
        for k, v in r["tools"].items():
            print(f"{'':>12}{k:<11} p50 {v['p50_ms']:>8} ms  p99 {v['p99_ms']:>8} ms")
    print(json.dumps({"bench": "harness", "task": task.id, "results": results}))


if __name__ == "__main__":
    main()
