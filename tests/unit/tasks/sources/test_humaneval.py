"""HumanEval problems -> tasks: the prompt is the workspace, the canonical solution the
gold patch; through the harness the oracle solves each and nothing passes before.
(All 164: ``tests/integration/test_task_formats.py::test_all_humaneval_solved``, slow.)"""

from __future__ import annotations

import gzip
import json

from source_fixtures import ENV

from opencomposer.policies.oracle import OraclePolicy
from opencomposer.grading import Carry
from opencomposer.grading.grade import grade, opener
from opencomposer.episode.run import run_task
from opencomposer.tasks.format import Task
from opencomposer.tasks.sources.humaneval import import_humaneval, read_problems

SOME = [0, 32, 38, 100, 163]  # 32 and 38 call helpers defined in the prompt


def test_five_problems_solved_by_oracle_and_failing_before(tmp_path):
    rep = import_humaneval(tmp_path, SOME, env=ENV)
    assert rep.summary()["ok"] == 5 and not rep.failed
    problems = {p["task_id"]: p for p in read_problems()}
    assert len(problems) == 164
    for name in rep.ok:
        task = Task.load(tmp_path / name)
        p = problems[task.meta.source.spec]
        assert (task.workspace / "solution.py").read_text() == p["prompt"]
        added = "".join(l[1:] + "\n" for l in task.gold_patch.splitlines() if l.startswith("+") and not l.startswith("+++"))
        assert added == p["canonical_solution"]
        assert grade(task, Carry(), opener("local")).reward == 0.0, name  # the empty body fails its tests
        res = run_task(task, OraclePolicy(task), "local")
        assert res.reward.reward == 1.0, (name, res.reward.details)


def test_bad_rows_reported_rest_imported(tmp_path):
    good = read_problems()[:2]
    rows = [good[0], {**good[1], "test": ""}, {k: v for k, v in good[1].items() if k not in ("entry_point", "task_id")}]
    data = tmp_path / "he.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    rep = import_humaneval(tmp_path / "out", data=data, env=ENV)
    s = rep.summary()
    assert (s["ok"], s["failed"]) == (1, 2), s
    assert "row 2: field(s) ['test'] missing" in s["failed_reasons"]["HumanEval/1"]
    assert "row 3: field(s) ['task_id', 'entry_point'] missing" in s["failed_reasons"]["row 3"]
