"""Does the grounded oracle (``[sft] grounded_oracle``) solve tasks, and is every read it makes grounded?

    .venv/bin/python benchmarks/oracle_grounding.py --tasks runs/learn-gpu/tasks/lines --per-library 6 \
        [--config configs/learn/gpu-lines.toml] [--direct] [--set agent.lint_tool=true]

Runs the compact oracle (grounded, or the direct one with ``--direct``) on the first ``--per-library``
tasks of each library in ``--tasks``, in local sandboxes with the config's ``[agent]`` settings, and counts
the episodes that solved their task and those whose every ``read_file`` started at a line an earlier
observation printed (a search's ``file:N:``, up to 3 lines above it, a lint finding's ``file:N:`` less
``LINT_WINDOW`` lines, or a read's "start_line=N to read further"); with the lint tool offered, also those
whose first read was around a lint finding. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import learn_run  # noqa: E402

from opencomposer.episode.run import run_task  # noqa: E402
from opencomposer.policies import make_policy  # noqa: E402
from opencomposer.policies.oracle import ABOVE_DEFINITION, LINT_WINDOW  # noqa: E402
from opencomposer.tasks.format import Task  # noqa: E402


def grounded(events) -> bool:
    shown = ""
    for e in events:
        if e.name == "read_file":
            n = e.arguments["start_line"]
            if not (any(f":{n + k}:" in shown for k in range(ABOVE_DEFINITION + 1))
                    or f":{n + LINT_WINDOW}:" in shown or f"start_line={n} to read further" in shown):
                return False
        shown += "\n" + e.observation
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", required=True, help="a folder of task directories")
    ap.add_argument("--per-library", type=int, default=6)
    ap.add_argument("--config", default="configs/learn/gpu-lines.toml", help="its [agent] settings are used")
    ap.add_argument("--direct", action="store_true", help="the oracle that reads around the gold hunk")
    ap.add_argument("--set", action="append", default=[], help="a config setting, e.g. agent.lint_tool=true")
    a = ap.parse_args()
    cfg = learn_run.config_with(a.config, a.set)
    by = collections.defaultdict(list)
    for d in sorted(p.parent for p in Path(a.tasks).glob("*/task.toml")):
        by[Task.load(d).meta.source.spec].append(d)
    if not by:
        raise SystemExit(f"--tasks {a.tasks}: no task directories (*/task.toml) in it")
    picked = [d for dirs in by.values() for d in dirs[: a.per_library]]
    counts, reads, t0 = collections.Counter(), [], time.time()
    for d in picked:
        task = Task.load(d)
        r = run_task(task, make_policy("oracle", task=task, compact=True, grounded=not a.direct), "local", cfg.agent)
        events = [e for s in r.trajectory.steps for e in s.tool_events]
        counts["solved"] += bool(r.reward.passed)
        counts["grounded"] += grounded(events)
        first_read = next((s.text for s in r.trajectory.steps if any(e.name == "read_file" for e in s.tool_events)), "")
        counts["read_at_lint"] += first_read.startswith("lint flags line")
        counts["solved_at_lint"] += first_read.startswith("lint flags line") and bool(r.reward.passed)
        reads.append(sum(e.name == "read_file" for e in events))
    print(json.dumps({"bench": "oracle_grounding", "oracle": "direct" if a.direct else "grounded",
                      "tasks": len(picked), "libraries": len(by), "solved": counts["solved"],
                      "every_read_grounded": counts["grounded"], "first_read_at_a_lint_finding": counts["read_at_lint"],
                      "solved_from_a_lint_finding": counts["solved_at_lint"], "reads_per_episode": round(sum(reads) / len(reads), 2),
                      "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
