"""Task directories: a missing or garbled task.toml is a clear error naming the file."""

from pathlib import Path

import pytest

from opencomposer.tasks.format import (
    FeatureInfo, SourceInfo, Task, TaskFormatError, TaskMeta, TestsInfo, find_tasks, write_task_toml,
)


def make_task(root: Path) -> Path:
    (root / "workspace").mkdir(parents=True)
    (root / "solution").mkdir()
    (root / "solution" / "gold.patch").write_text("")
    (root / "instruction.md").write_text("Implement `f`.\n")
    meta = TaskMeta(id="t1", source=SourceInfo(spec="x==1"),
                    feature=FeatureInfo(level="body", file="x.py", symbol="f"),
                    tests=TestsInfo(command="pytest", files=["t.py"], targets=["t.py"], fail_to_pass=["t.py::a"]))
    write_task_toml(root / "task.toml", meta)
    return root


def test_round_trip(tmp_path):
    t = Task.load(make_task(tmp_path / "t"))
    assert t.id == "t1" and t.instruction == "Implement `f`." and t.meta.tests.fail_to_pass == ["t.py::a"]
    assert find_tasks([tmp_path]) == [tmp_path / "t"]


def test_missing_task_toml(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "task.toml").unlink()
    with pytest.raises(TaskFormatError, match=r"task\.toml: missing"):
        Task.load(root)


def test_garbled_task_toml(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "task.toml").write_text("id = 't1\n[tests\n")
    with pytest.raises(TaskFormatError, match="garbled, not valid TOML"):
        Task.load(root)


def test_bad_field_is_named(tmp_path):
    root = make_task(tmp_path / "t")
    text = (root / "task.toml").read_text().replace('fail_to_pass = [\n    "t.py::a",\n]', "fail_to_pass = []")
    (root / "task.toml").write_text(text + "\nsurprise = 1\n")
    with pytest.raises(TaskFormatError) as e:
        Task.load(root)
    assert "tests.fail_to_pass" in str(e.value) and "surprise" in str(e.value) and "task.toml" in str(e.value)


def test_missing_parts(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "instruction.md").write_text("  \n")
    with pytest.raises(TaskFormatError, match="instruction.md: empty"):
        Task.load(root)
    with pytest.raises(TaskFormatError, match="not a task directory"):
        Task.load(tmp_path / "nope")
