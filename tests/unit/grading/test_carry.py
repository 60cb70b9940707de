"""What reaches the grader of an episode: changes to the code under test, and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from opencomposer.grading.carry import collect, refusal
from opencomposer.protocols import SandboxSpec
from opencomposer.rewards.changes import Changes, workspace_changes
from opencomposer.sandbox import make_sandbox


@pytest.fixture
def base(tmp_path: Path) -> Path:
    for rel in ("lib/__init__.py", "lib/core.py", "lib/data.json", "tests/test_core.py", "setup.py", "README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    return tmp_path


@pytest.mark.parametrize("path,status,why", [
    ("lib/core.py", "M", None),
    ("lib/data.json", "M", None),
    ("lib/core.py", "D", None),
    ("lib/helpers.py", "A", None),  # a new module inside a package
    ("README.md", "M", None),
    ("tests/test_core.py", "M", "a test file"),
    ("lib/test_extra.py", "A", "a test file"),
    ("conftest.py", "A", "a test file"),
    ("lib/conftest.py", "A", "a test file"),
    ("setup.py", "M", "configuration"),
    ("pytest.ini", "A", "configuration"),
    ("tox.ini", "A", "configuration"),
    ("setup.cfg", "A", "configuration"),
    ("pyproject.toml", "A", "configuration"),
    ("lib/sitecustomize.py", "A", "start-up hook"),
    ("sitecustomize.py", "A", "start-up hook"),
    ("usercustomize.py", "A", "start-up hook"),
    ("lib/evil.pth", "A", "start-up hook"),
    ("evil-1.0.dist-info/entry_points.txt", "A", "start-up hook"),
    ("lib/__main__.py", "A", None),  # code of the package (python-slugify's CLI lives there)
    ("pytest.py", "A", "outside an existing package"),
    ("_pytest/__init__.py", "A", "outside an existing package"),
    ("newpkg/mod.py", "A", "outside an existing package"),
    ("lib/notes.txt", "A", "not a Python module"),
    (".git/hooks/pre-commit", "M", "hidden"),
    ("lib/.hidden.py", "A", "hidden"),
    ("lib/__pycache__/core.cpython-311.pyc", "A", "byte code"),
    ("lib/_speed.so", "A", "byte code or a binary"),
    ("../outside.py", "A", "outside the workspace"),
    ("/etc/passwd", "M", "outside the workspace"),
    ("lib/gone.py", "D", "not a file of the base image"),
])
def test_refusal_rules(base, path, status, why):
    got = refusal(path, status, base)
    if why is None:
        assert got is None, (path, got)
    else:
        assert got is not None and why in got, (path, got)


@pytest.mark.parametrize("backend", ["local", pytest.param("namespace", marks=pytest.mark.namespace)])
def test_collect_reads_changed_code_from_the_sandbox(base, backend):
    from opencomposer.sandbox.namespace import unavailable_reason
    if backend == "namespace" and unavailable_reason():
        pytest.skip(unavailable_reason())
    with make_sandbox(SandboxSpec(base), backend) as sb:
        sb.write_file("lib/core.py", b"x = 2\n")
        sb.write_file("lib/new.py", b"y = 3\n")
        sb.write_file("conftest.py", b"import os\n")
        sb.exec("ln -s /etc/hostname lib/link.py && rm setup.py")
        changes = Changes(files=[("M", "lib/core.py"), ("A", "lib/new.py"), ("A", "conftest.py"),
                                 ("A", "lib/link.py"), ("D", "setup.py")])
        carry = collect(base, sb, changes)
    assert carry.files == {"lib/core.py": b"x = 2\n", "lib/new.py": b"y = 3\n"}
    assert carry.deleted == []
    assert set(carry.refused) == {"conftest.py", "lib/link.py", "setup.py"}
    assert "outside the workspace" in carry.refused["lib/link.py"] or "unreadable" in carry.refused["lib/link.py"]


def test_collect_from_git_changes(minicalc_task):
    """The file list comes from git in the sandbox; the base commit from the host's workspace."""
    task = minicalc_task
    with make_sandbox(task.sandbox_spec(), "local") as sb:
        sb.write_file("minicalc/ops.py", sb.read_file("minicalc/ops.py") + b"\n\ndef clamp(x, lo, hi):\n    return x\n")
        sb.write_file("tests/conftest.py", b"def pytest_runtest_makereport(item, call):\n    pass\n")
        sb.exec("git -c user.name=a -c user.email=a@b commit -qam hide")  # committing hides nothing
        changes = workspace_changes(task.workspace, sb)
        carry = collect(task.workspace, sb, changes)
    assert sorted(carry.files) == ["minicalc/ops.py"] and b"def clamp" in carry.files["minicalc/ops.py"]
    assert "tests/conftest.py" in carry.refused and changes.head_moved


def test_changes_of_a_workspace_without_git_are_found_by_hashing(base):
    """A workspace that is no git repository of its own (the shipped fixtures sit inside ours)."""
    with make_sandbox(SandboxSpec(base), "local") as sb:
        sb.write_file("lib/core.py", b"x = 2\n")
        sb.write_file("lib/new.py", b"y = 3\n")
        sb.exec("rm README.md")
        changes = workspace_changes(base, sb)
    assert sorted(changes.files) == [("A", "lib/new.py"), ("D", "README.md"), ("M", "lib/core.py")]
    assert changes.error == ""
