"""The oracle solves hand-made feature-deletion tasks through the ordinary tools."""

from __future__ import annotations

import sys
from pathlib import Path

from opencomposer.harness.loop import run_episode
from opencomposer.policies.oracle import OraclePolicy
from opencomposer.protocols import SandboxSpec
from opencomposer.sandbox import make_sandbox
from opencomposer.tasks.deletion import make_patch
from opencomposer.tasks.format import Task
from testkit.oracle_tasks import SHAPES, SHAPES_DELETED, STATS, STATS_DELETED, diff, make_task, solve

def test_oracle_restores_a_function_body(tmp_path, cfg):
    patch = make_patch(STATS, STATS_DELETED, "mathy/stats.py")  # how real tasks get their gold patch
    task = make_task(
        tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
        {"mathy/stats.py": STATS_DELETED}, patch, "mathy.stats.mean",
    )
    sb, traj = solve(task, cfg)
    with sb:
        assert sb.read_file("mathy/stats.py").decode() == STATS
    assert traj.exit_reason == "submitted" and "mathy.stats.mean" in traj.final_message
    assert traj.invalid_calls == 0 and traj.failed_calls == 0
    names = [e.name for s in traj.steps for e in s.tool_events]
    assert names == ["list_dir", "search", "read_file", "edit_file", "run", "submit"]
    assert "mathy/stats.py:4:def mean(xs):" in traj.steps[1].tool_events[0].observation
    assert traj.steps[4].tool_events[0].observation.startswith("exit code 0")
    assert "<tool_call>" in traj.steps[0].text  # the text is what a local model would write


def shapes_task(tmp_path: Path) -> Task:
    """A hunk whose text (1 line of context) occurs twice: Square.name and Circle.name."""
    patch = diff("mathy/shapes.py", SHAPES_DELETED, SHAPES, context=1)
    return make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/shapes.py": SHAPES},
                     {"mathy/shapes.py": SHAPES_DELETED}, patch, "mathy.shapes.Circle.name")


def test_oracle_widens_the_context_when_the_hunk_is_not_unique(tmp_path, cfg):
    sb, traj = solve(shapes_task(tmp_path), cfg)
    with sb:
        assert sb.read_file("mathy/shapes.py").decode() == SHAPES
    edits = [e for s in traj.steps for e in s.tool_events if e.name == "edit_file"]
    assert len(edits) == 2 and "occurs 2 times" in edits[0].observation and edits[1].ok
    assert len(edits[1].arguments["old"]) > len(edits[0].arguments["old"])
    assert traj.exit_reason == "submitted" and traj.failed_calls == 1


def test_oracle_falls_back_to_write_file_when_widening_fails(tmp_path, cfg):
    cfg = cfg.model_copy(update={"max_output_chars": 400})  # too small a window to widen; reads take pages
    sb, traj = solve(shapes_task(tmp_path), cfg)
    with sb:
        assert sb.read_file("mathy/shapes.py").decode() == SHAPES
    events = [e for s in traj.steps for e in s.tool_events]
    edit = next(e for e in events if e.name == "edit_file")
    assert "occurs 2 times" in edit.observation
    assert sum(e.name == "read_file" for e in events) >= 3  # around the hunk, then page by page
    assert events[-2].name == "run" and events[-3].name == "write_file"
    assert traj.exit_reason == "submitted" and "could not" not in traj.final_message


def several_files_task(root, new_file: str):
    """Two hunks in stats.py kept apart by fillers, one in __init__.py, and ``new_file`` created."""
    fillers = "".join(f"\n\ndef f{i}():\n    return {i}\n" for i in range(6))  # keeps the hunks apart
    long_stats = STATS.split("\n\ndef span")[0] + fillers + "\n\ndef span(xs):\n    return max(xs) - min(xs)\n"
    long_deleted = STATS_DELETED.split("\n\ndef span")[0] + fillers + "\n\ndef span(xs):\n    raise NotImplementedError\n"
    original = {"mathy/__init__.py": "from mathy.stats import mean\n", "mathy/stats.py": long_stats,
                new_file: "VALUE = 3\n"}
    deleted = {"mathy/__init__.py": "", "mathy/stats.py": long_deleted}
    patch = (diff("mathy/stats.py", long_deleted, long_stats) + diff("mathy/__init__.py", "", original["mathy/__init__.py"])
             + diff(new_file, None, "VALUE = 3\n"))
    return make_task(root, original, deleted, patch, "mathy.stats.mean"), original


def test_oracle_handles_several_files_hunks_and_a_new_file(tmp_path, cfg):
    task, original = several_files_task(tmp_path / "task", "mathy/extra.py")
    assert len(task.gold_patch.split("@@ -")) - 1 == 4
    sb, traj = solve(task, cfg)
    with sb:
        for path, text in original.items():
            assert sb.read_file(path).decode() == text, path
        assert sb.exec("python -c 'import mathy; print(mathy.mean([1, 3]))'").output.strip() == "2.0"
    assert traj.exit_reason == "submitted" and traj.invalid_calls == 0


def test_oracle_starts_over_for_a_new_episode(tmp_path, cfg):
    task = make_task(
        tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
        {"mathy/stats.py": STATS_DELETED}, diff("mathy/stats.py", STATS_DELETED, STATS), "mathy.stats.mean",
    )
    policy = OraclePolicy(task)
    for _ in range(2):
        with make_sandbox(SandboxSpec(base_dir=task.workspace), "local") as sb:
            traj = run_episode(task.instruction, sb, policy, cfg)
            assert traj.exit_reason == "submitted" and sb.read_file("mathy/stats.py").decode() == STATS


def test_compact_oracle_batches_independent_calls(tmp_path, cfg):
    """list_dir+search and run+submit share turns: 4 turns for a one-hunk task."""
    patch = make_patch(STATS, STATS_DELETED, "mathy/stats.py")
    task = make_task(
        tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
        {"mathy/stats.py": STATS_DELETED}, patch, "mathy.stats.mean",
    )
    sb = make_sandbox(SandboxSpec(base_dir=task.workspace, env_dir=Path(sys.prefix)), "local")
    traj = run_episode(task.instruction, sb, OraclePolicy(task, compact=True), cfg, task_id=task.id)
    with sb:
        assert sb.read_file("mathy/stats.py").decode() == STATS
    assert traj.exit_reason == "submitted" and traj.turns == 4 and traj.invalid_calls == 0
    assert [e.name for e in traj.steps[0].tool_events] == ["list_dir", "search"]
    assert [e.name for e in traj.steps[-1].tool_events] == ["run", "submit"]


# ---------------------------------------------------------------- by line numbers (AgentConfig.edit_tools)


def test_oracle_edits_by_line_numbers_when_edit_file_is_not_offered(tmp_path, cfg):
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"]})
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
                     {"mathy/stats.py": STATS_DELETED}, make_patch(STATS, STATS_DELETED, "mathy/stats.py"),
                     "mathy.stats.mean")
    sb, traj = solve(task, cfg)
    with sb:
        assert sb.read_file("mathy/stats.py").decode() == STATS
    assert traj.exit_reason == "submitted" and traj.invalid_calls == 0 and traj.failed_calls == 0
    events = [e for s in traj.steps for e in s.tool_events]
    assert [e.name for e in events] == ["list_dir", "search", "read_file", "replace_lines", "run", "submit"]
    edit = events[3].arguments  # only the changed line, found by the number read_file showed it with
    assert (edit["start_line"], edit["end_line"]) == (5, 5) and "    5\t    raise NotImplementedError" in events[2].observation
    assert edit["new"].startswith("    if not xs:\n") and edit["new"].endswith("return sum(xs) / len(xs)\n")
    assert traj.tools == ["read_file", "list_dir", "search", "replace_lines", "write_file", "run", "submit"]


def test_oracle_by_lines_has_no_trouble_with_repeated_text(tmp_path, cfg):
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"]})
    sb, traj = solve(shapes_task(tmp_path), cfg)
    with sb:
        assert sb.read_file("mathy/shapes.py").decode() == SHAPES
    assert [e.name for s in traj.steps for e in s.tool_events].count("replace_lines") == 1
    assert traj.exit_reason == "submitted" and traj.failed_calls == 0


def test_oracle_by_lines_alone_handles_several_files_hunks_and_a_new_file(tmp_path, cfg):
    """With replace_lines the only edit tool: hunks moved by earlier ones are read again, and
    the new file is created empty and filled."""
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines"]})
    task, original = several_files_task(tmp_path / "task", "mathy/sub/extra.py")
    sb, traj = solve(task, cfg)
    with sb:
        for path, text in original.items():
            assert sb.read_file(path).decode() == text, path
    names = [e.name for s in traj.steps for e in s.tool_events]
    assert "edit_file" not in names and "write_file" not in names and names.count("replace_lines") == 4
    assert traj.exit_reason == "submitted" and traj.invalid_calls == 0 and traj.failed_calls == 0


def test_oracle_by_lines_rewrites_every_line_when_the_lines_do_not_match(tmp_path, cfg):
    """The patch's line numbers are off (the file moved on): the oracle reads the whole file
    and replaces all its lines with the patched text."""
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines"]})
    moved = "# a comment the patch does not know\n" * 30
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
                     {"mathy/stats.py": moved + STATS_DELETED}, make_patch(STATS, STATS_DELETED, "mathy/stats.py"),
                     "mathy.stats.mean")
    sb, traj = solve(task, cfg)
    with sb:
        assert sb.read_file("mathy/stats.py").decode() == moved + STATS
    edits = [e for s in traj.steps for e in s.tool_events if e.name == "replace_lines"]
    assert len(edits) == 1 and edits[0].arguments["start_line"] == 1 and edits[0].ok
    assert traj.exit_reason == "submitted" and traj.failed_calls == 0


def test_oracle_edit_with_overrides_the_tools_offered(tmp_path, cfg):
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/stats.py": STATS},
                     {"mathy/stats.py": STATS_DELETED}, diff("mathy/stats.py", STATS_DELETED, STATS), "mathy.stats.mean")
    cfg = cfg.model_copy(update={"edit_tools": ["edit_file", "replace_lines", "write_file"]})
    with make_sandbox(SandboxSpec(base_dir=task.workspace), "local") as sb:
        traj = run_episode(task.instruction, sb, OraclePolicy(task, edit_with="replace_lines"), cfg)
        assert sb.read_file("mathy/stats.py").decode() == STATS
    names = [e.name for s in traj.steps for e in s.tool_events]
    assert "replace_lines" in names and "edit_file" not in names


def _grounded_episode(task, cfg):
    spec = SandboxSpec(base_dir=task.workspace, env_dir=Path(sys.prefix))
    sb = make_sandbox(spec, "local")
    traj = run_episode(task.instruction, sb, OraclePolicy(task, compact=True, grounded=True), cfg, task_id=task.id)
    return sb, [e for s in traj.steps for e in s.tool_events], traj


def _every_read_starts_where_it_was_shown(events) -> None:
    """Each read_file's start_line was printed before it: by the search (file:N:, or up to 3 lines above that
    to take in the lines just above a definition) or by a read's "read further"."""
    shown = ""
    for e in events:
        if e.name == "read_file":
            n = e.arguments["start_line"]
            assert any(f":{n + k}:" in shown for k in range(4)) or f"start_line={n} to read further" in shown, (
                n, shown[-400:])
        shown += "\n" + e.observation


def test_grounded_oracle_reads_a_method_from_the_definition_its_search_showed(tmp_path, cfg):
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"]})
    patch = diff("mathy/shapes.py", SHAPES_DELETED, SHAPES, context=1)
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/shapes.py": SHAPES},
                     {"mathy/shapes.py": SHAPES_DELETED}, patch, "Circle.name", file="mathy/shapes.py")
    sb, events, traj = _grounded_episode(task, cfg)  # Square.name is defined first, with the same text
    with sb:
        assert sb.read_file("mathy/shapes.py").decode() == SHAPES
    assert traj.exit_reason == "submitted" and traj.invalid_calls == 0 and traj.failed_calls == 0
    assert [e.name for e in events] == ["list_dir", "search", "read_file", "replace_lines", "run", "submit"]
    search = events[1]
    assert search.arguments["path"] == "mathy/shapes.py"
    assert "mathy/shapes.py:65:    def name(self):" in search.observation  # Square's, not the one to read
    assert "mathy/shapes.py:69:class Circle:" in search.observation
    assert events[2].arguments["start_line"] == 73 and "end_line" not in events[2].arguments
    _every_read_starts_where_it_was_shown(events)


def _long_function_episode(tmp_path, cfg, body: str, gone: str, returns: str = "1"):
    """``def total():`` with ``body`` at line 8 of mathy/long.py, the line ``gone`` deleted; the grounded
    oracle's episode, the file checked restored; its events and trajectory."""
    original = f"import os\n\n\ndef prelude():\n    return {returns}\n\n\ndef total():\n" + body + "    return v89\n"
    deleted = original.replace(gone, "")
    task = make_task(tmp_path / "task", {"mathy/__init__.py": "", "mathy/long.py": original},
                     {"mathy/long.py": deleted}, make_patch(original, deleted, "mathy/long.py"), "mathy.long.total")
    sb, events, traj = _grounded_episode(task, cfg)
    with sb:
        assert sb.read_file("mathy/long.py").decode() == original
    return events, traj


def test_grounded_oracle_reads_on_until_the_gap_of_a_long_function_is_in_view(tmp_path, cfg):
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"], "max_output_chars": 1200})
    body = "".join(f"    v{i} = {i} * 3\n" for i in range(90))
    events, traj = _long_function_episode(tmp_path, cfg, body, "    v70 = 70 * 3\n")
    assert traj.exit_reason == "submitted" and traj.failed_calls == 0
    reads = [e for e in events if e.name == "read_file"]
    assert reads[0].arguments["start_line"] == 8 and len(reads) >= 2  # def total(): then "read further"
    _every_read_starts_where_it_was_shown(events)


def test_the_default_oracle_still_reads_around_the_hunk(tmp_path, cfg):
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"]})
    task = shapes_task(tmp_path)
    sb, traj = solve(task, cfg)
    sb.__exit__(None, None, None)
    read = [e for s in traj.steps for e in s.tool_events if e.name == "read_file"][0]
    assert read.arguments["start_line"] == 68  # five lines above the hunk: where only the gold patch points


def test_grounded_oracle_with_lint_reads_around_the_finding_the_lint_showed(tmp_path, cfg):
    """A deleted assignment leaves the next line's name undefined: the oracle lints the file with its
    search, reads the window around that finding (one read, not from the definition on) and restores it."""
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"], "max_output_chars": 1200,
                                 "lint_tool": True})
    body = "    v0 = 3\n" + "".join(f"    v{i} = v{i - 1} + 3\n" for i in range(1, 90))
    events, traj = _long_function_episode(tmp_path, cfg, body, "    v70 = v69 + 3\n", returns="os.sep")
    assert traj.exit_reason == "submitted" and traj.invalid_calls == 0 and traj.failed_calls == 0
    assert [e.name for e in events] == ["list_dir", "search", "lint", "read_file", "replace_lines", "run", "submit"]
    # the gap leaves `v69` unused (line 78, first) and `v70` undefined (line 79, `v71 = v70 + 3`)
    assert events[2].observation.splitlines() == [
        "mathy/long.py:78:5: F841 Local variable `v69` is assigned to but never used",
        "mathy/long.py:79:11: F821 Undefined name `v70`"]
    read = events[3]
    assert (read.arguments["start_line"], read.arguments["end_line"]) == (78 - 8, 78 + 8)
    assert "lint flags line 78, in `total`: F841 Local variable `v69` is assigned to but never used" in traj.steps[1].text


def test_grounded_oracle_with_lint_falls_back_to_the_definition_when_no_finding_is_near(tmp_path, cfg):
    cfg = cfg.model_copy(update={"edit_tools": ["replace_lines", "write_file"], "max_output_chars": 1200,
                                 "lint_tool": True})
    body = "".join(f"    v{i} = {i} * 3\n" for i in range(90))  # every v_i but the last unused: the first is far above
    events, _ = _long_function_episode(tmp_path, cfg, body, "    v70 = 70 * 3\n", returns="os.sep")
    assert events[2].name == "lint" and events[2].observation.startswith(
        "mathy/long.py:9:5: F841 Local variable `v0` is assigned to but never used\n")
    reads = [e for e in events if e.name == "read_file"]
    assert reads[0].arguments["start_line"] == 8 and len(reads) >= 2  # def total(): then "read further"
