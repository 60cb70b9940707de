"""benchmarks/bench_fail_fast.py: each sampled task graded four ways in one run, the rewards agreeing task by task,
and a folder without tasks refused by name."""

from __future__ import annotations

import json

import pytest
from testkit.scripts import load_benchmark

bf = load_benchmark("bench_fail_fast")


def test_real_tasks_graded_both_ways_with_the_same_rewards(toolz_tasks, capsys):
    assert bf.main([str(toolz_tasks), "--n", "2", "--backend", "local"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tasks"] == 2 and out["reward_disagreements"] == [] and out["gold_failed"] == []
    assert out["gold_passed"] == 2 and out["failing_stopped"] == 2  # the unchanged workspace stops at a failure
    assert out["failing_full_s"] > 0 and out["failing_fast_s"] > 0


def test_a_folder_without_tasks_is_refused_naming_it(tmp_path):
    with pytest.raises(SystemExit, match=str(tmp_path)):
        bf.main([str(tmp_path), "--backend", "local"])
