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


def test_a_crlf_file_keeps_its_gold_patch_applicable(tmp_path):
    """A library file with CRLF line endings (lark 1.2.2's tree_templates.py): the gold patch
    holds "\\r\\n" lines, and reading it must not turn them into "\\n" (universal newlines did,
    and `patch` then refused the hunks: 11 of lark's 149 tasks failed their check)."""
    import shutil
    import subprocess

    from opencomposer.tasks.deletion import make_patch

    src = Path(__file__).parents[3] / "configs" / "suites" / "tasks" / "smoke" / "textkit__initials__body"
    task_dir = tmp_path / "task"
    shutil.copytree(src, task_dir)
    original = "def f(x):\r\n    y = x + 1\r\n    return y\r\n"
    deleted = "def f(x):\r\n    raise NotImplementedError\r\n"
    (task_dir / "workspace" / "crlf.py").write_bytes(deleted.encode())
    (task_dir / "solution" / "gold.patch").write_bytes(make_patch(original, deleted, "crlf.py").encode())
    gold = Task.load(task_dir).gold_patch
    assert "\r\n" in gold
    subprocess.run(["patch", "-p1", "--forward", "-s"], input=gold.encode(), cwd=task_dir / "workspace", check=True)
    assert (task_dir / "workspace" / "crlf.py").read_bytes() == original.encode()
