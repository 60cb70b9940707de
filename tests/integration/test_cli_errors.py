"""Bad input at the CLI: exit code 2, a one-line reason naming the file/key, JSON last."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_agent_on_garbled_task(tmp_path: Path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "task.toml").write_text("id = [unclosed\n")
    r = run_cli("agent", "--task", str(tmp_path / "t"), "--policy", "oracle")
    assert r.returncode == 2
    assert "task.toml: garbled" in r.stderr.replace("\n", "")
    assert "garbled" in last_json(r.stdout)["error"]


def test_agent_on_missing_task_toml(tmp_path: Path):
    (tmp_path / "t").mkdir()
    r = run_cli("agent", "--task", str(tmp_path / "t"))
    assert r.returncode == 2 and "missing" in last_json(r.stdout)["error"]


def test_config_typo_names_key(tmp_path: Path):
    cfg = tmp_path / "a.toml"
    cfg.write_text("[agent]\nmax_turnz = 3\n")
    (tmp_path / "t").mkdir()
    r = run_cli("agent", "--task", str(tmp_path / "t"), "--config", str(cfg))
    assert r.returncode == 2 and "agent.max_turnz" in r.stderr and "unknown key" in r.stderr


def test_an_error_naming_a_config_table_keeps_its_brackets(tmp_path: Path):
    """Messages name tables like [sync]; the console must show them, not eat them as markup."""
    cfg = tmp_path / "rl.toml"
    cfg.write_text(f'[tasks]\ndir = "{tmp_path / "tasks"}"\n[rollout]\nengine = "server"\n')
    r = run_cli("train", "--config", str(cfg))
    assert r.returncode == 2 and "[sync] store" in r.stderr.replace("\n", " ")
    assert "[sync] store" in last_json(r.stdout)["error"]


def test_bad_source_and_levels(tmp_path: Path):
    r = run_cli("tasks", "make", "--source", "github:foo/bar", "--out", str(tmp_path))
    assert r.returncode == 2 and "expected pypi:NAME==VERSION" in r.stderr
    r = run_cli("tasks", "make", "--source", "pypi:toolz", "--out", str(tmp_path), "--levels", "file")
    assert r.returncode == 2 and "unknown level" in r.stderr


def test_list_reports_unreadable(tmp_path: Path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "task.toml").write_text("nonsense = \n")
    r = run_cli("tasks", "list", str(tmp_path))
    assert r.returncode == 0 and last_json(r.stdout)["unreadable"] == 1
