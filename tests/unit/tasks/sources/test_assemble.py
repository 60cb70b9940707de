"""Diffs the importers write apply back exactly (modify, add, delete, no final newline)."""

from __future__ import annotations

import pytest

from opencomposer.harness.patch import apply_hunks, parse_patch
from opencomposer.tasks.format import Task
from opencomposer.tasks.sources.assemble import file_diff, tree_files


@pytest.mark.parametrize("old, new", [
    ("a\nb\nc\n", "a\nB\nc\nd\n"),
    (None, "print('hi')\n"),
    ("gone\nnow\n", None),
    ("x = 1", "x = 2"),
])
def test_file_diff_applies(old, new):
    patch = file_diff("pkg/m.py", old, new)
    (fp,) = parse_patch(patch)
    assert fp.is_new == (old is None) and fp.is_delete == (new is None)
    assert apply_hunks(old or "", fp.hunks, fp.path) == (new or "")


def test_written_task_loads(tmp_path):
    from source_fixtures import ENV

    from opencomposer.tasks.sources.humaneval import import_humaneval

    rep = import_humaneval(tmp_path, [5], env=ENV)
    task = Task.load(tmp_path / rep.ok[0])
    assert set(tree_files(task.workspace)) == {"solution.py"}  # .git left out
    assert (task.root / "tests/test.sh").read_text().rstrip().endswith("test_solution.py::test_check")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
