"""rewards/placement.py: where an episode's change sits against the gold patch's (a diagnostic RL's rows
average per step), read from the carried code against the base; run_task records it for every graded episode."""

from __future__ import annotations

from pathlib import Path

from opencomposer.episode.run import run_task
from opencomposer.harness.trajectory import Trajectory
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.rewards.placement import gold_additions, placement
from opencomposer.rl.metrics import placement_stats
from opencomposer.tasks.deletion import make_patch

from testkit.oracle_tasks import STATS, STATS_DELETED, make_task

BASE = "def f(xs):\n    n = len(xs)\n    return total / n\n\n\ndef g():\n    return 1\n"  # `total = sum(xs)` deleted
GOLD_TEXT = "def f(xs):\n    n = len(xs)\n    total = sum(xs)\n    return total / n\n\n\ndef g():\n    return 1\n"
GOLD = make_patch(GOLD_TEXT, BASE, "lib/core.py")  # (solution, start): the gold patch


def _base(tmp_path: Path) -> Path:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "core.py").write_text(BASE)
    return tmp_path


def test_the_gold_lines_are_read_with_their_new_file_numbers():
    assert gold_additions(GOLD) == {"lib/core.py": [(3, "    total = sum(xs)")]}
    two = GOLD + make_patch("a\nb\n", "a\n", "lib/other.py")
    assert set(gold_additions(two)) == {"lib/core.py", "lib/other.py"}


def test_the_gold_line_the_right_place_another_place_and_another_file(tmp_path):
    base = _base(tmp_path)
    assert placement(GOLD, {"lib/core.py": GOLD_TEXT.encode()}, base) == {
        "edit_gold_file": 1.0, "edit_gold_text": 1.0, "edit_line_distance": 0.0}
    here_other_code = GOLD_TEXT.replace("total = sum(xs)", "total = max(xs)")
    assert placement(GOLD, {"lib/core.py": here_other_code.encode()}, base) == {
        "edit_gold_file": 1.0, "edit_gold_text": 0.0, "edit_line_distance": 0.0}
    lower = BASE.replace("    return 1\n", "    total = sum(xs)\n    return 1\n")  # the gold's text, 4 lines down
    assert placement(GOLD, {"lib/core.py": lower.encode()}, base) == {
        "edit_gold_file": 1.0, "edit_gold_text": 1.0, "edit_line_distance": 4.0}
    assert placement(GOLD, {"lib/elsewhere.py": b"x = 1\n"}, base) == {"edit_gold_file": 0.0, "edit_gold_text": 0.0}
    assert placement(GOLD, {"lib/core.py": BASE.encode()}, base) == {"edit_gold_file": 0.0, "edit_gold_text": 0.0}
    assert placement(GOLD + make_patch("a\nb\n", "a\n", "lib/other.py"), {}, base) == {}  # a gold over two files


def test_rl_rows_average_it_over_the_rollouts_measured():
    trajs = [Trajectory([], meta={"placement": p}) for p in (
        {"edit_gold_file": 1.0, "edit_gold_text": 1.0, "edit_line_distance": 0.0},
        {"edit_gold_file": 1.0, "edit_gold_text": 0.0, "edit_line_distance": 2.0},
        {"edit_gold_file": 1.0, "edit_gold_text": 0.0, "edit_line_distance": 7.0},
        {"edit_gold_file": 0.0, "edit_gold_text": 0.0})] + [Trajectory([], meta={"placement": {}})]
    assert placement_stats(trajs) == {"edit_gold_file": 0.75, "edit_at_gold_line": 0.25,
                                      "edit_near_gold_line": 0.5, "edit_gold_text": 0.25}
    assert placement_stats([Trajectory([])]) == {}


def test_every_graded_episode_records_it(tmp_path, cfg):
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
                     {"mathy/stats.py": STATS_DELETED}, make_patch(STATS, STATS_DELETED, "mathy/stats.py"),
                     "mathy.stats.mean")
    ep = run_task(task, OraclePolicy(task), "local", cfg)  # (its grade needs the task's env: not the point here)
    assert ep.trajectory.exit_reason == "submitted" and ep.trajectory.meta["changes"]["files"]
    assert ep.trajectory.meta["placement"] == {"edit_gold_file": 1.0, "edit_gold_text": 1.0, "edit_line_distance": 0.0}


def test_a_rewritten_file_counts_as_one_changed_range(tmp_path):
    # the middle of 20,000 repeated lines against the base is too large for a line diff (quadratic in
    # difflib): it is one range from the first to the last changed line
    base = _base(tmp_path)
    rewritten = "def f(xs):\n" + "    a = 1\n    b = 2\n" * 10_000
    assert placement(GOLD, {"lib/core.py": rewritten.encode()}, base) == {
        "edit_gold_file": 1.0, "edit_gold_text": 0.0, "edit_line_distance": 0.0}
    deleted = BASE.replace("    n = len(xs)\n", "")  # a deletion only: its place is the line after it
    assert placement(GOLD, {"lib/core.py": deleted.encode()}, base) == {
        "edit_gold_file": 1.0, "edit_gold_text": 0.0, "edit_line_distance": 1.0}
