"""benchmarks/ablation_behaviour.py: arm configs, metrics from real episodes, a real tiny arm, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opencomposer.config import ConfigError, load_config
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.episode.run import run_task
from opencomposer.tasks.format import Task
from opencomposer.tasks.sources.humaneval import import_humaneval
from opencomposer.protocols import ToolCall
from testkit.scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
ab = load_benchmark("ablation_behaviour")


def test_shipped_config_loads_and_arms_differ_only_in_the_two_switches():
    cfg = load_config(ROOT / "configs" / "ablation" / "base.toml", ab.AblationConfig)
    arms = {a: ab.arm_config(cfg, a, Path("runs/x/sft_model")).model_dump() for a in ab.ARMS}
    assert [(arms[a]["reward"]["length"]["enabled"], arms[a]["feedback"]["enabled"]) for a in ab.ARMS] == \
        [(False, False), (True, False), (False, True), (True, True)]
    for a, d in arms.items():
        assert d["model"]["name"] == "runs/x/sft_model" and d["run"]["out_dir"].endswith(a)
        for key in ("tasks", "rollout", "agent", "loss", "train", "eval"):
            assert d[key] == arms["baseline"][key]
        assert d["run"]["seed"] == arms["baseline"]["run"]["seed"]


def test_overlapping_splits_are_rejected_naming_the_problems(tmp_path):
    p = tmp_path / "a.toml"
    p.write_text("[ablation]\ntrain = [1, 2]\nheldout = [2, 3]\n[tasks]\ndir = 'x'\n")
    with pytest.raises(ConfigError, match=r"problems \[2\] are in both train and heldout"):
        load_config(p, ab.AblationConfig)


def test_metrics_leave_undefined_ratios_undefined():
    rows = [{"task": "a", "solved": True, "turns": 4, "tool_calls": 6, "invalid_calls": 0,
             "completion_tokens": 300, "summaries": 0, "exit_reason": "submitted"},
            {"task": "b", "solved": False, "turns": 5, "tool_calls": 4, "invalid_calls": 2,
             "completion_tokens": 500, "summaries": 1, "exit_reason": "max_turns"}]
    m = ab.eval_metrics(rows, {"a"})
    assert m["all"]["invalid_call_rate"] == 0.2 and m["all"]["tokens_per_solved_mean"] == 300
    assert m["all"]["tokens_per_solve_total"] == 800 and m["all"]["summaries"] == 1
    assert m["heldout"]["solved"] == 0 and m["heldout"]["tokens_per_solved_mean"] is None
    assert ab.split_metrics([])["solve_rate"] is None
    assert "n/a" in ab.summary_table([{"arm": "sft", "metrics": m}])


def test_episode_row_of_a_real_oracle_episode(tmp_path):
    import_humaneval(tmp_path / "tasks", [53])
    task = Task.load(tmp_path / "tasks" / "HumanEval_53")
    res = run_task(task, OraclePolicy(task, compact=True), "local")
    row = ab.episode_row(res.trajectory)
    assert row["solved"] and row["exit_reason"] == "submitted" and row["invalid_calls"] == 0
    assert row["tool_calls"] == res.trajectory.tool_calls >= 4
    assert row["outcome"] == "solved"
    # the same episode unsolved: its edit was applied, so it ends as "edited_tests_fail"
    assert ab.outcome(res.trajectory, solved=False) == "edited_tests_fail"


def test_outcomes_of_a_refused_edit_and_of_no_edit(tmp_path):
    """An edit whose ``old`` text is not in the file is refused; an episode that only reads made no edit."""
    from opencomposer.policies.scripted import ScriptedPolicy

    import_humaneval(tmp_path / "tasks", [53])
    task = Task.load(tmp_path / "tasks" / "HumanEval_53")
    refused = [ToolCall("edit_file", {"path": "solution.py", "old": "not in the file\n", "new": "x = 1\n"}, "a"),
               ToolCall("submit", {"message": "done"}, "b")]
    reads = [ToolCall("read_file", {"path": "solution.py"}, "c"), ToolCall("submit", {"message": "done"}, "d")]
    for calls, want in ((refused, "edit_refused"), (reads, "no_edit")):
        traj = run_task(task, ScriptedPolicy([calls]), "local").trajectory
        row = ab.episode_row(traj)
        assert (row["solved"], row["outcome"]) == (False, want)
    m = ab.split_metrics([{**row, "outcome": o} for o in ("solved", "no_edit", "no_edit")])
    assert m["outcomes"] == {"solved": 1, "edited_tests_fail": 0, "edit_refused": 0, "no_edit": 2}


def test_a_tiny_arm_runs_end_to_end_and_is_not_rerun(tmp_path):
    import_humaneval(tmp_path / "tasks", [23, 53])
    cfg = ab.AblationConfig.model_validate({
        "ablation": {"train": [53], "heldout": [23]},
        "tasks": {"dir": str(tmp_path / "tasks")},
        "rollout": {"k": 2, "tasks_per_step": 1, "max_new_tokens": 8, "backend": "local", "engine": "builtin"},
        "agent": {"max_turns": 2, "max_tokens": 2000},
        "feedback": {"enabled": True}, "run": {"out_dir": str(tmp_path / "abl"), "steps": 1}})
    train, held = ab.ensure_tasks(cfg, print)
    tasks = [Task.load(p) for p in train + held]
    res = ab.arm_stage(cfg, "both", Path("tiny-random"), train, tasks, {"HumanEval_53"}, print)
    assert res["metrics"]["train"]["episodes"] == 1 and res["metrics"]["heldout"]["episodes"] == 1
    assert len(res["rl_steps"]) == 1 and "r_length" in res["rl_steps"][0] and "summaries" in res["rl_steps"][0]
    assert res["failed_episodes"] == 0
    result = tmp_path / "abl" / "both" / "result.json"
    before = result.stat().st_mtime_ns
    again = ab.arm_stage(cfg, "both", Path("tiny-random"), train, tasks, {"HumanEval_53"}, print)
    assert again == json.loads(result.read_text()) and result.stat().st_mtime_ns == before


def test_unknown_arm_is_an_error(capsys):
    assert ab.main(["--config", str(ROOT / "configs" / "ablation" / "base.toml"), "--arms", "baseline,nope"]) == 2
    assert "unknown arm(s) ['nope']" in capsys.readouterr().err
