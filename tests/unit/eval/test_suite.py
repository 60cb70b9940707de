"""Suites: names, files and directories; difficulty labels; sampling; clear errors."""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from opencomposer.config import validate
from opencomposer.eval.suite import (
    SUITES_DIR,
    SuiteError,
    SuiteFile,
    known_suites,
    load_suite,
)

SMOKE_TASKS = SUITES_DIR / "tasks" / "smoke"


def test_every_shipped_suite_file_validates():
    files = sorted(SUITES_DIR.glob("*.toml"))
    assert {f.stem for f in files} >= {"smoke", "humaneval-20", "heldout"}
    for f in files:
        validate(tomllib.loads(f.read_text()), SuiteFile, str(f))
    assert set(known_suites()) >= {"smoke", "humaneval-20"}


def test_smoke_by_name():
    s = load_suite("smoke")
    assert s.name == "smoke" and len(s.tasks) == 5
    assert s.levels() == {"block": 1, "body": 3, "function": 1}
    assert s.difficulty["textkit__clamp__function"] == "function"
    # env = "current": the fixture tasks run with this interpreter's pytest
    assert all(t.env_dir == Path(sys.prefix).resolve() for t in s.tasks)


def test_directory_and_toml_path(tmp_path):
    s = load_suite(SMOKE_TASKS)
    assert s.name == "smoke" and len(s.tasks) == 5 and s.tasks[0].env_dir is None
    f = tmp_path / "mine.toml"
    f.write_text(f'[[source]]\nkind = "dir"\npath = "{SMOKE_TASKS}/textkit__*__body"\ndifficulty = "easy"\n'
                 f'[[source]]\nkind = "dir"\npath = "{SMOKE_TASKS / "textkit__clamp__function"}"\n')
    s = load_suite(f)
    assert s.name == "mine" and s.levels() == {"easy": 3, "function": 1}


def test_limit_samples_across_levels(tmp_path):
    f = tmp_path / "two.toml"
    f.write_text(f'[[source]]\nkind = "dir"\npath = "{SMOKE_TASKS}"\nlimit = 3\nseed = 1\n')
    s = load_suite(f)
    # round-robin over levels: block and function (one task each) are both kept
    assert len(s.tasks) == 3 and s.levels() == {"block": 1, "body": 1, "function": 1}
    assert [t.id for t in s.tasks] == [t.id for t in load_suite(f).tasks]  # seeded


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(SuiteError, match=r"unknown suite 'nope'.*known suites: .*smoke"):
        load_suite("nope")
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text('[[source]]\nkind = "svn"\npath = "x"\n')
    with pytest.raises(SuiteError, match=r"bad.toml.*source\.0\.kind"):
        load_suite(bad)
    bad.write_text('[[source]]\nkind = "dir"\n')
    with pytest.raises(SuiteError, match="needs 'path'"):
        load_suite(bad)
    bad.write_text('[[source]]\nkind = "dir"\npath = "nowhere/*"\n')
    with pytest.raises(SuiteError, match="matches nothing"):
        load_suite(bad)
    bad.write_text(f'[[source]]\nkind = "dir"\npath = "{SMOKE_TASKS}"\n[[source]]\nkind = "dir"\n'
                   f'path = "{SMOKE_TASKS / "textkit__mean__body"}"\n')
    with pytest.raises(SuiteError, match="'textkit__mean__body' is already in the suite"):
        load_suite(bad)
    broken = tmp_path / "tasks" / "t1"
    shutil.copytree(SMOKE_TASKS / "textkit__mean__body", broken)
    (broken / "task.toml").write_text("id = [\n")
    with pytest.raises(SuiteError, match="task.toml: garbled"):
        load_suite(tmp_path / "tasks")


def test_harbor_source_imported_once(tmp_path, monkeypatch):
    from opencomposer.tasks.sources.harbor_export import export_task

    monkeypatch.setenv("OPENCOMPOSER_CACHE", str(tmp_path / "cache"))
    smoke = load_suite("smoke")
    (tmp_path / "harbor").mkdir()
    for t in smoke.tasks[:2]:
        export_task(t, tmp_path / "harbor")
    f = tmp_path / "h.toml"
    f.write_text('[[source]]\nkind = "harbor"\npath = "harbor"\nenv = "current"\n')
    s = load_suite(f)
    assert sorted(t.id for t in s.tasks) == sorted(t.id for t in smoke.tasks[:2])
    assert all((tmp_path / "cache" / "suites") in t.root.parents for t in s.tasks)
    assert s.levels() == {t.meta.feature.level: 1 for t in smoke.tasks[:2]}
    marker = next((tmp_path / "cache" / "suites").glob("harbor-*/.imported"))
    assert load_suite(f).tasks[0].root.parent == marker.parent  # second load reads the cache
    f.write_text('[[source]]\nkind = "harbor"\npath = "nowhere"\n')
    with pytest.raises(SuiteError, match="'nowhere'.*does not exist"):
        load_suite(f)
