"""Every path a task names stays inside the task: each task.toml key, absolute paths, ``..``
and escaping symlinks are refused at ``Task.load`` with the file, the key and the path; an
imported Harbor task or SWE-bench row that tries it fails as an item and writes nothing;
an env made elsewhere is usable only through a link in the environments root.

Run: ``pytest tests/unit/tasks/sources/test_confine.py``.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import tomli_w
from source_fixtures import ENV

from opencomposer.tasks.envs import adopt_env
from opencomposer.tasks.format import (
    FeatureInfo,
    SourceInfo,
    Task,
    TaskFormatError,
    TaskMeta,
    TestsInfo,
    find_tasks,
    write_task_toml,
)
from opencomposer.tasks.sources.harbor import import_harbor
from opencomposer.tasks.sources.swebench import import_swebench


def make_task(root: Path, **environment) -> Path:
    (root / "workspace" / "pkg").mkdir(parents=True)
    (root / "workspace" / "pkg" / "m.py").write_text("X = 1\n")
    (root / "tests" / "files" / "tests").mkdir(parents=True)
    (root / "tests" / "files" / "tests" / "test_m.py").write_text("def test_x():\n    pass\n")
    (root / "solution").mkdir()
    (root / "solution" / "gold.patch").write_text("")
    (root / "instruction.md").write_text("Implement `X`.\n")
    write_task_toml(root / "task.toml", TaskMeta(
        id=root.name, source=SourceInfo(spec="pkg==1"), feature=FeatureInfo(level="body", file="pkg/m.py", symbol="X"),
        environment=environment or {"pythonpath": ["."]},
        tests=TestsInfo(command="pytest", files=["tests/test_m.py"], targets=["tests/test_m.py::test_x"],
                        fail_to_pass=["tests/test_m.py::test_x"], pass_to_pass=["tests/test_m.py::test_x"])))
    return root


def set_key(root: Path, key: str, value) -> None:
    data = tomllib.loads((root / "task.toml").read_text())
    section, _, field = key.partition(".")
    data[section][field] = value
    write_task_toml(root / "task.toml", TaskMeta.model_validate(data))


@pytest.mark.parametrize("key, wrap", [
    ("feature.file", str), ("tests.files", lambda v: [v]), ("tests.targets", lambda v: [v + "::test_x"]),
    ("tests.fail_to_pass", lambda v: [v + "::test_x"]), ("tests.pass_to_pass", lambda v: [v + "::test_x"]),
    ("environment.pythonpath", lambda v: [v]), ("environment.env", str),
])
@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_each_path_key_is_confined(tmp_path, key, wrap, how):
    root = make_task(tmp_path / "tasks" / "t1")
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "test_m.py").write_text("def test_x():\n    pass\n")
    if how == "absolute":
        value = str(outside if key == "environment.env" else outside / "test_m.py")
    elif how == "dotdot":
        value = "../../secret" if key == "environment.env" else "../../../secret/test_m.py"
    else:  # a link inside the task (and in its workspace) that leads out of it
        for base in (root, root / "workspace"):
            os.symlink(outside, base / "link")
        value = "link" if key == "environment.env" else "link/test_m.py"
    set_key(root, key, wrap(value))
    with pytest.raises(TaskFormatError) as e:
        Task.load(root)
    msg = str(e.value)
    assert str(root / "task.toml") in msg and f"key '{key}" in msg and repr(wrap(value)[0] if
                                                                       isinstance(wrap(value), list) else value) in msg
    assert "expected" in msg


@pytest.mark.parametrize("part", ["workspace", "solution/gold.patch", "instruction.md", "tests/files"])
def test_a_part_that_is_a_symlink_out_of_the_task_is_refused(tmp_path, part):
    root = make_task(tmp_path / "t1")
    target = tmp_path / "elsewhere"
    os.rename(root / part, target)
    os.symlink(target, root / part)
    with pytest.raises(TaskFormatError, match=rf"task\.toml: {part} follows a symlink to {target}, outside the task"):
        Task.load(root)


def test_a_hidden_file_linking_out_of_the_task_is_refused(tmp_path):
    root = make_task(tmp_path / "t1")
    (tmp_path / "conftest.py").write_text("")
    os.symlink(tmp_path / "conftest.py", root / "tests" / "files" / "conftest.py")  # named by no key
    with pytest.raises(TaskFormatError, match=r"tests/files/conftest.py follows a symlink to .*, outside the task"):
        Task.load(root)


def test_envs_inside_the_task_or_the_environments_root_load(tmp_path):
    out = tmp_path / "tasks"
    root = make_task(out / "t1")
    (root / "env").mkdir()
    set_key(root, "environment.env", "env")
    assert Task.load(root).env_dir == (root / "env").resolve()
    (out / "_envs" / "lib-1").mkdir(parents=True)
    set_key(root, "environment.env", "../_envs/lib-1")
    assert Task.load(root).env_dir == (out / "_envs" / "lib-1").resolve()
    # an env made elsewhere: only through the operator's link in the environments root
    link = adopt_env(out, ENV)
    assert link.parent == out / "_envs" and link.is_symlink() and adopt_env(out, ENV) == link
    set_key(root, "environment.env", f"../_envs/{link.name}")
    assert Task.load(root).env_dir == ENV.resolve()
    set_key(root, "environment.env", f"../_envs/{link.name}/../..")  # through the link and up: out
    with pytest.raises(TaskFormatError, match="key 'environment.env'"):
        Task.load(root)
    for shows_hidden in (".", "solution", "tests/files"):  # the env is readable from the sandbox
        set_key(root, "environment.env", shows_hidden)
        with pytest.raises(TaskFormatError, match="shows the task's hidden tests/ or solution/"):
            Task.load(root)


@pytest.mark.parametrize("tid", ["..", ".staging", "_envs"])
def test_an_id_that_cannot_name_a_task_dir_is_refused(tmp_path, tid):
    root = make_task(tmp_path / "t1")
    text = (root / "task.toml").read_text().replace('id = "t1"', f'id = "{tid}"')
    (root / "task.toml").write_text(text)
    with pytest.raises(TaskFormatError, match=f"key 'id': '{tid}' cannot name a task directory"):
        Task.load(root)


def test_listing_skips_staging_and_reserved_dirs(tmp_path):
    make_task(tmp_path / "t1")
    make_task(tmp_path / ".t2.tmp-host-1-0123abcd")  # a staging dir, complete or not
    make_task(tmp_path / "_envs")
    assert find_tasks([tmp_path]) == [tmp_path / "t1"]


# --------------------------------------------------------------------------- importers


def harbor_task(root: Path, extra: dict) -> Path:
    """A Harbor task as our export writes it, with ``extra`` merged into its metadata."""
    env = root / "environment"
    (env / "workspace" / "pkg").mkdir(parents=True)
    (env / "workspace" / "pkg" / "m.py").write_text("X = 1\n")
    (env / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\nCOPY workspace/ /app/\n")
    (root / "tests" / "files" / "tests").mkdir(parents=True)
    (root / "tests" / "files" / "tests" / "test_m.py").write_text("def test_x():\n    pass\n")
    (root / "tests" / "test.sh").write_text("#!/bin/sh\n")
    (root / "solution").mkdir()
    (root / "solution" / "gold.patch").write_text(
        "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1 +1 @@\n-X = 1\n+X = 2\n")
    (root / "instruction.md").write_text("Set X.\n")
    meta = {"id": root.name, "targets": ["tests/test_m.py::test_x"], "files": ["tests/test_m.py"],
            "fail_to_pass": ["tests/test_m.py::test_x"], "pass_to_pass": [], "pythonpath": ["."], **extra}
    (root / "task.toml").write_text(tomli_w.dumps({"version": "1.0", "metadata": {"opencomposer": meta}}))
    return root


def test_harbor_tasks_that_point_outside_are_refused(tmp_path):
    src, out = tmp_path / "harbor", tmp_path / "out"
    secret = tmp_path / "secret"
    secret.mkdir()
    harbor_task(src / "good", {})
    harbor_task(src / "dotdot-target", {"targets": ["../../etc/passwd"]})
    harbor_task(src / "abs-file", {"files": ["/etc/passwd"]})
    harbor_task(src / "dotdot-pythonpath", {"pythonpath": ["../.."]})
    harbor_task(src / "bad-id", {"id": ".."})
    linked = harbor_task(src / "linked-solution", {})
    (secret / "gold.patch").write_text((linked / "solution" / "gold.patch").read_text())
    (linked / "solution" / "gold.patch").unlink()
    os.symlink(secret / "gold.patch", linked / "solution" / "gold.patch")
    rep = import_harbor(src, out, env=ENV).summary()
    why = rep["failed_reasons"]
    assert rep["ok"] == 1 and rep["failed"] == 5, rep
    assert "key 'tests.targets[0]': path '../../etc/passwd'" in why["dotdot-target"]
    assert "key 'tests.files[0]': path '/etc/passwd' is absolute" in why["abs-file"]
    assert "key 'environment.pythonpath[0]': path '../..'" in why["dotdot-pythonpath"]
    assert "key 'id': '..' cannot name a task directory" in why["bad-id"]
    assert "solution/gold.patch: follows a symlink to" in why["linked-solution"]
    assert {p.name for p in out.iterdir()} == {"good", "_envs"}  # nothing of a refused task was written
    # without --env the env a task's metadata names is used only when it is in OUT/_envs
    harbor_task(tmp_path / "h2" / "abs-env", {"env": str(ENV)})
    rep = import_harbor(tmp_path / "h2", out).summary()
    assert "key 'metadata.opencomposer.env'" in rep["failed_reasons"]["abs-env"], rep
    assert str(ENV) in rep["failed_reasons"]["abs-env"] and "or pass --env" in rep["failed_reasons"]["abs-env"]


def test_harbor_good_task_with_an_env_from_elsewhere_is_linked(tmp_path):
    src, out = tmp_path / "harbor", tmp_path / "out"
    harbor_task(src / "good", {})
    rep = import_harbor(src, out, env=ENV).summary()
    assert rep["ok"] == 1, rep
    task = Task.load(out / "good")
    assert task.meta.environment.env.startswith("../_envs/ext-") and task.env_dir == ENV.resolve()


def test_swebench_rows_that_point_outside_are_refused(minicalc_repo, tmp_path):
    repo, row = minicalc_repo
    bad = {
        "abs-env": {"opencomposer": {"env": str(ENV)}},
        "dotdot-target": {"opencomposer": {"targets": ["../../../etc/x.py::t"]}},
        "abs-file": {"opencomposer": {"files": ["/etc/passwd"]}},
        "feature-out": {"opencomposer": {"feature": {"level": "issue", "file": "../../x.py", "symbol": "x"}}},
    }
    rows = [json.dumps(row)] + [json.dumps({**row, "instance_id": k, **v}) for k, v in bad.items()]
    rows.append(json.dumps({**row, "instance_id": ".."}))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(rows) + "\n")
    rep = import_swebench(jsonl, repo.parent, tmp_path / "tasks", env=ENV).summary()
    assert rep["ok"] == 2, rep  # the good row, and abs-env: --env wins over what a row names
    why = rep["failed_reasons"]
    assert "key 'tests.files[0]': path '../../../etc/x.py'" in why["dotdot-target"], why  # files come from targets
    assert "key 'tests.files[0]': path '/etc/passwd' is absolute" in why["abs-file"]
    assert "key 'feature.file': path '../../x.py'" in why["feature-out"]
    assert "field 'instance_id'" in why[".."] and "cannot name a task directory" in why[".."]
    assert sorted(p.name for p in (tmp_path / "tasks").iterdir() if not p.name.startswith("_")) == [
        "abs-env", "acme__minicalc-1"]
    # the env a row names is honoured only without --env, and then only inside OUT/_envs
    jsonl.write_text(json.dumps({**row, "instance_id": "abs-env2", **bad["abs-env"]}) + "\n")
    rep = import_swebench(jsonl, repo.parent, tmp_path / "tasks").summary()
    assert "field 'opencomposer.env'" in rep["failed_reasons"]["abs-env2"], rep
