"""The compact oracle edits real tasks by line numbers when the agent is offered replace_lines
and not edit_file (``[agent] edit_tools``), and its traces still solve them: HumanEval problems
and tasks made from a real PyPI library (toolz), through ``pipeline.warm_start.oracle_traces`` as the
SFT stage makes them, then rendered for SFT with the tools the episodes were given.

Run: ``pytest tests/integration/test_oracle_by_lines.py`` (about two minutes; needs PyPI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from opencomposer.harness.prompt import episode_tools
from opencomposer.models.chat import render_prompt
from opencomposer.pipeline.warm_start import oracle_traces
from opencomposer.rl.config import RLRunConfig
from opencomposer.tasks.format import find_tasks
from opencomposer.tasks.sources.humaneval import import_humaneval

LINES = ["replace_lines", "write_file"]


@pytest.fixture(scope="module")
def humaneval(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("humaneval")
    assert import_humaneval(out, [0, 32, 53, 100, 163]).summary()["ok"] == 5
    return out


def traces(tasks: Path, tmp_path: Path) -> list:
    cfg = RLRunConfig.model_validate({"tasks": {"dir": str(tasks)}, "agent": {"edit_tools": LINES, "max_turns": 8},
                                      "run": {"out_dir": str(tmp_path / "run")}})
    dirs = find_tasks([tasks])
    trajs = oracle_traces(dirs, "local", tmp_path / "oracle", cfg)
    assert len(trajs) == len(dirs)  # every trace solved its task (unsolved ones are dropped)
    return trajs


@pytest.mark.parametrize("source", ["humaneval", "toolz_tasks"])
def test_oracle_traces_solve_real_tasks_by_line_numbers(source, request, tmp_path, tiny):
    trajs = traces(request.getfixturevalue(source), tmp_path)
    for t in trajs:
        names = [e.name for s in t.steps for e in s.tool_events]
        assert "replace_lines" in names and "edit_file" not in names, (t.task_id, names)
        assert t.invalid_calls == 0 and t.failed_calls == 0 and t.turns <= 5, (t.task_id, t.counts)
        assert t.tools == ["read_file", "list_dir", "search", "replace_lines", "write_file", "run", "submit"]
    _, tok = tiny
    prompt = render_prompt(tok, trajs[0].messages[:2], episode_tools(trajs[0]))  # what SFT trains on
    assert '"name": "replace_lines"' in prompt and "edit_file" not in prompt
