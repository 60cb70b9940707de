"""``tasks stats``: counts, medians and the oracle solve rate of real (HumanEval) tasks."""

from __future__ import annotations

import json

import pytest

from source_fixtures import ENV

from opencomposer.episode.oracle import run_oracle
from opencomposer.tasks.sources.assemble import file_diff
from opencomposer.tasks.sources.humaneval import import_humaneval
from opencomposer.tasks.stats import ORACLE_FILE, diff_size, task_stats


def test_diff_size_counts_changed_lines_and_files():
    patch = file_diff("a.py", "x = 1\ny = 2\n", "x = 1\ny = 3\nz = 4\n") + file_diff("b.py", None, "new\n")
    assert diff_size(patch) == (4, 2)  # -y=2 +y=3 +z=4, +new
    assert diff_size("not a patch") == (0, 0)


def test_stats_with_oracle_and_from_saved_results(tmp_path):
    rep = import_humaneval(tmp_path, [0, 2], env=ENV)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "task.toml").write_text("id = [")
    s = task_stats([tmp_path], oracle="local", run_oracle=run_oracle)
    assert s["tasks"] == 2 and s["unreadable"] == 1 and "broken" in s["unreadable_reasons"]
    assert s["by_source"] == {"humaneval": 2} and s["by_level"] == {"body": 2}
    assert s["median_gold_files"] == 1 and s["median_gold_lines"] > 0
    lens = sorted(len((tmp_path / n / "instruction.md").read_text().strip()) for n in rep.ok)
    assert s["median_instruction_chars"] == (lens[0] + lens[1]) / 2
    assert s["oracle"]["ran"] == 2 and s["oracle"]["solved"] == 2 and s["oracle"]["solve_rate"] == 1.0
    saved = json.loads((tmp_path / ORACLE_FILE).read_text())
    assert {r["task"] for r in saved} == set(rep.ok)
    again = task_stats([tmp_path])  # no --oracle: read back the saved results
    assert again["oracle"]["solved"] == 2 and again["oracle"]["sandbox"] == f"from {ORACLE_FILE}"
    with pytest.raises(ValueError, match="needs run_oracle"):  # tasks/ cannot run episodes itself
        task_stats([tmp_path], oracle="local")
